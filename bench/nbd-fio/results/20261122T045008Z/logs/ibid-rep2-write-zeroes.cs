# started on Sun Nov 22 05:06:28 2026

2401,,context-switches,22287066051,100.00,,
