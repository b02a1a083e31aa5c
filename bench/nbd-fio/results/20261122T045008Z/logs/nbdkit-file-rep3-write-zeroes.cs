# started on Sun Nov 22 05:10:42 2026

238,,context-switches,514190613,100.00,,
