"""GPU speed, side by side in one run: this recipe and `trl sft` on the same model, data and tokens per step.

    python bench/gpu_benchmark.py                                   # on a CUDA machine: bench/gpu_benchmark.json
    python bench/gpu_benchmark.py --shape tiny --runs recipe:chat   # the same path on CPU (the test runs it)

A Llama-3-8B-shaped model with random weights (saved once under --work; speed and memory do not depend on the
values), LoRA r=16 alpha 32 on every linear, no dropout, bf16, rows of up to 4096 tokens packed 2 to a micro batch
(NeMo AutoModel's 2 x 4096), WARMUP_STEPS steps and then MEASURED_STEPS timed ones. Each run is a fresh process; a
run is SETUP:DATA, both named below:

- setups: `recipe` (train.py, one varlen kernel per packed row on CUDA: --use_flash_attn true), `recipe-qlora`,
  `recipe-loop` (train.py's default attention, once per example), `recipe-liger` (Liger Kernel's fused layers),
  `recipe-compile` (--torch_compile), `trl` (TRL's own SFT script, as `trl sft` runs it on one GPU, with the flags a
  careful user gives: TRL_SFT_FLAGS and the best attention the machine has);
- data: `chat` (conversations whose lengths follow LMSYS-Chat-1M's published statistics, CHAT_LENGTHS; cut at 4096),
  `full` (every example 4096 tokens: NeMo's own setting), `demo` (the shipped dates, about 66 tokens an example).

Recorded per run: tokens/s over the timed steps, MFU as this project counts a LoRA step's FLOPs (bench/benchmark.py:
the work the loss needs) and as NeMo AutoModel counts them (NEMO: 2/3 of its full-training count), both over the
datasheet's bf16 peak and over a matmul peak measured on the spot; peak memory; seconds from the process's start to
its first step; and, for the first recipe run of a case, a profile of one step (GPU time in matmuls, attention and
other kernels, and the GPU's idle time) and every call in one step that waited for the GPU, with where it came from.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
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
                 num_key_value_heads=2, vocab_size=49152, max_position_embeddings=4096),
}
# Dense bf16 tensor-core peaks from the datasheets, TFLOP/s (SXM parts)
DATASHEET_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0}
# What the memory plan counts differently (bench/gpu_check.py's replan reads these for the runs recorded before the
# speed part compared setups)
METHODS = {"lora": [], "qlora": ["--use_4bit_quantization", "true"], "lora-compile": ["--torch_compile", "true"],
           "lora-dropout": ["--lora_dropout", "0.05"],
           "qlora-checkpointing": ["--use_4bit_quantization", "true", "--activation_checkpointing", "true"]}

ROW_TOKENS, ROWS = 4096, 2  # tokens per packed row, rows per micro batch
WARMUP_STEPS, MEASURED_STEPS = 3, 10
# Zheng et al., "LMSYS-Chat-1M: A Large-Scale Real-World LLM Conversation Dataset" (ICLR 2024), Table 1: 2.0 turns per
# conversation, 69.5 tokens per prompt, 214.5 per response on average (their tokenizer). Only the means are published:
# the spread is this benchmark's assumption, log-normal lengths with SPREAD as sigma and a geometric turn count.
CHAT_LENGTHS = {"turns": 2.0, "prompt_tokens": 69.5, "response_tokens": 214.5}
SPREAD = 1.0
DEFAULT_RUNS = ["recipe:chat", "trl:chat", "recipe-qlora:chat", "recipe:full", "trl:full", "recipe:demo"]

LORA = ["--lora_r", "16", "--lora_alpha", "32", "--lora_dropout", "0"]
COMMON = ["--per_device_train_batch_size", str(ROWS), "--packing", "true", "--logging_steps", "1",
          "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", "--seed", "42",
          "--learning_rate", "1e-4", "--lr_scheduler_type", "constant"]
# `trl sft` as a careful user runs it for this job (the attention is added by what the machine has)
TRL_SFT_FLAGS = ["--use_peft", *LORA, "--lora_target_modules", "all-linear", "--bf16", "true", "--dtype", "bfloat16",
                 "--gradient_checkpointing", "false"]


def recipe_tokenizer_dir() -> Path:
    """SmolLM2's tokenizer files: the converted default model's, or those files alone (bench/gpu_check.py carries them
    to a GPU machine instead of the 98 MB GGUF package)."""
    from recipe.model.model_files import DEFAULT_MODEL_DIR, convert_default_model

    folder = Path(DEFAULT_MODEL_DIR)
    return folder if (folder / "tokenizer.json").is_file() else convert_default_model()


def shape_values(shape: str) -> dict:
    """The config values of a named shape: memory.py's preset, with what a checkpoint needs beyond it."""
    from recipe.planning.memory import PRESETS, preset_shape

    return {**(preset_shape(shape) if shape in PRESETS else {}), **SHAPES[shape]}


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


# ---------------------------------------------------------------------------------------------------------------------
# Data: conversational prompt/completion parquet, so the recipe and TRL both supervise the completion only


def words_of(rng: random.Random, tokens: int, tokens_per_word: float) -> str:
    """Random pseudo-words that SmolLM2's tokenizer turns into about `tokens` tokens."""
    syllables = [a + b for a in "bcdfghklmnprstvw" for b in ("a", "e", "i", "o", "u", "ar", "en", "is")]
    count = max(1, round(tokens / tokens_per_word))
    return " ".join("".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(count))


def tokens_per_word(tokenizer) -> float:
    rng = random.Random(1)
    text = words_of(rng, 2000, 1.0)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) / len(text.split())


def log_normal(rng: random.Random, mean: float) -> int:
    """A length of log-normal spread SPREAD whose mean is `mean`."""
    return max(1, round(rng.lognormvariate(math.log(mean) - SPREAD ** 2 / 2, SPREAD)))


def chat_conversations(examples: int, tokenizer, seed: int = 0) -> list[dict]:
    """Conversations of CHAT_LENGTHS' shape: a geometric number of turns (mean 2.0), each prompt and response of
    log-normal length with the published means; the last response is the completion."""
    rng, ratio = random.Random(seed), tokens_per_word(tokenizer)
    rows = []
    for _ in range(examples):
        turns = 1
        while rng.random() > 1 / CHAT_LENGTHS["turns"]:
            turns += 1
        messages = []
        for _ in range(turns):
            messages += [{"role": "user", "content": words_of(rng, log_normal(rng, CHAT_LENGTHS["prompt_tokens"]),
                                                             ratio)},
                         {"role": "assistant", "content": words_of(
                             rng, log_normal(rng, CHAT_LENGTHS["response_tokens"]), ratio)}]
        rows.append({"prompt": messages[:-1], "completion": messages[-1:]})
    return rows


def full_length_conversations(examples: int, tokenizer, seed: int = 0) -> list[dict]:
    """A short question and an answer long enough to be cut at ROW_TOKENS: every example fills a row."""
    rng, ratio = random.Random(seed), tokens_per_word(tokenizer)
    return [{"prompt": [{"role": "user", "content": words_of(rng, 100, ratio)}],
             "completion": [{"role": "assistant", "content": words_of(rng, ROW_TOKENS + 400, ratio)}]}
            for _ in range(examples)]


def write_prompt_completion(rows: list[dict], out: Path) -> Path:
    """Parquet with string columns (datasets' JSON reader would infer types from the values)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    turns = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([("prompt", turns), ("completion", turns)])),
                   out / "train.parquet")
    return out


def dataset(kind: str, work: Path, tokenizer, steps: int) -> Path:
    """The data of `kind` (chat, full, demo) for `steps` micro batches of ROWS x ROW_TOKENS, written once."""
    from benchmark import prompt_completion_copy

    out = work / f"data-{kind}"
    if (out / "train.parquet").is_file():
        return out
    if kind == "demo":
        return prompt_completion_copy(REPO / "data" / "dates", out)
    rows_needed = steps * ROWS
    if kind == "full":
        return write_prompt_completion(full_length_conversations(rows_needed + 4, tokenizer), out)
    mean = CHAT_LENGTHS["turns"] * (CHAT_LENGTHS["prompt_tokens"] + CHAT_LENGTHS["response_tokens"])
    return write_prompt_completion(chat_conversations(int(rows_needed * ROW_TOKENS / mean * 1.5), tokenizer), out)


# ---------------------------------------------------------------------------------------------------------------------
# One run: a fresh process, timed from inside by STEP_CLOCK


def recipe_command(setup: str, model: Path, data: Path, out: Path, steps: int, row_tokens: int) -> list[str]:
    flags = {"recipe": [], "recipe-qlora": ["--use_4bit_quantization", "true"], "recipe-loop": [],
             "recipe-liger": ["--use_liger_kernels", "true"], "recipe-compile": ["--torch_compile", "true"]}[setup]
    from recipe.model.fast_paths import varlen_kernel

    # one kernel per packed row where this machine has one (flash-attn's or torch's): run_summary.json says which ran
    kernel = (["--use_flash_attn", "true"] if torch.cuda.is_available() and setup != "recipe-loop" and
              varlen_kernel()[0] is not None else [])
    return ["train.py", "--model_name_or_path", str(model), "--dataset_name", str(data), "--splits", "train",
            "--eval_num_prompts", "0", "--output_dir", str(out), "--overwrite_output_dir", "true", "--max_steps",
            str(steps), "--max_length", str(row_tokens), *COMMON, *LORA, *flags, *kernel]


def trl_attention() -> str:
    """The best attention TRL accepts here: flash-attn's kernel where installed, else sdpa (on padding-free rows
    transformers then builds the block-diagonal mask); eager-free on CPU too."""
    from recipe.platform.hardware import is_flash_attn_installed

    return "flash_attention_2" if torch.cuda.is_available() and is_flash_attn_installed() else "sdpa"


def trl_command(model: Path, data: Path, out: Path, steps: int, row_tokens: int) -> list[str]:
    """TRL's SFT script in this process, as `trl sft` starts it on one GPU (its launcher adds a process only)."""
    import trl

    script = Path(trl.__file__).parent / "scripts" / "sft.py"
    precision = [] if torch.cuda.is_available() else ["--bf16", "false", "--dtype", "float32", "--use_cpu", "true"]
    return [str(script), "--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out),
            "--max_steps", str(steps), "--max_length", str(row_tokens), *COMMON, *TRL_SFT_FLAGS,
            "--attn_implementation", trl_attention(), *precision]


def trl_sft_command_line(row_tokens: int = ROW_TOKENS) -> str:
    """The `trl sft` command the trl setup runs, as the docs write it out."""
    return ("trl sft --model_name_or_path MODEL --dataset_name DATA --output_dir OUT --max_length "
            f"{row_tokens} {' '.join(COMMON)} {' '.join(TRL_SFT_FLAGS)} --attn_implementation sdpa")


# Runs a training script in this process and times it from inside: each step's start and end (after the GPU has
# finished), the Trainer's logs, the peak memory; one step profiled (torch.profiler) and one step's calls that wait for
# the GPU recorded (CUDA's sync debug mode; on CPU, reads of a tensor's values into Python), each with its frames and
# whether a decoder layer is on the stack. Written as JSON to STEP_CLOCK_OUT at exit.
STEP_CLOCK = r'''
import atexit, json, os, resource, runpy, sys, time, traceback, warnings
started = time.time()
import torch
from transformers import trainer_callback
record = {"step_begin": [], "step_end": [], "logs": [], "profile": None, "syncs": None}
profile_step, sync_step = int(os.environ["STEP_CLOCK_PROFILE"]), int(os.environ["STEP_CLOCK_SYNC"])
cuda = torch.cuda.is_available()
sync = torch.cuda.synchronize if cuda else (lambda: None)
state = {}

def in_decoder_layer():
    frame = sys._getframe()
    while frame is not None:
        if type(frame.f_locals.get("self")).__name__.endswith("DecoderLayer"):
            return True
        frame = frame.f_back
    return False

def frames():
    keep = [f for f in traceback.extract_stack()[:-3] if "/torch/" not in f.filename and "warnings" not in f.filename]
    return [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in keep[-6:]]

def note(call):
    record["syncs"].append({"call": call, "in_decoder_layer": in_decoder_layer(), "frames": frames()})

class HostReads(torch.overrides.TorchFunctionMode):
    READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__index__, torch.Tensor.__float__, torch.Tensor.nonzero, torch.nonzero}
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            note(func.__name__)
        return func(*args, **(kwargs or {}))

def begin(step):
    sync()
    record["step_begin"].append(time.time() - started)
    if step == profile_step:
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        state["profiler"] = torch.profiler.profile(activities=activities)
        state["profiler"].__enter__()
    if step == sync_step:
        record["syncs"] = []
        if cuda:
            state["showwarning"] = warnings.showwarning
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, *rest: "synchroniz" in str(message) and note(str(message)[:200])
            torch.cuda.set_sync_debug_mode(1)
        else:
            state["reads"] = HostReads()
            state["reads"].__enter__()

def end(step):
    if step == sync_step:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = state.pop("showwarning")
        else:
            state.pop("reads").__exit__(None, None, None)
    sync()
    record["step_end"].append(time.time() - started)
    if step == profile_step:
        profiler = state.pop("profiler")
        profiler.__exit__(None, None, None)
        record["profile"] = summarize(profiler, record["step_end"][-1] - record["step_begin"][-1])

def summarize(profiler, seconds):
    import re
    kinds = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for event in profiler.key_averages():
        if cuda:
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            time_us = event.self_device_time_total
        else:
            if not event.key.startswith("aten::"):
                continue
            time_us = event.self_cpu_time_total
        name = event.key.lower()
        kind = ("attention" if re.search(r"flash|fmha|attention|varlen|sdpa", name) else
                "matmul" if re.search(r"gemm|cutlass|cublas|nvjet|xmma|wgmma|aten::(mm|addmm|bmm|matmul|linear)", name)
                else "other")
        kinds[kind] += time_us / 1e6
    busy = sum(kinds.values())
    return {"step_seconds": seconds, **{f"{k}_seconds": v for k, v in kinds.items()},
            "idle_seconds": max(0.0, seconds - busy) if cuda else None,
            "basis": "CUDA kernels' time" if cuda else "CPU time of aten operators (they nest: shares only)"}

handler = trainer_callback.CallbackHandler
on_step_begin, on_step_end, on_log = handler.on_step_begin, handler.on_step_end, handler.on_log
def step_begin(self, args, state_, control):
    begin(state_.global_step)
    return on_step_begin(self, args, state_, control)
def step_end(self, args, state_, control):
    end(state_.global_step - 1)  # the Trainer counted the step before it calls on_step_end
    return on_step_end(self, args, state_, control)
def log(self, args, state_, control, logs):
    record["logs"].append({k: v for k, v in logs.items() if isinstance(v, (int, float))})
    return on_log(self, args, state_, control, logs)
handler.on_step_begin, handler.on_step_end, handler.on_log = step_begin, step_end, log

def write():
    record["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if cuda:
        record["gpu_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        record["gpu_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    with open(os.environ["STEP_CLOCK_OUT"], "w") as f:
        json.dump(record, f)
atexit.register(write)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def timed_run(command: list[str], out: Path, steps: int, warmup: int) -> dict:
    """`command` (a script and its arguments) under STEP_CLOCK: the step times, logs and memory it recorded."""
    import subprocess

    out.mkdir(parents=True, exist_ok=True)
    record = out / "step_clock.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "STEP_CLOCK_OUT": str(record),
           "STEP_CLOCK_PROFILE": str(steps - 2), "STEP_CLOCK_SYNC": str(steps - 1)}  # after the timed steps
    result = subprocess.run([sys.executable, "-c", STEP_CLOCK, *command], cwd=REPO, env=env, capture_output=True,
                            text=True)
    if result.returncode != 0 or not record.is_file():
        raise RuntimeError(f"{Path(command[0]).name} failed ({result.returncode}):\n"
                           f"{(result.stdout + result.stderr)[-3000:]}")
    clock = json.loads(record.read_text())
    tokens = [entry["num_tokens"] for entry in clock["logs"] if "num_tokens" in entry and "loss" in entry]
    begins, ends = clock["step_begin"], clock["step_end"]
    timed = slice(warmup, steps - 2)  # the profiled and the sync-recorded steps come after
    seconds = ends[timed.stop - 1] - ends[timed.start - 1]
    step_tokens = [b - a for a, b in zip([0.0, *tokens], tokens)]
    return {"tokens_per_s": sum(step_tokens[timed]) / seconds, "timed_steps": timed.stop - timed.start,
            "tokens_per_step": sum(step_tokens[timed]) / (timed.stop - timed.start),
            "s_per_step": seconds / (timed.stop - timed.start), "first_step_seconds": ends[0] - begins[0],
            "seconds_to_first_step": begins[0], "losses": [e["loss"] for e in clock["logs"] if "loss" in e],
            "profile": clock["profile"], "syncs": clock["syncs"],
            **{key: clock.get(key) for key in ("peak_rss_gib", "gpu_allocated_gib", "gpu_reserved_gib")},
            "output_tail": (result.stdout + result.stderr)[-1500:]}


def nemo_lora_flops_per_token(config, seq: int) -> float:
    """NeMo AutoModel's count for a LoRA step of Llama-family models: its `llama3_flops` (flops_utils.py: per
    sequence, seq x layers x hidden^2 x (12 + 12 kv/heads + 18 ffn/hidden + 6 seq/hidden + 6 vocab/(layers x
    hidden))) per token, times 2/3, the share without weight gradients. It gives their published Llama-3-8B row
    (402 TFLOP/s at 12,472.87 tokens/s on one H100, 2 x 4096 tokens): 32.2 GFLOP per token."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, layers = text.hidden_size, text.num_hidden_layers
    heads, groups = text.num_attention_heads, getattr(text, "num_key_value_heads", text.num_attention_heads)
    per_token = layers * hidden * hidden * (12 + 12 * groups / heads + 18 * text.intermediate_size / hidden
                                            + 6 * seq / hidden + 6 * text.vocab_size / (layers * hidden))
    return per_token * 2 / 3


def measure(shape: str, runs: list[str], work: Path, steps: int = WARMUP_STEPS + MEASURED_STEPS + 2,
            warmup: int = WARMUP_STEPS, row_tokens: int = ROW_TOKENS, on_result=None) -> dict:
    """Each SETUP:DATA run of `runs` on a random model of `shape`, with both MFU counts against the datasheet and a
    matmul peak measured here; `on_result(run, row)` as each ends (a failed run records its error)."""
    from transformers import AutoConfig, AutoTokenizer

    from benchmark import data_shape, flops_per_token, matmul_peak_gflops
    from recipe.platform.hardware import native_bf16_supported

    model = random_model(shape, work)
    tokenizer = AutoTokenizer.from_pretrained(model)
    config = AutoConfig.from_pretrained(model)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    datasheet = next((peak for name, peak in DATASHEET_BF16_TFLOPS.items() if name in device), None)
    dtype = torch.bfloat16 if native_bf16_supported() else torch.float32
    scale = 0.25 if shape == "tiny" else 1.0  # the tiny shape only runs the code path
    peak = matmul_peak_gflops(dtype, os.cpu_count() or 1, "cuda" if torch.cuda.is_available() else "cpu",
                              scale) / 1e3
    results, shapes = {}, {}
    for run in runs:
        setup, kind = run.split(":")
        data = dataset(kind, work, tokenizer, steps)
        if kind not in shapes:  # the recipe's tokenization of it: supervised share, token-weighted example length
            shapes[kind] = data_shape(data, model)
        out = work / f"run-{setup}-{kind}"
        command = (trl_command(model, data, out, steps, row_tokens) if setup == "trl" else
                   recipe_command(setup, model, data, out, steps, row_tokens))
        try:
            row = timed_run(command, out, steps, warmup)
        except Exception as err:
            row = {"error": str(err)[-3000:]}
        else:
            per_token = flops_per_token(str(model), 16, {**shapes[kind], "mean_context": min(
                shapes[kind]["mean_context"], row_tokens)})
            nemo = nemo_lora_flops_per_token(config, row_tokens)
            for name, flops in (("mfu", per_token), ("mfu_nemo_count", nemo)):
                achieved = flops * row["tokens_per_s"] / 1e12
                row[f"{name}_datasheet"] = achieved / datasheet if datasheet else None
                row[f"{name}_measured_peak"] = achieved / peak
            row.update(flops_per_token=per_token, nemo_flops_per_token=nemo, setup=setup, data=kind,
                       attention=attention_of(setup, out), command=[Path(command[0]).name, *command[1:]])
            if setup != "trl":
                row["memory_against_plan"] = memory_of(out)
        results[run] = row
        if on_result:
            on_result(run, row)
    return {"date": time.strftime("%Y-%m-%d"), "device": device, "shape": shape, "steps": steps, "warmup": warmup,
            "rows": ROWS, "row_tokens": row_tokens, "datasheet_tflops": datasheet, "measured_tflops": peak,
            "measured_dtype": str(dtype), "data": shapes, "chat_lengths": CHAT_LENGTHS, "spread": SPREAD,
            "trl_sft": trl_sft_command_line(row_tokens), "results": results}


def attention_of(setup: str, out: Path) -> str:
    """The attention a run used: the recipe's decision (run_summary.json), TRL's flag."""
    if setup == "trl":
        return trl_attention()
    summary = json.loads((out / "run_summary.json").read_text())
    return next(str(d["value"]) for d in summary.get("decisions", []) if d["setting"] == "attention")


def memory_of(out: Path) -> dict | None:
    from recipe.reporting.report import memory_against_plan, read_summary

    return memory_against_plan(read_summary(out))


def summary_lines(m: dict) -> list[str]:
    lines = [f"{m['date']}, {m['device']}; {m['shape']} (random weights), LoRA r=16 all-linear, {m['rows']} x "
             f"{m['row_tokens']} packed tokens per micro batch, {m['steps'] - m['warmup'] - 2} timed steps after "
             f"{m['warmup']}; peak: datasheet bf16 {m['datasheet_tflops'] or 'unknown'} TFLOP/s, measured "
             f"{m['measured_tflops']:.3g} TFLOP/s in {m['measured_dtype']}"]
    for run, row in m["results"].items():
        if "error" in row:
            lines.append(f"{run:20s} FAILED: {row['error'][-300:]}")
            continue
        mfu = lambda key: f"{row[key]:.0%}" if row.get(key) is not None else "n/a"  # noqa: E731
        memory = (f"GPU {row['gpu_allocated_gib']:.1f} GiB allocated" if row.get("gpu_allocated_gib") is not None
                  else f"RSS {row['peak_rss_gib']:.1f} GiB")
        lines.append(f"{run:20s} {row['attention']}: {row['tokens_per_s']:9.0f} tokens/s ({row['tokens_per_step']:.0f}"
                     f" per step), MFU {mfu('mfu_datasheet')} (NeMo's count {mfu('mfu_nemo_count_datasheet')}), "
                     f"{memory}, first step after {row['seconds_to_first_step']:.0f} s")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS), help="comma list of SETUP:DATA")
    parser.add_argument("--out", default=str(REPO / "bench" / "gpu_benchmark.json"))
    parser.add_argument("--work", default=str(REPO / "outputs" / "bench"), help="checkpoint, data and run folders")
    args = parser.parse_args()
    measured = measure(args.shape, args.runs.split(","), Path(args.work))
    print("\n" + "\n".join(summary_lines(measured)))
    Path(args.out).write_text(json.dumps(measured, indent=2))


if __name__ == "__main__":
    main()
