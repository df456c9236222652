"""How DeepSpeed ZeRO-3 loads and partitions the recipe's model, measured on 2 CPU processes over gloo.

    .venv/bin/python bench/zero3_loading.py            # about 2 minutes on 2 cores; prints a JSON line per method

DeepSpeed through accelerate's Trainer does not run on a CPU host, but DeepSpeed itself does (its CPU accelerator picks
gloo). So this builds the model exactly as train.py does (utils.build_model under transformers' ZeRO-3 config, then
PEFT), hands it to `deepspeed.initialize` with a stage-3 config on 2 processes, and records for LoRA, QLoRA as
transformers loads it, and QLoRA as train.py loads it (qlora-rank0: rank 0 reads, sharding.partition_from_rank0):
each rank's anonymous-RSS growth while reading the model and while DeepSpeed partitions it (memory.PhasePeaks), how
much of the frozen weights each rank keeps, and the logits of the partitioned model against one process's load of the
same model with the same adapter initialisation. The memory planner's ZeRO-3 assumptions come from these numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
PROBE = "Convert this date to ISO format (YYYY-MM-DD): May 1, 2000"


def build(model_dir: str, method: str, from_rank0: bool = False):
    """The base model and tokenizer as train.py builds them, then the recipe's LoRA adapter (seeded). `from_rank0`:
    rank 0 reads, the other ranks build on the meta device (sharding.py)."""
    import torch
    from peft import get_peft_model

    from arguments import ModelArguments
    from utils import build_model, build_peft_config, build_tokenizer

    quantized = method.startswith("qlora")
    args = ModelArguments(model_name_or_path=model_dir, use_4bit_quantization=quantized,
                          bnb_4bit_quant_storage_dtype="bfloat16", use_peft_lora=True)
    tokenizer, added = build_tokenizer(args)
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    model = build_model(args, tokenizer, added, dtype=torch.bfloat16 if quantized else torch.float32,
                        attention="sdpa", weights_from_rank0=from_rank0,
                        device_map=({"": "cpu"} if rank0 else {"": "meta"}) if from_rank0 else None)
    torch.manual_seed(0)
    return get_peft_model(model, build_peft_config(args, added)), tokenizer


def probe_logits(model, tokenizer):
    import torch

    with torch.no_grad():
        return model.eval()(**tokenizer([PROBE], return_tensors="pt")).logits.float()


def worker(model_dir: str, method: str, out: str) -> None:
    """One rank of the 2-process ZeRO-3 load (under torchrun)."""
    import deepspeed
    import torch
    from transformers.integrations import HfDeepSpeedConfig

    from memory import PhasePeaks

    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3}, "bf16": {"enabled": method.startswith("qlora")},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    zero3 = HfDeepSpeedConfig(config)  # noqa: F841  (kept alive: transformers reads it while loading)
    import bitsandbytes  # noqa: F401  (imported before the phases, as train.py has by then)
    import peft  # noqa: F401

    peaks = PhasePeaks()
    peaks.start("read")
    from_rank0 = method.endswith("rank0")
    model, tokenizer = build(model_dir, method, from_rank0)
    peaks.start("partition")
    if from_rank0:
        from sharding import partition_from_rank0

        partition_from_rank0(model, config, torch.device("cpu"))
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    peaks.end()
    frozen = [p for p in engine.module.parameters() if not p.requires_grad]
    logits = probe_logits(engine.module, tokenizer)  # every rank takes part in the gathers
    rank = torch.distributed.get_rank()
    report = {"rank": rank, "phases": peaks.phases,
              "frozen_numel": sum(getattr(p, "ds_numel", p.numel()) for p in frozen),
              "frozen_numel_kept": sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in frozen),
              "frozen_classes": sorted({type(p).__name__ for p in frozen})}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    if rank == 0:
        torch.save(logits, Path(out, "logits.pt"))


def measure(model_dir: str, method: str, out: Path) -> dict:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
               "worker", model_dir, method, str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-4000:])
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    model, tokenizer = build(model_dir, method)
    difference = (probe_logits(model, tokenizer) - torch.load(out / "logits.pt")).abs().max().item()
    return {"method": method, "logits_max_abs_difference_to_one_process": difference,
            "ranks": [{"frozen_kept_fraction": round(r["frozen_numel_kept"] / r["frozen_numel"], 4),
                       "frozen_classes": r["frozen_classes"],
                       **{f"{phase}_growth_gib": round(v["host_growth_gib"], 4) for phase, v in r["phases"].items()}}
                      for r in ranks]}


def main() -> None:
    import tempfile

    from utils import convert_default_model

    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(*sys.argv[2:])
        return
    model_dir, work = str(convert_default_model()), Path(tempfile.mkdtemp())
    for method in ("lora", "qlora", "qlora-rank0"):  # qlora-rank0: as train.py loads it
        print(json.dumps(measure(model_dir, method, work / method)), flush=True)


if __name__ == "__main__":
    main()
