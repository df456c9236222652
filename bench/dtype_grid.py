"""Every single-machine shipped accelerate config with each dtype a user may set: one step on two CPU processes, or
refused by preflight before loading.

    .venv/bin/python bench/dtype_grid.py                # the whole grid; writes bench/dtype_grid.json and .md
    .venv/bin/python bench/dtype_grid.py --cells ID..   # some of it (ids as in the table), printed, nothing written

The cells: LoRA x {--bf16 true, --bf16 false}, and QLoRA x --bnb_4bit_quant_storage_dtype {bfloat16, float32} x
--bnb_4bit_compute_dtype {bfloat16, float32} x {--bf16 true, --bf16 false, --fp16 true}, under each config. Each cell
is first judged by the recipe's preflight as each rank of `accelerate launch --config_file CONFIG --num_processes 2
train.py ...` judges it on this machine; a cell it refuses is not launched (the refusal is the result, with its fix).
Every other cell is launched with the shipped config, only the process count changed, and trains one step of a
2-layer random Llama; a cell that fails after loading is a defect of the recipe. Whether `--bf16 true` trains depends
on the CPU (refused where bf16 is emulated): the table names the machine it was made on.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RESULTS = REPO / "bench" / "dtype_grid.json"
TABLE = REPO / "bench" / "dtype_grid.md"
PRECISIONS = {"bf16": ["--bf16", "true"], "fp32": ["--bf16", "false"], "fp16": ["--fp16", "true", "--bf16", "false"]}
DTYPES = ("bfloat16", "float32")
LAUNCH_SECONDS = 300


def single_machine_configs() -> list[str]:
    """The shipped accelerate configs of one machine that shard (FSDP, DeepSpeed), by file name."""
    names = []
    for path in sorted((REPO / "configs").glob("*.yaml")):
        settings = yaml.safe_load(path.read_text()) or {}
        if settings.get("distributed_type") in ("FSDP", "DEEPSPEED") and settings.get("num_machines", 1) == 1:
            names.append(path.name)
    return names


@dataclass(frozen=True)
class Cell:
    config: str
    precision: str  # a key of PRECISIONS
    storage: str | None = None  # QLoRA: bnb_4bit_quant_storage_dtype; None for LoRA
    compute: str | None = None  # QLoRA: bnb_4bit_compute_dtype

    @property
    def id(self) -> str:
        method = f"qlora-{self.storage}-{self.compute}" if self.storage else "lora"
        return f"{self.config.removesuffix('.yaml')}:{method}:{self.precision}"

    def flags(self) -> list[str]:
        quantized = (["--use_4bit_quantization", "true", "--bnb_4bit_quant_storage_dtype", self.storage,
                      "--bnb_4bit_compute_dtype", self.compute] if self.storage else [])
        return [*PRECISIONS[self.precision], *quantized]


def cells() -> list[Cell]:
    grid = []
    for config in single_machine_configs():
        grid += [Cell(config, precision) for precision in ("bf16", "fp32")]
        grid += [Cell(config, precision, storage, compute) for storage in DTYPES for compute in DTYPES
                 for precision in PRECISIONS]
    return grid


def run_flags(model_dir: Path, data_dir: Path, out: Path) -> list[str]:
    """One step of train.py, nothing evaluated or saved."""
    return ["--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir), "--output_dir", str(out),
            "--max_steps", "1", "--per_device_train_batch_size", "2", "--logging_steps", "1", "--splits", "train",
            "--eval_num_prompts", "0", "--save_strategy", "no", "--disable_tqdm", "true", "--report_to", "none"]


def launch_command(cell: Cell) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "configs" / cell.config),
            "--num_processes", "2", "--main_process_port", "0"]


def preflight_errors(cell: Cell, model_dir: Path, data_dir: Path, out: Path) -> list[str]:
    """What the recipe's preflight refuses in this cell, on this machine, before any weight is read: the facts of
    this machine, with the launch rank 0 of the cell's `accelerate launch` has (accelerate's own code computes it)."""
    from recipe.settings.arguments import parse_arguments
    from recipe.settings.checks import preflight
    from recipe.settings.configuration import settle
    from recipe.platform.launch import Launch, launch_environment

    request = parse_arguments([*run_flags(model_dir, data_dir, out), *cell.flags()])
    env = launch_environment([*launch_command(cell)[3:], "train.py"])
    facts = replace(machine_facts(str(model_dir)), launch=Launch(env, 2))  # rank 0 of 2, as Launch reads it
    return [str(problem) for problem in preflight(settle(request, facts)) if problem.level == "error"]


@functools.cache
def machine_facts(model_dir: str):
    """This machine's facts about the model (the same in every cell: read once)."""
    from recipe.settings.arguments import parse_arguments
    from recipe.settings.facts import gather

    return gather(parse_arguments(["--model_name_or_path", model_dir]))


def last_error(log: str) -> str:
    """The exception a rank raised (the launcher's own ChildFailedError says only that a rank failed)."""
    raised = [line.split(": ", 1)[1] for line in log.splitlines()
              if line.startswith("[rank") and ": " in line and "Error: " in line.split(": ", 1)[1][:80]]
    return raised[-1].strip() if raised else (log.strip().splitlines() or [""])[-1]


def run_cell(cell: Cell, model_dir: Path, data_dir: Path, work: Path) -> dict:
    out = work / cell.id.replace(":", "-")
    refused = preflight_errors(cell, model_dir, data_dir, out)
    if refused:
        return {"outcome": "refused", "detail": refused[0]}
    start = time.monotonic()
    done = subprocess.run([*launch_command(cell), str(REPO / "train.py"), *run_flags(model_dir, data_dir, out),
                           *cell.flags()], cwd=REPO, capture_output=True, text=True, timeout=LAUNCH_SECONDS,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    log = done.stdout + done.stderr
    losses = [line for line in log.splitlines() if line.startswith("{'loss'")]
    if done.returncode == 0 and losses:
        loss = float(losses[0].split("'loss': '")[1].split("'")[0])
        return {"outcome": "trains", "detail": f"loss {loss:.4g}", "seconds": round(time.monotonic() - start, 1)}
    return {"outcome": "fails", "detail": f"exit {done.returncode}: {last_error(log)}"}


def tiny_model(out: Path) -> Path:
    """A 2-layer Llama with the default model's tokenizer, random weights."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from recipe.model.model_files import convert_default_model

    tokenizer = AutoTokenizer.from_pretrained(convert_default_model())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def demo_data(out: Path, examples: int = 32) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    lines = (REPO / "data" / "dates" / "train.jsonl").read_text().splitlines()[:examples]
    (out / "train.jsonl").write_text("\n".join(lines) + "\n")
    return out


def cell_text(result: dict) -> str:
    if result["outcome"] == "trains":
        return f"trains ({result['detail']})"
    return f"{result['outcome']}: {result['detail']}"


def table(results: dict) -> str:
    """One row per config and method, one column per precision flag."""
    rows: dict[tuple[str, str], dict[str, dict]] = {}
    for cell_id, result in results["cells"].items():
        config, method, precision = cell_id.split(":")
        rows.setdefault((config, method), {})[precision] = result
    header = ["config", "method", *(" ".join(PRECISIONS[p]) for p in PRECISIONS)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (config, method), by_precision in rows.items():
        cells_text = [cell_text(by_precision[p]) if p in by_precision else "" for p in PRECISIONS]
        lines.append("| " + " | ".join([config, method, *cells_text]) + " |")
    machine_line = results["machine"]
    return (f"# Shipped configs x dtypes: one step on two CPU processes, or refused before loading\n\n"
            f"Made by `bench/dtype_grid.py` on {results['date']}, {machine_line['cpu']}, {machine_line['cores']} "
            f"cores, native bf16: {machine_line['native_bf16']}. `fails` would be a defect: a cell that loaded "
            "weights and then broke. Under a config whose `mixed_precision` is bf16, `--bf16 false` trains with the "
            "launch's bf16 autocast, as accelerate and transformers apply it (launch with `--mixed_precision no` for "
            "fp32).\n\n" + "\n".join(lines) + "\n")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", nargs="*", help="cell ids (config:method:precision); all by default")
    args = parser.parse_args(argv)
    chosen = [cell for cell in cells() if not args.cells or cell.id in args.cells]
    from recipe.platform.hardware import describe

    results = {"date": time.strftime("%Y-%m-%d"), "machine": describe(), "cells": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir, data_dir = tiny_model(work / "model"), demo_data(work / "data")
        for cell in chosen:
            results["cells"][cell.id] = result = run_cell(cell, model_dir, data_dir, work)
            print(f"{cell.id}: {result['outcome']}: {result['detail']}", flush=True)
    if args.cells:
        return
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    TABLE.write_text(table(results))
    print(f"wrote {RESULTS.relative_to(REPO)} and {TABLE.relative_to(REPO)}")


if __name__ == "__main__":
    main(sys.argv[1:])
