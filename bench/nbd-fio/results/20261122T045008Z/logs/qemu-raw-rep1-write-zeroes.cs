# started on Sun Nov 22 04:55:06 2026

251,,context-switches,15725152,100.00,,
