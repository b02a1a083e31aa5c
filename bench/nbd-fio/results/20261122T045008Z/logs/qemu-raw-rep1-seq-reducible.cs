# started on Sun Nov 22 04:53:28 2026

3095,,context-switches,5336501059,100.00,,
