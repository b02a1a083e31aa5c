# started on Sun Nov 22 05:02:36 2026

22217,,context-switches,28552124215,100.00,,
