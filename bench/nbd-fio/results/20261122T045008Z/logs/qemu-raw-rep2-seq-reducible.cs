# started on Sun Nov 22 04:59:03 2026

4502,,context-switches,6428215268,100.00,,
