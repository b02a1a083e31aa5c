# started on Sun Nov 22 04:51:45 2026

1149858,,context-switches,31273782524,100.00,,
