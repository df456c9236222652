"""Checkpoints that survive kills and preemption.

- A checkpoint counts only once it is complete: after the Trainer has written it on every rank, rank 0 adds the
  adapter config, the tokenizer, and last a `checkpoint_complete` marker. `latest` resumes from the newest
  checkpoint with the marker, so a folder half-written by a kill is never picked up.
- Rotation (`save_total_limit`) counts complete checkpoints only, never deletes the newest complete one, the best
  one (`load_best_model_at_end`) nor the one this run resumed from, and clears half-written folders older than the
  newest complete checkpoint.
- SIGTERM (SLURM's warning before a kill) or SIGINT stops training at the end of the current step on every rank,
  saves a checkpoint and exits with 128 + the signal number. A repeated SIGTERM is ignored and no signal interrupts a
  save; a second SIGINT outside a save kills at once.
- The marker records every file of the checkpoint with its size and SHA-256. Before a checkpoint is resumed,
  consolidated or merged, its files are checked against it (`damage`): a file truncated or changed after the save (a
  failing disk, a partial copy between machines) is found before anything is loaded. `latest` skips a damaged
  checkpoint for the newest intact one and says which it skipped and why; a damaged checkpoint named explicitly is
  refused. Markers written before the records existed (`{}`) are taken as they are.
- `latest` is the newest intact complete checkpoint as rank 0 sees it, the same on every rank (`resume_point`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from transformers import TrainerCallback

from recipe.platform.launch import Launch

COMPLETE = "checkpoint_complete"
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def checkpoints(output_dir: str | Path) -> list[tuple[int, Path, bool]]:
    """(step, folder, complete) for every checkpoint-N folder, oldest first."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), path, (path / COMPLETE).is_file())
             for path in folder.iterdir() if path.is_dir() and (m := CHECKPOINT.match(path.name))]
    return sorted(found)


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_records(folder: Path) -> dict[str, dict]:
    """Every file under a checkpoint folder but the marker: relative path -> size and SHA-256."""
    return {path.relative_to(folder).as_posix(): {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
            for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != COMPLETE)}


def damage(folder: str | Path) -> str | None:
    """What differs between a complete checkpoint's files and what its marker recorded when it was written; None when
    they agree (or the marker records no files). Sizes first: a truncated file is found without reading it."""
    folder = Path(folder)
    recorded = json.loads((folder / COMPLETE).read_text()).get("files")
    if not recorded:
        return None
    for name, record in recorded.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if (size := path.stat().st_size) != record["bytes"]:
            return f"{path} has {size} bytes, {record['bytes']} were written"
    for name, record in recorded.items():
        if sha256_of(folder / name) != record["sha256"]:
            return f"{folder / name} changed after it was written (its SHA-256 differs)"
    return None


def latest_complete(output_dir: str | Path) -> str | None:
    complete = [path for _, path, done in checkpoints(output_dir) if done]
    return str(complete[-1]) if complete else None


def latest_intact(output_dir: str | Path) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest complete checkpoint whose files are as written, and the newer ones skipped, with why."""
    skipped = []
    for _, path, done in reversed(checkpoints(output_dir)):
        if done:
            if (why := damage(path)) is None:
                return str(path), skipped
            skipped.append((str(path), why))
    return None, skipped


def resume_point(resume: str | None, output_dir: str | Path, rank0: bool = True) -> str | None:
    """The checkpoint a run resumes from. `latest` is the newest intact complete checkpoint in output_dir as rank 0
    sees it, sent to every rank (ranks on other machines may see a shared file system at another moment), or a fresh
    start when there is none. A named checkpoint was verified by preflight (checks.resume_checkpoint)."""
    if resume != "latest":
        return resume
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    found = [None]
    if rank0:
        found[0], skipped = latest_intact(output_dir)
        for path, why in skipped:
            print(f"--resume_from_checkpoint latest: skipping {path}, damaged after it was written: {why}; resuming "
                  f"from {found[0] or 'the start (no intact checkpoint)'}", file=sys.stderr, flush=True)
    if distributed:
        torch.distributed.broadcast_object_list(found, src=0)
    return found[0]


def rotate(output_dir: str | Path, limit: int | None, protected: set[Path]) -> list[Path]:
    """Keep the newest `limit` complete checkpoints plus the protected ones; drop stale half-written folders."""
    found = checkpoints(output_dir)
    complete = [path for _, path, done in found if done]
    if not complete:
        return []
    newest_step = max(step for step, _, done in found if done)
    doomed = [path for step, path, done in found if not done and step < newest_step]
    if limit and limit > 0:
        keep = {path.resolve() for path in (*complete[-limit:], complete[-1], *protected)}
        doomed += [path for path in complete if path.resolve() not in keep]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


class CompleteCheckpointsMixin:
    """For a Trainer class: completion markers and safe rotation around the Trainer's own checkpoint save."""

    def __init__(self, *args, launch: Launch, signals: StopOnSignal | None = None, resume: str | None = None,
                 **kwargs):
        """`launch`: the settled launch (its rank 0 writes the markers). `signals`: stops training at the end of a step
        with a checkpoint, and is told when a save is in progress (which no second signal interrupts). `resume`:
        --resume_from_checkpoint, resolved once the Trainer has set up the process group, the same on every rank
        (`resumed_from`, never rotated away)."""
        self.launch = launch
        super().__init__(*args, **kwargs)
        self.signals = signals
        if signals is not None:
            self.add_callback(signals)
        self.resumed_from = resume_point(resume, self.args.output_dir, launch.is_rank0)

    def _save_checkpoint(self, model, trial) -> None:
        with self.signals.saving_checkpoint() if self.signals else nullcontext():
            self._save_complete_checkpoint(model, trial)

    def _save_complete_checkpoint(self, model, trial) -> None:
        limit, self.args.save_total_limit = self.args.save_total_limit, None  # rotation happens below, safely
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        self.accelerator.wait_for_everyone()  # every rank's shards are on disk
        if self.launch.is_rank0:
            folder = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
            if hasattr(self.model, "peft_config"):  # lets `export.py consolidate` turn sharded files into an adapter
                self.model.peft_config["default"].save_pretrained(folder)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(folder)
            marker = folder / COMPLETE
            record = {"step": self.state.global_step, "time": time.time(), "files": file_records(folder)}
            with open(marker, "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
            # transformers' own rotation keeps the best checkpoint (load_best_model_at_end); so does this one
            kept = (self.resumed_from, self.state.best_model_checkpoint)
            rotate(self.args.output_dir, limit, {Path(path) for path in kept if path})
        self.accelerator.wait_for_everyone()


class StopOnSignal(TrainerCallback):
    """Turn SIGTERM / SIGINT into: finish this step, save a checkpoint, stop. Every rank stops at the same step.

    The same request often arrives twice: SLURM signals every process of the job, and the launcher (torchrun's agent)
    forwards its own copy to the workers. So a repeated SIGTERM is ignored, no second signal interrupts a checkpoint
    being saved, and only a second SIGINT outside a save (a user's second Ctrl-C) ends the process at once. The
    launcher's grace before it kills the workers (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, set by the run_peft_*.sh
    launchers) must cover the rest of a step and the save."""

    def __init__(self):
        self.received: int | None = None
        self.saving = False
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            return
        if self.saving or signum == signal.SIGTERM:
            print(f"signal {signum} again: ignored, " + ("a checkpoint is being saved" if self.saving else
                  "the run already stops after this step and its checkpoint"), file=sys.stderr, flush=True)
            return
        signal.signal(signum, signal.SIG_DFL)  # a second Ctrl-C ends the process at once
        os.kill(os.getpid(), signum)

    @contextmanager
    def saving_checkpoint(self):
        self.saving = True
        try:
            yield
        finally:
            self.saving = False

    def on_step_end(self, args, state, control, **kwargs):
        requested = torch.tensor([0 if self.received is None else int(self.received)])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if torch.distributed.get_backend() == "nccl":
                requested = requested.cuda()
            torch.distributed.all_reduce(requested, op=torch.distributed.ReduceOp.MAX)  # one rank's signal stops all
        if requested.item():
            self.received = int(requested.item())
            control.should_save = True
            control.should_training_stop = True
        return control
