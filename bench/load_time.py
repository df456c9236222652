"""Rank 0's load against its plan: a random model of at least 4 GiB in 16 bits, loaded by two CPU processes through a
shipped config with its files dropped from the page cache first, one step trained.

    .venv/bin/python bench/load_time.py                   # LoRA and QLoRA; writes bench/load_time.json
    .venv/bin/python bench/load_time.py --methods lora    # one of them, printed only

The plan (configuration.planned_load: the checkpoint's bytes at the read rate rank 0 measured, and for QLoRA the
decoder linears' 16-bit bytes at the quantization rate it measured, run_summary.json's load_plan) is set against what
rank 0 took from the start of its read to the end of it, the split experts and 4-bit state included (the phase marks
of run_memory.PhasePeaks). The other ranks wait that long in their first collective: the collective timeout the run
set (its first line) must cover it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RESULTS = REPO / "bench" / "load_time.json"
CONFIGS = {"lora": "fsdp2_config.yaml", "qlora": "fsdp_config_qlora.yaml"}
TOLERANCE = 0.30
GIB = 2**30


def random_model(out: Path, hidden: int = 2048, layers: int = 30) -> Path:
    """A Llama of about 4.1 GiB in bf16 with the default model's tokenizer; most of it decoder linears, which QLoRA
    quantizes."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from recipe.model.model_files import convert_default_model

    tokenizer = AutoTokenizer.from_pretrained(convert_default_model())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
                         max_position_embeddings=512, tie_word_embeddings=False, dtype="bfloat16",
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def run(method: str, model_dir: Path, data_dir: Path, work: Path) -> dict:
    out, marks = work / method, work / f"{method}-marks.txt"
    from recipe.platform.hardware import drop_from_page_cache

    for file in model_dir.glob("*.safetensors"):
        drop_from_page_cache(file)
    config = REPO / "configs" / CONFIGS[method]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--num_processes", "2", "--main_process_port", "0", "--mixed_precision", "no", str(REPO / "train.py"),
               "--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir), "--output_dir", str(out),
               "--max_steps", "1", "--per_device_train_batch_size", "1", "--max_length", "64", "--splits", "train",
               "--eval_num_prompts", "0", "--save_strategy", "no", "--bf16", "false", "--report_to", "none",
               "--lora_target_modules", "q_proj,v_proj",
               *(["--use_4bit_quantization", "true", "--bnb_4bit_compute_dtype", "float32"]
                 if method == "qlora" else [])]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "RECIPE_PHASE_MARKS": str(marks)})
    if done.returncode:
        raise RuntimeError(f"{method} run failed:\n{(done.stdout + done.stderr)[-4000:]}")
    at = {phase: float(t) for rank, _, phase, t in (line.split() for line in marks.read_text().splitlines())
          if rank == "0"}
    summary = json.loads((out / "run_summary.json").read_text())
    plan = summary["results"]["load_plan"]
    planned = plan["read"] + plan["quantize"]
    measured = at["wrap"] - at["read"]
    timeout = int(next(line for line in done.stdout.splitlines() if "collective timeout" in line)
                  .split("collective timeout ")[1].split(" s")[0])
    return {"planned_s": round(planned, 1), "measured_s": round(measured, 1), "ratio": round(planned / measured, 3),
            "plan": {key: round(value, 3) if isinstance(value, float) else value for key, value in plan.items()},
            "collective_timeout_s": timeout, "covered": timeout >= measured}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args(argv)
    results = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "runs": {}}
    with tempfile.TemporaryDirectory(dir=REPO / "bench") as tmp:  # on the repository's disk, not a RAM-backed /tmp
        work = Path(tmp)
        model_dir = random_model(work / "model")
        results["checkpoint_gib"] = round(sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / GIB, 2)
        data_dir = work / "data"
        data_dir.mkdir()
        lines = (REPO / "data" / "dates" / "train.jsonl").read_text().splitlines()[:16]
        (data_dir / "train.jsonl").write_text("\n".join(lines) + "\n")
        for method in args.methods:
            results["runs"][method] = result = run(method, model_dir, data_dir, work)
            within = abs(result["ratio"] - 1) <= TOLERANCE
            print(f"{method}: planned {result['planned_s']} s, measured {result['measured_s']} s (plan/measured "
                  f"{result['ratio']}, {'within' if within else 'outside'} {TOLERANCE:.0%}); collective timeout "
                  f"{result['collective_timeout_s']} s covers it: {result['covered']}", flush=True)
    print(json.dumps(results, indent=1))
    if set(args.methods) == set(CONFIGS):
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
