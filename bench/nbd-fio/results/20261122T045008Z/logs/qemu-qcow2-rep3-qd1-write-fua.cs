# started on Sun Nov 22 05:08:27 2026

62198,,context-switches,3037707232,100.00,,
