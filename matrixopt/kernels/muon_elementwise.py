r"""Muon's elementwise passes around Newton–Schulz: the dispatch between the fused Triton kernels
(:mod:`matrixopt.kernels.muon_fused`, which holds the blocked algorithms) and the torch references here.

- :func:`momentum_pack`: ``B <- B + (1 - mu)(G - B)``; the update ``G + mu (B - G)`` (Nesterov) or ``B`` packed into
  a ``(k, s, l)`` stack short side first (tall matrices transposed); the fused kernel also sums the squares of
  what it packs, so that the normalization reads the stack once.
- :func:`frobenius_normalize`: each stacked matrix divided by its Frobenius norm, summed in float64.
- :func:`apply_update`: ``W <- (1 - lr wd) W - lr s(m, n) Y`` from the Newton–Schulz output, transposed back for
  tall matrices.
- :func:`second_moment_normalize`: AdaMuon's element-wise second moment, and the stack divided by its root.
- :func:`row_sums_of_squares`: the sum of squares of each row of each stacked matrix as it lies (NorMuon's).
- :func:`nonfinite_flags`: which gradients hold a NaN or an Inf (the optimizers' check before a step).
- :func:`fused_for`: the kernels' module for other fused passes over lists of tensors (Adam's one pass, which SOAP
  runs in its eigenbasis and Shampoo for its graft, the Kronecker factors' update, and Shampoo's graft-and-select).

Each pass takes its matrices as a list of tensors, each one ``(m, n)`` matrix or a stack ``(E, m, n)`` of E
matrices of one shape (stacked experts, :func:`matrixopt.optim.layout.mark_experts`), k matrices in all, in stack
order: the host's work grows with the tensors, not with the matrices in them.

Dispatch: these run the Triton kernels for CUDA tensors they can take (see :func:`fusable`) outside
``torch.compile``, and the torch references otherwise (the CPU, no Triton). :func:`elementwise_backend` forces one
for a block of code (benchmarks; tests, where ``"triton"`` on CPU tensors runs Triton's interpreter under
``TRITON_INTERPRET=1``). The module imports without Triton; the kernels are imported on first use.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from types import ModuleType

import torch
from torch import Tensor

from matrixopt.kernels._tuning import BackendSwitch
from matrixopt.kernels.decay import decay_

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the fused kernels read and write


def fused_kernels() -> ModuleType | None:
    """The Triton kernels' module, or None without Triton (imported on first use, like ns_step's kernels)."""
    try:
        from matrixopt.kernels import muon_fused
    except ImportError:
        return None
    return muon_fused


def matrix_count(t: Tensor) -> int:
    """How many matrices ``t`` holds: E for a stack ``(E, m, n)``, 1 for a matrix ``(m, n)``."""
    return t.shape[0] if t.ndim == 3 else 1


def as_stack(t: Tensor) -> Tensor:
    """``t`` as a stack of matrices: ``(E, m, n)`` as it is, a matrix ``(m, n)`` as a ``(1, m, n)`` view."""
    return t if t.ndim == 3 else t.unsqueeze(0)


def fusable(*tensors: Sequence[Tensor]) -> bool:
    """Whether the fused kernels take these lists of ``(m, n)`` matrices and ``(E, m, n)`` stacks: unit column
    stride, a supported dtype (Triton itself is checked by the dispatch)."""
    return all(t.ndim in (2, 3) and t.stride(-1) == 1 and t.dtype in KERNEL_DTYPES for ts in tensors for t in ts)


def _dense_layout(X: Tensor) -> Tensor | None:
    """X, or X.mT, when that is contiguous (each matrix one block of memory), else None."""
    if X.is_contiguous():
        return X
    if X.mT.is_contiguous():
        return X.mT
    return None


# ----------------------------------------------------------------------------------------------- torch references


def frobenius_normalize_reference(X: Tensor, dtype: torch.dtype, parts: Tensor | None = None) -> Tensor:
    """``muon_fused.frobenius_normalize_triton`` in torch: the norm accumulated in float64, any layout."""
    if parts is None:
        norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float64)  # (b, 1, 1)
    else:
        norm = parts.sum(1).sqrt()[:, None, None]
    inv = torch.where(norm > 0, norm.reciprocal(), 0.0).clamp(max=torch.finfo(torch.float32).max).float()
    Y = torch.empty_like(X, dtype=dtype)  # keeps X's layout (a transposed view stays one)
    torch.mul(X, inv, out=Y)
    return Y


def _transposed(m: Tensor, transpose: bool | None) -> bool:
    return m.size(-2) > m.size(-1) if transpose is None else transpose


def _slots(like: Sequence[Tensor], X: Tensor) -> list[Tensor]:
    """The blocks of the stack ``X (k, s, l)`` that the matrices and stacks ``like`` fill, in order: each
    ``(E, s, l)`` (``(1, s, l)`` for a matrix), views of X."""
    return list(X.split([matrix_count(t) for t in like]))


def momentum_pack_reference(grads: Sequence[Tensor], bufs: Sequence[Tensor], out: Tensor, momentum: float,
                            nesterov: bool, transpose: bool | None = None, grad_scale: Tensor | None = None,
                            sign: bool = False) -> None:
    """``muon_fused.momentum_pack_triton`` with foreach ops and one stacking copy (any device, any strides)."""
    g32 = [g if g.dtype == torch.float32 else g.float() for g in grads]
    if grad_scale is not None:
        g32 = torch._foreach_mul(g32, grad_scale.to(g32[0].device))
    torch._foreach_lerp_(list(bufs), g32, 1 - momentum)  # B = mu B + (1 - mu) G
    updates = torch._foreach_lerp(g32, list(bufs), momentum) if nesterov else bufs
    if sign:
        updates = torch._foreach_sign(updates)
    torch.cat([as_stack(u).mT if _transposed(u, transpose) else as_stack(u) for u in updates], out=out)


def apply_update_reference(params: Sequence[Tensor], Y: Tensor, scale: Callable[[int, int], float],
                           lr: float | Tensor, weight_decay: float, transpose: bool | None = None,
                           decay_mode: str = "decoupled", row_scale: Tensor | None = None) -> None:
    """``muon_fused.apply_update_triton`` with foreach ops (any device, any strides)."""
    if isinstance(lr, Tensor):
        lr = lr.to(Y.device)
    ys = [(y.mT if _transposed(p, transpose) else y) for p, y in zip(params, _slots(params, Y))]  # (E, m, n) each
    if row_scale is not None:  # per row of each W_i as it lies
        ys = [y.float() * r[:, :y.shape[1], None] for y, r in zip(ys, _slots(params, row_scale))]
    params = [as_stack(p) for p in params]
    decay_(params, lr, weight_decay, decay_mode, ys)
    # in the parameter's precision
    updates = [y.to(p.dtype) * (-scale(*p.shape[1:]) * lr) for p, y in zip(params, ys)]
    torch._foreach_add_(params, updates)


def second_moment_normalize_reference(O: Tensor, states: Sequence[Tensor], beta2: float, eps: float,
                                      transpose: bool | None = None, skip: Tensor | None = None) -> Tensor:
    """``muon_fused.second_moment_normalize_triton`` with foreach ops (any device, any strides); ``skip`` by a
    select, without a host sync."""
    states = [as_stack(v) for v in states]
    views = [o.mT if _transposed(v, transpose) else o for o, v in zip(_slots(states, O), states)]  # as each V_i lies
    o32 = [o.float() for o in views]
    new = torch._foreach_mul(states, beta2)
    torch._foreach_addcmul_(new, o32, o32, value=1 - beta2)
    if skip is not None:  # a skipped step's O is not even finite: keep the moments as they were
        new = [torch.where(skip != 0, v, n) for v, n in zip(states, new)]
    torch._foreach_copy_(states, new)
    torch._foreach_copy_(views, torch._foreach_div(o32, torch._foreach_add(torch._foreach_sqrt(new), eps)))
    return row_sums_of_squares_reference(O, states, transpose)  # of the values as stored


def row_sums_of_squares_reference(O: Tensor, like: Sequence[Tensor], transpose: bool | None = None) -> Tensor:
    """``muon_fused.row_sums_of_squares_triton`` in torch (any device, any strides)."""
    k, s, l = O.shape
    rows = torch.zeros((k, max(s, l)), dtype=torch.float32, device=O.device)
    for r, o, m in zip(_slots(like, rows), _slots(like, O), like):
        o = o.mT if _transposed(m, transpose) else o  # (E, rows, cols)
        r[:, :o.shape[1]] = torch.linalg.vector_norm(o, dim=-1, dtype=torch.float32).square()
    return rows


# ----------------------------------------------------------------------------------------------- dispatch

BACKENDS = BackendSwitch.CHOICES
_switch = BackendSwitch("elementwise")


def _on_gpu(*tensors: Sequence[Tensor]) -> bool:
    """Whether every tensor of these lists is on the GPU (a tensor in place of a list, a stack, counts as one)."""
    return not torch.compiler.is_compiling() and all(
        ts.is_cuda if isinstance(ts, Tensor) else all(t.is_cuda for t in ts) for ts in tensors)


def _kernels(auto: bool) -> ModuleType | None:
    """The kernels' module if the forced backend, else ``auto`` (whether the kernels suit these tensors on a
    GPU), asks for Triton and Triton is there; None for the torch references."""
    if not (_switch.name == "triton" if _switch.name != "auto" else auto):
        return None
    fused = fused_kernels()
    if fused is None and _switch.name == "triton":
        raise ImportError("elementwise_backend('triton') needs Triton: pip install triton")
    return fused


def skips_on_device(*tensors: Sequence[Tensor]) -> bool:
    """Whether :func:`momentum_pack` and :func:`apply_update` run the fused kernels on these lists of matrices,
    and so honour ``skip`` (a device flag) without a host sync; the torch references do not take it. The dispatch
    looks at the tensors' device and layout (:func:`fusable`) and at the forced backend."""
    return _kernels(_on_gpu(*tensors) and fusable(*tensors)) is not None


def momentum_pack(grads: Sequence[Tensor], bufs: Sequence[Tensor], out: Tensor, momentum: float,
                  nesterov: bool, transpose: bool | None = None, skip: Tensor | None = None,
                  grad_scale: Tensor | None = None, sign: bool = False) -> Tensor | None:
    """Momentum step on every matrix and its update packed short side first (module docstring).

    grads: matrices ``(m_i, n_i)`` or stacks ``(E, m_i, n_i)`` of them, k matrices in all (module docstring), with
    ``{m_i, n_i} = {s, l}``, one float dtype. bufs: their fp32 momentum, same shapes, updated in place.
    out: ``(k, s, l)`` contiguous; ``out[i]`` receives matrix i's update ``G + mu (B - G)`` (Nesterov) or ``B`` in
    out's dtype, transposed when tall (``transpose=None``; then ``s <= l``), or transposed for every matrix
    (``True``) or none (``False``), as a sharded stack that must be laid out alike on every rank needs. skip: a 0-d
    float32 device flag, nonzero to write nothing; only where :func:`skips_on_device` holds (else ValueError).
    grad_scale: a 0-d float32 tensor the gradients are multiplied by first (gradient clipping's coefficient; the
    gradients are not written). sign: pack the update's sign (+1, -1 or 0; AdaMuon's Newton–Schulz input) instead
    of the update.

    Returns, from the fused kernel, ``(k, T)`` float64 partial sums of squares of the packed values (rows summing to
    each ``||out[i]||_F^2``) for :func:`frobenius_normalize`'s ``parts``, which then skips a pass over the stack;
    None from the torch reference."""
    fused = _kernels(_on_gpu(grads, bufs) and fusable(grads, bufs))
    if fused is None:
        _no_skip(skip)
        momentum_pack_reference(grads, bufs, out, momentum, nesterov, transpose, grad_scale, sign)
        return None
    parts = torch.empty((out.shape[0], fused.pack_tiles(*out.shape[1:])), dtype=torch.float64, device=out.device)
    fused.momentum_pack_triton(grads, bufs, out, momentum, nesterov, transpose, skip=skip, parts=parts,
                               grad_scale=grad_scale, sign=sign)
    return parts


def apply_update(params: Sequence[Tensor], Y: Tensor, scale: Callable[[int, int], float], lr: float | Tensor,
                 weight_decay: float, transpose: bool | None = None, skip: Tensor | None = None,
                 decay_mode: str = "decoupled", row_scale: Tensor | None = None) -> None:
    """``W_i <- (1 - lr wd) W_i - lr scale(m_i, n_i) Y[i]`` (``Y[i]^T`` for tall ``W_i``, or for every ``W_i`` as
    ``transpose`` says, as in :func:`momentum_pack`), in place; the decay in the form ``decay_mode`` names
    (:mod:`matrixopt.kernels.decay`; ``"cautious"`` masks it by the sign of ``Y[i] * W_i``). ``row_scale``:
    ``(k, l)`` float32, or None: row r of ``W_i`` (as it lies) takes its update times ``row_scale[i, r]``.

    params: matrices ``(m_i, n_i)`` or stacks ``(E, m_i, n_i)`` of them, k matrices in all, with
    ``{m_i, n_i} = {s, l}``, one float dtype. Y: ``(k, s, l)``, any float
    dtype and strides. lr: a float, or a 0-d tensor (no host sync on the GPU). skip: as in :func:`momentum_pack`."""
    fused = _kernels(_on_gpu(params) and fusable(params))
    if fused:
        fused.apply_update_triton(params, Y, scale, lr, weight_decay, transpose, skip=skip, decay_mode=decay_mode,
                                  row_scale=row_scale)
    else:
        _no_skip(skip)
        apply_update_reference(params, Y, scale, lr, weight_decay, transpose, decay_mode, row_scale)


def second_moment_normalize(O: Tensor, states: Sequence[Tensor], beta2: float, eps: float,
                            transpose: bool | None = None, skip: Tensor | None = None) -> Tensor:
    """An element-wise second moment of a stack of updates, and the updates divided by its square root, in place
    (AdaMuon's, :class:`matrixopt.AdaMuon`)::

        V_i <- beta2 V_i + (1 - beta2) O_i * O_i;    O_i <- O_i / (sqrt(V_i) + eps)

    O: ``(k, s, l)`` stack, any float dtype and strides. states: float32 matrices ``V_i`` or stacks of them, k
    matrices in all, each ``O[i]`` as it lies or transposed: transposed when tall (``transpose=None``; then
    ``s <= l``), or as ``transpose`` says for every matrix, as in :func:`momentum_pack`. skip: a 0-d float32 device
    flag, nonzero to leave the moments as they were. Returns ``(k, max(s, l))`` float32: per row of the normalized
    ``O_i`` as ``V_i`` lies, its sum of squares (of the values as stored), zero past ``V_i``'s rows. The fused kernel
    reads and writes each element once (12 bytes per bf16 element)."""
    fused = _kernels(_on_gpu(states, [O]) and fusable(states) and O.dtype in KERNEL_DTYPES)
    if fused is None:
        return second_moment_normalize_reference(O, states, beta2, eps, transpose, skip)
    return fused.second_moment_normalize_triton(O, states, beta2, eps, transpose, skip=skip)


def row_sums_of_squares(O: Tensor, like: Sequence[Tensor], transpose: bool | None = None) -> Tensor:
    """``(k, max(s, l))`` float32: per row of each ``O[i]`` as matrix ``like[i]`` lies (``O[i]`` transposed for a
    tall one, or as ``transpose`` says, as in :func:`momentum_pack`), its sum of squares; zero past its rows.
    O: ``(k, s, l)``, any float dtype and strides; ``like``: matrices or stacks of them, k matrices in all;
    only their shapes are read. The fused
    kernel reads O once, tall and wide matrices alike (NorMuon's per-neuron statistics)."""
    fused = _kernels(_on_gpu([O]) and O.dtype in KERNEL_DTYPES)
    if fused is None:
        return row_sums_of_squares_reference(O, like, transpose)
    return fused.row_sums_of_squares_triton(O, like, transpose)


def _no_skip(skip: Tensor | None) -> None:
    if skip is not None:
        raise ValueError("skip (a device flag) needs the fused kernels: CUDA matrices with unit column stride and "
                         "Triton (check skips_on_device first, and check the flag on the host where it is False)")


def frobenius_normalize(X: Tensor, dtype: torch.dtype, parts: Tensor | None = None) -> Tensor:
    """Each matrix of ``X (b, m, n)`` (any float dtype) divided by its Frobenius norm, returned in ``dtype`` with
    X's layout; a zero matrix stays zero. The norm is accumulated in float64, so inputs of any finite scale
    (1e-30 to 1e30) neither overflow nor underflow. ``parts``: ``(b, T)`` float64 whose rows sum to each matrix's
    squared norm, as :func:`momentum_pack` returns them; the norm is then not computed again."""
    fused = _kernels(_on_gpu([X]) and X.dtype in KERNEL_DTYPES and dtype in KERNEL_DTYPES)
    if fused is None or _dense_layout(X) is None:
        return frobenius_normalize_reference(X, dtype, parts)
    return fused.frobenius_normalize_triton(X, dtype, parts)


def nonfinite_flags_reference(grads: Sequence[Tensor]) -> Tensor:
    """``(n,)`` float32: 1 where ``grads[i]`` holds a NaN or an Inf, else 0, by one foreach max-abs pass."""
    # an empty tensor (an empty FSDP shard) has no max: a zero stands in
    maxabs = torch._foreach_norm([g if g.numel() else g.new_zeros(1) for g in grads], ord=math.inf)
    return (~torch.isfinite(torch.stack(maxabs))).float()


def nonfinite_flags(grads: Sequence[Tensor]) -> Tensor:
    """``(n,)`` float32 on the gradients' device: 1 where ``grads[i]`` holds a NaN or an Inf, else 0, without a host
    sync. grads: tensors of one dtype on one device. The fused kernel takes contiguous fp32/bf16/fp16 CUDA tensors in
    one launch (its host side costs a tenth of the foreach pass's, which allocates a result per tensor)."""
    if not grads:
        return torch.zeros(0)
    takes = all(g.dtype in KERNEL_DTYPES and g.is_contiguous() for g in grads)
    fused = _kernels(_on_gpu(grads)) if takes else None
    if fused is None:
        return nonfinite_flags_reference(grads)
    return fused.nonfinite_flags_triton(grads)


def generator_on(generator: torch.Generator | None, device: torch.device) -> torch.Generator | None:
    """``generator`` where it already lives on ``device``'s kind of device, else a generator there seeded from a draw
    of it (a host generator then drives random bits on a GPU without a sync); None stays None (the default
    generator)."""
    if generator is None or generator.device.type == device.type:
        return generator
    return torch.Generator(device).manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))


def stochastic_round_bf16_reference(x: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """:func:`stochastic_round_bf16` in torch ops: 16 random bits added to the float32 pattern, then truncated."""
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device,
                          generator=generator_on(generator, x.device))
    rounded = (bits + noise).bitwise_and_(-65536)  # 0xFFFF0000 as int32: keep sign, exponent, 7 mantissa bits
    rounded = torch.where(torch.isfinite(x), rounded, bits)  # Inf + noise would turn into NaN
    return rounded.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero


def stochastic_round_bf16(x: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """``x`` (float32, any shape) rounded stochastically to a new bfloat16 tensor: up (in magnitude) with
    probability equal to the dropped 16 bits' fraction of an ulp, so ``E[result] = x``. NaN and Inf stay as they
    are. ``generator``: where the random bits come from (a host generator serves any device without a sync); the
    same generator state gives the same result. On the GPU one fused pass (6 bytes per value; its bits from
    Triton's Philox, keyed by one draw of ``generator``), elsewhere the torch reference (about 50 bytes)."""
    fused = _kernels(_on_gpu([x])) if x.dtype == torch.float32 else None
    if fused is None:
        return stochastic_round_bf16_reference(x, generator)
    source = generator if generator is None or generator.device.type == "cpu" else None
    seed = int(torch.randint(0, 2**62, (1,), generator=source))  # a device generator would cost a host sync
    return fused.stochastic_round_bf16_triton(x.contiguous(), seed)


def _row_matrices(ts: Sequence[Tensor] | Tensor, dtypes: tuple[torch.dtype, ...]) -> bool:
    """Whether ``ts`` are matrices of one of ``dtypes`` with unit column stride: a list of them, or a
    ``(b, m, n)`` stack standing for its b matrices (checked once)."""
    if isinstance(ts, Tensor):
        return ts.dtype in dtypes and ts.ndim == 3 and ts.stride(-1) == 1
    return all(t.dtype in dtypes and t.ndim == 2 and t.stride(1) == 1 for t in ts)


def fused_for(*tensors: Sequence[Tensor] | Tensor) -> ModuleType | None:
    """The fused kernels' module for a pass over these lists of float32 matrices with unit column stride (on the
    GPU, or anywhere under a forced ``"triton"`` backend), else None: the caller runs its torch reference. A
    ``(b, m, n)`` tensor may stand for the list of its b matrices (a stack, checked once). Used by Adam's one-pass
    kernel (:func:`matrixopt.optim.adam.adam_step`, Shampoo's graft), the factors' update and Shampoo's
    graft-and-select."""
    takes = all(_row_matrices(ts, (torch.float32,)) for ts in tensors)
    return _kernels(_on_gpu(*tensors)) if takes else None


def copy_matrices(dsts: Sequence[Tensor] | Tensor, srcs: Sequence[Tensor] | Tensor) -> None:
    """``dsts[i].copy_(srcs[i])`` for every i: lists of matrices, or ``(b, m, n)`` stacks standing for their
    matrices, pairwise shaped alike (Shampoo's and SOAP's blocks of larger tensors, to and from the stacks of a
    batch). Float32 or bfloat16 matrices with unit column stride on the GPU (one dtype per side) take one launch
    (:func:`matrixopt.kernels.muon_fused.copy_matrices_triton`); anything else a foreach copy."""
    takes = all(_row_matrices(ts, (torch.float32, torch.bfloat16))
                and (isinstance(ts, Tensor) or len({t.dtype for t in ts}) <= 1) for ts in (dsts, srcs))
    fused = _kernels(_on_gpu(dsts, srcs)) if takes else None
    if fused is not None:
        fused.copy_matrices_triton(dsts, srcs)
        return
    torch._foreach_copy_(_unstacked(dsts), _unstacked(srcs))


def decay_update(params: Sequence[Tensor], updates: Sequence[Tensor], lr: float | Tensor, weight_decay: float,
                 decay_mode: str, skip: Tensor | None = None) -> None:
    """``W <- decay(W) - lr U`` in place for every pair (:mod:`matrixopt.kernels.decay`), U read, not written: the
    update step of Shampoo and SOAP. ``params``: tensors of any shape and float dtype; ``updates``: float32, shaped
    alike. lr: a float or a 0-d tensor on the parameters' device. skip: a 0-d float32 device flag, nonzero to write
    W as it was (U must then be finite). Contiguous float32 parameters on the GPU take one launch
    (:func:`matrixopt.kernels.muon_fused.decay_update_triton`, the tensors seen as ``(numel / C, C)`` matrices);
    anything else the torch reference, :func:`decay_update_reference`."""
    takes = all(t.dtype == torch.float32 and t.ndim >= 1 and t.is_contiguous() for ts in (params, updates)
                for t in ts)
    fused = _kernels(_on_gpu(params, updates)) if takes else None
    if fused is None:
        decay_update_reference(params, updates, lr, weight_decay, decay_mode, skip)
        return
    fused.decay_update_triton([_rows_of(w) for w in params], [_rows_of(u) for u in updates], lr, weight_decay,
                              decay_mode, skip)


def _rows_of(t: Tensor) -> Tensor:
    """A contiguous tensor as the ``(numel / C, C)`` matrix of its rows (``C`` its last dimension)."""
    return t.view(-1, t.shape[-1]) if t.shape[-1] else t.view(0, 0)


def decay_update_reference(params: Sequence[Tensor], updates: Sequence[Tensor], lr: float | Tensor,
                           weight_decay: float, decay_mode: str, skip: Tensor | None = None) -> None:
    """:func:`decay_update` by foreach ops: the decay (:func:`~matrixopt.kernels.decay.decay_`, weighted by
    ``1 - skip``), then ``W += -lr (1 - skip) U``, U cast to each parameter's dtype."""
    params, updates = list(params), list(updates)
    live = None if skip is None else 1 - skip
    decay_(params, lr, weight_decay, decay_mode, updates, live)
    if live is not None:
        lr = live * lr
    if isinstance(lr, Tensor):
        updates = torch._foreach_mul(updates, lr)
        alpha = -1.0
    else:
        alpha = -lr
    same = all(u.dtype == p.dtype for u, p in zip(updates, params))
    torch._foreach_add_(params, updates if same else [u.to(p.dtype) for u, p in zip(updates, params)], alpha=alpha)


def _unstacked(ts: Sequence[Tensor] | Tensor) -> list[Tensor]:
    return list(ts.unbind(0)) if isinstance(ts, Tensor) else list(ts)


def elementwise_backend(name: str) -> contextlib.AbstractContextManager[None]:
    """Force ``"torch"`` (foreach references), ``"triton"`` (any device; on the CPU only under
    ``TRITON_INTERPRET=1``) or ``"auto"`` inside a ``with`` block."""
    return _switch.forced(name)
