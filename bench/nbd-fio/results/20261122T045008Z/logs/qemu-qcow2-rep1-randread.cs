# started on Sun Nov 22 04:56:00 2026

215084,,context-switches,16155622694,100.00,,
