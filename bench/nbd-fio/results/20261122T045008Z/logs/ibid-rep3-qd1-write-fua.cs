# started on Sun Nov 22 05:12:36 2026

23024,,context-switches,2382032622,100.00,,
