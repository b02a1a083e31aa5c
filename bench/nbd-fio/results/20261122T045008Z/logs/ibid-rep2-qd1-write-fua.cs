# started on Sun Nov 22 05:06:18 2026

65199,,context-switches,5469640128,100.00,,
