# started on Sun Nov 22 04:59:12 2026

221739,,context-switches,22293440009,100.00,,
