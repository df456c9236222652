"""After a run: run_summary.json, the training curves and the adapter's model card."""
