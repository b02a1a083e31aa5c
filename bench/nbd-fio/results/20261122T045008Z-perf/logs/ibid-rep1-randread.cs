# started on Sun Nov 22 05:16:35 2026

794109,,context-switches,39795027236,100.00,,
