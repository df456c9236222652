"""The README's memory figures, made by the planner (what `train.py --check` prints for each run), never by hand.

    .venv/bin/python bench/plan_tables.py           # prints the three README blocks
    .venv/bin/python bench/plan_tables.py --write   # rewrites them where they are (README.md, docs/), between markers

- `models`: the verdict table for configs/models/, each as train.py settles QLoRA on 2 x 24 GB with
  configs/fsdp2_config_qlora.yaml, batch 2 x 2048, accumulation 4: the attention, the activation-checkpointing
  decision with the plans it was taken from, the plan per GPU and host RAM of each phase, and preflight's verdict.
- `launchers`: each run_*.sh, run by bash with a stand-in `accelerate` that records its command, planned for
  Llama-2-70B (its published config.json: fp16 checkpoint) on the launcher's hardware.
- `qlora-64gb`: the host-RAM arithmetic of run_peft_qlora_fsdp.sh (FSDP1 + offload) from the same plan.
- `gpt-oss-one-gpu`: gpt-oss-20b QLoRA on one 24 GB GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# where the blocks may be
DOCUMENTS = [REPO / "README.md", REPO / "NOTES.md", REPO / "bench" / "README.md", REPO / "configs" / "README.md",
             *sorted((REPO / "docs").glob("*.md"))]
MODEL_FLAGS = ["--check", "--accelerate_config", "configs/fsdp2_config_qlora.yaml", "--gpu_gib", "24",
               "--use_4bit_quantization", "true", "--max_length", "2048", "--per_device_train_batch_size", "2",
               "--gradient_accumulation_steps", "4", "--eval_num_prompts", "0"]
# What each launcher is for (its header says the same): the hardware, each GPU's memory, and the figures published for
# the reference recipe's run of it, where there are any.
LAUNCHERS = {
    "run_peft_fsdp.sh": ("8 x H100 80 GB", 80, "72-80 GB per GPU"),
    "run_peft_qlora_fsdp.sh": ("2 x 24 GB, 64 GB host", 24, "19.6 GB per GPU, ~107 GB host"),
    "run_peft_deepspeed.sh": ("8 x H100 80 GB", 80, "none"),
    "run_peft_qlora_deepspeed.sh": ("2 GPUs, 48 GB+", 48, "none"),
}
# meta-llama/Llama-2-70b-hf's config.json, as published (the launchers' default model)
LLAMA_2_70B = REPO / "configs" / "models" / "Llama-2-70b-hf"  # the launchers' model, as published
RECORDER = ("#!/usr/bin/env python3\nimport json, os, sys\n"
            "open(os.environ['ARGV_LOG'], 'w').write(json.dumps(sys.argv[1:]))\n")
PHASES = ("load", "train", "save")


def host_by_phase(plan) -> str:
    return ", ".join(f"{plan.phases[phase]['host machine']:.1f}" for phase in PHASES)


def model_row(model_dir: Path) -> str:
    from recipe.planning.memory import ALLOCATOR_HEADROOM
    from recipe.settings.checks import preflight
    from recipe.settings.configuration import configure, memory_plan

    config = configure(["--model_name_or_path", str(model_dir), *MODEL_FLAGS])
    plans = {on: memory_plan(config, checkpointing=on).per_gpu_total * ALLOCATOR_HEADROOM for on in (False, True)}
    plan = memory_plan(config)
    # what each error is, without the machine's path to the folder
    errors = [problem.what.replace(str(model_dir), model_dir.name) for problem in preflight(config)
              if problem.level == "error"]
    verdict = "error: " + "; ".join(errors) if errors else "passed"  # as --check ends (config.json alone: no tokenizer)
    checkpointing = "on" if config.training.activation_checkpointing else "off"
    return (f"| {model_dir.name} | {config.attention} | {checkpointing} ({plans[False]:.1f} / {plans[True]:.1f}) | "
            f"{plan.phases['train']['gpu']:.1f} | {host_by_phase(plan)} | {verdict} |")


def models_table() -> str:
    rows = [model_row(model_dir) for model_dir in sorted((REPO / "configs" / "models").iterdir())]
    return "\n".join(["| model | attention | activation checkpointing (plan without / with, GiB per GPU incl. "
                      "headroom) | plan per GPU, train | host RAM per machine (load, train, save) | verdict |",
                      "|---|---|---|---|---|---|", *rows])


def launcher_check_argv(script: str, model_dir: Path, gpu_gib: float, **env: str) -> list[str]:
    """The launcher's `accelerate launch --config_file C train.py ARGS`, as bash runs it, turned into
    `train.py --check --accelerate_config C ARGS --gpu_gib G` with the model's config.json in `model_dir`."""
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "accelerate").write_text(RECORDER)
        (Path(folder) / "accelerate").chmod(0o755)
        log = Path(folder) / "argv.json"
        subprocess.run(["bash", str(REPO / script)], cwd=REPO, check=True, timeout=60,
                       env={**os.environ, "PATH": f"{folder}:{os.environ['PATH']}", "ARGV_LOG": str(log),
                            "MODEL": str(model_dir), **env})
        argv = json.loads(log.read_text())
    at = argv.index("train.py")
    config_file = argv[argv.index("--config_file") + 1]
    return ["--check", "--accelerate_config", config_file, *argv[at + 1:], "--gpu_gib", str(gpu_gib)]


def launcher_plan(script: str, model_dir: Path, **env: str):
    """The launcher's accelerate config file, its settled configuration and its memory plan (`env`: the launcher's
    variables, e.g. ACCELERATE_CONFIG)."""
    from recipe.settings.configuration import configure, memory_plan

    argv = launcher_check_argv(script, model_dir, LAUNCHERS[script][1], **env)
    config = configure(argv)
    return argv[argv.index("--accelerate_config") + 1], config, memory_plan(config)


def launchers_table(model_dir: Path) -> str:
    rows = []
    for script, (hardware, _, published) in LAUNCHERS.items():
        config_file, _, plan = launcher_plan(script, model_dir)
        rows.append(f"| `{script}` | `{Path(config_file).name}` | {hardware} | "
                    f"{plan.phases['train']['gpu']:.1f} / {host_by_phase(plan)} | {published} |")
    return "\n".join(["| launcher | accelerate config | hardware | planned peak, GiB: per GPU (train) / host RAM per "
                      "machine (load, train, save) | published |", "|---|---|---|---|---|", *rows])


def qlora_64gb(model_dir: Path) -> str:
    """run_peft_qlora_fsdp.sh's host RAM, phase by phase, in the plan's own terms."""
    _, config, plan = launcher_plan("run_peft_qlora_fsdp.sh", model_dir)
    host, load, train, save = plan.host, *(plan.phases[phase] for phase in PHASES)
    state = host["trainable weights"] + host["gradients"] + host["optimizer state"]
    def fits(plan) -> str:
        return "64 GB is " + ("enough" if max(p["host machine"] for p in plan.phases.values()) < 64e9 / 2**30 else
                              "not enough")

    _, _, fsdp2 = launcher_plan("run_peft_qlora_fsdp.sh", model_dir,
                                ACCELERATE_CONFIG="configs/fsdp2_config_qlora.yaml")
    return (f"**QLoRA on 64 GB of host RAM** (`run_peft_qlora_fsdp.sh`, Llama-2-70B, {config.launch.num_processes} x "
            f"24 GB, FSDP1 with offload): the 4-bit base (NF4 with nested constants, embeddings and head in bf16) is "
            f"{host['weights (frozen)']:.1f} GiB. Load: rank 0 quantizes into host RAM one fp16 weight at a time "
            f"(the memory-mapped checkpoint pages are cache the kernel can drop) while FSDP1 moves each unit to the "
            f"GPU, broadcasts it and offloads the shards, freeing rank 0's copy as it goes: rank 0 "
            f"{load['host rank 0']:.1f} GiB, each other rank {load['host other rank']:.1f}, the machine "
            f"{load['host machine']:.1f} with the processes. Train: the offloaded shards "
            f"({host['weights (frozen)']:.1f}) + adapter, gradients and AdamW state ({state:.1f}) + processes "
            f"({host['processes']:.1f}) = {train['host machine']:.1f} GiB. Save: the adapter gathered onto rank 0 "
            f"({save['host rank 0']:.1f}) on top = {save['host machine']:.1f} GiB: {fits(plan)}. The FSDP2 variant "
            "(`ACCELERATE_CONFIG=configs/fsdp2_config_qlora.yaml`) peaks at "
            f"{fsdp2.phases['load']['host machine']:.1f} "
            f"GiB while loading (rank 0 lets go of each tensor of its base once accelerate has sent it, as the other "
            f"rank's shards arrive): {fits(fsdp2)}. "
            "The published 107 GB was measured on an older stack, where (by its code) every rank loaded the model and "
            "the final save gathered the full state dict.")


def gpt_oss_one_gpu() -> str:
    """gpt-oss-20b QLoRA on one 24 GB GPU (no accelerate config), one 2048-token row per step, as memory.py plans it."""
    from recipe.planning.memory import ALLOCATOR_HEADROOM, Run, Shapes, load_config, plan

    shapes = Shapes.of(load_config(str(REPO / "configs" / "models" / "gpt-oss-20b")))
    run = Run(method="qlora", engine="none", gpus=1, batch=1, seq=2048, eager_attention=True, lora_r=16,
              lora_dropout=0.0, nested_quant=True)
    without, with_ = (plan(shapes, replace(run, checkpointing=on)) for on in (False, True))
    reserved = with_.per_gpu_total * ALLOCATOR_HEADROOM
    return (f"**gpt-oss-20b on one 24 GB GPU** (QLoRA with nested quantization, LoRA r=16 on attention and every "
            "expert, 1 x 2048 tokens per step, activation checkpointing; `python memory.py --model "
            "configs/models/gpt-oss-20b --method qlora --gpus 1 --batch 1 --seq 2048 --lora_r 16 --lora_dropout 0 "
            f"--gpu_gib 24`): {with_.per_gpu_total:.1f} GiB allocated, about {reserved:.1f} reserved: "
            f"{'fits' if reserved <= 24 else 'does not fit'} ({without.per_gpu_total * ALLOCATOR_HEADROOM:.0f} GiB "
            f"without checkpointing); {with_.per_gpu['weights (frozen)']:.1f} GiB of it the 4-bit base. The host "
            f"holds {with_.phases['load']['host rank 0']:.1f} GiB while loading (the 4-bit base, with one layer's "
            "experts in 16 bits at a time until they are split and quantized; then the model moves to the GPU). "
            "The published checkpoint's experts are MXFP4, which the recipe refuses with the fix: train from the bf16 "
            "release, or dequantize once.")


def blocks() -> dict[str, str]:
    return {"models": models_table(), "launchers": launchers_table(LLAMA_2_70B), "qlora-64gb": qlora_64gb(LLAMA_2_70B),
            "gpt-oss-one-gpu": gpt_oss_one_gpu()}


def marked(name: str, tool: str = "plan_tables.py") -> re.Pattern:
    """A document's block `name`: between `<!-- TOOL: name -->` and `<!-- /TOOL -->` lines (TOOL: the script that
    writes it)."""
    tool = re.escape(tool)
    return re.compile(rf"(<!-- {tool}: {re.escape(name)} -->\n)(.*?)(<!-- /{tool} -->)", re.S)


def readme_block(name: str, text: str, tool: str = "plan_tables.py") -> str | None:
    found = marked(name, tool).search(text)
    return found.group(2).removesuffix("\n") if found else None


def written_blocks(name: str, tool: str = "plan_tables.py") -> list[tuple[Path, str]]:
    """Each document that holds block `name`, with the block as written there."""
    found = []
    for document in DOCUMENTS:
        block = readme_block(name, document.read_text(), tool)
        if block is not None:
            found.append((document, block))
    return found


def write_blocks(made: dict[str, str], tool: str = "plan_tables.py") -> None:
    """Rewrite each block of `made` wherever a document holds it."""
    for name, block in made.items():
        found = written_blocks(name, tool)
        if not found:
            sys.exit(f"no document has a `<!-- {tool}: {name} -->` ... `<!-- /{tool} -->` block")
        for document, _ in found:
            text = marked(name, tool).sub(lambda match: match.group(1) + block + "\n" + match.group(3),
                                          document.read_text())
            document.write_text(text)
            print(f"{document.relative_to(REPO)}: {name} rewritten")


def blocks_command(make_blocks, description: str, argv: list[str] | None = None,
                   tool: str = "plan_tables.py") -> None:
    """A script that prints the blocks `make_blocks()` makes, or (--write) rewrites them where they are."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the blocks where they are written")
    args = parser.parse_args(argv)
    made = make_blocks()
    if not args.write:
        print("\n\n".join(f"<!-- {name} -->\n{text}" for name, text in made.items()))
        return
    write_blocks(made, tool)


def main(argv: list[str] | None = None) -> None:
    blocks_command(blocks, __doc__, argv)


if __name__ == "__main__":
    main()
