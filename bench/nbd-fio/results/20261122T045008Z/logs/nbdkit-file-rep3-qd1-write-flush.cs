# started on Sun Nov 22 05:10:21 2026

45768,,context-switches,1479038115,100.00,,
