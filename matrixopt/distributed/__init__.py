"""Distributed training with matrixopt's optimizers.

    model, opt = matrixopt.distributed.layerwise(model, "muon", lr=0.02)   # where DDP would go

``layerwise`` gives each data-parallel rank whole parameters to optimize (balanced by the optimizer's cost),
reduces gradients to owners during backward and broadcasts updated parameters overlapped with the next forward.
:func:`setup` picks layer-wise or plain DDP by name for a trainer; :func:`batch_slice` and
:func:`mean_over_ranks` split a global batch and average a logged value. Checkpoints:
:mod:`matrixopt.distributed.checkpoint` (``save`` on N ranks, ``load`` on M, ``export`` to one file).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from matrixopt.distributed import comm
from matrixopt.distributed.layerwise import LayerwiseOptimizer
from matrixopt.optim.registry import build_optimizer

PARALLEL = ("layerwise", "ddp")


def layerwise(model: nn.Module, optimizer: str, *, process_group: dist.ProcessGroup | None = None,
              **kwargs: Any) -> tuple[nn.Module, LayerwiseOptimizer]:
    """``(model, opt)``: the model (unchanged, with hooks) and a :class:`LayerwiseOptimizer` running the
    registered ``optimizer`` layer-wise over ``process_group``. kwargs: see :class:`LayerwiseOptimizer`."""
    return model, LayerwiseOptimizer(model, optimizer, process_group=process_group, **kwargs)


def setup(model: nn.Module, optimizer: str, parallel: str = "layerwise",
          **hparams: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Data-parallel training over all ranks: ``"layerwise"`` (any registered optimizer) or ``"ddp"``
    (DistributedDataParallel with the whole optimizer on every rank, e.g. the AdamW baseline).

    Train with each rank's slice of the global batch (:func:`batch_slice`); clip with ``opt.clip_grad_norm_``
    under layerwise and ``torch.nn.utils.clip_grad_norm_(model.parameters())`` under DDP; accumulate inside
    ``opt.no_sync()`` / ``model.no_sync()`` respectively."""
    if parallel not in PARALLEL:
        raise ValueError(f"unknown parallel mode {parallel!r}; choose one of {PARALLEL}")
    comm.require_initialized()
    if parallel == "layerwise":
        return layerwise(model, optimizer, **hparams)
    opt = build_optimizer(model, optimizer, **hparams)
    device_ids = [next(model.parameters()).device.index] if next(model.parameters()).is_cuda else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids), opt


def batch_slice(batch_size: int, process_group: dist.ProcessGroup | None = None) -> slice:
    """This rank's rows of a global batch of ``batch_size`` rows (equal slices, rank order), so N ranks see the
    same data as one process. With per-rank mean losses and mean-reduced gradients that reproduces the
    single-process gradient."""
    group = process_group or dist.group.WORLD
    rank, world = comm.rank(group), comm.world_size(group)
    if batch_size % world:
        raise ValueError(f"global batch size {batch_size} is not divisible by the {world} data-parallel ranks; "
                         f"use a multiple of {world}")
    per = batch_size // world
    return slice(rank * per, (rank + 1) * per)


def mean_over_ranks(value: Tensor, process_group: dist.ProcessGroup | None = None) -> Tensor:
    """The mean of a per-rank scalar over ranks (e.g. the loss to log). Collective."""
    group = process_group or dist.group.WORLD
    t = value.detach().float().clone()
    return comm.all_reduce_sum(t, group) / comm.world_size(group)


def any_rank(flag: bool, host_group: dist.ProcessGroup) -> bool:
    """Whether ``flag`` is set on any rank of ``host_group`` (from :func:`comm.host_group`): agreed on the host,
    without waiting for queued GPU work. Collective."""
    t = torch.tensor([float(flag)])
    return comm.all_reduce_max(t, host_group).item() > 0


__all__ = ["PARALLEL", "LayerwiseOptimizer", "any_rank", "batch_slice", "layerwise", "mean_over_ranks", "setup"]
