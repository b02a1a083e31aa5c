# started on Sun Nov 22 05:17:32 2026

7314,,context-switches,23223222398,100.00,,
