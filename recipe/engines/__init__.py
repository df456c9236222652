"""The trainer and the engines under it: FSDP1, FSDP2 and ZeRO-3 kept on CPU hosts (`trainers`), how a sharded run's
weights reach the ranks and leave them (`sharding`), checkpoints that survive kills and bad disks (`checkpoints`), and
how a run ends when something fails (`failures`). Imports compat, the platform and model folders."""
