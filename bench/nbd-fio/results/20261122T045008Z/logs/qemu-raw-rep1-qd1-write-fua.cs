# started on Sun Nov 22 04:54:56 2026

7795,,context-switches,544587863,100.00,,
