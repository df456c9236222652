"""How weights reach the ranks of a sharded run and how the adapter leaves them (sharding.py), measured on 2 gloo
processes: what each rank holds while loading and saving, against the memory plan."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from conftest import REPO, launch_two_processes
from memory import Run, Shapes, load_config, plan

pytestmark = pytest.mark.multiprocess


def two_process_run(model_dir, data_dir, out, *extra):
    """train.py under the shipped FSDP2 config, one step, no checkpoints, on a model that is mostly its embedding
    (0.1 GiB: above the runtime's noise, quick to step); each rank's memory by phase."""
    launch_two_processes(REPO / "train.py", [
        "--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir), "--splits", "train", "--output_dir",
        str(out), "--max_steps", "1", "--per_device_train_batch_size", "1", "--bf16", "false",
        "--eval_num_prompts", "0", "--disable_tqdm", "true", "--save_strategy", "no", *extra])
    return json.loads((out / "run_summary.json").read_text())["results"]["memory_by_rank"]


def load_growth(phases: dict) -> float:
    """The peak of reading, wrapping and sharding, above what the process held before it read the model."""
    return max(phases[p]["host_peak_gib"] for p in ("read", "wrap", "shard")) - phases["read"]["host_start_gib"]


def assert_phases_as_planned(by_rank: list[dict], model_dir, method: str) -> None:
    """Rank 1 read nothing of the base, the save gathered the adapter alone, and both ranks' load and save peaks are
    within 15% of the plan (or 10 MiB, for the smallest quantities)."""
    # As configuration.planned_run describes these runs: fp32 LoRA, or 4-bit with the rest in the bf16 storage dtype
    run = Run(method=method, engine="fsdp", gpus=2, device="cpu", precision="bf16" if method == "qlora" else "fp32",
              checkpoint_dtype="float32", batch=1, seq=512, lora_r=16, nested_quant=False, optimizer="adamw")
    shapes = Shapes.of(load_config(str(model_dir)))
    planned = plan(shapes, run)
    model_gib = plan(shapes, replace(run, engine="none", gpus=1)).host["weights (frozen)"]  # the base, loaded
    rank0, rank1 = by_rank
    assert rank1["read"]["host_growth_gib"] < 0.25 * model_gib, (rank1, model_gib)  # never materializes the base
    measured = {"load host rank 0": load_growth(rank0), "load host other rank": load_growth(rank1),
                "save host rank 0": rank0["save"]["host_growth_gib"]}
    predicted = {"load host rank 0": planned.phases["load"]["host rank 0"],
                 "load host other rank": planned.phases["load"]["host other rank"],
                 "save host rank 0": planned.phases["save"]["host rank 0"]}
    print(method, {key: (round(predicted[key], 3), round(measured[key], 3)) for key in measured},
          "rank 1 read", round(rank1["read"]["host_growth_gib"], 4), "of", round(model_gib, 3))
    assert predicted["save host rank 0"] < 0.1 * model_gib, predicted  # the adapter alone, not the base
    for key in measured:
        assert abs(measured[key] - predicted[key]) <= max(0.15 * predicted[key], 10 / 1024), (key, measured, predicted)


def test_qlora_one_rank_reads_and_only_the_adapter_is_gathered_as_planned(wide_model_dir, chat_dir, tmp_path):
    """QLoRA (fp32 compute: bf16 is emulated on many CPUs); LoRA is measured in test_distributed's 2-process run."""
    by_rank = two_process_run(wide_model_dir, chat_dir, tmp_path / "run", "--use_4bit_quantization", "true",
                              "--bnb_4bit_compute_dtype", "float32")
    assert_phases_as_planned(by_rank, wide_model_dir, "qlora")


def test_fsdp1_gathers_the_adapter_alone(tiny_model_dir, tmp_path):
    out = tmp_path / "gathered.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "tests/fsdp1_gather_worker.py", str(tiny_model_dir), str(out)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-5000:]
    saved = torch.load(out)
    expected, gathered = saved["expected"], saved["gathered"]
    assert expected and gathered.keys() == expected.keys()  # the LoRA weights, named as PEFT saves them; no base
    for name in expected:
        assert torch.equal(gathered[name], expected[name]), name
