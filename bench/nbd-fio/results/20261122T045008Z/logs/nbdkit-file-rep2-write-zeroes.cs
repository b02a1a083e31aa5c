# started on Sun Nov 22 05:04:23 2026

263,,context-switches,639607356,100.00,,
