# started on Sun Nov 22 05:13:22 2026

3916,,context-switches,6534311350,100.00,,
