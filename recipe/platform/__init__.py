"""What this machine and this launch are: the launch's environment (`launch.Launch`, its one reader) and the hardware
(native bf16, kernels installed, how fast it reads and quantizes a checkpoint). Imports nothing of the recipe but
compat."""
