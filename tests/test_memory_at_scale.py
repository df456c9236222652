"""The memory plan against runs of train.py on a 2.1 GiB model and a 128k-vocabulary loss, measured from outside the processes (bench/memory_grid.py
runs the whole grid; this is its reduced case): each phase of each rank within 10% (or 50 MiB) of the plan."""

import os
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import memory_grid  # noqa: E402
from memory_grid import Case  # noqa: E402

REDUCED_GRID = [
    # the loss over a 128k vocabulary: 2048 labels (bench/memory_grid.py measures 4096), and 1024 on 2 processes
    Case("llama-logits", "one", "lora", 2048, False, supervised=1.0),
    Case("llama-logits", "fsdp2", "lora", 1024, False, supervised=1.0),
    Case("llama-2g", "one", "lora", 256, False),  # 2.1 GiB of weights
    Case("llama-2g", "fsdp2", "lora", 256, False),  # loaded from rank 0 and sharded
]


@pytest.fixture(scope="session")
def models_cache(tmp_path_factory):
    """The random models, made once per session (the pytest-xdist workers share them through a lock)."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    cache = shared / "memory-grid-models"
    cache.mkdir(exist_ok=True)
    with FileLock(f"{cache}.lock"):
        for case in REDUCED_GRID:
            memory_grid.make_model(case.model, cache)
    return cache


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", REDUCED_GRID, ids=lambda case: case.name.replace(" ", "-"))
def test_each_phase_of_each_rank_as_planned(case, models_cache, tmp_path):
    result = memory_grid.run_case(case, models_cache, tmp_path)
    print(result)
    off = {key: row for key, row in result["phases"].items() if not row["ok"]}
    assert not off, (case.name, result["phases"])
    assert len(result["phases"]) == 3 * case.processes
