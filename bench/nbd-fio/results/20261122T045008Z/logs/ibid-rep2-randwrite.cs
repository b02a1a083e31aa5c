# started on Sun Nov 22 05:05:03 2026

1051848,,context-switches,42494796911,100.00,,
