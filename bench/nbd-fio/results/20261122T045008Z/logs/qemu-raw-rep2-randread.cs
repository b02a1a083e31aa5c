# started on Sun Nov 22 04:59:44 2026

303395,,context-switches,20248994879,100.00,,
