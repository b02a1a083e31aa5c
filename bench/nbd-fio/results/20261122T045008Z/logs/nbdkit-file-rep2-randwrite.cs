# started on Sun Nov 22 05:02:58 2026

478747,,context-switches,21447772257,100.00,,
