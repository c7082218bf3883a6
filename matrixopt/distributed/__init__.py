"""Distributed training with matrixopt's optimizers.

    model, opt = matrixopt.distributed.layerwise(model, "muon", lr=0.02)   # where DDP would go

``layerwise`` gives each data-parallel rank whole parameters to optimize (balanced by the optimizer's cost),
reduces gradients to owners during backward and broadcasts updated parameters overlapped with the next forward.
A trainer picks its parallel mode by name through :func:`make_parallelism`, one :class:`Parallelism` per mode
(one process, DDP, layer-wise, FSDP2 with tensor parallelism). Under FSDP2 the matrix optimizers run on the
DTensor shards: :class:`ShardedMuon`, :class:`ShardedNorMuon`, :class:`ShardedAdaMuon`, and :class:`ShardedShampoo`,
:class:`ShardedSOAP` (each matrix preconditioned whole on an owner rank). :func:`batch_slice` and
:func:`mean_over_ranks` split a global batch and average a logged value. Checkpoints:
:mod:`matrixopt.distributed.checkpoint` (``save`` on N ranks, ``load`` on M, ``export`` to one file).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from matrixopt.distributed.layerwise import LayerwiseOptimizer
from matrixopt.distributed.parallelism import (
    DDP,
    FSDP,
    PARALLELISMS,
    Layerwise,
    Parallelism,
    SingleProcess,
    TPPlan,
    any_rank,
    batch_slice,
    make_parallelism,
    mean_over_ranks,
)
from matrixopt.distributed.sharded import ShardedAdaMuon, ShardedMuon, ShardedNorMuon
from matrixopt.distributed.sharded_precond import ShardedShampoo, ShardedSOAP


def layerwise(model: nn.Module, optimizer: str, *, process_group: dist.ProcessGroup | None = None,
              **kwargs: Any) -> tuple[nn.Module, LayerwiseOptimizer]:
    """``(model, opt)``: the model (unchanged, with hooks) and a :class:`LayerwiseOptimizer` running the
    registered ``optimizer`` layer-wise over ``process_group``. kwargs: see :class:`LayerwiseOptimizer`."""
    return model, LayerwiseOptimizer(model, optimizer, process_group=process_group, **kwargs)


__all__ = ["DDP", "FSDP", "PARALLELISMS", "Layerwise", "LayerwiseOptimizer", "Parallelism", "ShardedAdaMuon",
           "ShardedMuon", "ShardedNorMuon", "ShardedSOAP", "ShardedShampoo", "SingleProcess", "TPPlan", "any_rank",
           "batch_slice", "layerwise", "make_parallelism", "mean_over_ranks"]
