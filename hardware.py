"""What this machine can do that changes how the recipe runs: native bf16 (else fp32 on a CPU), flash-attn, Liger
Kernel."""

from __future__ import annotations

import importlib.util
import os
import platform
from pathlib import Path

import torch

NATIVE_BF16_SWITCH = "RECIPE_NATIVE_BF16"  # 0: answer as a CPU without native bf16 would (tests, CI); 1: as one with it


def native_bf16_supported() -> bool:
    """True where bf16 matmuls run natively: a CUDA GPU with bf16, or a CPU with AVX512-BF16, AMX or Arm BF16.

    Elsewhere bf16 is emulated, many times slower than fp32 (measured ~10-20x on AVX2 CPUs). RECIPE_NATIVE_BF16=0 or 1
    overrides the probe, so the paths that branch on it can be run on any machine."""
    switch = os.environ.get(NATIVE_BF16_SWITCH, "").strip()
    if switch:
        if switch not in ("0", "1"):
            raise ValueError(f"{NATIVE_BF16_SWITCH}={switch!r}: use 0 (no native bf16) or 1 (native bf16), or unset it")
        return switch == "1"
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    if platform.system() != "Linux":
        return False
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def is_flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def is_liger_kernel_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None
