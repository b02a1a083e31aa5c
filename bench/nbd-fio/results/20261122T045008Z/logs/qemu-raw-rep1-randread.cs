# started on Sun Nov 22 04:54:13 2026

223068,,context-switches,16511876697,100.00,,
