# started on Sun Nov 22 05:00:49 2026

6613,,context-switches,5892679247,100.00,,
