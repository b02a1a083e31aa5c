# started on Sun Nov 22 05:05:35 2026

1314270,,context-switches,36915726725,100.00,,
