# started on Sun Nov 22 04:58:54 2026

4581,,context-switches,5937377258,100.00,,
