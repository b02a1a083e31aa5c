# started on Sun Nov 22 05:13:12 2026

3476,,context-switches,5799820796,100.00,,
