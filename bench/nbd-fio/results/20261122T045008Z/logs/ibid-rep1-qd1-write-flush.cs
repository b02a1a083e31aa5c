# started on Sun Nov 22 04:52:18 2026

27015,,context-switches,2132056708,100.00,,
