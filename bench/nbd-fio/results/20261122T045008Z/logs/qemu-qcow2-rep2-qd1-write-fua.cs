# started on Sun Nov 22 05:02:14 2026

54737,,context-switches,4460129482,100.00,,
