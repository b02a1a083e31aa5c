# started on Sun Nov 22 05:04:26 2026

87189,,context-switches,27338561252,100.00,,
