# started on Sun Nov 22 05:09:49 2026

847901,,context-switches,22371307649,100.00,,
