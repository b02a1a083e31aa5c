# started on Sun Nov 22 05:04:03 2026

51113,,context-switches,1456143081,100.00,,
