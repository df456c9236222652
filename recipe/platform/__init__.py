"""What this machine, this launch and this process are: the launch's environment (`launch.Launch`, its one reader), the
hardware (native bf16, kernels installed, cores, how fast it reads and quantizes a checkpoint) and the process's start
and exit (`process`). Imports nothing of the recipe but compat."""
