# started on Sun Nov 22 04:50:08 2026

139126,,context-switches,44096033108,100.00,,
