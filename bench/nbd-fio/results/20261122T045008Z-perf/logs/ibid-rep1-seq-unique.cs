# started on Sun Nov 22 05:15:24 2026

123185,,context-switches,31164141558,100.00,,
