# started on Sun Nov 22 04:58:31 2026

159288,,context-switches,4082456807,100.00,,
