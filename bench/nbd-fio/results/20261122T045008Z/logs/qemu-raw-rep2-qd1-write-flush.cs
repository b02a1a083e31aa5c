# started on Sun Nov 22 05:00:17 2026

93622,,context-switches,4421030927,100.00,,
