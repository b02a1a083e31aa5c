# started on Sun Nov 22 05:17:09 2026

41800,,context-switches,6460129765,100.00,,
