# started on Sun Nov 22 05:08:52 2026

20193,,context-switches,22861362849,100.00,,
