# started on Sun Nov 22 05:00:37 2026

147,,context-switches,9134987,100.00,,
