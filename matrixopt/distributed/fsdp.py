"""FSDP2 / DTensor ``Shard(0)`` matrices: gather each matrix to one owner rank, orthogonalize there, scatter back.

With ``fully_shard`` every rank holds a slice of rows of every matrix. Orthogonalization needs whole matrices,
but only one rank needs each one. For a stack of ``b`` same-shape matrices, ordered so that each owner's
matrices are consecutive (owners ascending)::

    owned = gather_to_owners(local, counts, sizes, rows_dim, group).wait()   # (b, rows, n) -> (k, m, n)
    owned = orthogonalize(owned)                                             # the k matrices this rank owns
    local = scatter_from_owners(owned, counts, sizes, rows_dim, group).wait() # (k, m, n) -> (b, rows, n)

Each matrix crosses the network once each way, (P-1)/P of it: in total less than one all-gather plus one
reduce-scatter of the matrix parameters, and no rank ever materializes a matrix it does not own (no
``full_tensor()``). Uneven shards (dim 0 not divisible by the world size, even empty shards) are handled:
``sizes`` lists every rank's rows.

A stack may hold its matrices transposed (``rows_dim=2``: ``(b, n, rows)``), as Muon packs tall matrices short
side first; the exchange then moves them as they lie and the owner gets ``(k, n, m)``, with no transposing copy
on either side. Both calls are asynchronous: ``wait()`` makes the current stream wait (not the host), so
exchanges of several stacks overlap the orthogonalization of others. :func:`apply_fsdp` shards a model the way
the tests and benchmark do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from matrixopt.distributed import tp_comm


class InFlight:
    """An exchange launched on the network: :meth:`wait` returns its result."""

    def __init__(self, work: dist.Work, finish: Callable[[], Tensor], keep: Tensor) -> None:
        self._work, self._finish, self._keep = work, finish, keep  # keep: the send buffer, alive until the wait

    def wait(self) -> Tensor:
        self._work.wait()
        self._keep = None
        return self._finish()


def _matrices(k: int, rows: int, width: int, rows_dim: int) -> tuple[int, int, int]:
    return (k, rows, width) if rows_dim == 1 else (k, width, rows)


def gather_to_owners(local: Tensor, counts: Sequence[int], sizes: Sequence[int], rows_dim: int,
                     group: ProcessGroup | None) -> InFlight:
    """Whole matrices to their owners.

    local: contiguous ``(b, sizes[rank], n)`` (``rows_dim=1``) or ``(b, n, sizes[rank])`` (``rows_dim=2``), this
    rank's rows of b matrices, the first ``counts[0]`` owned by rank 0, the next ``counts[1]`` by rank 1, ...
    sizes: every rank's row count (uneven allowed). Result: ``(k, m, n)`` or ``(k, n, m)``, the ``k = counts[rank]``
    matrices this rank owns in stack order, ``m = sum(sizes)``."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    b = local.size(0)
    width = local.size(3 - rows_dim)
    if (rows_dim not in (1, 2) or len(sizes) != world or len(counts) != world or sum(counts) != b
            or local.size(rows_dim) != sizes[me] or not local.is_contiguous()):
        raise ValueError(f"gather_to_owners: a contiguous stack {tuple(local.shape)} with rows along dim {rows_dim} "
                         f"does not match counts {list(counts)} and row sizes {list(sizes)} on rank {me}")
    k = counts[me]
    recv_splits = [k * s * width for s in sizes]
    recv, work = tp_comm.all_to_all_async(local.reshape(-1), [c * sizes[me] * width for c in counts], recv_splits,
                                          group)

    def finish() -> Tensor:
        pieces = [p.view(_matrices(k, s, width, rows_dim)) for p, s in zip(recv.split(recv_splits), sizes)]
        return torch.cat(pieces, dim=rows_dim)

    return InFlight(work, finish, local)


def scatter_from_owners(owned: Tensor, counts: Sequence[int], sizes: Sequence[int], rows_dim: int,
                        group: ProcessGroup | None) -> InFlight:
    """The inverse of :func:`gather_to_owners`: owned ``(k, m, n)`` or ``(k, n, m)`` (any strides) -> this rank's
    rows ``(b, sizes[rank], n)`` or ``(b, n, sizes[rank])`` of all ``b = sum(counts)`` matrices, contiguous."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    k = owned.size(0)
    width = owned.size(3 - rows_dim)
    if counts[me] != k or owned.size(rows_dim) != sum(sizes) or len(sizes) != world:
        raise ValueError(f"scatter_from_owners: owned stack {tuple(owned.shape)} does not match counts "
                         f"{list(counts)} and row sizes {list(sizes)} on rank {me}")
    send = owned.new_empty(k * sum(sizes) * width)  # grouped by destination: each rank's rows of the k matrices
    offset = 0
    for blk, s in zip(owned.split(list(sizes), dim=rows_dim), sizes):
        send[offset:offset + k * s * width].view(blk.shape).copy_(blk)
        offset += k * s * width
    rows = sizes[me]
    recv, work = tp_comm.all_to_all_async(send, [k * s * width for s in sizes], [c * rows * width for c in counts],
                                          group)
    return InFlight(work, lambda: recv.view(_matrices(sum(counts), rows, width, rows_dim)), send)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy | None = None,
               reshard_after_forward: bool = True) -> nn.Module:
    """``fully_shard`` every module held in an ``nn.ModuleList`` (transformer blocks), then the root, as
    torchtitan does. Parameters become DTensors with ``Shard(0)`` on ``mesh``. mp_policy: FSDP2's mixed
    precision (e.g. bf16 parameters in forward/backward, fp32 gradient reduction); None keeps fp32. Returns
    ``model``."""
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy or MixedPrecisionPolicy())
    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for block in module:
                fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model
