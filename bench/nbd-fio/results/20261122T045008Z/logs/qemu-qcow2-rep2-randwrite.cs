# started on Sun Nov 22 05:00:59 2026

150299,,context-switches,24184026706,100.00,,
