"""What a run really uses, beside what memory.py plans: the memory each phase (load, train, save) of this process
held, sampled while it runs, and the glibc setting that lets host RAM follow what the run holds.

train.py starts a phase at each step of its story and writes the peaks into run_summary.json (`memory_by_rank`),
next to the plan (`memory_plan`); bench/memory_grid.py samples the same processes from outside and uses the phase
marks written here.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch

GIB = 2**30


# glibc serves allocations under its mmap threshold from heaps that keep what is freed; the threshold grows with every
# freed large block, up to 32 MiB, so a model's weights and all-gather buffers (MiBs each) end up there. Measured with
# a 2.2 GiB, 20-layer Llama under FSDP2 on 2 CPU processes: each rank held 4.5-5.3 GiB while training, 2.5 with a fixed
# 64 KiB threshold, which is what the plan counts. Each block at or above it is its own mapping, returned when freed.
# 1 MiB, not 64 KiB: each step's activations (hundreds of KiB to a few MiB on CPU) would otherwise be mapped, zeroed by
# the kernel and unmapped every step. The default run's 8 steps: 3.37 s per step at 64 KiB (35 s of system time),
# 1.68 s at 1 MiB, 1.58 s with glibc's own threshold; the same losses.
MMAP_THRESHOLD_BYTES = 2**20
M_MMAP_THRESHOLD, M_TRIM_THRESHOLD = -3, -1  # mallopt's parameter numbers (malloc.h)


def return_freed_memory(set_by_environment: bool = False) -> bool:
    """Fix glibc's mmap threshold for this process, so host RAM follows what the run holds (False where this is not
    glibc). `set_by_environment` (Launch.mmap_threshold_set): MALLOC_MMAP_THRESHOLD_, read by glibc at start-up,
    wins."""
    import ctypes
    import ctypes.util

    if set_by_environment:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        # the trim threshold too: the dynamic threshold had doubled it with every raise since start-up
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to fix
        return False


class PhasePeaks:
    """What this process really used in each phase of a run (load = read + shard, train, save), to set beside the plan.

    Host: the peak of anonymous memory (RssAnon, sampled every 2 ms by a thread) above the phase's start: what the
    plan counts and what the OOM killer weighs. The kernel's exact high-water mark (VmHWM, reset at each phase start)
    is kept too; it also counts the memory-mapped checkpoint pages, which the kernel can drop. GPU: the peak CUDA
    allocation (what the plan counts), the peak the caching allocator reserved, and the peak of the device's used
    memory (cudaMemGetInfo, sampled every 20 ms: the process's whole footprint, CUDA context and NCCL buffers included,
    while it has the GPU to itself). Without /proc (not Linux) the host values are None."""

    INTERVAL_S = 0.002
    DEVICE_EVERY = 10  # samples: the device's used memory every 20 ms (a driver call, not a /proc read)
    def __init__(self, marks: str | None = None, rank: int = 0):
        """`marks`: where each phase's start goes, for a sampler outside the process (bench/memory_grid.py's
        RECIPE_PHASE_MARKS, Launch.phase_marks): one line per mark, "rank pid phase unix-time"."""
        self.marks, self.rank = marks, rank
        self.phases: dict[str, dict[str, float | None]] = {}
        self._current: str | None = None
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self._anon_peak = 0
        self._device_peak = 0

    @staticmethod
    def _status(*fields: str) -> list[int | None]:
        values = dict.fromkeys(fields)
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                name = line.split(":", 1)[0]
                if name in values:
                    values[name] = int(line.split()[1]) * 1024
        except OSError:
            pass
        return list(values.values())

    def _sample(self, host: bool, device: int | None) -> None:
        # RssAnon as resident minus shared pages (file-backed and shmem) of /proc/self/statm, read through one open
        # file: 3 us a sample against 110 us for parsing /proc/self/status. With that parse and an Event's wait, the
        # sampler took a fifth of a core (measured on a 2 GHz CPU), taken from the ranks and data workers beside it.
        page = os.sysconf("SC_PAGE_SIZE")
        statm = os.open("/proc/self/statm", os.O_RDONLY) if host else None
        count = 0
        try:
            while not self._stop.is_set():
                time.sleep(self.INTERVAL_S)
                if statm is not None:
                    _, resident, shared = os.pread(statm, 128, 0).split()[:3]
                    self._anon_peak = max(self._anon_peak, (int(resident) - int(shared)) * page)
                count += 1
                if device is not None and count % self.DEVICE_EVERY == 0:
                    self._device_peak = max(self._device_peak, self._device_used(device))
        finally:
            if statm is not None:
                os.close(statm)

    @staticmethod
    def _device_used(device: int) -> int:
        free, total = torch.cuda.mem_get_info(device)
        return total - free

    def mark(self, phase: str) -> None:
        if self.marks:
            with open(self.marks, "a") as out:
                out.write(f"{self.rank} {os.getpid()} {phase} {time.time():.6f}\n")

    def start(self, phase: str) -> None:
        self.end()
        self.mark(phase)
        try:
            Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS (VmHWM) to the current RSS
        except OSError:
            pass
        anon, rss = self._status("RssAnon", "VmRSS")
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.phases[phase] = {"host_start_gib": anon / GIB if anon is not None else None,
                              "rss_start_gib": rss / GIB if rss is not None else None}
        self._current, self._anon_peak = phase, anon or 0
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._device_peak = self._device_used(device) if device is not None else 0
        if anon is not None or device is not None:
            self._stop.clear()
            self._sampler = threading.Thread(target=self._sample, args=(anon is not None, device), daemon=True)
            self._sampler.start()

    def end(self) -> None:
        if self._current is None:
            return
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            self._sampler = None
        record = self.phases[self._current]
        anon, hwm = self._status("RssAnon", "VmHWM")
        if record["host_start_gib"] is not None:
            record["host_peak_gib"] = max(self._anon_peak, anon or 0) / GIB
            record["host_growth_gib"] = record["host_peak_gib"] - record["host_start_gib"]
        if record["rss_start_gib"] is not None and hwm is not None:
            record["rss_hwm_growth_gib"] = hwm / GIB - record["rss_start_gib"]
        if torch.cuda.is_available():
            record["cuda_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            record["cuda_reserved_peak_gib"] = torch.cuda.max_memory_reserved() / GIB
            device = torch.cuda.current_device()
            record["cuda_device_used_peak_gib"] = max(self._device_peak, self._device_used(device)) / GIB
        self._current = None
        self.mark("end")
