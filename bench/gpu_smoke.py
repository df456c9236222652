"""GPU smoke test: run the LoRA-FSDP and QLoRA-FSDP launchers for a few steps on the GPUs present and record the peak
memory of each GPU (nvidia-smi, every 0.5 s) and of the host (RSS of the whole process tree).

    python bench/gpu_smoke.py                                   # the launchers' own model and data (Hub access)
    MODEL=/models/llama-3-8b DATASET=data/dates python bench/gpu_smoke.py --steps 5 --out smoke.json

Not a test: it needs GPUs, and the numbers it prints are what goes into the README's memory table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
RECIPES = {"lora-fsdp": "run_peft_fsdp.sh", "qlora-fsdp": "run_peft_qlora_fsdp.sh"}


def gpu_memory_used_mib() -> list[int]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [int(line) for line in out.split()]


def tree_rss_bytes(pid: int) -> int:
    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.NoSuchProcess:
        return 0


def run_recipe(script: str, extra: list[str], num_gpus: int) -> dict:
    """Run one launcher while sampling memory; return its peaks, wall time and exit code."""
    peaks = {"gpu_mib": [0] * num_gpus, "host_rss_gib": 0.0}
    env = {**os.environ, "NUM_PROCESSES": str(num_gpus)}
    started = time.time()
    process = subprocess.Popen(["bash", str(REPO / script), *extra], cwd=REPO, env=env)

    def sample() -> None:
        while process.poll() is None:
            peaks["gpu_mib"] = [max(a, b) for a, b in zip(peaks["gpu_mib"], gpu_memory_used_mib())]
            peaks["host_rss_gib"] = max(peaks["host_rss_gib"], tree_rss_bytes(process.pid) / 2**30)
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    returncode = process.wait()
    sampler.join()
    return {**peaks, "seconds": round(time.time() - started, 1), "returncode": returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"comma list from {', '.join(RECIPES)}")
    parser.add_argument("--out", default="gpu_smoke.json")
    args, train_overrides = parser.parse_known_args()
    try:
        num_gpus = len(gpu_memory_used_mib())
    except (OSError, subprocess.CalledProcessError):
        sys.exit("error: no NVIDIA GPU found (nvidia-smi failed); this script measures GPU runs only.")
    gpu_name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True).stdout.splitlines()[0]
    # A few steps, with one sharded checkpoint save on the way (where 8-bit optimizers and full-state-dict saves fail)
    extra = ["--max_steps", str(args.steps), "--save_strategy", "steps", "--save_steps", str(args.steps),
             "--eval_strategy", "no", "--logging_steps", "1", *train_overrides]
    results = {"date": time.strftime("%Y-%m-%d"), "gpus": f"{num_gpus} x {gpu_name}", "recipes": {}}
    for name in args.recipes.split(","):
        results["recipes"][name] = run_recipe(RECIPES[name], [*extra, "--output_dir", f"outputs/smoke-{name}"],
                                              num_gpus)
        print(json.dumps({name: results["recipes"][name]}), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"{results['date']}, {results['gpus']}")
    for name, r in results["recipes"].items():
        print(f"{name:11s} exit {r['returncode']}  peak GPU MiB {r['gpu_mib']}  host RSS {r['host_rss_gib']:.1f} GiB  "
              f"{r['seconds']} s")
    sys.exit(max(r["returncode"] for r in results["recipes"].values()))


if __name__ == "__main__":
    main()
