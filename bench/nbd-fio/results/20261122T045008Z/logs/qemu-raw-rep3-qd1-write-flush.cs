# started on Sun Nov 22 05:14:38 2026

74375,,context-switches,3676473764,100.00,,
