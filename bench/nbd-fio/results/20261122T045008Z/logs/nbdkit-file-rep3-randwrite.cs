# started on Sun Nov 22 05:09:17 2026

661978,,context-switches,20918927139,100.00,,
