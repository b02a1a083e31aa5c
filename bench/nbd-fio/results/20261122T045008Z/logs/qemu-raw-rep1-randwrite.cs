# started on Sun Nov 22 04:53:40 2026

110648,,context-switches,15802940738,100.00,,
