"""The collectives that tensor-parallel Newton–Schulz and the FSDP owner gather use, and nothing else.

Every function takes local tensors and a process group (None means the default group); none does math beyond
padding and slicing. Uneven shards are first-class: sizes along the sharded dim may differ by rank (a rank may
even hold zero rows, as FSDP2 does for a dim 0 smaller than the world size).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


def chunk_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``torch.chunk(n, parts)`` padded with zeros to ``parts`` entries: how DTensor ``Shard`` and FSDP2
    split a dim of size n over ``parts`` ranks (``ceil(n / parts)`` each, the remainder last, then empties)."""
    if parts < 1:
        raise ValueError(f"chunk_sizes needs parts >= 1, got {parts}")
    step = -(-n // parts)
    return [max(0, min(step, n - i * step)) for i in range(parts)]


def all_reduce_sum(t: Tensor, group: ProcessGroup | None) -> Tensor:
    """In-place sum over the group; returns ``t``."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_reduce_sum_async(t: Tensor, group: ProcessGroup | None) -> dist.Work:
    """Launch an in-place sum over the group; ``wait()`` the returned handle before reading ``t``."""
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True)


def all_reduce_max(t: Tensor, group: ProcessGroup | None) -> Tensor:
    """In-place max over the group; returns ``t``."""
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def all_gather_sizes(size: int, group: ProcessGroup | None, device: torch.device) -> list[int]:
    """Every rank's ``size``, in group rank order."""
    t = torch.zeros(dist.get_world_size(group), dtype=torch.int64, device=device)
    t[dist.get_rank(group)] = size
    return all_reduce_sum(t, group).tolist()


def all_gather_last_dim(local: Tensor, sizes: Sequence[int], group: ProcessGroup | None) -> Tensor:
    """Concatenate every rank's ``local`` along the last dim.

    local: ``(..., sizes[rank])``. Returns ``(..., sum(sizes))``. Pads to ``max(sizes)`` so every backend
    (gloo included) sees equal-sized buffers, then trims."""
    width = max(sizes)
    pad = local.new_zeros(*local.shape[:-1], width)
    pad[..., : local.size(-1)] = local
    bufs = [torch.empty_like(pad) for _ in sizes]
    dist.all_gather(bufs, pad, group=group)
    return torch.cat([b[..., :s] for b, s in zip(bufs, sizes)], dim=-1)


def all_to_all_async(send: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                     group: ProcessGroup | None) -> tuple[Tensor, dist.Work]:
    """Launch a personalized exchange of flat buffers: rank r's ``send`` is cut into ``send_splits`` (elements per
    destination rank); the returned buffer receives the concatenation of what every rank sent here,
    ``sum(recv_splits)`` elements, once the returned handle is ``wait()``-ed (on CUDA the current stream waits,
    not the host). Keep ``send`` alive until then."""
    recv = send.new_empty(sum(recv_splits))
    work = dist.all_to_all_single(recv, send, output_split_sizes=list(recv_splits),
                                  input_split_sizes=list(send_splits), group=group, async_op=True)
    return recv, work
