"""GPU half of the benchmark: the recipe's train.py on a Llama-3-8B-shaped model, LoRA and QLoRA, 2048-token packed rows.

    python bench/gpu_benchmark.py                          # on a CUDA machine: writes bench/gpu_benchmark.json
    python bench/gpu_benchmark.py --shape tiny --steps 3   # the same path on CPU with a 2-layer model (the test runs it)

The weights are random, initialised from the shape's config and saved once under outputs/bench/ (no download): speed
and memory do not depend on their values. Each method runs in a fresh process; printed: trained tokens/s, seconds per
step, peak memory (GPU allocated and reserved, or RSS on CPU), and MFU: model FLOPs per trained token
(bench/benchmark.py's count, runner and matmul peak) times tokens/s after the first step (train.py's per-step wall
times: the first carries CUDA's warm-up and any compiling) over the bf16 peak, both the datasheet's (where this script
knows the GPU) and the measured one. `--methods lora,lora-compile` measures `--torch_compile`. The 70B-class QLoRA
memory figure comes from `memory.py` (planned, not run: a random 70B checkpoint does not fit the disk of the machines
this was written for).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

# memory.py's preset shapes, plus what the checkpoint needs beyond the parameter counts
SHAPES = {
    "llama-3-8b": dict(max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=49152, max_position_embeddings=2048),
}
# Dense bf16 tensor-core peaks from the datasheets, TFLOP/s (SXM parts)
DATASHEET_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0}
METHODS = {"lora": [], "qlora": ["--use_4bit_quantization", "true"], "lora-compile": ["--torch_compile", "true"],
           # what the memory plan counts differently: dropout's masks, and checkpointed layers
           "lora-dropout": ["--lora_dropout", "0.05"],
           "qlora-checkpointing": ["--use_4bit_quantization", "true", "--activation_checkpointing", "true"]}

def recipe_tokenizer_dir() -> Path:
    """SmolLM2's tokenizer files: the converted default model's, or those files alone (bench/gpu_check.py carries them
    to a GPU machine instead of the 98 MB GGUF package)."""
    from model_files import DEFAULT_MODEL_DIR, convert_default_model

    folder = Path(DEFAULT_MODEL_DIR)
    return folder if (folder / "tokenizer.json").is_file() else convert_default_model()


def shape_values(shape: str) -> dict:
    """The config values of a named shape: memory.py's preset, with what a checkpoint needs beyond it."""
    from memory import PRESETS

    return {**PRESETS.get(shape, {}), **SHAPES[shape]}


def checkpoint_config(values: dict, tokenizer, **extra):
    """A Llama config of `values` with an untied head and `tokenizer`'s special ids (SmolLM2's fit any larger
    vocabulary)."""
    from transformers import LlamaConfig

    return LlamaConfig(**values, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **extra)


def random_model(shape: str, work: Path, config: dict | None = None) -> Path:
    """A checkpoint of the shape (or of `config`, named `shape`) with random weights and SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    out = work / f"random-{shape}"
    if (out / "config.json").is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(recipe_tokenizer_dir())
    config = checkpoint_config(config or shape_values(shape), tokenizer)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the runs are other processes: hand the GPU memory back
    return out


def train(model_dir: Path, data: Path, work: Path, method: str, steps: int, batch: int, seq: int) -> dict:
    from benchmark import PEAK, recipe_argv, run
    from report import memory_against_plan, read_summary
    from hardware import is_flash_attn_installed

    # FlashAttention's varlen kernel where it is installed (CUDA); the recipe's sdpa_varlen otherwise
    flash = ["--use_flash_attn", "true"] if torch.cuda.is_available() and is_flash_attn_installed() else []
    argv = [*recipe_argv(str(model_dir), str(data), steps, work / f"gpu-{method}"),
            # after the CPU benchmark's batch shape, so these win
            "--per_device_train_batch_size", str(batch), "--max_length", str(seq), *METHODS[method], *flash]
    result = run([sys.executable, "-c", PEAK, "train.py", *argv],
                 {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    # After the first step (CUDA warm-up, allocator growth, compiling): train.py's per-step wall times
    summary = read_summary(work / f"gpu-{method}")
    seconds = summary["results"]["step_seconds"]
    tokens = [entry["num_tokens"] for entry in summary["log_history"] if "num_tokens" in entry]
    steady = (tokens[-1] - tokens[0]) / sum(seconds[1:]) if len(seconds) >= 3 and len(tokens) == len(seconds) else None
    return {"attention": "flash_attention_2" if flash else "sdpa_varlen",
            "tokens_per_s": result["tokens"] / result["seconds"], "s_per_step": result["seconds"] / steps,
            "steady_tokens_per_s": steady, "first_step_seconds": seconds[0],
            **{key: result[key] for key in ("tokens", "gpu_allocated_gib", "gpu_reserved_gib", "peak_rss_gib")},
            "memory_against_plan": memory_against_plan(summary)}


def planned_70b_qlora_gib(seq: int) -> float:
    """memory.py's plan for Llama-2-70B QLoRA on one GPU (activation checkpointing, one sequence of `seq` tokens)."""
    from memory import Run, Shapes, load_config, plan

    run = Run(method="qlora", seq=seq, lora_r=16, lora_dropout=0.0)
    return plan(Shapes.of(load_config("llama-2-70b")), run).per_gpu_total


def measure(shape: str, steps: int, batch: int, seq: int, methods: list[str], work: Path,
            on_result=None) -> dict:
    """Each method's run of train.py on a random model of `shape`, with MFU against the datasheet and the measured
    peak; the 70B QLoRA one-GPU plan beside them. `on_result(method, row)` is called as each run ends."""
    from benchmark import data_shape, flops_per_token, matmul_peak_gflops, prompt_completion_copy
    from hardware import native_bf16_supported

    model_dir = random_model(shape, work)
    data = prompt_completion_copy(REPO / "data" / "dates", work / "dates-prompt-completion")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    datasheet = next((peak for name, peak in DATASHEET_BF16_TFLOPS.items() if name in device), None)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    # In the dtype the runs train in: bf16 on a GPU, the recipe's choice on CPU (fp32 where bf16 would be emulated)
    dtype = torch.bfloat16 if native_bf16_supported() else torch.float32
    scale = 0.25 if shape == "tiny" else 1.0  # the tiny shape only runs the code path
    measured = matmul_peak_gflops(dtype, os.cpu_count() or 1, device_type, scale) / 1e3  # TFLOP/s
    per_token = flops_per_token(str(model_dir), 16, data_shape(data, model_dir))
    results = {}
    for method in methods:
        results[method] = row = train(model_dir, data, work, method, steps, batch, seq)
        achieved = per_token * (row["steady_tokens_per_s"] or row["tokens_per_s"]) / 1e12
        row["mfu_datasheet"] = achieved / datasheet if datasheet else None
        row["mfu_measured_peak"] = achieved / measured
        if on_result:
            on_result(method, row)
    return {"date": time.strftime("%Y-%m-%d"), "device": device, "shape": shape, "steps": steps, "batch": batch,
            "seq": seq, "flops_per_token": per_token, "datasheet_tflops": datasheet, "measured_tflops": measured,
            "measured_dtype": str(dtype), "results": results,
            "planned_70b_qlora_one_gpu_gib": planned_70b_qlora_gib(seq)}


def summary_lines(m: dict) -> list[str]:
    lines = [f"{m['date']}, {m['device']}; {m['shape']} (random weights), LoRA r=16 all-linear, {m['batch']} x "
             f"{m['seq']} packed tokens, {m['steps']} steps; {m['flops_per_token'] / 1e9:.3g} GFLOP per trained token; "
             f"peak: datasheet bf16 {m['datasheet_tflops'] or 'unknown'} TFLOP/s, measured {m['measured_tflops']:.3g} "
             f"TFLOP/s in {m['measured_dtype']}"]
    for method, row in m["results"].items():
        mfu = f"{row['mfu_datasheet']:.0%}" if row["mfu_datasheet"] is not None else "n/a"
        steady = f"{row['steady_tokens_per_s']:.0f}" if row["steady_tokens_per_s"] else "n/a"
        lines.append(f"{method:12s} {row['attention']}: {row['tokens_per_s']:9.0f} tokens/s ({steady} after the first "
                     f"step, which took {row['first_step_seconds']:.1f} s) {row['s_per_step']:6.2f} s/step  MFU {mfu} "
                     f"(of measured peak {row['mfu_measured_peak']:.0%})  GPU {row['gpu_allocated_gib']:.1f} GiB "
                     f"allocated, {row['gpu_reserved_gib']:.1f} reserved; RSS {row['peak_rss_gib']:.1f} GiB")
    lines.append(f"Llama-2-70B QLoRA on one GPU, 1 x {m['seq']} tokens, checkpointing: "
                 f"{m['planned_70b_qlora_one_gpu_gib']:.1f} GiB allocated, planned by memory.py (not run)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=2, help="packed rows per step")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--methods", default="lora,qlora", help=f"comma list from {', '.join(METHODS)}")
    parser.add_argument("--out", default=str(REPO / "bench" / "gpu_benchmark.json"))
    parser.add_argument("--work", default=str(REPO / "outputs" / "bench"), help="checkpoint and run folders")
    args = parser.parse_args()
    measured = measure(args.shape, args.steps, args.batch, args.seq, args.methods.split(","), Path(args.work))
    print("\n" + "\n".join(summary_lines(measured)))
    Path(args.out).write_text(json.dumps(measured, indent=2))


if __name__ == "__main__":
    main()
