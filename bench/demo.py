"""The default run (`make demo`, `python train.py` with no arguments) on this machine, as a user runs it.

    .venv/bin/python bench/demo.py     # about 2-4 minutes on 2 cores; writes bench/demo.json

Records the date, the machine, the held-out exact match before and after training, the train and eval losses and the
run's seconds, from the run's own run_summary.json. The README's figures for the default run are made from the file
(bench/figures.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "demo.json"
sys.path.insert(0, str(REPO))

from recipe.platform.hardware import describe  # noqa: E402
from recipe.reporting.report import read_summary  # noqa: E402

KEPT = ("exact_match_before", "exact_match_after", "train_loss", "eval_loss", "train_steps", "trained_examples")


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        started = time.monotonic()
        subprocess.run([sys.executable, "train.py", "--output_dir", folder, "--overwrite_output_dir", "true"],
                       cwd=REPO, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        seconds = time.monotonic() - started
        summary = read_summary(Path(folder))
    record = {"date": date.today().isoformat(), **describe(), "seconds": round(seconds, 1),
              "bf16": summary["arguments"].get("bf16"), **{key: summary["results"][key] for key in KEPT}}
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
