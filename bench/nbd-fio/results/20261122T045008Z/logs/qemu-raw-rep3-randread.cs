# started on Sun Nov 22 05:14:05 2026

148772,,context-switches,19571430311,100.00,,
