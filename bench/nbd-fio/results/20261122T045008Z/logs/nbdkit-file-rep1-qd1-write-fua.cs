# started on Sun Nov 22 04:58:42 2026

96865,,context-switches,3858838381,100.00,,
