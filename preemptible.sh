#!/usr/bin/env bash
# Runs a launch command (its arguments) so that preemption ends it cleanly; every run_peft_*.sh launcher and the SLURM
# script go through it.
# - Before the launch, this node's part of it is checked (python -m recipe.platform.launch check-node): a machine rank
#   outside 0..num_machines-1 or other than SLURM_NODEID, a machine rank 0 away from --main_process_ip, or a port
#   already taken would otherwise leave every node waiting for the rendezvous until it times out. It exits 2 with the
#   setting.
# - torchrun's agent (inside `accelerate launch`) forwards SIGTERM / SIGINT to the workers, then kills them after
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds, 30 by default: shorter than a 70B step. 280 here leaves room for the rest
#   of the step and the checkpoint train.py then saves, inside SLURM's 300 s warning (--signal=TERM@300).
# - The agent exits 1 after a signal even when every worker saved and exited 143; this exits 128 + the signal number
#   (143 for SIGTERM, 130 for SIGINT), as the workers do, so a scheduler sees a preemption, not a failure. On a node
#   that was not signalled itself (one rank's signal stops every rank), the workers report the signal through the file
#   named by RECIPE_STOP_REPORT. Signal this script or its whole process group (SLURM and Ctrl-C do), not the agent.
# Usage:   ./preemptible.sh accelerate launch [accelerate flags] train.py [train.py flags]
set -uo pipefail
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-280}
# The interpreter of the launch: the command itself (python -m accelerate.commands.launch), or the one accelerate's
# script names on its first line (a launcher found nowhere fails below, as it would without the check).
python=
if [[ $1 == *python* ]]; then
  python=$1
elif launcher=$(command -v "$1") && read -r shebang < "$launcher" && [[ $shebang == *python* ]]; then
  python=${shebang#\#!}
fi
if [[ -n $python ]]; then
  PYTHONPATH="$(dirname "$0")${PYTHONPATH:+:$PYTHONPATH}" $python -m recipe.platform.launch check-node "$@" || exit 2
fi
RECIPE_STOP_REPORT=$(mktemp) && export RECIPE_STOP_REPORT
signalled=
trap 'signalled=143' TERM  # run once the launch has ended: bash waits for a foreground command first
trap 'signalled=130' INT
status=0
"$@" || status=$?
if [[ -z $signalled && -s $RECIPE_STOP_REPORT ]]; then
  signalled=$((128 + $(< "$RECIPE_STOP_REPORT")))
fi
rm -f "$RECIPE_STOP_REPORT"
exit "${signalled:-$status}"
