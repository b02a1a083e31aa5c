# started on Sun Nov 22 05:04:52 2026

29107,,context-switches,11144488926,100.00,,
