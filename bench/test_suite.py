"""How long the test suite takes on this machine, as CI runs it: `make test` and `make test-fast` on a fresh clone.

    .venv/bin/python bench/test_suite.py   # clones HEAD into a temporary folder, runs both, writes test_suite.json

Records the date, the CPU, and for each command the tests passed and failed, pytest's own seconds and the seconds in
all (the first command includes `make setup`). docs/tests.md's timing is made from the file (bench/figures.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "test_suite.json"
sys.path.insert(0, str(REPO))

from recipe.platform.hardware import describe  # noqa: E402
SUMMARY = re.compile(r"(?:(\d+) failed, )?(\d+) passed.* in ([\d.]+)s")


def timed(command: list[str], cwd: Path) -> dict:
    started = time.monotonic()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    seconds = time.monotonic() - started
    found = SUMMARY.findall(result.stdout)
    if not found:
        raise SystemExit(f"{' '.join(command)}: no pytest summary (exit {result.returncode}):\n{result.stdout[-3000:]}"
                         f"{result.stderr[-3000:]}")
    failed, passed, pytest_seconds = found[-1]
    return {"passed": int(passed), "failed": int(failed or 0), "pytest_s": float(pytest_seconds),
            "total_s": round(seconds, 1), "returncode": result.returncode}


def main() -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as folder:
        clone = Path(folder) / "clone"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        results = {"make test": timed(["make", "test"], clone), "make test-fast": timed(["make", "test-fast"], clone)}
    record = {"date": date.today().isoformat(), "commit": commit, **describe(), "results": results}
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    sys.exit(max(r["returncode"] for r in results.values()))


if __name__ == "__main__":
    main()
