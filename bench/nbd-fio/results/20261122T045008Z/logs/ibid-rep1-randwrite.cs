# started on Sun Nov 22 04:51:13 2026

826331,,context-switches,34692746274,100.00,,
