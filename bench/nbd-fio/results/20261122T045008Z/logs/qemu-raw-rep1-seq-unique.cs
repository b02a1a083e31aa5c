# started on Sun Nov 22 04:53:16 2026

3057,,context-switches,5170726040,100.00,,
