# started on Sun Nov 22 05:07:03 2026

4363,,context-switches,5771182613,100.00,,
