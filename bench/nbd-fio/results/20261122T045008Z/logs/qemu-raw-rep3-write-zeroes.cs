# started on Sun Nov 22 05:14:59 2026

215,,context-switches,22135106,100.00,,
