# started on Sun Nov 22 05:01:31 2026

147394,,context-switches,21400270548,100.00,,
