# started on Sun Nov 22 05:08:17 2026

76206,,context-switches,3753053800,100.00,,
