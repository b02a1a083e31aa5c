# started on Sun Nov 22 04:57:59 2026

710802,,context-switches,19399394173,100.00,,
