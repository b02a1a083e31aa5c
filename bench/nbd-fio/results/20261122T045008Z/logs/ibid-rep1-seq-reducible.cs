# started on Sun Nov 22 04:50:58 2026

34534,,context-switches,12170764684,100.00,,
