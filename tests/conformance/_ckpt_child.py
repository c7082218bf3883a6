"""Child process for the SIGKILL checkpoint test: trains the config in argv[1] (JSON) into argv[2] and kills
itself with SIGKILL while writing checkpoint number argv[3]. argv[4] is where: "open" (right after the temporary
file is opened, with half the bytes written) or "fsync" (all bytes written, not yet renamed into place)."""

import builtins
import json
import os
import signal
import sys

from matrixopt.train.config import TrainConfig, from_dict
from matrixopt.train.trainer import train

cfg = from_dict(TrainConfig, json.loads(sys.argv[1]))
out, kill_at, where = sys.argv[2], int(sys.argv[3]), sys.argv[4]
count = 0
real_open, real_fsync = builtins.open, os.fsync


class HalfWriter:
    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def write(self, data):  # half the bytes reach the file, then the process dies
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def killing_open(file, mode="r", *args, **kwargs):
    global count
    f = real_open(file, mode, *args, **kwargs)
    if str(file).endswith(".tmp") and "w" in mode:
        count += 1
        if where == "open" and count == kill_at:
            return HalfWriter(f)
    return f


def killing_fsync(fd):
    if where == "fsync" and count == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    real_fsync(fd)


builtins.open = killing_open
os.fsync = killing_fsync
train(cfg, out, progress=False)
