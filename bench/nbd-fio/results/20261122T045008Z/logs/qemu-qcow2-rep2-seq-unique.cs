# started on Sun Nov 22 05:00:39 2026

6871,,context-switches,5308090887,100.00,,
