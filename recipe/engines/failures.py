"""How a run ends when something fails: a write that found no space or permission, a rank that lost the others, and
one rank's failure ending every rank of every machine (RankFailures, through the launch's rendezvous store)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

from recipe.platform.launch import Launch


def gathered_errors(err: BaseException) -> dict[int, BaseException]:
    """Each rank's error that torch's distributed checkpoint gathered into `err` (CheckpointException.failures: rank ->
    (error, traceback)); empty for any other error."""
    failures = getattr(err, "failures", None)
    return {rank: failed for rank, (failed, _) in failures.items()} if isinstance(failures, dict) else {}


def write_failure(err: BaseException, output_dir: str) -> str | None:
    """Why a save failed for want of space or permission, from `err` or the errors it came from; None for any other
    failure. A full disk reaches here as OSError from Python's own writes, but as SafetensorError from safetensors and
    RuntimeError from torch.save ("unexpected pos"), so a nearly full disk under output_dir counts too."""
    chain, pending = [], [err]
    while pending:  # the errors it came from, and those of each rank a distributed checkpoint gathered (failures)
        error = pending.pop()
        if error is None or error in chain:
            continue
        chain.append(error)
        pending += [error.__cause__ or error.__context__, *gathered_errors(error).values()]
    for error in chain:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT):
            return f"{error.strerror} ({error.filename or 'while saving'})"
    if Path(output_dir).exists() and shutil.disk_usage(output_dir).free < 2**20:
        return f"No space left on device ({type(chain[0]).__name__}: {str(chain[0])[:200]})"
    return None


def lost_rank(err: BaseException) -> str | None:
    """What a collective reported when another rank stopped answering (its node killed, lost, or out of memory), or
    its timeout ran out; None for any other failure (its traceback is then shown as it is). gloo raises a RuntimeError
    naming the closed connection or the timeout ("Timed out waiting ..."); NCCL's watchdog raises DistBackendError."""
    import torch.distributed as dist

    message = str(err)
    lost = isinstance(err, dist.DistError) or any(
        sign in message for sign in ("Connection closed by peer", "Connection reset by peer", "Timed out waiting"))
    return f"{type(err).__name__}: {message.splitlines()[0][:300]}" if lost else None


class RankFailures:
    """One rank's failure ends every rank of the launch within FAILURE_POLL_S, on every machine.

    A rank that raises (a full disk in its part of a save, an out-of-memory, a bad shard) writes its error into the
    launch's rendezvous store (torchrun's, which every rank of every machine reaches) before it exits; a thread in every
    other rank watches for it and ends its process. Without it a rank on another machine, where no launcher kills it,
    would wait in its next collective until the collective timeout (NCCL notices no peer that left; gloo notices a
    closed connection, but reports it as a lost rank, not why). The failed rank's own log holds its error; each other
    machine's first rank prints it once more, so every machine's log says why its run ended."""

    KEY = "recipe/failed-rank"
    FAILURE_POLL_S = 1.0

    def __init__(self, launch: Launch):
        self.launch, self.key = launch, f"{self.KEY}/{launch.restart}"
        self.store = launch.store()
        threading.Thread(target=self.watch, name="rank-failures", daemon=True).start()

    @classmethod
    def of(cls, launch: Launch) -> RankFailures | None:
        return cls(launch) if launch.num_processes > 1 and launch.store_address else None

    def announce(self, error: str) -> None:
        try:
            self.store.set(self.key, json.dumps({"rank": self.launch.rank, "machine": self.launch.machine_rank,
                                                 "error": error}))
        except Exception:  # the store's machine is gone too: the others see this rank's connections close
            pass

    def announced(self) -> dict | None:
        """Another rank's failure, if one was announced; None where none was, or the store cannot be reached."""
        try:
            failure = json.loads(self.store.get(self.key)) if self.store.check([self.key]) else None
        except Exception:
            return None
        return failure if failure and failure["rank"] != self.launch.rank else None

    def watch(self) -> None:
        while True:
            time.sleep(self.FAILURE_POLL_S)
            if failure := self.announced():
                stop_for(self.launch, failure)


WATCH: dict = {"watch": None, "error": None}  # this process's RankFailures, and the last error it said
FAILED_RANK_LEAVES_S = 3.0
STOPPING = threading.Lock()


def stop_for(launch: Launch, failure: dict) -> None:
    """End this process for another rank's failure (exit code 1), without the interpreter's teardown: the main thread
    may be inside a collective that will never complete. The failed rank printed its error; each other machine's
    first rank prints it once more."""
    if not STOPPING.acquire(blocking=False):  # the watch and the main thread both found it: the first one says it,
        threading.Event().wait()  # and ends the process
    if launch.local_rank == 0 and failure["machine"] != launch.machine_rank:
        print(f"error: rank {failure['rank']} (machine {failure['machine']}) failed: {failure['error']}",
              file=sys.stderr)
    print(f"rank {launch.rank} stopped: rank {failure['rank']} failed", file=sys.stderr, flush=True)
    sys.stdout.flush()
    time.sleep(FAILED_RANK_LEAVES_S)  # the failed rank exits first: its launcher names it, not this one, as the cause
    os._exit(1)


def failed_elsewhere(err: BaseException, launch: Launch, output_dir: str) -> dict | None:
    """The failure of another rank that `err` carries: torch's distributed checkpoint gathers every rank's error of a
    save or load and raises them on all ranks (CheckpointException); None where this rank failed too, or for any
    other error."""
    errors = gathered_errors(err)
    if not errors or launch.rank in errors:
        return None
    rank, error = min(errors.items())
    why = write_failure(error, output_dir)
    return {"rank": rank, "machine": rank // max(launch.local_processes, 1),
            "error": f"cannot write to {output_dir}: {why}" if why else f"{type(error).__name__}: {error}"[:300]}
