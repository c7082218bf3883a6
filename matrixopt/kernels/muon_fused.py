r"""Triton kernels of Muon's elementwise passes, fused: one kernel before Newton–Schulz and one after, over many
matrices per launch (dispatch and torch references: :mod:`matrixopt.kernels.muon_elementwise`).

Before (``momentum_pack``), for every matrix i of a same-shape bucket (gradient ``G_i``, fp32 momentum ``B_i``)::

    B_i <- B_i + (1 - mu) (G_i - B_i)                    momentum, in place
    U_i  = G_i + mu (B_i - G_i)   (Nesterov)  or  B_i
    out[slot_i] = U_i, or U_i^T when G_i is tall        short side first, in the iteration dtype

After (``apply_update``), for every parameter matrix ``W_i`` and Newton–Schulz output ``Y (b, s, l)``::

    W_i <- (1 - lr wd) W_i - lr s(m, n) Y[slot_i]   (Y[slot_i]^T when W_i is tall; the decay's other forms in
                                                     matrixopt.kernels.decay)

Between them Newton–Schulz divides each stacked matrix by its Frobenius norm (``frobenius_normalize``): one pass
sums squares per tile in float64 (no overflow or underflow for gradients of any finite scale, and a fixed
summation order, so results repeat bit for bit), a second scales, 6 bytes per bf16 element in all.

The passes before and after read and write every element once: 14 bytes per fp32-gradient element before (read
G and B, write B and a bf16 U), 10 after (read and write an fp32 W, read a bf16 Y), against about 70 for the same
work as separate foreach ops, ``cat`` and casts. Tall matrices are transposed on the way into the stack and back, so a
``(3072, 768)`` and a ``(768, 3072)`` weight share one Newton–Schulz batch.

The matrices of one launch live in separate allocations: their addresses and row strides travel in a small
int64 table, and each program reads its matrix's row, casts the address to a typed pointer and works on one
``BLOCK_R x BLOCK_C`` tile. Tall and wide matrices take separate launches (the transpose is a compile-time
choice), so each launch reads and writes along rows. The host builds a table from runs (:data:`Run`): the E
matrices of an expert stack ``(E, m, n)`` are E rows a fixed stride apart, one run, so its cost grows with the
tensors of a launch, not with their matrices, and it is cached by the runs (the addresses, strides and slots).

Blocked algorithm, one program per (tile, matrix)::

    g_ptr, b_ptr, rows strides, slot = table[i]
    tile = rows r0:r0+BLOCK_R, cols c0:c0+BLOCK_C of the matrix as it lies (R x C)
    ... the formulas above on the tile ...
    store at out[slot, r, c] (wide) or out[slot, c, r] (tall, the tile transposed in registers)

The optimizers' non-finite check (``nonfinite_flags_triton``) reads every gradient the same way, from an address
table: one program per 64k-element chunk of any tensor, so one launch covers a model's gradients. Compact state's
stochastic rounding to bfloat16 (``stochastic_round_bf16_triton``) is one pass, 6 bytes per value, its random
bits from Triton's Philox.

The kernels are imported on first use by :mod:`matrixopt.kernels.muon_elementwise`; this module needs Triton.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor

from matrixopt.kernels._tuning import import_triton, launch_kernel
from matrixopt.kernels.decay import WEIGHT_DECAY_MODES, check_weight_decay_mode
from matrixopt.kernels.muon_elementwise import KERNEL_DTYPES, _dense_layout

triton, tl = import_triton(__name__)

# ----------------------------------------------------------------------------------------------- configs


# A 64 x 64 tile moves 16 KB of fp32 per operand: large enough to saturate HBM with a few programs per SM, small
# enough that a 768 x 768 matrix still gives 144 programs. Memory-bound, so no tuning per shape.
TILE_ROWS, TILE_COLS, TILE_WARPS = 64, 64, 4

_TL_DTYPES = {dt: getattr(tl, str(dt).removeprefix("torch.")) for dt in KERNEL_DTYPES}

# ----------------------------------------------------------------------------------------------- kernels

@triton.jit
def _tile(pid, R, C, skip_ptr, HAS_SKIP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program ``pid``'s ``BLOCK_R x BLOCK_C`` tile of an ``R x C`` matrix (row-major over the tiles): its row and
    column offsets and the in-bounds mask, empty when the 0-d skip flag is set (``HAS_SKIP``)."""
    n_c = tl.cdiv(C, BLOCK_C)
    offs_r = (pid // n_c) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = (pid % n_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = tl.where(tl.load(skip_ptr) == 0, R, 0) if HAS_SKIP else R  # no rows at all when skipping
    return offs_r, offs_c, (offs_r[:, None] < rows) & (offs_c[None, :] < C)


@triton.jit
def _momentum_pack_kernel(
    # (k, 5) int64 table: gradient address, momentum address, gradient row stride, momentum row stride, slot
    table_ptr,
    # (b, S, L) output stack, row-major
    out_ptr,
    # size of each matrix as it lies (R x C); (S, L) = (R, C), or (C, R) when TALL
    R, C,
    # runtime coefficients: 1 - mu (momentum) and mu (Nesterov)
    one_minus_mu, mu,
    # 0-d float32 flag read when HAS_SKIP: nonzero skips every read and write (a step with non-finite gradients)
    skip_ptr,
    # (b, T) float64, T = programs per matrix: each program's sum of squares of its packed tile, when HAS_PARTS
    parts_ptr,
    # 0-d float32 read when HAS_SCALE: the gradients are multiplied by it first (a deferred clipping coefficient)
    scale_ptr,
    # meta-parameters
    G_DTYPE: tl.constexpr, NESTEROV: tl.constexpr, TALL: tl.constexpr, HAS_SKIP: tl.constexpr,
    HAS_PARTS: tl.constexpr, HAS_SCALE: tl.constexpr, SIGN: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    row = table_ptr + tl.program_id(1).to(tl.int64) * 5
    g_ptr = tl.load(row).to(tl.pointer_type(G_DTYPE))
    b_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    g_rs = tl.load(row + 2)
    b_rs = tl.load(row + 3)
    slot = tl.load(row + 4)

    offs_r, offs_c, mask = _tile(pid, R, C, skip_ptr, HAS_SKIP, BLOCK_R, BLOCK_C)
    g = tl.load(g_ptr + offs_r[:, None] * g_rs + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g * tl.load(scale_ptr)
    b_ptrs = b_ptr + offs_r[:, None] * b_rs + offs_c[None, :]
    b = tl.load(b_ptrs, mask=mask, other=0.0)
    b = b + one_minus_mu * (g - b)
    tl.store(b_ptrs, b, mask=mask)
    if NESTEROV:
        u = g + mu * (b - g)
    else:
        u = b
    if SIGN:  # the update's sign (AdaMuon's sign-stabilized input): +1, -1 or 0
        u = tl.where(u > 0, 1.0, tl.where(u < 0, -1.0, 0.0))
    u = u.to(out_ptr.dtype.element_ty)
    if HAS_PARTS:  # the normalization's sum of squares, of the values as stored
        u64 = u.to(tl.float64)
        tl.store(parts_ptr + slot * tl.num_programs(0) + pid, tl.sum(tl.sum(u64 * u64, axis=1), axis=0))
    base = out_ptr + slot * R * C
    if TALL:  # out[slot] is (C, R): element (r, c) goes to row c, column r
        tl.store(base + offs_c[:, None] * R + offs_r[None, :], tl.trans(u), mask=tl.trans(mask))
    else:
        tl.store(base + offs_r[:, None] * C + offs_c[None, :], u, mask=mask)

@triton.jit
def _keep(w, u, lr, weight_decay, DECAY: tl.constexpr):
    """The factor weight decay leaves of ``w`` before ``lr u`` is subtracted (:mod:`matrixopt.kernels.decay`):
    ``DECAY`` 0 decoupled ``1 - lr wd``, 1 independent ``1 - wd``, 2 cautious (decoupled where ``u w >= 0``)."""
    if DECAY == 1:
        keep = 1.0 - weight_decay
    elif DECAY == 2:
        keep = 1.0 - tl.where(u * w >= 0, lr * weight_decay, 0.0)
    else:
        keep = 1.0 - lr * weight_decay
    return keep


@triton.jit
def _apply_update_kernel(
    # (k, 3) int64 table: parameter address, parameter row stride, slot
    table_ptr,
    # (b, S, L) Newton–Schulz output and its strides
    y_ptr, stride_yb, stride_ys, stride_yl,
    # size of each parameter matrix as it lies (R x C)
    R, C,
    # runtime values: learning rate (or its address when LR_PTR), weight decay, update scale
    lr, weight_decay, scale,
    # 0-d float32 flag read when HAS_SKIP: nonzero leaves every parameter as it is
    skip_ptr,
    # (b, L) float32 read when HAS_ROW_SCALE: row r of W_i's update is multiplied by row_scale[slot_i, r]
    row_scale_ptr, L,
    # meta-parameters; DECAY: 0 decoupled (1 - lr wd), 1 independent (1 - wd), 2 cautious (decoupled where y w >= 0)
    P_DTYPE: tl.constexpr, LR_PTR: tl.constexpr, TALL: tl.constexpr, HAS_SKIP: tl.constexpr, DECAY: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    row = table_ptr + tl.program_id(1).to(tl.int64) * 3
    p_ptr = tl.load(row).to(tl.pointer_type(P_DTYPE))
    p_rs = tl.load(row + 1)
    slot = tl.load(row + 2)
    if LR_PTR:
        lr_value = tl.load(lr).to(tl.float32)
    else:
        lr_value = lr

    offs_r, offs_c, mask = _tile(pid, R, C, skip_ptr, HAS_SKIP, BLOCK_R, BLOCK_C)
    y_base = y_ptr + slot * stride_yb
    if TALL:  # Y[slot] is (C, R): read the (c, r) tile along its rows and transpose it in registers
        y = tl.trans(tl.load(y_base + offs_c[:, None] * stride_ys + offs_r[None, :] * stride_yl,
                             mask=tl.trans(mask), other=0.0))
    else:
        y = tl.load(y_base + offs_r[:, None] * stride_ys + offs_c[None, :] * stride_yl, mask=mask, other=0.0)
    p_ptrs = p_ptr + offs_r[:, None] * p_rs + offs_c[None, :]
    w = tl.load(p_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = y.to(tl.float32)
    if HAS_ROW_SCALE:
        u = u * tl.load(row_scale_ptr + slot * L + offs_r, mask=offs_r < R, other=0.0)[:, None]
    w = w * _keep(w, u, lr_value, weight_decay, DECAY) - (lr_value * scale) * u
    tl.store(p_ptrs, w.to(P_DTYPE), mask=mask)


@triton.jit
def _second_moment_kernel(
    # (k, 3) int64 table: second-moment address, its row stride, slot
    table_ptr,
    # (b, S, L) stack of updates, normalized in place, and its strides
    o_ptr, stride_ob, stride_os, stride_ol,
    # size of each second moment as it lies (R x C); (S, L) = (R, C), or (C, R) when TALL
    R, C,
    # runtime coefficients: the second moment's decay and the epsilon added to its square root
    beta2, eps,
    # 0-d float32 flag read when HAS_SKIP: nonzero reads and writes nothing (the row sums stay zero)
    skip_ptr,
    # (b, T_C, RMAX) float32 with T_C >= column tiles: each program's sums of squares of the normalized update, per
    # row as the state lies
    rows_ptr, T_C, RMAX,
    # meta-parameters; HAS_V False: no second moment, O is only read for its row sums (the table's addresses unused)
    TALL: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    row = table_ptr + tl.program_id(1).to(tl.int64) * 3
    slot = tl.load(row + 2)

    offs_r, offs_c, mask = _tile(pid, R, C, skip_ptr, HAS_SKIP, BLOCK_R, BLOCK_C)
    o_base = o_ptr + slot * stride_ob
    if TALL:  # O[slot] is (C, R): the (c, r) tile is read and written along its rows, transposed in registers
        o_ptrs = o_base + offs_c[:, None] * stride_os + offs_r[None, :] * stride_ol
        o = tl.trans(tl.load(o_ptrs, mask=tl.trans(mask), other=0.0))
    else:
        o_ptrs = o_base + offs_r[:, None] * stride_os + offs_c[None, :] * stride_ol
        o = tl.load(o_ptrs, mask=mask, other=0.0)
    if HAS_V:
        o = o.to(tl.float32)
        v_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
        v_ptrs = v_ptr + offs_r[:, None] * tl.load(row + 1) + offs_c[None, :]
        v = tl.load(v_ptrs, mask=mask, other=0.0)
        v = v * beta2 + (1.0 - beta2) * (o * o)
        tl.store(v_ptrs, v, mask=mask)
        u = (o / (tl.sqrt(v) + eps)).to(o_ptr.dtype.element_ty)
        if TALL:
            tl.store(o_ptrs, tl.trans(u), mask=tl.trans(mask))
        else:
            tl.store(o_ptrs, u, mask=mask)
    else:
        u = o
    u32 = u.to(tl.float32)  # the sums are of the values as stored
    tile_c = pid % tl.cdiv(C, BLOCK_C)
    tl.store(rows_ptr + (slot * T_C + tile_c) * RMAX + offs_r, tl.sum(u32 * u32, axis=1), mask=offs_r < R)


@triton.jit
def _sumsq_kernel(x_ptr, partial_ptr, N, BLOCK: tl.constexpr):
    """partial[b, t] = sum of x^2 over tile t of matrix b (N contiguous elements per matrix), in float64."""
    t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs = t * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + b * N + offs, mask=offs < N, other=0.0).to(tl.float64)
    tl.store(partial_ptr + b * tl.num_programs(0) + t, tl.sum(x * x, axis=0))

@triton.jit
def _scale_kernel(x_ptr, partial_ptr, out_ptr, N, T, FLT_MAX, BLOCK: tl.constexpr, T_BLOCK: tl.constexpr):
    """out = x / ||x||_F per matrix (0 for a zero matrix), the norm summed from the T partials in order."""
    t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    acc = tl.zeros((T_BLOCK,), dtype=tl.float64)
    for t0 in range(0, T, T_BLOCK):
        offs_t = t0 + tl.arange(0, T_BLOCK)
        acc += tl.load(partial_ptr + b * T + offs_t, mask=offs_t < T, other=0.0)
    sumsq = tl.sum(acc, axis=0)
    inv = tl.where(sumsq > 0, 1.0 / tl.sqrt(tl.maximum(sumsq, 1e-300)), 0.0)
    inv = tl.minimum(inv, FLT_MAX).to(tl.float32)
    offs = t * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + b * N + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * N + offs, (x * inv).to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------- launchers


Run = tuple[tuple[int, ...], tuple[int, ...], int]
"""A run of rows of an address table, ``(base, step, count)``: the ``count`` rows ``base + i * step``, i < count.
A stack ``(E, m, n)`` is one run of E rows (its matrices lie a fixed stride apart and take consecutive slots), a
matrix a run of one, so a table costs the host a few values per tensor, not per matrix."""


def table_rows(runs: Sequence[Run]) -> Tensor:
    """The int64 table ``(rows, columns)`` (on the host) that ``runs`` stand for, in order."""
    counts = torch.tensor([count for _, _, count in runs])  # (P,)
    base = torch.tensor([b for b, _, _ in runs], dtype=torch.int64)  # (P, columns)
    step = torch.tensor([st for _, st, _ in runs], dtype=torch.int64)
    run = torch.repeat_interleave(counts)  # (rows,) the run of each row
    i = torch.arange(len(run)) - (counts.cumsum(0) - counts)[run]  # each row's index in its run
    return base[run] + i[:, None] * step[run]


_TABLES: OrderedDict[tuple, Tensor] = OrderedDict()
_CAPTURED: dict[tuple, Tensor] = {}  # tables that captured graphs read: never evicted
_TABLES_KEPT = 256  # gradients are usually reallocated at the same addresses step after step: keep their tables


def _table(runs: tuple[Run, ...], device: torch.device) -> Tensor:
    """The int64 table of ``runs`` as a device tensor: cached by the runs (which fix its content), else a small
    asynchronous copy from pinned memory (from pageable memory the driver may wait for the stream to drain first:
    a host sync). During CUDA graph capture it must be cached already (by the same launch before capture), and
    stays so for good."""
    key = (device, runs)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():  # graphs read it at every replay: kept
        table = _TABLES.pop(key, None)
        table = _CAPTURED.setdefault(key, table) if table is not None else _CAPTURED.get(key)
        if table is None:
            raise RuntimeError("a fused kernel's address table was first built during CUDA graph capture: run the "
                               "same kernel on the same tensors once before capturing")
        return table
    table = _TABLES.get(key)
    if table is None:
        rows = table_rows(runs)
        table = _TABLES[key] = (rows.pin_memory() if device.type == "cuda" else rows).to(device, non_blocking=True)
        if len(_TABLES) > _TABLES_KEPT:
            _TABLES.popitem(last=False)
    else:
        _TABLES.move_to_end(key)
    return table


def _stride(t: Tensor) -> int:
    """Bytes from one matrix of a stack ``(E, m, n)`` to the next; 0 for a matrix."""
    return t.stride(0) * t.element_size() if t.ndim == 3 else 0


def _layout(what: str, mats: Sequence[Tensor], k: int, s: int, l: int, transpose: bool | None,
            runs: Iterable[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[tuple[bool, tuple[Run, ...]]]:
    """A launch's tables as runs, ``(transposed, runs)`` per orientation present: ``runs[j]`` is ``(base, step)``
    of the matrix or stack ``mats[j]``, to which the slot column is added (each matrix's place in the stack,
    counted over ``mats`` in order). Checks that ``mats`` hold ``k`` matrices, each filling an ``(s, l)`` slot as
    it lies or transposed, as ``transpose`` says."""
    fits = {(s, l), (l, s)} if transpose is None else {(l, s) if transpose else (s, l)}
    groups: dict[bool, list[Run]] = {False: [], True: []}
    slot = 0
    for t, (base, step) in zip(mats, runs):
        *stack, m, n = t.shape  # stack: (E,) or ()
        if (m, n) not in fits:
            how = "" if transpose is None else (" transposed" if transpose else " as it lies")
            raise ValueError(f"{what}: a {(m, n)} matrix does not fill a ({s}, {l}) slot{how}")
        count = stack[0] if stack else 1
        if count:
            groups[m > n if transpose is None else transpose].append(((*base, slot), (*step, 1), count))
        slot += count
    if slot != k:
        raise ValueError(f"{what}: {slot} matrices for a stack of {k}")
    return [(tall, tuple(rs)) for tall, rs in groups.items() if rs]


def pack_runs(grads: Sequence[Tensor], bufs: Sequence[Tensor], k: int, s: int, l: int,
              transpose: bool | None = None) -> list[tuple[bool, tuple[Run, ...]]]:
    """The tables of :func:`momentum_pack_triton` for a ``(k, s, l)`` stack, as runs (:func:`table_rows` expands
    them): ``(transposed, runs)`` per orientation present, each row ``[gradient address, momentum address, their
    row strides, slot]``. Checks the shapes."""
    if len(grads) != len(bufs):
        raise ValueError(f"momentum_pack: {len(grads)} gradients but {len(bufs)} momentum buffers")
    for g, b in zip(grads, bufs):
        if g.shape != b.shape or b.dtype != torch.float32:
            raise ValueError(f"momentum_pack: gradient {tuple(g.shape)} and fp32 momentum {tuple(b.shape)} "
                             f"({b.dtype}) must match in shape")
    return _layout("momentum_pack", grads, k, s, l, transpose,
                   (((g.data_ptr(), b.data_ptr(), g.stride(-2), b.stride(-2)), (_stride(g), _stride(b), 0, 0))
                    for g, b in zip(grads, bufs)))


def apply_runs(params: Sequence[Tensor], k: int, s: int, l: int,
               transpose: bool | None = None) -> list[tuple[bool, tuple[Run, ...]]]:
    """The tables of :func:`apply_update_triton` for a ``(k, s, l)`` stack, as runs: ``(transposed, runs)`` per
    orientation present, each row ``[parameter address, row stride, slot]``. Checks the shapes."""
    return _layout("apply_update", params, k, s, l, transpose,
                   (((p.data_ptr(), p.stride(-2)), (_stride(p), 0)) for p in params))


def _rows(runs: Sequence[Run]) -> int:
    """The rows of a table: a launch's matrices (its grid's second dimension)."""
    return sum(count for _, _, count in runs)


def pack_tiles(s: int, l: int) -> int:
    """Programs of :func:`momentum_pack_triton` per ``(s, l)`` matrix: the width of its ``parts``."""
    return triton.cdiv(s, TILE_ROWS) * triton.cdiv(l, TILE_COLS)  # square tiles: either orientation


def momentum_pack_triton(grads: Sequence[Tensor], bufs: Sequence[Tensor], out: Tensor, momentum: float,
                         nesterov: bool, transpose: bool | None = None, *,
                         tables: Sequence[Tensor] | None = None, skip: Tensor | None = None,
                         parts: Tensor | None = None, grad_scale: Tensor | None = None,
                         sign: bool = False) -> None:
    """Momentum step on every matrix and its update packed short side first, by the Triton kernel.

    grads: matrices ``(m_i, n_i)`` or stacks ``(E, m_i, n_i)`` of them, k matrices in all, with
    ``{m_i, n_i} = {s, l}``, ``s <= l``, all of one dtype (fp32, bf16 or fp16), unit column stride. bufs: their
    fp32 momentum, same shapes and unit column stride; updated in place. out: ``(k, s, l)`` contiguous, any
    supported dtype; ``out[i]`` receives matrix i's update, transposed when tall (``transpose=None``) or as
    ``transpose`` says for every matrix. tables: device copies of :func:`pack_runs`' tables to read instead
    (static ones, for CUDA graphs). skip: a 0-d float32 device flag; where nonzero at run time, nothing is read or
    written (momentum and stack stay as they were). parts: a contiguous ``(k, pack_tiles(s, l))`` float64 tensor
    that receives per-tile sums of squares of the packed values, each row summing to ``||out[i]||_F^2`` (zeros
    where skipped): :func:`frobenius_normalize_triton` then skips its own pass. grad_scale: a 0-d float32 device
    tensor every gradient is multiplied by as it is read (gradient clipping's coefficient, applied here instead of
    in a pass of its own); the gradients themselves are left as they are.
    sign: pack the update's sign (+1, -1, 0) instead of the update; ``parts`` are then the sign's."""
    k, s, l = out.shape
    if not out.is_contiguous():
        raise ValueError(f"momentum_pack needs a contiguous (k, s, l) output; got out {tuple(out.shape)} with "
                         f"strides {out.stride()}")
    if parts is not None and (parts.shape != (k, pack_tiles(s, l)) or parts.dtype != torch.float64
                              or not parts.is_contiguous()):
        raise ValueError(f"momentum_pack: parts must be a contiguous float64 ({k}, {pack_tiles(s, l)}) tensor; got "
                         f"{tuple(parts.shape)} {parts.dtype}")
    for j, (tall, runs) in enumerate(pack_runs(grads, bufs, k, s, l, transpose)):
        R, C = (l, s) if tall else (s, l)
        table = tables[j] if tables is not None else _table(runs, out.device)
        grid = (triton.cdiv(R, TILE_ROWS) * triton.cdiv(C, TILE_COLS), _rows(runs))
        _momentum_pack_kernel[grid](table, out, R, C, 1.0 - momentum, momentum, table if skip is None else skip,
                                    table if parts is None else parts, table if grad_scale is None else grad_scale,
                                    G_DTYPE=_TL_DTYPES[grads[0].dtype], NESTEROV=nesterov, TALL=tall,
                                    HAS_SKIP=skip is not None, HAS_PARTS=parts is not None,
                                    HAS_SCALE=grad_scale is not None, SIGN=sign,
                                    BLOCK_R=TILE_ROWS, BLOCK_C=TILE_COLS, num_warps=TILE_WARPS)


def apply_update_triton(params: Sequence[Tensor], Y: Tensor, scale: Callable[[int, int], float], lr: float | Tensor,
                        weight_decay: float, transpose: bool | None = None, *,
                        tables: Sequence[Tensor] | None = None, skip: Tensor | None = None,
                        decay_mode: str = "decoupled", row_scale: Tensor | None = None) -> None:
    """``W_i <- (1 - lr wd) W_i - lr scale(m_i, n_i) Y[i]`` (``Y[i]^T`` for tall ``W_i``, or for every ``W_i`` as
    ``transpose`` says), in place, by the Triton kernel.

    params: matrices ``(m_i, n_i)`` or stacks ``(E, m_i, n_i)`` of them, k matrices in all, with
    ``{m_i, n_i} = {s, l}``, all of one dtype, unit column stride.
    Y: ``(k, s, l)``, any float dtype and strides. lr: a float, or a 0-d tensor on Y's device (no host sync).
    tables: device copies of :func:`apply_runs`' tables to read instead (static ones, for CUDA graphs). skip: a
    0-d float32 device flag; where nonzero at run time, no parameter is written. decay_mode: one of
    :data:`matrixopt.kernels.decay.WEIGHT_DECAY_MODES`. row_scale: ``(k, l)`` float32 contiguous, or None: row r of
    ``W_i`` (as it lies) takes its update times ``row_scale[i, r]`` (NorMuon's per-neuron normalization)."""
    check_weight_decay_mode(decay_mode)
    k, s, l = Y.shape
    if row_scale is not None and (row_scale.shape != (k, l) or row_scale.dtype != torch.float32
                                  or not row_scale.is_contiguous()):
        raise ValueError(f"apply_update: row_scale must be a contiguous float32 ({k}, {l}) tensor, got "
                         f"{tuple(row_scale.shape)} {row_scale.dtype}")
    lr_ptr = isinstance(lr, Tensor)
    for j, (tall, runs) in enumerate(apply_runs(params, k, s, l, transpose)):
        R, C = (l, s) if tall else (s, l)
        table = tables[j] if tables is not None else _table(runs, Y.device)
        grid = (triton.cdiv(R, TILE_ROWS) * triton.cdiv(C, TILE_COLS), _rows(runs))
        _apply_update_kernel[grid](table, Y, Y.stride(0), Y.stride(1), Y.stride(2), R, C,
                                   lr if lr_ptr else float(lr), float(weight_decay), float(scale(R, C)),
                                   table if skip is None else skip,
                                   table if row_scale is None else row_scale, l,
                                   P_DTYPE=_TL_DTYPES[params[0].dtype], LR_PTR=lr_ptr, TALL=tall,
                                   HAS_SKIP=skip is not None, DECAY=WEIGHT_DECAY_MODES.index(decay_mode),
                                   HAS_ROW_SCALE=row_scale is not None,
                                   BLOCK_R=TILE_ROWS, BLOCK_C=TILE_COLS, num_warps=TILE_WARPS)


def second_moment_normalize_triton(O: Tensor, states: Sequence[Tensor], beta2: float, eps: float,
                                   transpose: bool | None = None, *, tables: Sequence[Tensor] | None = None,
                                   skip: Tensor | None = None) -> Tensor:
    """AdaMuon's element-wise second moment and normalization in one pass, by the Triton kernel:
    ``V_i <- beta2 V_i + (1 - beta2) O_i * O_i`` and ``O_i <- O_i / (sqrt(V_i) + eps)`` in place.

    O: ``(k, s, l)`` stack, fp32, bf16 or fp16, any strides. states: fp32 matrices or stacks of them, k matrices in
    all, with unit column stride, each ``O[i]`` as it lies or transposed, as in :func:`momentum_pack_triton`
    (``transpose``). tables: device copies of :func:`apply_runs`' tables of ``states`` (static ones, for CUDA
    graphs). skip: a 0-d float32 device flag; where nonzero at run time nothing is read or written. Returns
    ``(k, max(s, l))`` float32: row r of the normalized ``O_i`` as ``V_i`` lies, its sum of squares (zero past
    ``V_i``'s rows)."""
    if any(v.dtype != torch.float32 for v in states):
        raise ValueError("second_moment_normalize: the second moments must be float32")
    return _row_pass(O, states, transpose, tables, skip, beta2, eps)


def row_sums_of_squares_triton(O: Tensor, like: Sequence[Tensor], transpose: bool | None = None) -> Tensor:
    """``(k, max(s, l))`` float32: the sum of squares of each row of ``O[i]`` as matrix ``like[i]`` lies
    (``O[i]`` transposed as in :func:`momentum_pack_triton`), zero past its rows; one read of O, any strides,
    no copy of a transposed stack. ``like``: matrices or stacks of them, k matrices in all, of the stack's shapes;
    only their shapes are read."""
    return _row_pass(O, like, transpose, None, None, None, 0.0)


def _row_pass(O: Tensor, mats: Sequence[Tensor], transpose: bool | None, tables: Sequence[Tensor] | None,
              skip: Tensor | None, beta2: float | None, eps: float) -> Tensor:
    """The second-moment kernel over ``O`` with the matrices ``mats`` as they lie: with their second moments
    (``beta2`` a float) or only the row sums (None)."""
    k, s, l = O.shape
    rmax = max(s, l)
    n_c = triton.cdiv(rmax, TILE_COLS)
    rows_sq = torch.zeros((k, n_c, rmax), dtype=torch.float32, device=O.device)
    for j, (tall, runs) in enumerate(apply_runs(mats, k, s, l, transpose)):
        R, C = (l, s) if tall else (s, l)
        table = tables[j] if tables is not None else _table(runs, O.device)
        grid = (triton.cdiv(R, TILE_ROWS) * triton.cdiv(C, TILE_COLS), _rows(runs))
        _second_moment_kernel[grid](table, O, O.stride(0), O.stride(1), O.stride(2), R, C, float(beta2 or 0.0),
                                    float(eps), table if skip is None else skip, rows_sq, n_c, rmax,
                                    TALL=tall, HAS_SKIP=skip is not None, HAS_V=beta2 is not None,
                                    BLOCK_R=TILE_ROWS, BLOCK_C=TILE_COLS, num_warps=TILE_WARPS)
    return rows_sq.sum(1)


NORM_BLOCK = 4096  # elements per program of the two normalization passes


def frobenius_normalize_triton(X: Tensor, dtype: torch.dtype, parts: Tensor | None = None) -> Tensor:
    """Each matrix of ``X (b, m, n)`` divided by its Frobenius norm, in ``dtype``, by the Triton kernels. X must be
    contiguous or a transposed view of a contiguous stack; the result has X's layout. ``parts``: ``(b, T)`` float64
    whose rows sum to each matrix's squared norm (from :func:`momentum_pack_triton`): one pass instead of two."""
    dense = _dense_layout(X)
    if X.ndim != 3 or dense is None:
        raise ValueError(f"frobenius_normalize_triton takes a (b, m, n) stack stored contiguously (or its "
                         f"transpose); got shape {tuple(X.shape)}, strides {X.stride()}")
    b, N = X.shape[0], X.shape[1] * X.shape[2]
    out = torch.empty_like(dense, dtype=dtype)
    tiles = triton.cdiv(N, NORM_BLOCK)
    if parts is not None and (parts.ndim != 2 or parts.shape[0] != b or parts.dtype != torch.float64
                              or not parts.is_contiguous()):
        raise ValueError(f"frobenius_normalize_triton: parts must be a contiguous float64 ({b}, T) tensor; got "
                         f"{tuple(parts.shape)} {parts.dtype}")
    if b * N:
        if parts is None:
            parts = torch.empty((b, tiles), dtype=torch.float64, device=X.device)
            launch_kernel(_sumsq_kernel, (tiles, b), dense, parts, N, BLOCK=NORM_BLOCK, num_warps=8)
        if parts.shape[1] > 1024:  # else every program of the scale pass would sum thousands of partials
            parts = parts.sum(1, keepdim=True)
        T = parts.shape[1]
        launch_kernel(_scale_kernel, (tiles, b), dense, parts, out, N, T, torch.finfo(torch.float32).max,
                      BLOCK=NORM_BLOCK, T_BLOCK=min(1024, triton.next_power_of_2(T)), num_warps=8)
    return out if dense is X else out.mT


# ----------------------------------------------------------------------------------------------- non-finite check

# Each program of the non-finite check scans CHECK_CHUNK elements of one tensor, CHECK_BLOCK at a time: a GPT-2
# embedding (38.6M elements) is 590 programs, a 768 x 768 matrix 9, so the grid balances across tensors.
CHECK_BLOCK = 4096
CHECK_CHUNK = 16 * CHECK_BLOCK


@triton.jit
def _nonfinite_kernel(
    # (n, 2) int64 table: tensor address, element count; (P, 2) int64 work list: tensor, first element of the chunk
    table_ptr, chunks_ptr,
    # (n,) float32 flags, zero on entry: set to 1 for a tensor holding a NaN or an Inf
    flags_ptr,
    G_DTYPE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):
    work = chunks_ptr + tl.program_id(0).to(tl.int64) * 2
    i = tl.load(work)
    start = tl.load(work + 1)
    g_ptr = tl.load(table_ptr + i * 2).to(tl.pointer_type(G_DTYPE))
    numel = tl.load(table_ptr + i * 2 + 1)
    bad = tl.zeros((BLOCK,), dtype=tl.int1)
    for off in range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        x = tl.load(g_ptr + idx, mask=idx < numel, other=0.0).to(tl.float32)
        bad = bad | (x != x) | (tl.abs(x) == float("inf"))
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        tl.store(flags_ptr + i, 1.0)  # every program that finds one writes the same value


@functools.lru_cache(maxsize=16)
def _chunk_table(numels: tuple[int, ...], device: torch.device) -> Tensor:
    """The check's work list for tensors of these sizes, ``[tensor, first element]`` per CHECK_CHUNK, on ``device``
    (built once per set of sizes: thousands of rows for a model)."""
    rows = [[i, start] for i, n in enumerate(numels) for start in range(0, n, CHECK_CHUNK)]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2).to(device)


def nonfinite_flags_triton(grads: Sequence[Tensor]) -> Tensor:
    """``(n,)`` float32 on the gradients' device: 1 where ``grads[i]`` holds a NaN or an Inf, else 0, in one launch
    over every tensor. grads: contiguous tensors of any shape, one dtype of fp32, bf16 and fp16, one device."""
    flags = torch.zeros(len(grads), dtype=torch.float32, device=grads[0].device)
    numels = tuple(g.numel() for g in grads)
    chunks = _chunk_table(numels, flags.device)
    if len(chunks):
        table = _table(tuple(((g.data_ptr(), n), (0, 0), 1) for g, n in zip(grads, numels)), flags.device)
        _nonfinite_kernel[(len(chunks),)](table, chunks, flags, G_DTYPE=_TL_DTYPES[grads[0].dtype],
                                          BLOCK=CHECK_BLOCK, CHUNK=CHECK_CHUNK, num_warps=4)
    return flags


# ----------------------------------------------------------------------------------------------- rounding

ROUND_BLOCK = 4096  # values per program: four runs of 1024, one Philox draw giving each of the four its noise


@triton.jit
def _stochastic_round_bf16_kernel(x_ptr, out_ptr, n, seed, QUARTER: tl.constexpr):
    """``out = bf16(x)`` rounded stochastically: the 16 low bits of x's float32 pattern plus 16 random bits, then
    truncated, so x rounds up (in magnitude) with probability equal to the dropped bits' fraction of an ulp.
    Inf and NaN are kept. Program p covers values ``p * 4 * QUARTER ..`` as four runs of QUARTER; Philox draws
    four 32-bit words per counter ``(seed, p * QUARTER + j)``, one word per run."""
    base = tl.program_id(0).to(tl.int64) * (4 * QUARTER)
    j = tl.arange(0, QUARTER)
    r0, r1, r2, r3 = tl.randint4x(seed, tl.program_id(0).to(tl.int64) * QUARTER + j)
    for q in tl.static_range(4):
        r = r0 if q == 0 else (r1 if q == 1 else (r2 if q == 2 else r3))
        idx = base + q * QUARTER + j
        mask = idx < n
        bits = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.int32, bitcast=True)
        noise = (r & 0xFFFF).to(tl.int32)
        special = (bits & 0x7F800000) == 0x7F800000  # Inf or NaN: Inf plus noise would read as NaN
        rounded = tl.where(special, bits, (bits + noise) & -65536)
        tl.store(out_ptr + idx, rounded.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)


def stochastic_round_bf16_triton(x: Tensor, seed: int) -> Tensor:
    """``x`` (contiguous float32) rounded stochastically to a new bfloat16 tensor of its shape, the random bits
    from Philox keyed by ``seed`` (0 <= seed < 2**63): the same seed gives the same result."""
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    n = x.numel()
    if n:
        _stochastic_round_bf16_kernel[(triton.cdiv(n, ROUND_BLOCK),)](x, out, n, seed, QUARTER=ROUND_BLOCK // 4,
                                                                      num_warps=4)
    return out


# ----------------------------------------------------------------------------------------------- Adam, one pass

ADAM_ROWS, ADAM_BLOCK, ADAM_WARPS = 8, 1024, 4  # rows per program, columns per iteration, warps


@triton.jit
def _columns(c0, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """The columns ``c0 .. c0 + BLOCK`` of a row pass; with ``ALIGNED``, hinted for vector loads and stores."""
    col = c0 + tl.arange(0, BLOCK)
    if ALIGNED:
        col = tl.max_contiguous(tl.multiple_of(col, BLOCK), BLOCK)
    return col


@triton.jit
def _row_operand(row, k, n, ALIGNED: tl.constexpr):
    """Operand ``k`` of a row-pass table row laid out as ``n`` addresses, the rows, the columns and the ``n`` row
    strides (elements): its float32 pointer and row stride; with ``ALIGNED`` hinted 16-byte aligned and a multiple
    of 4 elements (vector loads and stores)."""
    addr = tl.load(row + k)
    rs = tl.load(row + n + 2 + k)
    if ALIGNED:
        addr = tl.multiple_of(addr, 16)
        rs = tl.multiple_of(rs, 4)
    return addr.to(tl.pointer_type(tl.float32)), rs


@triton.jit
def _work_row(table_ptr, chunks_ptr, n, width):
    """This program's work item of a row pass: ``(i, r0, row, R, C)``, the matrix, its first row, its table row
    (``width`` entries: ``n`` addresses, the rows, the columns, the ``n`` row strides, padding) and its shape."""
    work = chunks_ptr + tl.program_id(0).to(tl.int64) * 2
    i = tl.load(work)
    r0 = tl.load(work + 1)
    row = table_ptr + i * width
    return i, r0, row, tl.load(row + n), tl.load(row + n + 1)


@triton.jit
def _adam_kernel(
    # (n, 12) int64 table, one row per matrix: gradient, first moment, second moment, output and numerator
    # addresses, rows, columns, and the five row strides (elements); (P, 2) int64 work list: matrix, first row
    table_ptr, chunks_ptr,
    # 0-d float32 skip flag (nonzero: write no moment, and zeros as the direction), read when HAS_SKIP
    skip_ptr,
    beta1, beta2, eps, bc1, sqrt_bc2,
    HAS_SKIP: tl.constexpr, NESTEROV: tl.constexpr, ALIGNED: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i, r0, row, R, C = _work_row(table_ptr, chunks_ptr, 5, 12)
    g_ptr, g_rs = _row_operand(row, 0, 5, ALIGNED)
    m_ptr, m_rs = _row_operand(row, 1, 5, ALIGNED)
    v_ptr, v_rs = _row_operand(row, 2, 5, ALIGNED)
    o_ptr, o_rs = _row_operand(row, 3, 5, ALIGNED)
    n_ptr, n_rs = _row_operand(row, 4, 5, ALIGNED)
    kept = tl.where(tl.load(skip_ptr) == 0, R, 0) if HAS_SKIP else R  # no row at all when skipping
    for r in range(r0, r0 + ROWS):
        for c0 in range(0, C, BLOCK):
            col = _columns(c0, BLOCK, ALIGNED)
            mask = (col < C) & (r < R)
            keep = (col < C) & (r < kept)
            g = tl.load(g_ptr + r * g_rs + col, mask=mask, other=0.0)
            m = tl.load(m_ptr + r * m_rs + col, mask=mask, other=0.0)
            v = tl.load(v_ptr + r * v_rs + col, mask=mask, other=0.0)
            m = m + (1.0 - beta1) * (g - m)
            v = v * beta2 + (1.0 - beta2) * g * g
            num = m
            if NESTEROV:  # torch.lerp(g, m, beta1), its two branches as torch computes them
                num = tl.where(beta1 < 0.5, g + beta1 * (m - g), m - (m - g) * (1.0 - beta1))
                tl.store(n_ptr + r * n_rs + col, tl.where(keep, num, 0.0), mask=mask)
            d = tl.div_rn(num, tl.div_rn(tl.sqrt_rn(v), sqrt_bc2) + eps) * bc1
            tl.store(m_ptr + r * m_rs + col, m, mask=keep)
            tl.store(v_ptr + r * v_rs + col, v, mask=keep)
            tl.store(o_ptr + r * o_rs + col, tl.where(keep, d, 0.0), mask=mask)


@triton.jit
def _factor_ema_kernel(
    # (n, 6) int64 table, one row per factor: factor and product addresses, rows, columns, their row strides
    # (elements); (P, 2) int64 work list: matrix, first row
    table_ptr, chunks_ptr,
    # (n,) float32 per product: nonzero where it is finite; 0-d float32 live flag (0: a skipped step), if HAS_LIVE
    ok_ptr, live_ptr,
    weight,
    HAS_LIVE: tl.constexpr, SUM: tl.constexpr, ALIGNED: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    i, r0, row, R, C = _work_row(table_ptr, chunks_ptr, 2, 6)
    f_ptr, f_rs = _row_operand(row, 0, 2, ALIGNED)
    g_ptr, g_rs = _row_operand(row, 1, 2, ALIGNED)
    ok = tl.load(ok_ptr + i) != 0
    w = weight * tl.load(live_ptr) if HAS_LIVE else weight
    for r in range(r0, r0 + ROWS):
        for c0 in range(0, C, BLOCK):
            col = _columns(c0, BLOCK, ALIGNED)
            mask = (col < C) & (r < R)
            f = tl.load(f_ptr + r * f_rs + col, mask=mask, other=0.0)
            g = tl.where(ok, tl.load(g_ptr + r * g_rs + col, mask=mask, other=0.0), 0.0)
            new = f + w * g if SUM else f * (1.0 - w) + w * g
            tl.store(f_ptr + r * f_rs + col, new, mask=mask)


def _addresses(ts: Sequence[Tensor] | Tensor) -> tuple[list[int], list[int], bool]:
    """Each matrix's address and row stride (elements), and whether every address and row stride is a multiple of
    16 bytes, for a list of matrices of one dtype or a ``(b, R, C)`` stack standing for its b matrices (their
    addresses by arithmetic: no view per matrix, the host's time per matrix counting at hundreds of blocks)."""
    if isinstance(ts, Tensor):
        base, size, rs = ts.data_ptr(), ts.element_size(), ts.stride(1)
        step = ts.stride(0) * size
        return ([base + j * step for j in range(ts.shape[0])], [rs] * ts.shape[0],
                base % 16 == 0 and step % 16 == 0 and rs * size % 16 == 0)
    ptrs, strides = [t.data_ptr() for t in ts], [t.stride(0) for t in ts]
    size = ts[0].element_size() if len(ts) else 4
    return ptrs, strides, all(p % 16 == 0 for p in ptrs) and all(r * size % 16 == 0 for r in strides)


def factor_ema_triton(factors: Sequence[Tensor], products: Sequence[Tensor] | Tensor, ok: Tensor, weight: float,
                      live: Tensor | None = None, sum_: bool = False) -> None:
    """Shampoo's factor update in one pass (one launch for the lists): ``F <- F (1 - w) + w P``, or ``F <- F + w P``
    with ``sum_``, where ``w = weight * live`` and a product P whose ``ok`` entry is zero counts as zeros (a
    non-finite block contributes nothing). 12 bytes per element, where the torch reference's select, multiply and
    add move 28. ``factors``, ``products``: float32 ``(R, C)`` matrices with unit column stride, pairwise shaped
    alike, on one device (``products`` may be their ``(n, R, C)`` stack); ``ok``: ``(n,)`` float32 or bool;
    ``live``: a 0-d float32 device flag, 0 on a skipped step, which leaves every factor as it was, bit for bit."""
    if not len(factors):
        return
    device = factors[0].device
    shapes = [f.shape for f in factors]
    chunks = _row_chunks(tuple(s[0] for s in shapes), device, ADAM_ROWS)
    (fp, fs, fa), (pp, ps, pa) = _addresses(factors), _addresses(products)
    rows = tuple(((*a, s[0], s[1], *r), (0,) * 6, 1) for a, s, r in zip(zip(fp, pp), shapes, zip(fs, ps)))
    aligned = fa and pa
    launch_kernel(_factor_ema_kernel, (len(chunks),), _table(rows, device), chunks, ok.float(),
                  live if live is not None else chunks, float(weight), HAS_LIVE=live is not None, SUM=sum_,
                  ALIGNED=aligned, ROWS=ADAM_ROWS, BLOCK=ADAM_BLOCK, num_warps=ADAM_WARPS)


# ----------------------------------------------------------------------------------------------- decay and update

@triton.jit
def _decay_update_kernel(
    # (n, 6) int64 table, one row per matrix: parameter and update addresses, rows, columns, their row strides
    # (elements); (P, 2) int64 work list: matrix, first row
    table_ptr, chunks_ptr,
    # learning rate (or its address when LR_PTR), weight decay; 0-d float32 flag read when HAS_SKIP
    lr, weight_decay, skip_ptr,
    # DECAY: 0 decoupled (1 - lr wd), 1 independent (1 - wd), 2 cautious (decoupled where u w >= 0)
    LR_PTR: tl.constexpr, HAS_SKIP: tl.constexpr, DECAY: tl.constexpr, ALIGNED: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i, r0, row, R, C = _work_row(table_ptr, chunks_ptr, 2, 6)
    w_ptr, w_rs = _row_operand(row, 0, 2, ALIGNED)
    u_ptr, u_rs = _row_operand(row, 1, 2, ALIGNED)
    eta = tl.load(lr).to(tl.float32) if LR_PTR else lr
    kept = tl.where(tl.load(skip_ptr) == 0, R, 0) if HAS_SKIP else R  # no row at all when skipping
    for r in range(r0, r0 + ROWS):
        for c0 in range(0, C, BLOCK):
            col = _columns(c0, BLOCK, ALIGNED)
            mask = (col < C) & (r < kept)
            w = tl.load(w_ptr + r * w_rs + col, mask=mask, other=0.0)
            u = tl.load(u_ptr + r * u_rs + col, mask=mask, other=0.0)
            tl.store(w_ptr + r * w_rs + col, w * _keep(w, u, eta, weight_decay, DECAY) - eta * u, mask=mask)


def decay_update_triton(params: Sequence[Tensor], updates: Sequence[Tensor], lr: float | Tensor,
                        weight_decay: float, decay_mode: str = "decoupled", skip: Tensor | None = None) -> None:
    """``W <- decay(W) - lr U`` in place for every pair in one launch, the decay as ``decay_mode`` says
    (:mod:`matrixopt.kernels.decay`): 12 bytes per element, where the torch reference's decay, scaling and add
    move 20 to 28. ``params``, ``updates``: float32 ``(R, C)`` matrices with unit column stride, pairwise shaped
    alike, on one device. lr: a float, or a 0-d tensor on their device (no host sync). skip: a 0-d float32 device
    flag; where nonzero at run time, no parameter is written."""
    check_weight_decay_mode(decay_mode)
    if not len(params):
        return
    device = params[0].device
    shapes = [w.shape for w in params]
    chunks = _row_chunks(tuple(sh[0] for sh in shapes), device, ADAM_ROWS)
    if not len(chunks):
        return
    (wp, ws, wa), (up, us, ua) = _addresses(params), _addresses(updates)
    rows = tuple(((a, b, sh[0], sh[1], r, q), (0,) * 6, 1) for a, b, sh, r, q in zip(wp, up, shapes, ws, us))
    lr_ptr = isinstance(lr, Tensor)
    launch_kernel(_decay_update_kernel, (len(chunks),), _table(rows, device), chunks,
                  lr if lr_ptr else float(lr), float(weight_decay), chunks if skip is None else skip,
                  LR_PTR=lr_ptr, HAS_SKIP=skip is not None, DECAY=WEIGHT_DECAY_MODES.index(decay_mode),
                  ALIGNED=wa and ua, ROWS=ADAM_ROWS, BLOCK=ADAM_BLOCK, num_warps=ADAM_WARPS)


# ----------------------------------------------------------------------------------------------- block copies

@triton.jit
def _copy_kernel(
    # (n, 6) int64 table, one row per matrix: source and destination addresses, rows, columns, their row strides
    # (elements); (P, 2) int64 work list: matrix, first row
    table_ptr, chunks_ptr,
    SRC: tl.constexpr, DST: tl.constexpr, DOWN: tl.constexpr, ALIGNED: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i, r0, row, R, C = _work_row(table_ptr, chunks_ptr, 2, 6)
    s_addr, d_addr = tl.load(row), tl.load(row + 1)
    s_rs, d_rs = tl.load(row + 4), tl.load(row + 5)
    if ALIGNED:  # 16-byte addresses and row strides: vector loads and stores
        s_addr, d_addr = tl.multiple_of(s_addr, 16), tl.multiple_of(d_addr, 16)
        s_rs, d_rs = tl.multiple_of(s_rs, 8), tl.multiple_of(d_rs, 8)
    s_ptr, d_ptr = s_addr.to(tl.pointer_type(SRC)), d_addr.to(tl.pointer_type(DST))
    for r in range(r0, r0 + ROWS):
        for c0 in range(0, C, BLOCK):
            col = _columns(c0, BLOCK, ALIGNED)
            mask = (col < C) & (r < R)
            x = tl.load(s_ptr + r * s_rs + col, mask=mask)
            if DOWN:  # to the nearest, ties to even, as torch rounds
                x = x.to(DST, fp_downcast_rounding="rtne")
            tl.store(d_ptr + r * d_rs + col, x.to(DST), mask=mask)


def copy_matrices_triton(dsts: Sequence[Tensor] | Tensor, srcs: Sequence[Tensor] | Tensor) -> None:
    """``dsts[i] <- srcs[i]``, converted to the destinations' dtype, for every i in one launch: each element read
    and written once, where torch copies a block of a larger tensor (a view that is not dense) by one kernel per
    block, or a grid of them by a strided copy at about half the memory bandwidth. ``dsts``, ``srcs``: lists of
    ``(R, C)`` matrices of one dtype each (float32 or bfloat16) with unit column stride, pairwise shaped alike, on
    one device, or ``(n, R, C)`` stacks standing for their n matrices."""
    n = len(dsts)
    if not n:
        return
    stack = dsts if isinstance(dsts, Tensor) else None
    shapes = [stack.shape[1:]] * n if stack is not None else [d.shape for d in dsts]
    dtype, device = (stack.dtype, stack.device) if stack is not None else (dsts[0].dtype, dsts[0].device)
    src_dtype = srcs.dtype if isinstance(srcs, Tensor) else srcs[0].dtype
    chunks = _row_chunks(tuple(sh[0] for sh in shapes), device, ADAM_ROWS)
    if not len(chunks):
        return
    (sp, ss, sa), (dp, ds, da) = _addresses(srcs), _addresses(dsts)
    rows = tuple(((a, b, sh[0], sh[1], r, q), (0,) * 6, 1) for a, b, sh, r, q in zip(sp, dp, shapes, ss, ds))
    launch_kernel(_copy_kernel, (len(chunks),), _table(rows, device), chunks, SRC=_TL_DTYPES[src_dtype],
                  DST=_TL_DTYPES[dtype], DOWN=src_dtype.itemsize > dtype.itemsize, ALIGNED=sa and da,
                  ROWS=ADAM_ROWS, BLOCK=ADAM_BLOCK, num_warps=ADAM_WARPS)


# ----------------------------------------------------------------------------------------------- Shampoo's graft

@triton.jit
def _graft_sums_kernel(
    # (n, 9) int64 table, one row per block: preconditioned, fallback and update addresses, rows, columns, their
    # three row strides (elements); (P, 2) int64 work list: block, first row; (P, 2) float32 out: per work item,
    # the sums of squares of its rows of S and of F
    table_ptr, chunks_ptr, out_ptr,
    ALIGNED: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    i, r0, row, R, C = _work_row(table_ptr, chunks_ptr, 3, 9)
    s_ptr, s_rs = _row_operand(row, 0, 3, ALIGNED)
    f_ptr, f_rs = _row_operand(row, 1, 3, ALIGNED)
    acc_s = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_f = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in range(r0, r0 + ROWS):
        for c0 in range(0, C, BLOCK):
            col = _columns(c0, BLOCK, ALIGNED)
            mask = (col < C) & (r < R)
            x = tl.load(s_ptr + r * s_rs + col, mask=mask, other=0.0)
            f = tl.load(f_ptr + r * f_rs + col, mask=mask, other=0.0)
            acc_s += x * x
            acc_f += f * f
    out = out_ptr + tl.program_id(0).to(tl.int64) * 2
    tl.store(out, tl.sum(acc_s, axis=0))
    tl.store(out + 1, tl.sum(acc_f, axis=0))


@triton.jit
def _graft_select_kernel(
    # the table and work list of _graft_sums_kernel; (n,) float32 per block: the scale of S, and nonzero where S
    # is finite (else the update is F)
    table_ptr, chunks_ptr, scale_ptr, keep_ptr,
    ALIGNED: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    i, r0, row, R, C = _work_row(table_ptr, chunks_ptr, 3, 9)
    s_ptr, s_rs = _row_operand(row, 0, 3, ALIGNED)
    f_ptr, f_rs = _row_operand(row, 1, 3, ALIGNED)
    u_ptr, u_rs = _row_operand(row, 2, 3, ALIGNED)
    scale = tl.load(scale_ptr + i)
    keep = tl.load(keep_ptr + i) != 0
    for r in range(r0, r0 + ROWS):
        for c0 in range(0, C, BLOCK):
            col = _columns(c0, BLOCK, ALIGNED)
            mask = (col < C) & (r < R)
            if keep:
                u = tl.load(s_ptr + r * s_rs + col, mask=mask, other=0.0) * scale
            else:
                u = tl.load(f_ptr + r * f_rs + col, mask=mask, other=0.0)
            tl.store(u_ptr + r * u_rs + col, u, mask=mask)


def graft_select_triton(S: Tensor, fallbacks: Sequence[Tensor], updates: Sequence[Tensor], graft: bool) -> None:
    """Shampoo's last pass over a run of blocks, into ``updates``: each block's preconditioned ``S[i]``, scaled to
    the Frobenius norm of its fallback (``graft``: ``||F_i|| / ||S_i||``, 0 for a zero ``S_i``; else 1), or the
    fallback ``F_i`` itself where ``S_i`` is not finite (its sum of squares is not: a NaN or Inf entry, or entries
    whose squares overflow float32). S: ``(b, m, n)`` float32 with unit column stride; fallbacks and updates: b
    float32 ``(m, n)`` matrices with unit column stride (blocks of larger tensors), on S's device. Two passes (the
    sums of squares of S and F, then the select): 20 bytes per element, against about 48 as torch ops."""
    b, m, n = S.shape
    chunks = _row_chunks((m,) * b, S.device, ADAM_ROWS) if b and m and n else ()
    if not len(chunks):
        return
    # S[j]'s address by arithmetic (no view per block: the host's time per block counts at hundreds of blocks)
    s0, s_step, s_rs = S.data_ptr(), S.stride(0) * S.element_size(), S.stride(1)
    fu = [(f.data_ptr(), u.data_ptr(), f.stride(0), u.stride(0)) for f, u in zip(fallbacks, updates)]
    rows = tuple(((s0 + j * s_step, fp, up, m, n, s_rs, fs, us, 0), (0,) * 9, 1)
                 for j, (fp, up, fs, us) in enumerate(fu))
    aligned = (s0 % 16 == 0 and s_step % 16 == 0 and s_rs % 4 == 0
               and all(fp % 16 == 0 and up % 16 == 0 and fs % 4 == 0 and us % 4 == 0 for fp, up, fs, us in fu))
    table = _table(rows, S.device)
    sums = torch.empty((len(chunks), 2), dtype=torch.float32, device=S.device)
    launch_kernel(_graft_sums_kernel, (len(chunks),), table, chunks, sums, ALIGNED=aligned, ROWS=ADAM_ROWS,
                  BLOCK=ADAM_BLOCK, num_warps=ADAM_WARPS)
    sums = sums.view(b, -1, 2).sum(dim=1)  # the work list takes each block's rows in order, the same count each
    ns, nf = sums.unbind(-1)
    keep = torch.isfinite(ns)
    scale = torch.where(ns > 0, (nf / ns).sqrt(), 0.0) if graft else torch.ones_like(ns)
    launch_kernel(_graft_select_kernel, (len(chunks),), table, chunks, scale, keep.float(), ALIGNED=aligned,
                  ROWS=ADAM_ROWS, BLOCK=ADAM_BLOCK, num_warps=ADAM_WARPS)


@functools.lru_cache(maxsize=16)
def _row_chunks(rows: tuple[int, ...], device: torch.device, per: int) -> Tensor:
    """Adam's work list for matrices of these row counts, ``[matrix, first row]`` per ``per`` rows, on ``device``."""
    items = [[i, r] for i, n in enumerate(rows) for r in range(0, n, per)]
    return torch.tensor(items, dtype=torch.int64).reshape(-1, 2).to(device)


def adam_triton(exp_avgs: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor], grads: Sequence[Tensor] | Tensor,
                step: int, betas: tuple[float, float], eps: float, skip: Tensor | None = None,
                out: Sequence[Tensor] | Tensor | None = None,
                nesterov: Sequence[Tensor] | None = None) -> list[Tensor] | Tensor:
    """Adam's moments and bias-corrected direction in one pass over each matrix (one launch for the lists):
    ``m <- lerp(m, g, 1 - beta1)``, ``v <- beta2 v + (1 - beta2) g^2``, and the returned tensors
    ``(m / (1 - beta1^t)) / (sqrt(v) / sqrt(1 - beta2^t) + eps)``, t = ``step`` for every matrix. 24 bytes per
    element against about 90 for the same work as foreach ops. All float32 ``(R, C)`` matrices with unit column
    stride (any row stride: blocks of larger tensors) on one device, each ``grads[i]`` shaped as ``exp_avgs[i]``
    and ``exp_avg_sqs[i]``. ``skip``: a 0-d float32 device flag; nonzero leaves the moments unwritten and returns
    zeros. ``out``: where to write the directions instead of new tensors (shaped alike, unit column stride; may be
    ``grads`` themselves, each element read before it is written). ``grads`` and ``out`` may be ``(n, R, C)``
    stacks standing for their n matrices (``out`` then returned as it is). ``nesterov``: tensors shaped alike that
    receive the Nesterov numerator ``lerp(g, m, beta1)`` (zeros when skipping), which then replaces ``m`` in the
    direction (Shampoo's graft: 28 bytes per element)."""
    beta1, beta2 = betas
    outs = out if isinstance(out, Tensor) else list(out) if out is not None else [
        torch.empty_like(m, memory_format=torch.contiguous_format) for m in exp_avgs]
    device = exp_avgs[0].device if exp_avgs else None
    shapes = [m.shape for m in exp_avgs]
    chunks = _row_chunks(tuple(s[0] for s in shapes), device, ADAM_ROWS) if exp_avgs else ()
    if len(chunks):
        nums = list(nesterov) if nesterov is not None else outs  # unused without Nesterov
        cols = [_addresses(q) for q in (grads, exp_avgs, exp_avg_sqs, outs, nums)]
        rows = tuple(((*a, s[0], s[1], *r), (0,) * 12, 1)
                     for a, s, r in zip(zip(*(c[0] for c in cols)), shapes, zip(*(c[1] for c in cols))))
        aligned = all(c[2] for c in cols)
        launch_kernel(_adam_kernel, (len(chunks),), _table(rows, device), chunks, skip if skip is not None else
                      chunks, float(beta1), float(beta2), float(eps), 1.0 / (1 - beta1**step),
                      (1 - beta2**step) ** 0.5, HAS_SKIP=skip is not None, NESTEROV=nesterov is not None,
                      ALIGNED=aligned, ROWS=ADAM_ROWS, BLOCK=ADAM_BLOCK, num_warps=ADAM_WARPS)
    return outs
