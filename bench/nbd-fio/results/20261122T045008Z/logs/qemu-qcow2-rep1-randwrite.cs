# started on Sun Nov 22 04:55:27 2026

206330,,context-switches,17476662636,100.00,,
