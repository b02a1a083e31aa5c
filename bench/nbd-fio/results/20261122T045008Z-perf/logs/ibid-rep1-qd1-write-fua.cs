# started on Sun Nov 22 05:17:20 2026

50747,,context-switches,5646548229,100.00,,
