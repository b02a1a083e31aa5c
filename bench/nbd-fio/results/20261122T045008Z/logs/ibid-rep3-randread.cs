# started on Sun Nov 22 05:11:54 2026

1529841,,context-switches,38716579869,100.00,,
