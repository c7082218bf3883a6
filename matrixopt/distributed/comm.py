"""Every collective call of :mod:`matrixopt.distributed`, in one place: the layer-wise optimizer's owner reduce
and broadcast, tensor-parallel Newton–Schulz's all-reduces and all-gathers, and the FSDP owner exchange.

Everything else in :mod:`matrixopt.distributed` moves tensors only through these functions, so a schedule (what
is sent when) can be read where it is used (``layerwise.py``, ``tp.py``, ``sharded.py``) and the transport swapped
here. Every function takes local tensors and a process group (None means the default group; ranks are ranks
within the group) and does no math beyond padding and slicing. Uneven shards are first-class: sizes along a
sharded dim may differ by rank (a rank may even hold zero rows, as FSDP2 does for a dim 0 smaller than the world
size).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
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


def rank(group: Group | None) -> int:
    return dist.get_rank(group)


def world_size(group: Group | None) -> int:
    return dist.get_world_size(group)


def group_ranks(group: Group | None) -> tuple[int, ...]:
    """The global ranks of ``group``'s members, in group rank order."""
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def chunk_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``torch.chunk(n, parts)`` padded with zeros to ``parts`` entries: how DTensor ``Shard`` and FSDP2
    split a dim of size n over ``parts`` ranks (``ceil(n / parts)`` each, the remainder last, then empties)."""
    if parts < 1:
        raise ValueError(f"chunk_sizes needs parts >= 1, got {parts}")
    step = -(-n // parts)
    return [max(0, min(step, n - i * step)) for i in range(parts)]


class Done:
    """The handle of a collective over a group of one rank, which has nothing to send: ``wait()`` returns at once."""

    def wait(self) -> bool:
        return True


def averages_in_reduce(group: Group) -> bool:
    """Whether :func:`reduce_to_owner` can average over ``group`` inside the collective (NCCL's ``ncclAvg``: no pass
    of its own over the result); gloo has no average."""
    return world_size(group) > 1 and dist.get_backend(group) == "nccl"


def reduce_to_owner(buffer: Tensor, owner: int, group: Group, *, mean: bool = False) -> dist.Work | Done:
    """Sum ``buffer`` over ranks into ``owner``'s copy (asynchronous); with ``mean``, their average, where
    :func:`averages_in_reduce` allows it. Other ranks' copies are left undefined. On a group of one rank nothing
    is sent."""
    if world_size(group) == 1:
        return Done()
    if mean and not averages_in_reduce(group):
        raise ValueError(f"the {dist.get_backend(group)} backend cannot average in a reduce; sum and divide instead")
    op = dist.ReduceOp.AVG if mean else dist.ReduceOp.SUM
    return dist.reduce(buffer, group_dst=owner, op=op, group=group, async_op=True)


def broadcast_from_owner(buffer: Tensor, owner: int, group: Group) -> dist.Work | Done:
    """Copy ``owner``'s ``buffer`` into every rank's (asynchronous). On a group of one rank nothing is sent."""
    if world_size(group) == 1:
        return Done()
    return dist.broadcast(buffer, group_src=owner, group=group, async_op=True)


def all_reduce_sum(t: Tensor, group: Group | None) -> Tensor:
    """In-place sum over ranks (blocking); returns ``t``."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_reduce_sum_async(t: Tensor, group: Group | None) -> dist.Work:
    """Launch an in-place sum over ranks; ``wait()`` the returned handle before reading ``t``."""
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True)


def all_reduce_max(t: Tensor, group: Group | None) -> Tensor:
    """In-place max over ranks (blocking); returns ``t``."""
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def all_gather_sizes(size: int, group: Group | None, device: torch.device) -> list[int]:
    """Every rank's ``size``, in group rank order."""
    t = torch.zeros(world_size(group), dtype=torch.int64, device=device)
    t[rank(group)] = size
    return all_reduce_sum(t, group).tolist()


def all_gather_last_dim(local: Tensor, sizes: Sequence[int], group: Group | None) -> Tensor:
    """Concatenate every rank's ``local`` along the last dim.

    local: ``(..., sizes[rank])``. Returns ``(..., sum(sizes))``. Pads to ``max(sizes)`` so every backend
    (gloo included) sees equal-sized buffers, then trims."""
    width = max(sizes)
    pad = local.new_zeros(*local.shape[:-1], width)
    pad[..., : local.size(-1)] = local
    bufs = [torch.empty_like(pad) for _ in sizes]
    dist.all_gather(bufs, pad, group=group)
    return torch.cat([b[..., :s] for b, s in zip(bufs, sizes)], dim=-1)


def all_gather_object(obj: Any, group: Group | None) -> list[Any]:
    """Every rank's picklable ``obj``, indexed by rank (blocking)."""
    out: list[Any] = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_to_all_async(send: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                     group: Group | None) -> tuple[Tensor, dist.Work]:
    """Launch a personalized exchange of flat buffers: rank r's ``send`` is cut into ``send_splits`` (elements per
    destination rank); the returned buffer receives the concatenation of what every rank sent here,
    ``sum(recv_splits)`` elements, once the returned handle is ``wait()``-ed (on CUDA the current stream waits,
    not the host). Keep ``send`` alive until then."""
    recv = send.new_empty(sum(recv_splits))
    work = dist.all_to_all_single(recv, send, output_split_sizes=list(recv_splits),
                                  input_split_sizes=list(send_splits), group=group, async_op=True)
    return recv, work


# ----------------------------------------------------------------------------------------------------------
# the FSDP owner exchange
#
# With ``fully_shard`` (DTensor ``Shard(0)``) every rank holds a slice of rows of every matrix. Orthogonalization
# needs whole matrices, but only one rank needs each one. For a stack of ``b`` same-shape matrices, ordered so
# that each owner's matrices are consecutive (owners ascending)::
#
#     owned = gather_to_owners(local, counts, sizes, rows_dim, group).wait()    # (b, rows, n) -> (k, m, n)
#     owned = orthogonalize(owned)                                              # the k matrices this rank owns
#     local = scatter_from_owners(owned, counts, sizes, rows_dim, group).wait() # (k, m, n) -> (b, rows, n)
#
# Each matrix crosses the network once each way, (P-1)/P of it: in total less than one all-gather plus one
# reduce-scatter of the matrix parameters, and no rank ever materializes a matrix it does not own (no
# ``full_tensor()``). ``sizes`` lists every rank's rows (uneven and empty shards allowed).
#
# A stack may hold its matrices transposed (``rows_dim=2``: ``(b, n, rows)``), as Muon packs tall matrices short
# side first; the exchange then moves them as they lie and the owner gets ``(k, n, m)``, with no transposing copy
# on either side. Both calls are asynchronous: ``wait()`` makes the current stream wait (not the host), so
# exchanges of several stacks overlap the orthogonalization of others.


class InFlight:
    """An exchange launched on the network: :meth:`wait` returns its result (on CUDA the current stream waits for
    it, not the host). The send buffers live as long as the handle."""

    def __init__(self, works: Sequence[dist.Work], finish: Callable[[], Any], keep: Any) -> None:
        self._works, self._finish, self._keep = works, finish, keep  # keep: the send buffers

    def wait(self) -> Any:
        for work in self._works:
            work.wait()
        self._works = ()
        return self._finish()


def _matrices(k: int, rows: int, width: int, rows_dim: int) -> tuple[int, int, int]:
    return (k, rows, width) if rows_dim == 1 else (k, width, rows)


def gather_to_owners(local: Tensor, counts: Sequence[int], sizes: Sequence[int], rows_dim: int,
                     group: Group | None) -> InFlight:
    """Whole matrices to their owners.

    local: contiguous ``(b, sizes[rank], n)`` (``rows_dim=1``) or ``(b, n, sizes[rank])`` (``rows_dim=2``), this
    rank's rows of b matrices, the first ``counts[0]`` owned by rank 0, the next ``counts[1]`` by rank 1, ...
    sizes: every rank's row count (uneven allowed). Result: ``(k, m, n)`` or ``(k, n, m)``, the ``k = counts[rank]``
    matrices this rank owns in stack order, ``m = sum(sizes)``."""
    world, me = world_size(group), rank(group)
    b = local.size(0)
    width = local.size(3 - rows_dim)
    if (rows_dim not in (1, 2) or len(sizes) != world or len(counts) != world or sum(counts) != b
            or local.size(rows_dim) != sizes[me] or not local.is_contiguous()):
        raise ValueError(f"gather_to_owners: a contiguous stack {tuple(local.shape)} with rows along dim {rows_dim} "
                         f"does not match counts {list(counts)} and row sizes {list(sizes)} on rank {me}")
    k = counts[me]
    recv_splits = [k * s * width for s in sizes]
    recv, work = all_to_all_async(local.reshape(-1), [c * sizes[me] * width for c in counts], recv_splits, group)

    def finish() -> Tensor:
        pieces = [p.view(_matrices(k, s, width, rows_dim)) for p, s in zip(recv.split(recv_splits), sizes)]
        return torch.cat(pieces, dim=rows_dim)

    return InFlight([work], finish, local)


def scatter_from_owners(owned: Tensor, counts: Sequence[int], sizes: Sequence[int], rows_dim: int,
                        group: Group | None) -> InFlight:
    """The inverse of :func:`gather_to_owners`: owned ``(k, m, n)`` or ``(k, n, m)`` (any strides) -> this rank's
    rows ``(b, sizes[rank], n)`` or ``(b, n, sizes[rank])`` of all ``b = sum(counts)`` matrices, contiguous."""
    world, me = world_size(group), rank(group)
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
    recv, work = all_to_all_async(send, [k * s * width for s in sizes], [c * rows * width for c in counts], group)
    return InFlight([work], lambda: recv.view(_matrices(sum(counts), rows, width, rows_dim)), send)


# ----------------------------------------------------------------------------------------------------------
# whole matrices of any shapes to owners and back
#
# Sharded Shampoo and SOAP precondition each matrix whole on one owner rank. The rows of b matrices of any shapes,
# each split over the ranks as ``fully_shard`` splits dim 0 (``sizes[i]``: every rank's rows of matrix i, uneven
# and empty allowed), go to their owners in one grouped set of point-to-point transfers, and the owners' results
# come back in another:
#
#     whole = gather_rows(rows, owners, sizes, group).wait()           # [(sizes[i][rank], n_i)] -> [(m_i, n_i)] owned
#     rows = scatter_rows(whole, owners, sizes, widths, group).wait()  # the inverse
#
# One transfer per (matrix, rank) pair with rows, each straight between a rank's rows and their row range in the
# owner's matrix, listed in matrix order on every rank. An all-to-all would need each rank's rows packed into one
# send buffer and the owner's received buffer unpacked into matrices: two more copies of the gradients each way.
#
# Both calls are asynchronous: a step computes while an exchange is in flight (SOAP's owners refresh their bases
# while the updates go back). Every rank makes the same calls in the same order, each on the same matrices: a
# call's transfers run as one group, and the sends and receives between two ranks match in the order they are
# listed.


def _exchange(ops: list[tuple[Callable[..., Any], Tensor, int]], group: Group | None) -> list[dist.Work]:
    """Launch point-to-point ``(dist.isend or dist.irecv, tensor, group rank)`` operations as one group; returns
    their handles. The ranks list their operations in one agreed order, so each pair's sends and receives match in
    order."""
    if not ops:
        return []
    ranks = group_ranks(group)
    return dist.batch_isend_irecv([dist.P2POp(op, t, ranks[peer], group) for op, t, peer in ops])


def gather_rows(rows: Sequence[Tensor], owners: Sequence[int], sizes: Sequence[Sequence[int]],
                group: Group | None, dtype: torch.dtype | None = None) -> InFlight:
    """Whole matrices to their owners.

    rows[i]: this rank's rows of matrix i, ``(sizes[i][rank], n_i)``, all of one dtype and device. owners[i]: the
    group rank that owns matrix i. ``wait()`` returns the matrices this rank owns, in matrix order, each
    ``(sum(sizes[i]), n_i)``, contiguous, in ``dtype`` (default: the rows'). Every rank's rows travel by one
    grouped set of point-to-point transfers straight into their place in the owner's matrix (a row range of a
    row-major matrix is contiguous): nothing is packed or unpacked; the rows sent are converted to ``dtype``
    first (a bfloat16 exchange moves half the bytes of float32), the owner copies its own rows in."""
    world, me = world_size(group), rank(group)
    if (len(owners) != len(rows) or len(sizes) != len(rows) or any(len(s) != world for s in sizes)
            or any(r.ndim != 2 or r.size(0) != s[me] for r, s in zip(rows, sizes))):
        raise ValueError(f"gather_rows: row blocks {[tuple(r.shape) for r in rows]} do not match owners "
                         f"{list(owners)} and row sizes {[list(s) for s in sizes]} on rank {me}")
    out, ops = [], []
    for i, (r, o) in enumerate(zip(rows, owners)):
        if o != me:
            if r.numel():
                ops.append((dist.isend, r.to(dtype or r.dtype).contiguous(), o))
            continue
        whole = r.new_empty((sum(sizes[i]), r.size(1)), dtype=dtype or r.dtype)
        for s, part in enumerate(whole.split(list(sizes[i]))):
            if s == me:
                part.copy_(r)
            elif part.numel():
                ops.append((dist.irecv, part, s))
        out.append(whole)
    return InFlight(_exchange(ops, group), lambda: out, ops)


def scatter_rows(whole: Sequence[Tensor], owners: Sequence[int], sizes: Sequence[Sequence[int]],
                 widths: Sequence[int], group: Group | None, dtype: torch.dtype = torch.float32) -> InFlight:
    """The inverse of :func:`gather_rows`: whole ``(sum(sizes[i]), n_i)`` in ``dtype`` for the matrices this rank
    owns, in matrix order -> (``wait()``) this rank's rows ``(sizes[i][rank], n_i)`` of every matrix i,
    ``n_i = widths[i]``: for the matrices owned here, views of ``whole``; the others received, each into a
    buffer of its own."""
    me = rank(group)
    mine = [i for i, o in enumerate(owners) if o == me]
    if (len(whole) != len(mine) or len(sizes) != len(owners) or len(widths) != len(owners)
            or any(w.shape != (sum(sizes[i]), widths[i]) or w.dtype != dtype for w, i in zip(whole, mine))):
        raise ValueError(f"scatter_rows: owned matrices {[(tuple(w.shape), w.dtype) for w in whole]} do not match "
                         f"owners {list(owners)}, row sizes {[list(s) for s in sizes]}, widths {list(widths)} and "
                         f"dtype {dtype} on rank {me}")
    owned = dict(zip(mine, whole))
    out: list[Tensor] = []
    ops = []
    device = whole[0].device if whole else object_device(group)
    for i, o in enumerate(owners):
        if o == me:
            parts = owned[i].split(list(sizes[i]))
            out.append(parts[me])
            ops += [(dist.isend, part, s) for s, part in enumerate(parts) if s != me and part.numel()]
        else:
            out.append(torch.empty((sizes[i][me], widths[i]), dtype=dtype, device=device))
            if out[-1].numel():
                ops.append((dist.irecv, out[-1], o))
    return InFlight(_exchange(ops, group), lambda: out, ops)


# ----------------------------------------------------------------------------------------------------------
# process lifetime


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
