"""After a run: run_summary.json (the arguments, every decision with its reason, the results), the training curves
and the adapter's model card that publishing uploads. Imports the planner (the memory plan beside what was measured)."""
