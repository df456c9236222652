"""The README's verdict table for the shipped model configs, made by the planner (`train.py --check` for each).

    .venv/bin/python bench/plan_tables.py   # prints the markdown rows; paste them under "New models"

Each row is the configuration train.py settles for QLoRA on 2 x 24 GB with configs/fsdp2_config_qlora.yaml, batch
2 x 2048, accumulation 4: the attention, the activation-checkpointing decision with the plans it was taken from, the
plan per GPU and the host RAM of each phase, and preflight's verdict.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FLAGS = ["--check", "--accelerate_config", "configs/fsdp2_config_qlora.yaml", "--gpu_gib", "24",
         "--use_4bit_quantization", "true", "--max_length", "2048", "--per_device_train_batch_size", "2",
         "--gradient_accumulation_steps", "4", "--eval_num_prompts", "0"]


def row(model_dir: Path) -> str:
    from memory import ALLOCATOR_HEADROOM
    from checks import preflight
    from configuration import configure, memory_plan

    config = configure(["--model_name_or_path", str(model_dir), *FLAGS])
    plans = {on: memory_plan(config, checkpointing=on).per_gpu_total * ALLOCATOR_HEADROOM for on in (False, True)}
    plan = memory_plan(config)
    host = ", ".join(f"{peaks['host machine']:.1f}" for peaks in plan.phases.values())
    errors = [str(problem) for problem in preflight(config) if problem.level == "error"]
    verdict = "error: " + "; ".join(errors) if errors else "passed"  # as --check ends (config.json alone: no tokenizer)
    checkpointing = "on" if config.training.activation_checkpointing else "off"
    return (f"| {model_dir.name} | {config.attention} | {checkpointing} ({plans[False]:.1f} / {plans[True]:.1f}) | "
            f"{plan.phases['train']['gpu']:.1f} | {host} | {verdict} |")


def main() -> None:
    print("| model | attention | activation checkpointing (plan without / with, GiB per GPU incl. headroom) | plan per "
          "GPU, train | host RAM per machine (load, train, save) | verdict |")
    print("|---|---|---|---|---|---|")
    for model_dir in sorted((REPO / "configs" / "models").iterdir()):
        print(row(model_dir), flush=True)


if __name__ == "__main__":
    main()
