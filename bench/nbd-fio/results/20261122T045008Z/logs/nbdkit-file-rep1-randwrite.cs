# started on Sun Nov 22 04:57:27 2026

421406,,context-switches,17993229022,100.00,,
