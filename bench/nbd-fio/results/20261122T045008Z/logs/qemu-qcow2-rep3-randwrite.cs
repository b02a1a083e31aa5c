# started on Sun Nov 22 05:07:12 2026

149822,,context-switches,21954856585,100.00,,
