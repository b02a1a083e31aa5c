# started on Sun Nov 22 04:58:52 2026

246,,context-switches,456949637,100.00,,
