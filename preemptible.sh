#!/usr/bin/env bash
# Runs a launch command (its arguments) so that preemption ends it cleanly; every run_peft_*.sh launcher and the SLURM
# script go through it.
# - torchrun's agent (inside `accelerate launch`) forwards SIGTERM / SIGINT to the workers, then kills them after
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds, 30 by default: shorter than a 70B step. 280 here leaves room for the rest
#   of the step and the checkpoint train.py then saves, inside SLURM's 300 s warning (--signal=TERM@300).
# - The agent exits 1 after a signal even when every worker saved and exited 143; this exits 128 + the signal number
#   (143 for SIGTERM, 130 for SIGINT), as the workers do, so a scheduler sees a preemption, not a failure. Signal this
#   script or its whole process group (SLURM and Ctrl-C do), not the agent alone.
# Usage:   ./preemptible.sh accelerate launch [accelerate flags] train.py [train.py flags]
set -uo pipefail
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-280}
signalled=
trap 'signalled=143' TERM  # run once the launch has ended: bash waits for a foreground command first
trap 'signalled=130' INT
status=0
"$@" || status=$?
exit "${signalled:-$status}"
