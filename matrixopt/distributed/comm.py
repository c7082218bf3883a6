"""The collective calls of the layer-wise optimizer, in one place. Ranks here are ranks within ``group``.

Everything else in :mod:`matrixopt.distributed` moves tensors only through these functions, so the schedule
(what is sent when) can be read in ``layerwise.py`` and the transport swapped here.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor

Group = dist.ProcessGroup


def require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("matrixopt.distributed needs torch.distributed initialised: launch with torchrun and "
                           "call torch.distributed.init_process_group('nccl' on GPU, 'gloo' on CPU) first")


def new_group(timeout: timedelta) -> Group:
    """A process group over all ranks with its own ``timeout``, so that a dead or stuck rank makes the others
    fail after ``timeout`` instead of hanging. Collective: every rank must call it."""
    require_initialized()
    return dist.new_group(timeout=timeout)


def rank(group: Group) -> int:
    return dist.get_rank(group)


def world_size(group: Group) -> int:
    return dist.get_world_size(group)


def reduce_to_owner(buffer: Tensor, owner: int, group: Group) -> dist.Work:
    """Sum ``buffer`` over ranks into ``owner``'s copy (asynchronous). Other ranks' copies are left undefined."""
    return dist.reduce(buffer, group_dst=owner, op=dist.ReduceOp.SUM, group=group, async_op=True)


def broadcast_from_owner(buffer: Tensor, owner: int, group: Group) -> dist.Work:
    """Copy ``owner``'s ``buffer`` into every rank's (asynchronous)."""
    return dist.broadcast(buffer, group_src=owner, group=group, async_op=True)


def all_reduce_sum(t: Tensor, group: Group) -> Tensor:
    """In-place sum over ranks (blocking)."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_reduce_max(t: Tensor, group: Group) -> Tensor:
    """In-place max over ranks (blocking)."""
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def all_gather_object(obj: Any, group: Group) -> list[Any]:
    """Every rank's picklable ``obj``, indexed by rank (blocking)."""
    out: list[Any] = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def host_group() -> Group:
    """A group over all ranks whose collectives run on the host (gloo), e.g. to agree on a flag every step without
    waiting for the GPU work queued so far: the default group if it is gloo, else a new gloo group. Collective:
    every rank must call it, in the same order as its other group creations."""
    require_initialized()
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


def object_device(group: Group) -> torch.device:
    """Where small control tensors live for this group's backend (CUDA for NCCL)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def leave(code: int = 0) -> NoReturn:
    """End a torchrun worker: destroy the default process group (if any), flush stdout and stderr, and exit with
    ``code`` without interpreter teardown.

    Collective work objects that torch keeps alive (DTensor's, FSDP2's) can outlive their destroyed gloo group;
    destroying them during interpreter teardown sometimes aborts the process ("terminate called without an active
    exception") after all the work has finished and its results are written. Only for the end of a process."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
