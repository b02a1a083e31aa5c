# started on Sun Nov 22 05:12:47 2026

2471,,context-switches,20659768562,100.00,,
