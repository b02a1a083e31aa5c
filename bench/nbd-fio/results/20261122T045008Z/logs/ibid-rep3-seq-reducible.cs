# started on Sun Nov 22 05:11:12 2026

28797,,context-switches,9607475992,100.00,,
