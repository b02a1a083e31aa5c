# started on Sun Nov 22 05:11:21 2026

1168901,,context-switches,43774566756,100.00,,
