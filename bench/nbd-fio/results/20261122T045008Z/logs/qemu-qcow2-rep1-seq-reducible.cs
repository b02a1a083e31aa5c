# started on Sun Nov 22 04:55:19 2026

6370,,context-switches,4662257529,100.00,,
