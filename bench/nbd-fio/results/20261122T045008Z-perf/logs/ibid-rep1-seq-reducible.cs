# started on Sun Nov 22 05:15:50 2026

29194,,context-switches,10996311569,100.00,,
