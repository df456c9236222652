"""What a person reads after a run: the training curves as a PNG and the model card of the adapter.

Both are written from `run_summary.json`, which train.py leaves in the output folder (arguments, hardware, losses,
held-out metrics, the log history).
"""

from __future__ import annotations

import json
from pathlib import Path

SUMMARY_FILE = "run_summary.json"
PLOT_FILE = "training_curves.png"
# The plan's phases as the run measures them (train.py's PhasePeaks): loading is read, wrap and shard
MEASURED_PARTS = {"load": ("read", "wrap", "shard"), "train": ("train",), "save": ("save",)}


def memory_against_plan(summary: dict, rank: int = 0) -> dict:
    """For each phase of the plan: what `rank` measured beside what was planned, GiB. GPU: the peak allocated (the
    plan's figure less the CUDA context it adds), the allocator's reserved peak and the device's used memory (the
    process's whole footprint, CUDA context included: against the plan's figure). Host: the growth of the process's
    anonymous memory over the phase, against the plan's `host rank 0` / `host other rank`."""
    from memory import CUDA_CONTEXT_GIB

    results = summary["results"]
    measured, plan = results["memory_by_rank"][rank], results.get("memory_plan") or {}
    place = "host rank 0" if rank == 0 else "host other rank"
    rows = {}
    for phase, parts in MEASURED_PARTS.items():
        records = [measured[part] for part in parts if part in measured]
        if not records:
            continue

        def peak(key: str) -> float | None:
            values = [record[key] for record in records if record.get(key) is not None]
            return max(values) if values else None

        planned = plan.get(phase, {})
        host_peak, host_start = peak("host_peak_gib"), records[0].get("host_start_gib")
        rows[phase] = {
            "planned_gpu_gib": planned.get("gpu"),
            "planned_allocated_gib": max(planned["gpu"] - CUDA_CONTEXT_GIB, 0.0) if planned.get("gpu") else None,
            "allocated_gib": peak("cuda_peak_gib"), "reserved_gib": peak("cuda_reserved_peak_gib"),
            "device_used_gib": peak("cuda_device_used_peak_gib"),
            "planned_host_gib": planned.get(place),
            "host_growth_gib": host_peak - host_start if host_peak is not None and host_start is not None else None}
    return rows


def plot_history(log_history: list[dict], path: Path) -> Path:
    """Train and eval loss, and the learning rate, against the optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key):
        points = [(entry["step"], entry[key]) for entry in log_history if key in entry and "step" in entry]
        return zip(*points) if points else ((), ())

    fig, (loss_ax, lr_ax) = plt.subplots(1, 2, figsize=(10, 3.6))
    for key, label, style in (("loss", "train", "-"), ("eval_loss", "eval", "o--")):
        steps, values = series(key)
        if steps:
            loss_ax.plot(steps, values, style, label=label)
    loss_ax.set(xlabel="step", ylabel="loss", title="loss")
    losses = [entry[key] for entry in log_history for key in ("loss", "eval_loss") if key in entry]
    if losses and min(losses) > 0 and max(losses) / min(losses) > 20:
        loss_ax.set_yscale("log")  # fine-tuning losses often fall by orders of magnitude
    if loss_ax.lines:  # a run shorter than --logging_steps logs no loss
        loss_ax.legend()
    steps, values = series("learning_rate")
    lr_ax.plot(steps, values)
    lr_ax.set(xlabel="step", ylabel="learning rate", title="learning rate")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def model_card(summary: dict) -> str:
    """A README.md for the adapter's Hub repo, from run_summary.json."""
    args, results = summary["arguments"], summary["results"]
    method = "QLoRA (4-bit NF4 base)" if args.get("use_4bit_quantization") else "LoRA"
    base, dataset = args.get("base_model") or args["model_name_or_path"], args["dataset_name"]
    if Path(dataset).exists():  # a local folder or file: its name, not where it lies on this disk
        dataset = Path(dataset).name
    metrics = [f"- train loss: {results['train_loss']:.4f} after {results['train_steps']} steps"]
    if results.get("eval_loss") is not None:
        metrics.append(f"- eval loss: {results['eval_loss']:.4f}")
    if results.get("exact_match_after") is not None:
        metrics.append(f"- held-out exact match: {results['exact_match_before']:.1%} before, "
                       f"{results['exact_match_after']:.1%} after")
    hyper = ["lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "learning_rate", "lr_scheduler_type",
             "per_device_train_batch_size", "gradient_accumulation_steps", "max_length", "packing", "padding_free",
             "max_steps", "num_train_epochs", "bf16", "chat_template_format"]
    table = "\n".join(f"| {key} | {args[key]} |" for key in hyper if key in args)
    plot = f"\n![training curves]({PLOT_FILE})\n" if summary.get("plot") else ""
    return f"""---
base_model: {base}
library_name: peft
tags: [sft, {'qlora' if args.get('use_4bit_quantization') else 'lora'}, trl]
---

# {method} adapter for {base}

Fine-tuned on `{dataset}` with supervised fine-tuning (TRL `SFTTrainer`), loss on the assistant turns only.

## Results

{chr(10).join(metrics)}
{plot}
## Training

- method: {method}
- hardware: {summary['hardware']}
- date: {summary['date']}

| setting | value |
|---|---|
{table}

## Use

```python
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer

model = AutoPeftModelForCausalLM.from_pretrained("<this repo>")
tokenizer = AutoTokenizer.from_pretrained("<this repo>")
```
"""


# Training arguments worth recording; an explicit list, so no token or credential can slip into the summary.
TRAINING_KEYS = ("learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm", "optim",
                 "per_device_train_batch_size", "gradient_accumulation_steps", "max_steps", "num_train_epochs",
                 "max_length", "packing", "padding_free", "bf16", "fp16", "activation_checkpointing", "seed")


def write_run_report(out_dir: Path, arguments: dict, results: dict, log_history: list[dict], hardware: str,
                     decisions: list[dict]) -> dict:
    """run_summary.json (with what configuration.settle decided, and why), training_curves.png and the model card
    (README.md) in `out_dir`."""
    import datetime

    plot = plot_history(log_history, Path(out_dir) / PLOT_FILE)
    summary = {"date": datetime.date.today().isoformat(), "hardware": hardware, "arguments": arguments,
               "decisions": decisions, "results": results, "plot": plot.is_file(), "log_history": log_history}
    (Path(out_dir) / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str))
    # In place of PEFT's placeholder, the card that gets published: written from the file, as export.publish does
    (Path(out_dir) / "README.md").write_text(model_card(read_summary(out_dir)))
    return summary


def read_summary(out_dir: Path) -> dict:
    path = Path(out_dir) / SUMMARY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: point to the output folder of a train.py run.")
    return json.loads(path.read_text())
