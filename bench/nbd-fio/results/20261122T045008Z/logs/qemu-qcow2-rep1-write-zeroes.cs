# started on Sun Nov 22 04:56:53 2026

378,,context-switches,37653317,100.00,,
