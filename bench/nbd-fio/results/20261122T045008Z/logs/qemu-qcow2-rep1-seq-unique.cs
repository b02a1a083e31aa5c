# started on Sun Nov 22 04:55:09 2026

6883,,context-switches,4845357271,100.00,,
