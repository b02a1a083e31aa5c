# started on Sun Nov 22 05:13:33 2026

115298,,context-switches,20146846642,100.00,,
