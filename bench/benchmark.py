"""Side-by-side benchmark: this recipe vs `trl sft` with its defaults vs `trl sft` hand-tuned to the recipe's settings.

    .venv/bin/python bench/benchmark.py                 # CPU: SmolLM2-135M, LoRA r=16 all-linear, 4 x 256 packed tokens
    .venv/bin/python bench/benchmark.py --steps 12 --repeats 2 --out bench/benchmark.json

The same fine-tune (model, data, sequence length, global batch, steps, LoRA) runs through each setup, alternating,
`--repeats` times; each run is a fresh process. Printed side by side: trained (non-padding) tokens per second, seconds
per step, peak RSS, final loss, the ratios to the recipe, and FLOPs utilisation: model FLOPs per trained token (for
LoRA: forward through every weight, backward input-gradients through every weight, weight gradients for the LoRA
weights only) times tokens/s, over the matmul peak this script measures on the same machine in the same dtype.
Not a test: numbers vary with the machine; the README keeps a dated table.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def matmul_peak_gflops(dtype: torch.dtype, threads: int) -> float:
    """Best of a few large matmuls in `dtype` on this CPU: the ceiling a training step's matmuls can reach."""
    torch.set_num_threads(threads)
    a, b = torch.randn(1024, 1536, dtype=dtype), torch.randn(1536, 1536, dtype=dtype)
    best = 0.0
    for _ in range(5):
        a @ b
        start, reps = time.perf_counter(), 20
        for _ in range(reps):
            a @ b
        best = max(best, 2 * 1024 * 1536 * 1536 * reps / (time.perf_counter() - start) / 1e9)
    return best


def flops_per_token(model_dir: str, lora_r: int, seq: int) -> float:
    """LoRA training FLOPs per token: 2N forward + 2N input-gradients over all N weights (frozen ones get no weight
    gradient), + 6 x LoRA weights (their forward, input- and weight-gradients), + causal attention (6 x layers x
    seq x hidden, forward and backward)."""
    from memory import Shapes, load_config

    shapes = Shapes.of(load_config(model_dir))
    embeddings = shapes.vocab * shapes.hidden  # the input lookup is no matmul (the tied lm_head is, counted once)
    n = shapes.total - embeddings + shapes.vocab * shapes.hidden
    lora = shapes.lora_per_rank * lora_r
    return 4 * n + 6 * lora + 6 * shapes.num_layers * seq * shapes.hidden


def run(command: list[str], env: dict) -> dict:
    """One training process: its wall time, peak RSS and the Trainer's final log lines."""
    start = time.time()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = process.communicate()[0]
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} failed:\n{output[-3000:]}")
    logs = [ast.literal_eval(line[line.index("{'"):]) for line in output.splitlines()
            if re.search(r"\{'(loss|train_runtime)'", line)]
    losses = [float(entry["loss"]) for entry in logs if "loss" in entry]
    final = next(entry for entry in logs if "train_runtime" in entry)
    tokens = max(float(entry["num_tokens"]) for entry in logs if "num_tokens" in entry)
    peak = re.findall(r"PEAK_RSS_BYTES (\d+)", output)
    return {"seconds": float(final["train_runtime"]), "wall": time.time() - start, "tokens": tokens,
            "final_loss": losses[-1], "losses": losses, "peak_rss_gib": int(peak[-1]) / 2**30 if peak else None}


# A wrapper that runs a console entry point in-process and prints the process's peak RSS at exit.
# `trl sft` trains in a child process (its launcher), so the peak is the larger of this process and its children.
PEAK = ("import atexit, resource, runpy, sys; "
        "atexit.register(lambda: print('PEAK_RSS_BYTES', 1024 * max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,"
        " resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))); "
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def setups(model: str, data: str, steps: int, out: Path, precision: str, threads: int) -> dict[str, tuple]:
    """name -> (command, extra environment)."""
    common = ["--max_steps", str(steps), "--per_device_train_batch_size", "4", "--max_length", "256",
              "--packing", "true", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
              "--disable_tqdm", "true", "--learning_rate", "1e-3", "--seed", "42"]
    lora = ["--use_peft", "--lora_r", "16", "--lora_alpha", "32", "--lora_target_modules", "all-linear"]
    trl = [sys.executable, "-c", PEAK, str(Path(sys.executable).parent / "trl"), "sft", "--model_name_or_path", model,
           "--dataset_name", data]
    return {
        "recipe (defaults)": ([sys.executable, "-c", PEAK, "train.py", "--model_name_or_path", model, "--dataset_name",
                               data, "--splits", "train", "--eval_num_prompts", "0", "--output_dir",
                               str(out / "recipe"), "--overwrite_output_dir", "true", *common], {}),
        "trl sft (defaults)": ([*trl, *common, *lora, "--output_dir", str(out / "trl-default"), "--use_cpu", "true"],
                               {}),
        # The recipe's numerics and settings: precision, no checkpointing, sdpa, no LoRA dropout, and every core (its
        # launcher would otherwise pin one thread).
        "trl sft (hand-tuned)": ([*trl, *common, *lora, "--output_dir", str(out / "trl-tuned"), "--use_cpu", "true",
                                  "--dtype", "bfloat16" if precision == "bf16" else "float32",
                                  "--bf16", str(precision == "bf16"), "--gradient_checkpointing", "false",
                                  "--attn_implementation", "sdpa", "--lora_dropout", "0"],
                                 {"OMP_NUM_THREADS": str(threads)}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "bench" / "benchmark.json"))
    args = parser.parse_args()

    from utils import DEFAULT_MODEL_DIR, convert_default_model, native_bf16_supported

    convert_default_model()
    precision = "bf16" if native_bf16_supported() else "fp32"
    threads = os.cpu_count() or 1
    peak = matmul_peak_gflops(torch.bfloat16 if precision == "bf16" else torch.float32, threads)
    work = REPO / "outputs" / "bench"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    commands = setups(DEFAULT_MODEL_DIR, str(REPO / "data" / "dates"), args.steps, work, precision, threads)
    results: dict[str, list[dict]] = {name: [] for name in commands}
    for repeat in range(args.repeats):
        for name, (command, extra_env) in commands.items():  # alternated: drift hits every setup alike
            results[name].append(run(command, {**env, **extra_env}))
            print(f"repeat {repeat + 1}: {name}: {results[name][-1]['seconds']:.1f} s", flush=True)

    per_token = flops_per_token(DEFAULT_MODEL_DIR, 16, 256)
    table = {}
    for name, runs in results.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        tokens = runs[0]["tokens"]
        table[name] = {"tokens_per_s": tokens / seconds, "s_per_step": seconds / args.steps,
                       "peak_rss_gib": max(r["peak_rss_gib"] or 0 for r in runs), "final_loss": runs[0]["final_loss"],
                       "flops_utilisation": per_token * tokens / seconds / (peak * 1e9), "losses": runs[0]["losses"]}
    base = table["recipe (defaults)"]["tokens_per_s"]
    print(f"\n{time.strftime('%Y-%m-%d')}, {threads} CPU threads, {precision}; matmul peak {peak:.0f} GFLOP/s; "
          f"{per_token / 1e6:.0f} MFLOP per trained token; {args.steps} steps of 4 x 256 packed tokens, median of "
          f"{args.repeats}")
    print("final loss: the recipe's is over the assistant tokens only; trl sft's over every token (this chat template "
          "has no generation markers, so TRL's assistant_only_loss cannot be used)")
    print(f"{'setup':22s} {'tokens/s':>9s} {'s/step':>7s} {'peak RSS':>9s} {'final loss':>10s} {'FLOPs util':>10s} "
          f"{'recipe / this':>13s}")
    for name, row in table.items():
        print(f"{name:22s} {row['tokens_per_s']:9.0f} {row['s_per_step']:7.2f} {row['peak_rss_gib']:8.2f}G "
              f"{row['final_loss']:10.4f} {row['flops_utilisation']:9.0%} {base / row['tokens_per_s']:12.2f}x")
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "threads": threads,
                                          "precision": precision, "matmul_peak_gflops": peak,
                                          "flops_per_token": per_token, "steps": args.steps, "runs": results,
                                          "table": table}, indent=2))


if __name__ == "__main__":
    main()
