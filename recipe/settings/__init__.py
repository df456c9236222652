"""From the command line to the one configuration that runs: the arguments (`arguments`), the facts and the decisions
(`configuration.settle`), and preflight's rules (`checks`), which read and never change it. Imports platform, model,
data and planning (the memory plan decides activation checkpointing and the micro batch)."""
