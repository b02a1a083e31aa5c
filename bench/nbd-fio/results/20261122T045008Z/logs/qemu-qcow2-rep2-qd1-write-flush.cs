# started on Sun Nov 22 05:02:04 2026

67496,,context-switches,4295315893,100.00,,
