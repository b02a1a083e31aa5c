# started on Sun Nov 22 05:00:27 2026

67645,,context-switches,3832739768,100.00,,
