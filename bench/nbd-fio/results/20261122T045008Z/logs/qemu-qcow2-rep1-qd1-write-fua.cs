# started on Sun Nov 22 04:56:43 2026

18131,,context-switches,977458004,100.00,,
