"""Memory and time, planned and measured: the planner (`memory`: peak memory per GPU and host RAM by phase, rank 0's
load in seconds) and what a run really uses (`run_memory`). Imports the platform and model folders (the meta model)."""
