# started on Sun Nov 22 04:52:28 2026

18693,,context-switches,2263996974,100.00,,
