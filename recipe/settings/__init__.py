"""From the command line to the one configuration that runs: the arguments (`arguments`), the facts and the decisions
(`configuration.settle`), and preflight's rules (`checks`), which read and never change it. Imports every folder
below it: the memory plan decides activation checkpointing and the micro batch, the engines say what a CPU changes,
the checkpoints on disk decide a resume."""
