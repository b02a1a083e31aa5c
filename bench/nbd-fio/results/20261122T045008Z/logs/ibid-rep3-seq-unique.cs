# started on Sun Nov 22 05:10:45 2026

95693,,context-switches,29888889528,100.00,,
