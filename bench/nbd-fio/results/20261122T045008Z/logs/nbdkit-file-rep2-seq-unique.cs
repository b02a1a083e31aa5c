# started on Sun Nov 22 05:02:26 2026

14798,,context-switches,10013673749,100.00,,
