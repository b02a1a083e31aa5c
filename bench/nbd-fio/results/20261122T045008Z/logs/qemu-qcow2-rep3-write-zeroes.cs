# started on Sun Nov 22 05:08:37 2026

349,,context-switches,55386515,100.00,,
