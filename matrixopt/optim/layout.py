"""How a parameter tensor is seen as matrices, and batched orthogonalization of many parameters at once.

- 2-D ``(out, in)``: one matrix.
- More dims, e.g. a conv kernel ``(out, in, kh, kw)``: flattened to ``(out, in*kh*kw)``.
- Stacked experts ``(E, out, in)`` marked with :func:`mark_experts`: E matrices of ``(out, in)``.
- Fused weights marked with :func:`mark_split` (e.g. QKV ``(3d, d)`` split ``(d, d, d)`` along dim 0): each
  piece is its own matrix.

Pieces of the same shape, from any parameters, are stacked and orthogonalized in one batched call.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

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


def apply_orthogonalized(params: list[Tensor], updates: list[Tensor], fn: Callable[[Tensor], Tensor],
                         scale: Callable[[int, int], float], alpha: float | Tensor) -> None:
    """``param += alpha * scale(m, n) * fn(piece)`` for every ``(m, n)`` matrix piece of every update, batching
    pieces of equal shape.

    params/updates: parallel lists, ``updates[i]`` shaped like ``params[i]``. ``fn`` maps a stack ``(b, s, l)`` of
    pieces laid out short side first (``s = min(m, n)``; tall pieces enter as transposed views, so a tall and a
    wide matrix with the same short side share one batch) to its orthogonalization, same shape, any float dtype.
    ``alpha``: a float, or a 0-d tensor (a tensor learning rate; no host sync).

    Cost: one ``cat`` and one ``fn`` call per shape; one fused scale/cast/transpose per shape and orientation into
    the parameter's layout; a single ``_foreach_add_`` over every piece (its fast path)."""
    buckets: dict[tuple, list[tuple[Tensor, Tensor, bool]]] = defaultdict(list)
    for p, u in zip(params, updates):
        for src, dst in zip(matrix_pieces(p, u), matrix_pieces(p, p)):
            m, n = src.shape[-2:]
            buckets[(min(m, n), max(m, n), src.dtype, dst.dtype, src.device)].append((src, dst, m > n))
    dsts, results = [], []
    for (s, l_, _, dtype, _), items in buckets.items():
        items.sort(key=lambda it: it[2])  # wide pieces first, then tall ones
        stack = [(src.mT if tall else src).reshape(-1, s, l_) for src, _, tall in items]
        Y = fn(stack[0] if len(stack) == 1 else torch.cat(stack, dim=0))  # (b, s, l)
        start = 0
        for tall in (False, True):
            part = [(x.shape[0], dst) for x, (_, dst, t) in zip(stack, items) if t == tall]
            count = sum(c for c, _ in part)
            if count == 0:
                continue
            Yp = Y[start:start + count]
            start += count
            factor = scale(l_, s) if tall else scale(s, l_)
            if isinstance(alpha, Tensor):
                factor = alpha * factor
            out = torch.empty((count, l_, s) if tall else (count, s, l_), dtype=dtype, device=Y.device)
            torch.mul(Yp.mT if tall else Yp, factor, out=out)  # scale, cast and lay out like the parameter
            for y, (_, dst) in zip(out.split([c for c, _ in part]), part):
                dsts.append(dst)
                results.append(y.view(dst.shape))
    torch._foreach_add_(dsts, results, alpha=1.0 if isinstance(alpha, Tensor) else alpha)
