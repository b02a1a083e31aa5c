# started on Sun Nov 22 05:06:52 2026

5145,,context-switches,5824118425,100.00,,
