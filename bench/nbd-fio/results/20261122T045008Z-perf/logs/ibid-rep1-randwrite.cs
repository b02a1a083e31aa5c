# started on Sun Nov 22 05:16:01 2026

791598,,context-switches,44838911068,100.00,,
