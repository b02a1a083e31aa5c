# started on Sun Nov 22 05:02:24 2026

296,,context-switches,57031441,100.00,,
