# started on Sun Nov 22 04:52:38 2026

5044,,context-switches,23850302821,100.00,,
