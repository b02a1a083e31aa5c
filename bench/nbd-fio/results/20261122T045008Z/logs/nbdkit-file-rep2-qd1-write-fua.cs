# started on Sun Nov 22 05:04:13 2026

40741,,context-switches,1345399688,100.00,,
