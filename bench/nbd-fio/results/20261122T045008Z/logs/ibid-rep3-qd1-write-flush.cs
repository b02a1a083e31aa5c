# started on Sun Nov 22 05:12:26 2026

33333,,context-switches,3017920410,100.00,,
