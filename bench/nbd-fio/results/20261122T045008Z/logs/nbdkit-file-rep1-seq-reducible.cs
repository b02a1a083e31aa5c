# started on Sun Nov 22 04:57:12 2026

18480,,context-switches,13012193001,100.00,,
