"""What `--torch_compile` costs and saves on this machine: the figures behind fast_paths.COMPILED_STEP_RATIO and
COMPILE_SECONDS, which decide whether a run left to its default compiles its decoder layers mid-run.

    .venv/bin/python bench/compile_payback.py --steps 24 --repeats 2   # 2026-12-05's run: bench/compile_payback.json

Runs the default recipe (SmolLM2-135M, the demo's batches) eager and with `--torch_compile true` (each decoder layer,
inductor), alternated, each a fresh process with torch's compile caches in a fresh folder (as a user's first run),
and reads each step's wall seconds from run_summary.json. Compiling's cost: the compiled run's seconds over its first
SETTLE steps (where it compiles and recompiles for new lengths) beyond the eager run's over the same steps. The ratio:
median compiled step after those over median eager step after them. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SETTLE = 4  # steps the compiled run spends compiling (the first, and the recompiles of the next lengths)


def run(compile_: bool, steps: int, out: Path) -> list[float]:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": cache}
        subprocess.run([sys.executable, "train.py", "--overwrite_output_dir", "true", "--output_dir", str(out),
                        "--max_steps", str(steps), "--eval_num_prompts", "0", "--torch_compile", str(compile_).lower()],
                       cwd=REPO, env=env, check=True, capture_output=True)
    return json.loads((out / "run_summary.json").read_text())["results"]["step_seconds"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    costs, ratios = [], []
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            eager = run(False, args.steps, Path(folder) / "eager")
            compiled = run(True, args.steps, Path(folder) / "compiled")
            costs.append(sum(compiled[:SETTLE]) - sum(eager[:SETTLE]))
            ratios.append(statistics.median(compiled[SETTLE:]) / statistics.median(eager[SETTLE:]))
            print(f"repeat {repeat + 1}: compiling {costs[-1]:.1f} s, compiled step {ratios[-1]:.2f} of eager",
                  flush=True)
    result = {"steps": args.steps, "repeats": args.repeats, "settle_steps": SETTLE,
              "compile_seconds": [round(c, 1) for c in costs], "compiled_step_ratio": [round(r, 3) for r in ratios],
              "median_compile_seconds": round(statistics.median(costs), 1),
              "median_compiled_step_ratio": round(statistics.median(ratios), 3), "cpus": os.cpu_count()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
