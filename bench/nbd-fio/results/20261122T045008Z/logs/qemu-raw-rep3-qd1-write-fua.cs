# started on Sun Nov 22 05:14:48 2026

38852,,context-switches,2866801443,100.00,,
