"""After a run: run_summary.json (the arguments, every decision with its reason, the results), the training curves,
the adapter's model card that publishing uploads, and the held-out prompts' exact match (`heldout`). Imports the
planner (the memory plan beside what was measured)."""
