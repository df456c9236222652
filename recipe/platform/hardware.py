"""What this machine can do that changes how the recipe runs: native bf16 (else fp32 on a CPU), flash-attn, Liger
Kernel."""

from __future__ import annotations

import importlib.util
import os
import platform
from pathlib import Path

import torch

NATIVE_BF16_SWITCH = "RECIPE_NATIVE_BF16"  # 0: answer as a CPU without native bf16 would (tests, CI); 1: as one with it


def describe() -> dict:
    """This machine in a results file's words: the CPU's name, its cores (those this process may use) and whether it
    runs bf16 natively."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": usable_cores(), "native_bf16": native_bf16_supported()}


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, where the system has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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


# ---------------------------------------------------------------------------------------------------------------------
# How fast this machine loads a checkpoint: what rank 0 of a sharded run needs, while the other ranks wait for it

READ_PROBE_BYTES = 256 * 2**20
QUANTIZE_PROBE_SHAPE = (2048, 4096)  # 16 MiB of 16-bit weights


def cold_read_gib_per_s(files: list[Path]) -> float | None:
    """The disk's read rate under the checkpoint: the first READ_PROBE_BYTES of its largest file, dropped from the
    page cache first (posix_fadvise DONTNEED: no root needed), then read once. None without a file to read."""
    files = [f for f in files if f.is_file() and f.stat().st_size > 0]
    if not files or not hasattr(os, "posix_fadvise"):
        return None
    largest = max(files, key=lambda f: f.stat().st_size)
    size = min(READ_PROBE_BYTES, largest.stat().st_size)
    import time

    drop_from_page_cache(largest, size)
    with open(largest, "rb", buffering=0) as f:
        start, left = time.perf_counter(), size
        while left > 0 and (chunk := f.read(min(left, 16 * 2**20))):
            left -= len(chunk)
        seconds = time.perf_counter() - start
    return (size - left) / 2**30 / max(seconds, 1e-6)


def drop_from_page_cache(file: Path, size: int = 0) -> None:
    """The first `size` bytes of `file` (0: all of it) out of the page cache, so the next read comes from the disk
    (posix_fadvise DONTNEED on clean pages: no root needed)."""
    with open(file, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, size, os.POSIX_FADV_DONTNEED)


def quantize_gib_per_s(storage: torch.dtype = torch.bfloat16, nested: bool = True) -> float:
    """NF4 quantization on this CPU, in GiB of 16-bit weights per second, as rank 0 quantizes while it loads
    (bitsandbytes' CPU backend packs a weight on its first move): one 16 MiB matrix, after a small one to warm up."""
    import time

    import bitsandbytes as bnb

    def quantize(rows: int, columns: int) -> float:
        weight = torch.randn(rows, columns, dtype=torch.bfloat16)
        start = time.perf_counter()
        bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", compress_statistics=nested,
                          quant_storage=storage).to("cpu")
        return weight.numel() * 2 / 2**30 / max(time.perf_counter() - start, 1e-6)

    quantize(256, 256)
    return quantize(*QUANTIZE_PROBE_SHAPE)
