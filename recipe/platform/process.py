"""How a recipe process starts and ends, apart from what it trains: no garbage collection while the libraries import,
and, after a run that ended well, an exit that leaves out the interpreter's teardown. `python train.py` calls
`before_imports` first thing and `after_imports` once its libraries are in; `finish` ends a run that ended well,
`exit_now` one that failed."""

from __future__ import annotations

import atexit
import gc
import os
import sys

AT_EXIT = {"skip_teardown": False}


def before_imports() -> None:
    """The libraries create millions of objects, all kept for the life of the process: no collection while they
    import (after_imports then keeps them out of every later one and of the one at exit). And the exit handler that
    leaves out the teardown (leave_if_finished), registered before any library's: handlers run last-registered first,
    so it runs after all of them."""
    gc.disable()
    atexit.register(leave_if_finished)


def after_imports() -> None:
    gc.freeze()
    gc.enable()


def finish() -> None:
    """End a run that ended well: destroy its process group and, if it had one, leave out the interpreter's teardown at
    exit (leave_if_finished). Left to that teardown, gloo's threads can abort a rank that trained and saved (SIGABRT,
    "terminate called without an active exception"; torch 2.13, pytorch issue 190489), and its launch reports a
    failure. Destroying the group does not end them while anything holds it: the trainer's reference cycles until a
    collection, and under FSDP2 and ZeRO-3 DTensor's sharding caches and DeepSpeed's lists of groups, to the exit
    (gloo threads left after the destroy and a collection: none under FSDP1, 3 under FSDP2, 6 under ZeRO-3). Never
    after a failure: another rank may still be inside a collective, and destroying the group under it can hang."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        AT_EXIT["skip_teardown"] = True


def leave_if_finished() -> None:
    """The last exit handler: by now Python has joined the process's threads and run every other handler."""
    if AT_EXIT["skip_teardown"]:
        exit_now(0)


def exit_now(code: int) -> None:
    """Leave at once with `code`, what was printed flushed, without the interpreter's teardown (after a failure,
    destroying the process group in it can hang)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
