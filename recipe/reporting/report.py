"""What a person reads after a run: the training curves as an SVG and the model card of the adapter.

Both are written from `run_summary.json`, which train.py leaves in the output folder (arguments, hardware, losses,
held-out metrics, the log history).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

SUMMARY_FILE = "run_summary.json"
PLOT_FILE = "training_curves.svg"
# The plan's phases as the run measures them (train.py's PhasePeaks): loading is read, wrap and shard
MEASURED_PARTS = {"load": ("read", "wrap", "shard"), "train": ("train",), "save": ("save",)}


def memory_against_plan(summary: dict, rank: int = 0) -> dict:
    """For each phase of the plan: what `rank` measured beside what was planned, GiB. GPU: the peak allocated (the
    plan's figure less the CUDA context it adds), the allocator's reserved peak and the device's used memory (the
    process's whole footprint, CUDA context included: against the plan's figure). Host: the growth of the process's
    anonymous memory over the phase, against the plan's `host rank 0` / `host other rank`."""
    from recipe.planning.memory import CUDA_CONTEXT_GIB

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
    """Train and eval loss, and the learning rate, against the optimizer step: two line charts in one SVG, written
    directly (a plotting library cost each run 2 s of imports for two polylines)."""
    def series(key):
        return [(entry["step"], entry[key]) for entry in log_history if key in entry and "step" in entry]

    losses = [value for key in ("loss", "eval_loss") for _, value in series(key)]
    log_scale = bool(losses) and min(losses) > 0 and max(losses) / min(losses) > 20  # losses often fall 100-fold
    panels = [Chart("loss", [("train", series("loss"), "#1f77b4", False),
                             ("eval", series("eval_loss"), "#ff7f0e", True)], log_scale),
              Chart("learning rate", [("", series("learning_rate"), "#1f77b4", False)], False)]
    width, height = 1000, 360
    body = "".join(chart.svg(x=i * width / 2, width=width / 2, height=height) for i, chart in enumerate(panels))
    path.write_text(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                    f'font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/>'
                    f"{body}</svg>\n")
    return path


@dataclass
class Chart:
    """One line chart: each line a (label, [(step, value)], colour, dashed with markers) tuple."""

    title: str
    lines: list[tuple[str, list[tuple[float, float]], str, bool]]
    log_scale: bool
    MARGIN = (60, 20, 30, 40)  # left, right, top, bottom

    def svg(self, x: float, width: float, height: float) -> str:
        left, right, top, bottom = self.MARGIN
        points = [point for _, line, _, _ in self.lines for point in line]
        out = [f'<g transform="translate({x:.0f},0)"><text x="{width / 2:.0f}" y="18" text-anchor="middle">'
               f"{self.title}</text>",
               f'<rect x="{left}" y="{top}" width="{width - left - right:.0f}" height="{height - top - bottom:.0f}" '
               'fill="none" stroke="black"/>',
               f'<text x="{width / 2:.0f}" y="{height - 6:.0f}" text-anchor="middle">step</text>']
        if not points:  # a run shorter than --logging_steps logs no loss
            return "".join(out) + "</g>"
        scale = math.log10 if self.log_scale else float
        steps, levels = [p[0] for p in points], [scale(p[1]) for p in points]
        x0, x1 = min(steps), max(max(steps), min(steps) + 1)
        y0, y1 = min(levels), max(max(levels), min(levels) + 1e-9)

        def to_x(step):
            return left + (step - x0) / (x1 - x0) * (width - left - right)

        def to_y(level):
            return height - bottom - (level - y0) / (y1 - y0) * (height - top - bottom)

        for fraction in (0, 0.5, 1):  # three ticks on each axis: the ends and the middle
            step, level = x0 + fraction * (x1 - x0), y0 + fraction * (y1 - y0)
            label = 10 ** level if self.log_scale else level
            out.append(f'<text x="{to_x(step):.1f}" y="{height - bottom + 14}" text-anchor="middle">{step:g}</text>'
                       f'<text x="{left - 4}" y="{to_y(level) + 4:.1f}" text-anchor="end">{label:.3g}</text>')
        for number, (label, line, colour, dashed) in enumerate(self.lines):
            if not line:
                continue
            coordinates = [(to_x(step), to_y(scale(value))) for step, value in line]
            style = ' stroke-dasharray="6,4"' if dashed else ""
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5"{style} points="'
                       + " ".join(f"{px:.1f},{py:.1f}" for px, py in coordinates) + '"/>')
            if dashed:
                out.extend(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{colour}"/>' for px, py in coordinates)
            if label:
                out.append(f'<text x="{width - right - 8:.0f}" y="{top + 16 + 16 * number}" text-anchor="end" '
                           f'fill="{colour}">{label}</text>')
        return "".join(out) + "</g>"


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
    """run_summary.json (with what configuration.settle decided, and why), training_curves.svg and the model card
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
