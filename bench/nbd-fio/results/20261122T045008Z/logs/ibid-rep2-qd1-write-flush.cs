# started on Sun Nov 22 05:06:08 2026

83573,,context-switches,5090289948,100.00,,
