"""Side-by-side benchmark: this recipe vs `trl sft` with its defaults vs `trl sft` hand-tuned to the recipe's settings.

    .venv/bin/python bench/benchmark.py                 # CPU: SmolLM2-135M, LoRA r=16 all-linear, 4 x 256 packed tokens
    .venv/bin/python bench/benchmark.py --steps 12 --repeats 2 --out bench/benchmark.json

The same fine-tune (model, data, sequence length, global batch, steps, LoRA, loss on the answers only) runs through
each setup, alternating, `--repeats` times; each run is a fresh process. The demo data goes in as conversational
prompt/completion, so TRL also trains on the completions only and the loss curves compare. Printed side by side:
trained (non-padding) tokens per second, seconds per step, peak RSS, the loss curve, the ratios to the recipe, and
FLOPs utilisation: model FLOPs per trained token times tokens/s, over the matmul peak this script measures on the same
machine in the same dtype just before each run. The FLOPs count only the work the loss needs: every weight forward
and input-gradient, weight gradients for the LoRA weights only (frozen weights get none), the LM head at the
supervised positions only, and causal attention within each example.

Then the matmul ceiling: the utilisation a step would reach if everything but its matmuls took no time (each of the
step's matrix products timed alone at its own shape). Then an ablation, in one process: forward + backward of one
recipe batch with each of fast_paths.py's shortcuts switched off in turn (and a padded batch of the same examples), and
with `--torch_compile`'s per-layer compilation (after the compiling step), alternated: what each one buys.
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


def matmul_peak_gflops(dtype: torch.dtype, threads: int, device: str = "cpu", scale: float = 1.0) -> float:
    """Best of a few large matmuls in `dtype` on `device`: the ceiling a training step's matmuls can reach. `scale`
    shrinks the matrices (a quick run of the code path, not a measurement)."""
    torch.set_num_threads(threads)
    rows, inner = (int(n * scale) for n in ((8192, 8192) if device == "cuda" else (1024, 1536)))
    a = torch.randn(rows, inner, dtype=dtype, device=device)
    b = torch.randn(inner, inner, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    best = 0.0
    for _ in range(5):
        a @ b
        sync()
        start, reps = time.perf_counter(), 20
        for _ in range(reps):
            a @ b
        sync()
        best = max(best, 2 * rows * inner * inner * reps / (time.perf_counter() - start) / 1e9)
    return best


def step_matmuls(model_dir: str, lora_r: int, tokens: int, supervised: int) -> list[tuple[tuple, bool, int]]:
    """One LoRA training step's matmuls as ((m, k, n), weight_transposed, count): each decoder linear's forward (x @
    W^T) and input gradient (g @ W), its LoRA branch's forward, input and weight gradients, and the LM head's forward
    and input gradient at the supervised positions."""
    from recipe.planning.memory import Shapes, load_config

    shapes = Shapes.of(load_config(model_dir))
    products, r = [], lora_r
    for d_in, d_out in shapes.layer_linears:
        products += [((tokens, d_in, d_out), True), ((tokens, d_out, d_in), False),  # frozen weight
                     ((tokens, d_in, r), True), ((tokens, r, d_out), True),  # LoRA forward
                     ((tokens, d_out, r), False), ((tokens, r, d_in), False),  # LoRA input gradients
                     ((d_out, tokens, r), False), ((r, tokens, d_in), False)]  # LoRA weight gradients
    counted = [(shape, transposed, shapes.num_layers) for shape, transposed in products]
    hidden, vocab = shapes.hidden, shapes.vocab
    return counted + [((supervised, hidden, vocab), True, 1), ((supervised, vocab, hidden), False, 1)]


def matmul_seconds(products: list[tuple[tuple, bool, int]], dtype: torch.dtype, threads: int) -> float:
    """Best-of-3 time of `products` (from step_matmuls), each timed alone on random operands in its own layout."""
    torch.set_num_threads(threads)
    total = 0.0
    for (m, k, n), transposed, count in products:
        a = torch.randn(m, k, dtype=dtype)
        b = torch.randn(n, k, dtype=dtype).t() if transposed else torch.randn(k, n, dtype=dtype)
        a @ b
        best = float("inf")
        for _ in range(3):
            start, reps = time.perf_counter(), 5
            for _ in range(reps):
                a @ b
            best = min(best, (time.perf_counter() - start) / reps)
        total += best * count
    return total


def data_shape(data_dir: Path, model: str | Path | None = None) -> dict:
    """Supervised fraction and token-weighted mean example length of the train split, as the recipe tokenizes it with
    `model`'s tokenizer (the default model's when None)."""
    from recipe.settings.configuration import configure
    from recipe.data.training_data import prepare

    config = configure(["--dataset_name", str(data_dir), "--splits", "train",
                        *(["--model_name_or_path", str(model)] if model else [])])
    labels = prepare(str(data_dir), ["train"], config.facts.tokenizer, max_length=config.max_length,
                     truncate=True).datasets["train"]["labels"]
    lengths = [len(x) for x in labels]
    return {"supervised_fraction": sum(sum(t != -100 for t in x) for x in labels) / sum(lengths),
            "mean_context": sum(n * n for n in lengths) / sum(lengths)}


def flops_per_token(model_dir: str, lora_r: int, shape: dict) -> float:
    """LoRA training FLOPs per token that the loss needs: 2W forward + 2W input-gradients over the decoder's weights W
    (frozen, so no weight gradients), 6 x LoRA weights (forward, input- and weight-gradients), the LM head's 2 x 2
    x vocab x hidden at the supervised positions only, and causal attention within each example (6 x layers x hidden x
    context, forward and backward). A mixture of experts counts the experts each token is routed to."""
    from recipe.planning.memory import Shapes, load_config

    shapes = Shapes.of(load_config(model_dir))
    head = 4 * shapes.vocab * shapes.hidden * shape["supervised_fraction"]
    attention = 6 * shapes.num_layers * shapes.hidden * shape["mean_context"]
    return 4 * shapes.active_linear + 6 * shapes.active_lora_per_rank * lora_r + head + attention


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
    gpu = [int(x) / 2**30 for x in (re.findall(r"PEAK_GPU_BYTES (\d+) (\d+)", output) or [(0, 0)])[-1]]
    return {"seconds": float(final["train_runtime"]), "wall": time.time() - start, "tokens": tokens,
            "final_loss": losses[-1], "losses": losses, "peak_rss_gib": int(peak[-1]) / 2**30 if peak else None,
            "gpu_allocated_gib": gpu[0], "gpu_reserved_gib": gpu[1]}


# A wrapper that runs a console entry point in-process and prints the process's peak RSS at exit, and its peak GPU
# memory (allocated, reserved) when it used CUDA. `trl sft` trains in a child process (its launcher), so the RSS peak
# is the larger of this process and its children.
PEAK = ("import atexit, resource, runpy, sys; "
        "atexit.register(lambda: print('PEAK_RSS_BYTES', 1024 * max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,"
        " resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))); "
        "cuda = lambda: 'torch' in sys.modules and sys.modules['torch'].cuda.is_available() "
        "and sys.modules['torch'].cuda; "
        "atexit.register(lambda: cuda() and print('PEAK_GPU_BYTES', cuda().max_memory_allocated(),"
        " cuda().max_memory_reserved())); "
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


COMMON = ["--per_device_train_batch_size", "4", "--max_length", "256", "--packing", "true", "--logging_steps", "1",
          "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", "--seed", "42",
          # the recipe's optimisation defaults, given to all, so the loss curves compare
          "--learning_rate", "1e-3", "--lr_scheduler_type", "cosine", "--warmup_steps", "0.1"]


def recipe_argv(model: str, data: str, steps: int, out: Path) -> list[str]:
    return ["--model_name_or_path", model, "--dataset_name", data, "--splits", "train", "--eval_num_prompts", "0",
            "--output_dir", str(out), "--overwrite_output_dir", "true", "--max_steps", str(steps), *COMMON]


def setups(model: str, data: str, steps: int, out: Path, precision: str, threads: int) -> dict[str, tuple]:
    """name -> (command, extra environment)."""
    lora = ["--use_peft", "--lora_r", "16", "--lora_alpha", "32", "--lora_target_modules", "all-linear"]
    trl = [sys.executable, "-c", PEAK, str(Path(sys.executable).parent / "trl"), "sft", "--model_name_or_path", model,
           "--dataset_name", data, "--max_steps", str(steps), *COMMON, *lora, "--use_cpu", "true"]
    return {
        "recipe (defaults)": (
            [sys.executable, "-c", PEAK, "train.py", *recipe_argv(model, data, steps, out / "recipe")], {}),
        "trl sft (defaults)": ([*trl, "--output_dir", str(out / "trl-default")], {}),
        # The recipe's numerics and settings: precision, no checkpointing, sdpa, no LoRA dropout, and every core (its
        # launcher would otherwise pin one thread).
        "trl sft (hand-tuned)": ([*trl, "--output_dir", str(out / "trl-tuned"),
                                  "--dtype", "bfloat16" if precision == "bf16" else "float32",
                                  "--bf16", str(precision == "bf16"), "--gradient_checkpointing", "false",
                                  "--attn_implementation", "sdpa", "--lora_dropout", "0"],
                                 {"OMP_NUM_THREADS": str(threads)}),
    }


def prompt_completion_copy(source: Path, out: Path) -> Path:
    """The demo's train split as conversational prompt/completion: TRL's completion-only loss then supervises the
    answers, as the recipe does with the chat version (this template has no generation markers for TRL's
    assistant_only_loss). Parquet with string columns: `datasets`' JSON reader would infer a column of ISO dates as
    timestamps, which the chat template then renders as `<datetime>`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for line in (source / "train.jsonl").read_text().splitlines():
        messages = json.loads(line)["messages"]
        rows.append({"prompt": messages[:-1], "completion": messages[-1:]})
    turns = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([("prompt", turns), ("completion", turns)])),
                   out / "train.parquet")
    return out


def ablation_trainer(model: str, data: str):
    """The recipe's Trainer for one step, its first packed batch, and the same examples as a padded batch."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    import train
    from recipe.settings.configuration import configure

    config = configure(recipe_argv(model, data, 1, REPO / "outputs" / "bench"))
    trainer, _ = train.build_trainer(config, train.build_base_model(config), train.load_data(config))
    packed = next(iter(trainer.get_train_dataloader()))
    bounds = packed["cu_seq_lens_q"].tolist()
    padded = DataCollatorForLanguageModeling(pad_token_id=config.facts.tokenizer.pad_token_id)([
        {"input_ids": packed["input_ids"][0, a:b].tolist(), "labels": packed["labels"][0, a:b].tolist()}
        for a, b in zip(bounds, bounds[1:])])
    return trainer, packed, padded


def ablation(model: str, data: str, repeats: int) -> tuple[dict[str, dict], int, float]:
    """Forward + backward of one recipe batch with each shortcut off in turn, and with the decoder layers compiled,
    alternated in rounds (after a warm-up step each, which compiles): median seconds, median ratio to the recipe's
    step of the same round, and in how many rounds it beat the recipe; the batch's tokens; the median matmul peak,
    measured at the start of each round."""
    import trl.kernels.chunked_logprob as kernels
    import trl.trainer.utils as trl_utils

    from recipe.model.fast_paths import ATTENTION

    trainer, packed, padded = ablation_trainer(model, data)
    wrapped = trainer.accelerator.prepare(trainer.model)  # the Trainer's own wrapping: autocast in bf16
    base = trainer.model.get_base_model()
    compact, every_position = trl_utils._use_triton, kernels._use_triton
    # --torch_compile's regional compilation, in place so it can be switched off and on between steps
    layers = base.model.layers
    for layer in layers:
        layer.compile(dynamic=True)
    compiled = [layer._compiled_call_impl for layer in layers]

    def step(attention=ATTENTION, head=compact, batch=packed, compile=False) -> float:
        base.set_attn_implementation(attention)
        trl_utils._use_triton = head
        for layer, call in zip(layers, compiled):
            layer._compiled_call_impl = call if compile else None
        start = time.perf_counter()
        trainer.compute_loss(wrapped, trainer._prepare_inputs(dict(batch))).backward()
        seconds = time.perf_counter() - start
        wrapped.zero_grad()
        return seconds

    variants = {
        "recipe (every shortcut)": {},
        "sdpa over the whole packed row": {"attention": "sdpa"},
        "LM head at every position (TRL on CPU)": {"head": every_position},
        "padded batch, same examples": {"batch": padded},
        "none of the shortcuts": {"attention": "sdpa", "head": every_position},
        "recipe + --torch_compile": {"compile": True},
    }
    for kwargs in variants.values():
        step(**kwargs)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in variants}
    peaks, dtype = [], torch.bfloat16 if trainer.args.bf16 else torch.float32
    for _ in range(repeats):
        peaks.append(matmul_peak_gflops(dtype, torch.get_num_threads()))
        for name, kwargs in variants.items():
            times[name].append(step(**kwargs))
    trl_utils._use_triton = compact
    recipe = times["recipe (every shortcut)"]
    # each variant against the recipe's step of the same round: the machine's speed drifts between rounds
    return {name: {"seconds": statistics.median(values),
                   "vs_recipe": statistics.median(v / r for v, r in zip(values, recipe)),
                   "faster_than_recipe": sum(v < r for v, r in zip(values, recipe))}
            for name, values in times.items()}, packed["input_ids"].numel(), statistics.median(peaks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ablation_repeats", type=int, default=9)
    parser.add_argument("--out", default=str(REPO / "bench" / "benchmark.json"))
    args = parser.parse_args()

    from recipe.platform.hardware import native_bf16_supported

    from recipe.model.model_files import DEFAULT_MODEL_DIR, convert_default_model

    convert_default_model()
    precision = "bf16" if native_bf16_supported() else "fp32"
    threads = os.cpu_count() or 1
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    work = REPO / "outputs" / "bench"
    data = prompt_completion_copy(REPO / "data" / "dates", work / "dates-prompt-completion")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    commands = setups(DEFAULT_MODEL_DIR, str(data), args.steps, work, precision, threads)
    results: dict[str, list[dict]] = {name: [] for name in commands}
    for repeat in range(args.repeats):
        for name, (command, extra_env) in commands.items():  # alternated: drift hits every setup alike
            # the machine's speed drifts: each run's utilisation is against the matmul peak measured just before it
            peak = matmul_peak_gflops(dtype, threads)
            results[name].append({**run(command, {**env, **extra_env}), "matmul_peak_gflops": peak})
            print(f"repeat {repeat + 1}: {name}: {results[name][-1]['seconds']:.1f} s", flush=True)

    shape = data_shape(data)
    per_token = flops_per_token(DEFAULT_MODEL_DIR, 16, shape)
    table = {}
    for name, runs in results.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        tokens = runs[0]["tokens"]
        utilisation = statistics.median(per_token * r["tokens"] / r["seconds"] / (r["matmul_peak_gflops"] * 1e9)
                                        for r in runs)
        table[name] = {"tokens_per_s": tokens / seconds, "s_per_step": seconds / args.steps,
                       "peak_rss_gib": max(r["peak_rss_gib"] or 0 for r in runs), "final_loss": runs[0]["final_loss"],
                       "flops_utilisation": utilisation, "losses": runs[0]["losses"]}
    ablated, batch_tokens, ablation_peak = ablation(DEFAULT_MODEL_DIR, str(data), args.ablation_repeats)
    # The bound: utilisation if everything but the step's matmuls took no time (peak measured alongside, for drift)
    step_tokens = round(statistics.mean(r["tokens"] for r in results["recipe (defaults)"]) / args.steps)
    products = step_matmuls(DEFAULT_MODEL_DIR, 16, step_tokens, round(step_tokens * shape["supervised_fraction"]))
    rounds = [(matmul_peak_gflops(dtype, threads), matmul_seconds(products, dtype, threads)) for _ in range(3)]
    record = {"date": time.strftime("%Y-%m-%d"), "threads": threads, "precision": precision, "data": shape,
              "flops_per_token": per_token, "steps": args.steps, "repeats": args.repeats, "runs": results,
              "table": table, "ablation": ablated, "ablation_repeats": args.ablation_repeats,
              "ablation_tokens": batch_tokens, "ablation_peak_gflops": ablation_peak, "step_tokens": step_tokens,
              "matmul_ceiling": statistics.median(per_token * step_tokens / seconds / (peak * 1e9)
                                                  for peak, seconds in rounds),
              "matmul_ceiling_peak_gflops": statistics.median(peak for peak, _ in rounds)}
    print_report(record)
    Path(args.out).write_text(json.dumps(record, indent=2))


def print_report(r: dict) -> None:
    """The setups side by side, the matmul ceiling and the ablation, from main's record."""
    table, shape, per_token = r["table"], r["data"], r["flops_per_token"]
    base = table["recipe (defaults)"]["tokens_per_s"]
    peaks = [run["matmul_peak_gflops"] for runs in r["runs"].values() for run in runs]
    print(f"\n{r['date']}, {r['threads']} CPU threads, {r['precision']}; matmul peak {min(peaks):.0f}-"
          f"{max(peaks):.0f} GFLOP/s (measured before each run); "
          f"{per_token / 1e6:.0f} MFLOP per trained token ({shape['supervised_fraction']:.1%} of tokens supervised, "
          f"examples of {shape['mean_context']:.0f} tokens); {r['steps']} steps of 4 x 256 packed tokens, median of "
          f"{r['repeats']}")
    print(f"{'setup':22s} {'tokens/s':>9s} {'s/step':>7s} {'peak RSS':>9s} {'final loss':>10s} {'FLOPs util':>10s} "
          f"{'recipe / this':>13s}")
    for name, row in table.items():
        print(f"{name:22s} {row['tokens_per_s']:9.0f} {row['s_per_step']:7.2f} {row['peak_rss_gib']:8.2f}G "
              f"{row['final_loss']:10.4f} {row['flops_utilisation']:9.0%} {base / row['tokens_per_s']:12.2f}x")
    print("loss curves: " + "; ".join(f"{name}: {' '.join(f'{x:.3f}' for x in row['losses'])}"
                                      for name, row in table.items()))
    print(f"\nmatmul ceiling: one step's matmuls alone ({r['step_tokens']} tokens, each product timed at its own "
          f"shape) would make {r['matmul_ceiling']:.0%} FLOPs utilisation (median of 3, peak "
          f"{r['matmul_ceiling_peak_gflops']:.0f} GFLOP/s); the rest is attention over short examples, elementwise "
          "work and the loss")
    print(f"\nablation: forward + backward of one recipe batch ({r['ablation_tokens']} tokens), "
          f"{r['ablation_repeats']} alternated rounds; utilisation against the median peak of the rounds, "
          f"{r['ablation_peak_gflops']:.0f} GFLOP/s")
    print(f"{'':40s} {'median':>8s} {'x recipe':>9s} {'faster in':>10s} {'FLOPs util':>10s}")
    for name, row in r["ablation"].items():
        utilisation = per_token * r["ablation_tokens"] / row["seconds"] / (r["ablation_peak_gflops"] * 1e9)
        print(f"{name:40s} {row['seconds']:6.2f} s {row['vs_recipe']:8.2f}x {row['faster_than_recipe']:4d} of "
              f"{r['ablation_repeats']:<2d} {utilisation:9.0%}")


if __name__ == "__main__":
    main()
