"""How a parameter tensor is seen as matrices, and batched orthogonalization of many parameters at once.

- 2-D ``(out, in)``: one matrix.
- More dims, e.g. a conv kernel ``(out, in, kh, kw)``: flattened to ``(out, in*kh*kw)``.
- Stacked experts ``(E, out, in)`` marked with :func:`mark_experts`: E matrices of ``(out, in)``.
- Fused weights marked with :func:`mark_split` (e.g. QKV ``(3d, d)`` split ``(d, d, d)`` along dim 0): each
  piece is its own matrix.

Pieces of the same shape, from any parameters and in either orientation, are stacked and orthogonalized in one
batched call. How work is packed: :func:`capped_runs` cuts batches to a bounded workspace, :func:`lpt` packs
costs into bins (ranks that own parameters, steps that refresh preconditioners).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import Tensor

from matrixopt.kernels.muon_elementwise import apply_update, matrix_count, momentum_pack

T = TypeVar("T")

_EXPERTS = "_matrixopt_experts"
_SPLIT = "_matrixopt_split"


def mark_experts(param: Tensor) -> Tensor:
    """Mark a ``(E, out, in)`` parameter as E stacked expert matrices, orthogonalized one by one (as a batch)."""
    if param.ndim != 3:
        raise ValueError(f"mark_experts needs a 3-D (E, out, in) parameter, got shape {tuple(param.shape)}")
    setattr(param, _EXPERTS, True)
    return param


def mark_split(param: Tensor, sizes: int | Sequence[int], dim: int = 0) -> Tensor:
    """Mark a fused weight to be orthogonalized as separate matrices along ``dim`` of its matrix view.

    sizes: the piece sizes (summing to the matrix's size along ``dim``) or an int number of equal pieces, e.g.
    3 for Q, K, V or 3 * n_head for per-head pieces of a ``(3d, d)`` QKV weight. ``dim`` is 0 (rows, the
    output features of nn.Linear) or 1 (columns)."""
    if dim not in (0, 1):
        raise ValueError(f"mark_split dim must be 0 or 1 (of the matrix view), got {dim}")
    mdims = matrix_shape(param)
    total = mdims[dim]
    if isinstance(sizes, int):
        if sizes < 1 or total % sizes:
            raise ValueError(f"can't split size {total} of {tuple(param.shape)} into {sizes} equal pieces")
        sizes = [total // sizes] * sizes
    sizes = [int(s) for s in sizes]
    if sum(sizes) != total or any(s < 1 for s in sizes):
        raise ValueError(f"split sizes {sizes} must be positive and sum to {total} (dim {dim} of the matrix "
                         f"view {mdims} of a parameter with shape {tuple(param.shape)})")
    setattr(param, _SPLIT, (dim, tuple(sizes)))
    return param


def copy_marks(src: Tensor, dst: Tensor) -> Tensor:
    """Give ``dst`` (a copy of ``src``: an fp32 master, a stand-in of its shape) ``src``'s matrix layout marks
    (:func:`mark_experts`, :func:`mark_split`); returns ``dst``."""
    for mark in (_EXPERTS, _SPLIT):
        if hasattr(src, mark):
            setattr(dst, mark, getattr(src, mark))
    return dst


def matrix_shape(param: Tensor) -> tuple[int, int]:
    """The (rows, cols) of one matrix of ``param`` (per expert for stacked experts)."""
    if param.ndim < 2:
        raise ValueError(f"a matrix parameter needs at least 2 dims, got shape {tuple(param.shape)}")
    if getattr(param, _EXPERTS, False):
        return param.shape[1], param.shape[2]
    return param.shape[0], param.numel() // param.shape[0]


def matrix_pieces(param: Tensor, t: Tensor) -> list[Tensor]:
    """Views of ``t`` (same shape as ``param``) as the matrices ``param`` is made of: each ``(m, n)`` or a batch
    ``(E, m, n)``. The views alias ``t``, so writing into them writes into ``t``."""
    experts = getattr(param, _EXPERTS, False)
    M = t if experts else t.reshape(t.shape[0], -1)  # (E, out, in) or (out, in)
    split = getattr(param, _SPLIT, None)
    if split is None:
        return [M]
    dim, sizes = split
    return list(M.split(sizes, dim=dim + (1 if experts else 0)))


@dataclass
class Bucket:
    """The ``(s, l)`` matrices of one Newton–Schulz batch: views of parameters, gradients and momentum, each a
    matrix ``(s, l)`` or ``(l, s)`` or a stack ``(E, s, l)`` or ``(E, l, s)`` of E of them (stacked experts: one
    view for all E), in stack order: each view fills its 1 or E slots of the batch's stack after the views before
    it, :attr:`count` slots in all."""

    s: int
    l: int
    device: torch.device
    key: tuple = ()
    """The batch's key (:func:`bucket_keys`): the same for a subset of its pieces bucketed apart."""
    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    bufs: list[Tensor] = field(default_factory=list)
    extra: list[Tensor] = field(default_factory=list)
    """Views of further per-matrix state, one per view of ``params``, where the optimizer keeps some (NorMuon's
    per-row and AdaMuon's per-element second moments): each laid out as its matrices lie, e.g. ``(m,)`` or
    ``(m, n)``, with E in front for a stack."""

    @property
    def count(self) -> int:
        """The matrices of the batch (its stack's length)."""
        return sum(matrix_count(p) for p in self.params)

    def tall(self, i: int) -> bool:
        """Whether the matrices of view i lie transposed in the stack (their rows are the stack's columns)."""
        return bool(self.params[i].shape[-2] > self.params[i].shape[-1])  # a plain bool also under torch.compile


def bucket_key(param: Tensor, grad: Tensor, piece: Tensor) -> tuple:
    """The Newton–Schulz batch a matrix piece of ``param`` (``(m, n)`` or ``(E, m, n)``) joins:
    ``(min(m, n), max(m, n))``, the gradient's and the parameter's dtype, the device."""
    m, n = piece.shape[-2:]
    return min(m, n), max(m, n), grad.dtype, param.dtype, param.device


BUCKET_NUMEL = 1 << 27
"""The most values one Newton–Schulz batch holds. Pieces with one :func:`bucket_key` beyond that are split, in
parameter order, into batches of up to this many (a larger piece alone): 128M values keep every batch large
enough to fill a GPU while bounding the step's workspace (the bf16 stack and its Gram matrices) and the state an
offloaded or compact step (:mod:`matrixopt.optim.offload`) holds on the device at once."""


def capped_runs(items: Sequence[T], numel: int, cap: int | None = None) -> list[Sequence[T]]:
    """``items``, each standing for ``numel`` values, in consecutive runs of at most ``cap`` values (default
    :data:`BUCKET_NUMEL`; one item at least): the batches of a stacked computation whose workspace must stay
    bounded, as the preconditioner refreshes of a large model (a 1.3B model's 1024² Shampoo factors stack to
    4.5 GiB at once otherwise)."""
    n = max(1, (BUCKET_NUMEL if cap is None else cap) // max(numel, 1))
    return [items[i:i + n] for i in range(0, len(items), n)]


def bucket_keys(params: list[Tensor], grads: list[Tensor]) -> list[list[tuple]]:
    """Per parameter, per matrix piece in :func:`matrix_pieces` order, the Newton–Schulz batch the piece joins:
    its :func:`bucket_key` plus the batch's index among that key's, filled in order up to :data:`BUCKET_NUMEL`
    values."""
    fill: dict[tuple, tuple[int, int]] = {}  # bucket_key -> (index of its open batch, values in it)
    out = []
    for p, g in zip(params, grads):
        keys = []
        for piece in matrix_pieces(p, p):
            base = bucket_key(p, g, piece)
            index, total = fill.get(base, (0, 0))
            if total and total + piece.numel() > BUCKET_NUMEL:
                index, total = index + 1, 0
            fill[base] = (index, total + piece.numel())
            keys.append((*base, index))
        out.append(keys)
    return out


def views_in_place(param: Tensor, t: Tensor) -> bool:
    """Whether :func:`matrix_pieces` of ``t`` (``param``'s shape) alias it: a matrix, stacked experts or a
    contiguous tensor; not, e.g., a channels_last conv kernel, which :func:`momentum_buckets` copies."""
    return t.ndim == 2 or bool(getattr(param, _EXPERTS, False)) or t.is_contiguous()


def momentum_buckets(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor],
                     extras: list[list[Tensor]] | None = None,
                     keys: list[list[tuple]] | None = None) -> tuple[list[Bucket], list[tuple[Tensor, Tensor]]]:
    """Every ``(m, n)`` matrix piece of every parameter, grouped by ``(s, l) = (min(m, n), max(m, n))``, gradient
    dtype, parameter dtype and device, in batches of up to :data:`BUCKET_NUMEL` values (``keys``: each piece's
    batch, :func:`bucket_keys` of these parameters by default); a piece of stacked experts ``(E, m, n)`` joins its
    batch as one view, not E. Also returns ``(tensor, contiguous copy)`` pairs for parameters or momentum buffers
    without an aliasing matrix view (e.g. a channels_last conv kernel): the pieces view the copies, which the
    caller writes back after the step. ``extras``: per parameter, views of further state, one per matrix piece in
    :func:`matrix_pieces` order (a stacked-experts piece carries E in front), which the buckets carry in
    ``extra``."""
    keys = bucket_keys(params, grads) if keys is None else keys
    buckets: dict[tuple, Bucket] = {}
    copies = []
    for j, (p, g, b) in enumerate(zip(params, grads, bufs)):
        targets = []
        for t in (p, b):
            if not views_in_place(p, t):
                copies.append((t, t.contiguous()))
                t = copies[-1][1]
            targets.append(t)
        pieces = matrix_pieces(p, targets[0])
        extra = extras[j] if extras is not None else [None] * len(pieces)
        for pp, gp, bp, xp, key in zip(pieces, matrix_pieces(p, g), matrix_pieces(p, targets[1]), extra, keys[j]):
            if key not in buckets:
                buckets[key] = Bucket(key[0], key[1], p.device, key)
            bucket = buckets[key]
            bucket.params.append(pp)
            bucket.grads.append(gp)
            bucket.bufs.append(bp)
            if xp is not None:
                bucket.extra.append(xp)
    return list(buckets.values()), copies


def row_state(param: Tensor) -> Tensor:
    """Zeros (float32, on ``param``'s device) for one value per row of each matrix ``param`` is made of:
    ``(m,)`` for a matrix (rows of the matrix view), ``(E, m)`` for stacked experts, with a leading dim of the
    pieces for a weight split along its columns (:func:`mark_split` with dim 1). :func:`row_pieces` views it."""
    lead = (param.shape[0],) if getattr(param, _EXPERTS, False) else ()
    split = getattr(param, _SPLIT, None)
    if split is not None and split[0] == 1:
        lead = (len(split[1]), *lead)
    return torch.zeros((*lead, matrix_shape(param)[0]), dtype=torch.float32, device=param.device)


def row_pieces(param: Tensor, t: Tensor) -> list[Tensor]:
    """Views of ``t`` (from :func:`row_state`) per matrix piece, in :func:`matrix_pieces` order: ``(m_i,)``, or
    ``(E, m_i)`` for stacked experts."""
    split = getattr(param, _SPLIT, None)
    if split is None:
        return [t]
    dim, sizes = split
    return list(t.split(sizes, dim=-1)) if dim == 0 else list(t.unbind(0))


def orthogonalized_momentum_step(buckets: list[Bucket], copies: list[tuple[Tensor, Tensor]], *, momentum: float,
                                 nesterov: bool, fn: Callable[[Tensor, Tensor | None], Tensor], dtype: torch.dtype,
                                 scale: Callable[[int, int], float], lr: float | Tensor, weight_decay: float,
                                 decay_mode: str = "decoupled", skip: Tensor | None = None,
                                 grad_scale: Tensor | None = None, sign: bool = False,
                                 adapt: Callable[[Bucket, Tensor, Tensor | None],
                                                 tuple[Tensor, Tensor | None]] | None = None) -> None:
    """Muon's step on every ``(m, n)`` matrix piece of :func:`momentum_buckets`' buckets, one batch per bucket:

        B <- mu B + (1 - mu) G;   U = G + mu (B - G) (Nesterov) or B
        W <- (1 - lr weight_decay) W - lr scale(m, n) adapt(fn(U))

    (the decay in the form ``decay_mode`` names, :mod:`matrixopt.kernels.decay`). ``adapt``: None, or
    ``adapt(bucket, Y, skip) -> (update, row_scale)``, the map of each bucket's orthogonalized stack ``Y (b, s, l)``
    to the update to apply, same shape, and None or a ``(b, l)`` float32 scale per row of each matrix as it lies,
    which the update kernel applies (NorMuon's and AdaMuon's second moments, :mod:`matrixopt.optim.adaptive`); it
    may update the bucket's ``extra`` state views, and must leave them as they were where ``skip`` is nonzero.

    The buckets' momentum views (float32) and parameter views are updated in place, and ``copies`` written back.
    ``fn`` maps a stack ``(b, s, l)`` of updates laid out short side first (tall pieces transposed), in ``dtype``,
    to its orthogonalization, same shape, any float dtype; its second argument is the stack's partial sums of
    squares from the fused momentum pass (``(b, T)`` float64, rows summing to each squared Frobenius norm), or None
    off the fused kernels. ``lr``: a float, or a 0-d tensor on the parameters'
    device (no host sync). ``skip``: a 0-d float32 device flag; where nonzero at run time nothing is written. It
    needs every bucket on the fused kernels (:func:`matrixopt.kernels.muon_elementwise.skips_on_device`) and no
    copies. ``grad_scale``: a 0-d float32 tensor every gradient is multiplied by as it is read (a deferred
    clipping coefficient, :meth:`matrixopt.optim.base.MatrixOptimizer.clip_grad_norm_`). ``sign``: ``fn`` gets the
    sign of U (+1, -1, 0) instead of U (AdaMuon's sign-stabilized form), from the same pass.

    Per ``(s, l)`` bucket, a wide ``(768, 3072)`` and a tall ``(3072, 768)`` weight together: one fused pass
    writes the momentum and packs the updates into the stack, one ``fn`` call, one fused pass applies the scaled
    update and the decay (:mod:`matrixopt.kernels.muon_elementwise`; foreach references off the GPU)."""
    if skip is not None and copies:
        raise ValueError("skip needs every matrix viewed in place (no copies written back)")
    for bk in buckets:
        X = torch.empty((bk.count, bk.s, bk.l), dtype=dtype, device=bk.device)
        parts = momentum_pack(bk.grads, bk.bufs, X, momentum, nesterov, skip=skip, grad_scale=grad_scale,
                              sign=sign)
        orthogonalized_update(bk, X, parts, fn=fn, scale=scale, lr=lr, weight_decay=weight_decay,
                              decay_mode=decay_mode, skip=skip, adapt=adapt)
    for t, c in copies:
        t.copy_(c)


def orthogonalized_update(bk: Bucket, X: Tensor, parts: Tensor | None, *, fn: Callable[[Tensor, Tensor | None], Tensor],
                          scale: Callable[[int, int], float], lr: float | Tensor, weight_decay: float,
                          decay_mode: str = "decoupled", skip: Tensor | None = None,
                          adapt: Callable[[Bucket, Tensor, Tensor | None],
                                          tuple[Tensor, Tensor | None]] | None = None) -> None:
    """The second half of :func:`orthogonalized_momentum_step` for one bucket whose updates are packed in ``X``
    (``parts``: the momentum pass's partial sums of squares, or None): ``fn``, ``adapt`` and the applied update."""
    Y, row_scale = fn(X, parts), None
    if adapt is not None:
        Y, row_scale = adapt(bk, Y, skip)
    apply_update(bk.params, Y, scale, lr, weight_decay, skip=skip, decay_mode=decay_mode, row_scale=row_scale)


def lpt(costs: Sequence[float], world_size: int, loads: Sequence[float] | None = None) -> tuple[list[int], list[float]]:
    """Greedy longest-processing-time packing into ``world_size`` bins (ranks that own parameters, steps that
    refresh them): items in decreasing cost (ties: lower index first) each go to the least-loaded bin (ties: lower
    bin). ``loads``: starting load per bin. Returns (bin per item, final loads)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    load = list(loads) if loads is not None else [0.0] * world_size
    heap = [(load[r], r) for r in range(world_size)]
    heapq.heapify(heap)
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        l, r = heapq.heappop(heap)
        owner[i] = r
        load[r] = l + costs[i]
        heapq.heappush(heap, (load[r], r))
    return owner, load
