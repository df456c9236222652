"""LoRA adapters in bf16 (as TRL makes QLoRA's) against fp32 adapters under bf16 autocast (the recipe's LoRA): the
default run's losses, held-out exact match and step time, alternated, each run a fresh process.

    .venv/bin/python bench/adapter_dtype.py --repeats 3 --out bench/adapter_dtype.json

The bf16 runs cast the trainable parameters to bf16 once the trainer is built (before the optimizer is made), as TRL
does for a quantized model's adapter. On a CPU without native bf16 the recipe trains in fp32 and there is nothing to
compare: the script says so and stops.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

RUN = r'''
import json, sys, time
sys.path.insert(0, {repo!r})
import torch
import train

if {bf16!r}:
    build = train.build_trainer
    def build_trainer(config, model, data):
        trainer, step_times = build(config, model, data)
        for parameter in trainer.model.parameters():
            if parameter.requires_grad:
                parameter.data = parameter.data.to(torch.bfloat16)
        return trainer, step_times
    train.build_trainer = build_trainer
trainer, summary = train.run(["--overwrite_output_dir", "true", "--output_dir", {out!r}, *{extra!r}])
steps = summary["step_seconds"][1:]
print("RESULT " + json.dumps({{"train_loss": summary["train_loss"], "eval_loss": summary.get("eval_loss"),
      "exact_match_after": summary.get("exact_match_after"),
      "step_seconds": statistics.median(steps) if steps else None,
      "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
      "adapter_dtypes": sorted({{str(p.dtype) for p in trainer.model.parameters() if p.requires_grad}})}}))
'''


def run(bf16: bool, out: Path, extra: list[str]) -> dict:
    code = "import statistics\n" + RUN.format(repo=str(REPO), bf16=bf16, out=str(out), extra=extra)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                            env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    line = next((line for line in result.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError((result.stdout + result.stderr)[-3000:])
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--max_steps", type=int, help="fewer steps than the default run's 48 (the test's reduced case)")
    args = parser.parse_args(argv)
    extra = (["--max_steps", str(args.max_steps), "--logging_steps", "1", "--eval_num_prompts", "4"]
             if args.max_steps else [])
    sys.path.insert(0, str(REPO))
    from recipe.platform.hardware import native_bf16_supported

    if not native_bf16_supported():
        sys.exit("this CPU has no native bf16: the recipe trains in fp32 here, with nothing to compare")
    runs = {"fp32 adapters": [], "bf16 adapters": []}
    for repeat in range(args.repeats):  # alternated, the order swapped each round: drift hits both alike
        order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
        for name in order:
            runs[name].append(run(name.startswith("bf16"), REPO / "outputs" / "bench" / name.replace(" ", "-"), extra))
            print(f"repeat {repeat + 1}: {name}: {runs[name][-1]['step_seconds']:.3f} s per step", flush=True)
    fp32_steps = [r["step_seconds"] for r in runs["fp32 adapters"]]
    result = {"date": time.strftime("%Y-%m-%d"), "repeats": args.repeats, "runs": runs,
              "median_step_seconds": {name: statistics.median(r["step_seconds"] for r in rs)
                                      for name, rs in runs.items()},
              "bf16_step_over_fp32_per_round": [b["step_seconds"] / f
                                                for b, f in zip(runs["bf16 adapters"], fp32_steps)]}
    print(json.dumps({key: value for key, value in result.items() if key != "runs"}))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
