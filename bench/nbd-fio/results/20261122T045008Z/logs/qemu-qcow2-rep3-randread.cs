# started on Sun Nov 22 05:07:44 2026

139276,,context-switches,18629927840,100.00,,
