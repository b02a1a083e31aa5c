# started on Sun Nov 22 05:10:32 2026

42205,,context-switches,2048610880,100.00,,
