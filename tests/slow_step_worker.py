"""train.py's recipe with every step after the first made SLOW_STEP_SECONDS longer: a stand-in for a 70B step with
gradient accumulation, which outlasts the launcher's default grace, for the preemption test. Not a copy of the recipe:
`train.main` is the call `python train.py` makes, with one callback added to the trainer it builds."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import TrainerCallback  # noqa: E402

import train  # noqa: E402


class SlowSteps(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step >= 1:
            time.sleep(float(os.environ["SLOW_STEP_SECONDS"]))


def build_slow_trainer(*args):
    trainer, step_times = build_trainer(*args)
    trainer.add_callback(SlowSteps())
    return trainer, step_times


build_trainer, train.build_trainer = train.build_trainer, build_slow_trainer

if __name__ == "__main__":
    train.main(sys.argv[1:])
