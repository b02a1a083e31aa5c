# started on Sun Nov 22 05:03:30 2026

312967,,context-switches,21005273939,100.00,,
