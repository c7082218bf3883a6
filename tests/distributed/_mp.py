"""Run a function on N processes joined in a process group (spawned, free TCP port): gloo on CPU, or NCCL with
one GPU per rank.

``run(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` in each process after
``init_process_group(backend)`` (on NCCL with ``cuda:rank`` as the current device); an exception in any rank
fails the caller with that rank's traceback, and a run that exceeds ``timeout`` seconds is killed and fails.
``fn`` must be a module-level function (spawn pickles it by reference).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from matrixopt.distributed import comm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, pg_timeout: float, backend: str,
           args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=pg_timeout))
    try:
        fn(rank, world_size, *args)
    except BaseException:
        dist.destroy_process_group()
        raise
    comm.leave(0)  # success: no interpreter teardown (gloo work objects outliving their group, see its docstring)


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, pg_timeout: float = 60.0,
        backend: str = "gloo") -> None:
    ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), pg_timeout, backend, args), nprocs=world_size,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world_size} ranks did not finish in {timeout} s")
