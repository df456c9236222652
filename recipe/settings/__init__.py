"""From the command line to the one configuration that runs: the arguments (`arguments`), the facts of the machine,
launch and model (`facts.gather`), the decisions (`configuration.settle`, its rules in `configuration.SETTLING`), and
preflight's rules (`checks`), which read and never change it. Imports every folder below it: the memory plan decides
activation checkpointing and the micro batch, the engines say what a CPU changes, the checkpoints on disk decide a
resume."""
