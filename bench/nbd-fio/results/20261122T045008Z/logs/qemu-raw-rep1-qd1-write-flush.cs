# started on Sun Nov 22 04:54:45 2026

29209,,context-switches,1352928946,100.00,,
