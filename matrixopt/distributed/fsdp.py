"""FSDP2 / DTensor ``Shard(0)`` matrices: gather each matrix to one owner rank, orthogonalize there, scatter back.

With ``fully_shard`` every rank holds a slice of rows of every matrix. Orthogonalization needs whole matrices,
but only one rank needs each one. For a batch of ``b`` same-shape matrices (as Muon's batching hands them over)::

    owners, load = lpt(costs, world, load)         # balance.lpt: least-loaded rank per matrix
    owned  = gather_to_owners(local, owners, ...)  # one all-to-all: (b, m_p, n) rows -> (k, m, n) whole matrices
    owned  = orthogonalize(owned)                  # local math on the k matrices this rank owns
    local  = scatter_from_owners(owned, ...)       # one all-to-all back: (k, m, n) -> (b, m_p, n)

Each matrix crosses the network once each way, (P-1)/P of it: in total less than one all-gather plus one
reduce-scatter of the matrix parameters, and no rank ever materializes a matrix it does not own (no
``full_tensor()``). Uneven shards (dim 0 not divisible by the world size, even empty shards) are handled:
``sizes`` lists every rank's rows. :func:`apply_fsdp` shards a model the way the tests and benchmark do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from matrixopt.distributed import tp_comm


def _by_owner(owners: Sequence[int], world: int) -> tuple[list[int], list[int]]:
    """The item order grouped by owner rank (stable), and how many items each rank owns."""
    order = sorted(range(len(owners)), key=lambda i: owners[i])
    return order, [owners.count(r) for r in range(world)]


def gather_to_owners(local: Tensor, owners: Sequence[int], sizes: Sequence[int], group: ProcessGroup | None) -> Tensor:
    """Whole matrices to their owners.

    local: ``(b, sizes[rank], n)``, this rank's rows of b matrices. owners: the owner rank of each matrix.
    sizes: every rank's row count (uneven allowed). Returns ``(k, m, n)``: the ``k`` matrices this rank owns,
    in increasing index order, ``m = sum(sizes)``."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    b, rows, n = local.shape
    assert len(owners) == b and len(sizes) == world and sizes[me] == rows, (owners, sizes, tuple(local.shape))
    order, counts = _by_owner(owners, world)
    # (b * rows * n,), grouped by destination; a cat of views, where local[order] would copy the index list to the
    # GPU with a host sync
    send = torch.cat([local[i].reshape(-1) for i in order]) if b else local.reshape(-1)
    recv = tp_comm.all_to_all(send, [c * rows * n for c in counts], [counts[me] * s * n for s in sizes], group)
    pieces = recv.split([counts[me] * s * n for s in sizes])
    return torch.cat([p.view(counts[me], s, n) for p, s in zip(pieces, sizes)], dim=1)  # (k, m, n)


def scatter_from_owners(owned: Tensor, owners: Sequence[int], sizes: Sequence[int],
                        group: ProcessGroup | None) -> Tensor:
    """The inverse of :func:`gather_to_owners`: owned ``(k, m, n)`` -> this rank's rows ``(b, sizes[rank], n)``
    of all ``b = len(owners)`` matrices."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    k, _, n = owned.shape
    order, counts = _by_owner(owners, world)
    assert counts[me] == k, (counts, tuple(owned.shape))
    send = owned.new_empty(k * sum(sizes) * n)  # grouped by destination: each rank's rows of the k matrices
    offset = 0
    for blk, s in zip(owned.split(list(sizes), dim=1), sizes):
        send[offset:offset + k * s * n].view(k, s, n).copy_(blk)
        offset += k * s * n
    rows = sizes[me]
    recv = tp_comm.all_to_all(send, [k * s * n for s in sizes], [c * rows * n for c in counts], group)
    recv = recv.view(len(owners), rows, n)  # in owner order
    if not owners:
        return recv
    position = {i: j for j, i in enumerate(order)}
    return torch.stack([recv[position[i]] for i in range(len(owners))])  # back to item order, no index tensor


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
