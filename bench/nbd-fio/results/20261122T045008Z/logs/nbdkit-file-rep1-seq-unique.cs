# started on Sun Nov 22 04:56:55 2026

17489,,context-switches,11910659625,100.00,,
