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
                         scale: Callable[[int, int], float], lr: float | Tensor, weight_decay: float) -> None:
    """``param = (1 - lr * weight_decay) * param - lr * scale(m, n) * fn(piece)`` for every ``(m, n)`` matrix piece
    of every update, batching pieces of equal shape.

    params/updates: parallel lists, ``updates[i]`` shaped like ``params[i]``. ``fn`` maps a stack ``(b, s, l)`` of
    pieces seen short side first (``s = min(m, n)``) to its orthogonalization, same shape, any float dtype. Tall
    pieces are stacked as they lie, ``(b, l, s)``, and reach ``fn`` as a transposed view, so no transposed copy is
    made on the way in or out. ``lr``: a float, or a 0-d tensor on the parameters' device (no host sync).

    Per shape: one ``cat``, one ``fn`` call and one fused scale/cast pass into the parameter dtype; then one
    foreach update over every piece: ``lerp`` towards ``-scale * Y / weight_decay`` folds the decay into the same
    pass (``add`` without decay, or with a tensor lr after a separate decay)."""
    decay = isinstance(lr, float | int) and weight_decay != 0
    if weight_decay != 0 and not decay:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    buckets: dict[tuple, list[tuple[Tensor, Tensor]]] = defaultdict(list)
    for p, u in zip(params, updates):
        for src, dst in zip(matrix_pieces(p, u), matrix_pieces(p, p)):
            m, n = src.shape[-2:]
            buckets[(m, n, src.dtype, dst.dtype, src.device)].append((src, dst))
    dsts, results = [], []
    for (m, n, _, dtype, _), pairs in buckets.items():
        stack = [src.reshape(-1, m, n) for src, _ in pairs]
        X = stack[0] if len(stack) == 1 else torch.cat(stack, dim=0)  # (b, m, n)
        Y = fn(X.mT).mT if m > n else fn(X)  # (b, m, n); tall stacks iterate short side first as a view
        if decay:
            factor = -scale(m, n) / weight_decay  # lerp(p, factor * Y, lr * wd) = (1 - lr wd) p - lr s Y
        else:
            factor = -scale(m, n) * lr
        out = torch.empty((X.shape[0], m, n), dtype=dtype, device=Y.device)
        torch.mul(Y, factor, out=out)  # scale and cast, in the parameter's layout
        for y, (_, dst) in zip(out.split([x.shape[0] for x in stack]), pairs):
            dsts.append(dst)
            results.append(y.view(dst.shape))
    if decay:
        torch._foreach_lerp_(dsts, results, lr * weight_decay)
    else:
        torch._foreach_add_(dsts, results)
