# started on Sun Nov 22 05:08:40 2026

16756,,context-switches,9885190834,100.00,,
