# started on Sun Nov 22 04:56:32 2026

14808,,context-switches,724934598,100.00,,
