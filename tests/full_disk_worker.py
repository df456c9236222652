"""train.py's recipe with one rank's disk full from some point on: FULL_DISK_RANK's writes of checkpoint shards raise
ENOSPC (No space left on device) from its write numbered FULL_DISK_FROM_WRITE (1 = the first; a checkpoint is two: the
model's shards, then the optimizer's), as its own disk would on a machine whose disk filled during the run; the other
ranks write as usual. The moment of the first failed write goes to FULL_DISK_MARK (a file), if set. Not a copy of the
recipe: `train.main`, with torch's distributed-checkpoint file writer wrapped on that rank."""

import errno
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train  # noqa: E402

from torch.distributed.checkpoint import filesystem  # noqa: E402

WRITES = {"count": 0}


def full_from_a_write(write_data):
    def write(self, plan, planner):
        WRITES["count"] += 1
        if WRITES["count"] >= int(os.environ["FULL_DISK_FROM_WRITE"]):
            if os.environ.get("FULL_DISK_MARK"):
                Path(os.environ["FULL_DISK_MARK"]).write_text(str(time.time()))
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return write_data(self, plan, planner)
    return write


if "FULL_DISK_RANK" in os.environ and os.environ["FULL_DISK_RANK"] == os.environ.get("RANK"):
    filesystem.FileSystemWriter.write_data = full_from_a_write(filesystem.FileSystemWriter.write_data)

if __name__ == "__main__":
    train.main(sys.argv[1:])
