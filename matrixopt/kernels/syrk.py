r"""Batched symmetric rank-k update (SYRK): ``C = alpha X X^T + beta Y`` for ``X (batch, m, k)``, ``Y (batch, m, m)``
symmetric; and its two-operand form ``C = alpha X W^T + beta Y`` for products known to be symmetric.

Only the lower-triangle tiles of C are computed; each is stored at (i, j) and mirrored to (j, i). With T = m / BLOCK
tiles per side that is T (T + 1) / 2 of T^2 tiles, about half the FLOPs of ``X @ X.mT``. Newton–Schulz uses it
twice per step: ``A = X X^T`` and, because A is symmetric so that ``A^2 = A A^T``, ``b A + c A^2 = syrk(A, c, b, A)``.
Gram Newton–Schulz (``linalg/ortho.py``) also multiplies symmetric matrices that commute (polynomials in one Gram
matrix): ``S T`` is then symmetric and, T being symmetric, equals ``S T^T = syrk(S, W=T)``.

Blocked algorithm, one program per (lower tile, matrix, K split)::

    tile (i, j), i >= j, from the program id p = i (i + 1) / 2 + j
    acc = 0                                          (BLOCK, BLOCK) fp32
    for k in this split's range, step BLOCK_K:
        acc += X[i rows, k:k+BLOCK_K] @ W[j rows, k:k+BLOCK_K]^T           (W = X for X X^T)
    C[i, j] = alpha acc + beta Y[i, j];  C[j, i] = C[i, j]^T
    (a diagonal tile keeps its lower half and mirrors it: C is exactly symmetric, which Gram Newton–Schulz
    needs: with T symmetric only up to round-off, S T^T would not be S T)

When the tiles times the batch cannot fill the GPU (a single 1024 x 1024 Gram matrix is 36 tiles of 128 on 132
SMs) the K range is split: each split writes its fp32 partial (mirrored) to a workspace and a second kernel sums
the splits and applies alpha and beta. Coefficients are runtime arguments: a new (alpha, beta) never recompiles.

Three kernels compute the same triangle; the tuner times each where it applies:
- ``_syrk_kernel``: one program per tile, pointer loads (any strides, any sizes, split-K);
- ``_syrk_tma_kernel``: a persistent grid (one program per SM walks the tiles of the whole batch, so the next
  tile's loads overlap the last one's epilogue) with tensor-memory-accelerator (TMA) loads and stores through
  tensor descriptors. The copy engine zero-fills reads past the edges and clips writes, so there are no masks.
  TMA needs a contiguous last dimension, 16-byte aligned rows (m and k multiples of 8 in bf16) and, on the GPU,
  a Hopper or newer device (compute capability 9). Its ``pair`` form computes two tiles of a row, (i, j) and
  (i, j + 1), per work item: the row tile is loaded once for both, a 128 x 256 output like the widest fast GEMM
  tiles. A row with an odd number of tiles ends in a pair whose second tile lies above the diagonal: it is
  computed (at most one tile in T per row) but not stored.
- ``_syrk_wide_kernel``: one program per 64 x 128 output tile (a pair of 64-tiles computed by one dot, the shape
  of one Hopper warpgroup's MMA), TMA loads and stores, for a single matrix or a few, where the 128-tiles leave
  SMs idle. A tile that the diagonal crosses is stored by halves: the half holding the diagonal symmetrized, as
  above. Same TMA requirements.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from matrixopt.kernels._tuning import import_triton, launch_kernel, pick

triton, tl = import_triton(__name__)
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton < 3.3 has no host-side tensor descriptors: pointer kernels only
    TensorDescriptor = None

# ----------------------------------------------------------------------------------------------- autotune configs


@dataclass(frozen=True)
class SyrkConfig:
    block: int  # square output tile side (the triangle needs square tiles)
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    persistent: bool = False  # the persistent TMA kernel (split_k must be 1)
    pair: bool = False  # persistent only: each program item is two tiles side by side on a row
    wide: bool = False  # the wide TMA kernel: one program per block x 2 block output tile (split_k must be 1)


NUM_SMS_H100 = 132


def tma_compatible(*tensors: Tensor) -> bool:
    """Whether TMA descriptors can address every tensor: contiguous last dimension, 16-byte aligned base and
    strides, and (on CUDA) a device of compute capability 9 or newer. On the CPU (Triton's interpreter) only the
    layout is checked. False with a Triton too old for tensor descriptors."""
    if TensorDescriptor is None:
        return False
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in t.stride()[:-1]):
            return False
    device = tensors[0].device
    return device.type != "cuda" or _cuda_properties(device.index)[0] >= 9


@functools.cache
def _cuda_properties(index: int | None) -> tuple[int, int]:
    """(major compute capability, multiprocessor count) of a CUDA device, read once: every launch asks."""
    props = torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device())
    return props.major, props.multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the H100's count elsewhere: the interpreter has none)."""
    if device.type != "cuda":
        return NUM_SMS_H100
    return _cuda_properties(device.index)[1]


def get_syrk_configs(batch: int, m: int, k: int, num_sms: int = NUM_SMS_H100, tma: bool = False) -> list[SyrkConfig]:
    """Candidates for one shape: 128-tiles (Hopper wgmma sweet spot); where the 128-tiles are a wave or two at
    most, 64 x 128 tiles through TMA (the wide kernel) when ``tma`` (see :func:`tma_compatible`), else 64-tiles
    only where the 128-tiles cannot fill the SMs (more programs for a single small matrix); K splits when even
    those are fewer than the SMs; and the persistent TMA kernel at 128-tiles, alone and in pairs, when ``tma``.

    Every candidate costs a compile on a shape's first call, so the list holds only configs that won somewhere:
    over the 36 shape decisions of ``docs/results/bench/ns_run14.json`` the 64-tiles won only for single 1024-row
    matrices (36 tiles of 128 on 132 SMs), and a 3-stage persistent variant never won, so it is gone. The wide
    kernel beat the pointer 64-tiles on every single-matrix shape of runs 40 and 45 (e.g. 8.6 against 10.8 us at
    1 x 1024 x 2048), with a 128-wide K block, except at 2048 x 2048 (a 64-wide one, 3 stages). The persistent
    kernel with one warpgroup (4 warps) and 4 or 5 stages beat two warpgroups by 2-12% on the batched Gram-form
    shapes of ``docs/results/bench/syrk_configs_h100.json`` (1.3B's 24 x 2048 x 8192 Gram matrices: 1.58 against
    1.81 ms on one H100); 2 to 4 programs per SM never did."""
    tiles = lambda blk: batch * (triton.cdiv(m, blk) * (triton.cdiv(m, blk) + 1) // 2)  # noqa: E731
    out = [SyrkConfig(128, 64, 1, 8, 4)]
    if tiles(128) < num_sms and not tma:
        out.append(SyrkConfig(64, 64, 1, 4, 4))
    if tma:
        out += [SyrkConfig(128, 64, 1, 8, 4, persistent=True), SyrkConfig(128, 64, 1, 4, 5, persistent=True),
                SyrkConfig(128, 64, 1, 4, 4, persistent=True), SyrkConfig(128, 64, 1, 8, 3, persistent=True, pair=True)]
        if tiles(128) <= 2 * num_sms:
            out += [SyrkConfig(64, 128, 1, 4, 4, wide=True), SyrkConfig(64, 64, 1, 4, 3, wide=True)]
    for split in (2, 4, 8):
        if tiles(128) * split <= 2 * num_sms and k // split >= 256:
            out.append(SyrkConfig(128, 64, split, 8, 4))
        if tiles(64) * split <= 2 * num_sms and k // split >= 256:
            out.append(SyrkConfig(64, 64, split, 4, 4))
    return out


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _lower_tile(p):
    """Lower-triangle tile (ti, tj), ti >= tj, numbered row by row: p = ti (ti + 1) / 2 + tj. The float root is
    fixed up by one either way."""
    ti = ((tl.sqrt(8.0 * p.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
    ti = tl.where(ti * (ti + 1) // 2 > p, ti - 1, ti)
    ti = tl.where((ti + 1) * (ti + 2) // 2 <= p, ti + 1, ti)
    return ti, p - ti * (ti + 1) // 2


@triton.jit
def _symmetrized(tile, BLOCK: tl.constexpr):
    """A diagonal tile with its upper half replaced by its lower half mirrored: exactly symmetric."""
    loc = tl.arange(0, BLOCK)
    return tl.where(loc[:, None] < loc[None, :], tile.T, tile)


@triton.jit
def masked_dot(a_ptrs, b_ptrs, stride_ak, stride_bk, k0, k_len, K,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``A[:, k0:k0 + k_len] @ B[k0:k0 + k_len, :]`` of one output tile in fp32, columns k >= K read as zero.

    a_ptrs: ``(BLOCK_M, BLOCK_K)`` pointers to A's tile at column k0 (``stride_ak`` between columns); b_ptrs:
    ``(BLOCK_K, BLOCK_N)`` pointers to B's tile at row k0 (``stride_bk`` between rows). The K loop of the pointer
    kernels (the SYRK's and the update's)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, k_len, BLOCK_K):
        kmask = (k0 + k + offs_k) < K
        a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _syrk_kernel(
    # pointers
    x_ptr, w_ptr, y_ptr, out_ptr,
    # sizes: M rows of X and W (C is M x M), K columns, K_PER_SPLIT columns per split (a multiple of BLOCK_K)
    M, K, K_PER_SPLIT,
    # strides (batch, row, col); out is C, or the (split * batch, M, M) workspace when PARTIAL
    stride_xb, stride_xm, stride_xk,
    stride_wb, stride_wm, stride_wk,
    stride_yb, stride_ym, stride_yn,
    stride_ob, stride_om, stride_on,
    # runtime coefficients
    alpha, beta,
    # meta-parameters
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, HAS_Y: tl.constexpr, PARTIAL: tl.constexpr,
):
    bid = tl.program_id(1)
    sid = tl.program_id(2)
    ti, tj = _lower_tile(tl.program_id(0))

    offs_i = ti * BLOCK + tl.arange(0, BLOCK)
    offs_j = tj * BLOCK + tl.arange(0, BLOCK)
    offs_k = tl.arange(0, BLOCK_K)
    # rows past M wrap around (always in bounds); their results are masked at the store
    rows_i = offs_i % M
    rows_j = offs_j % M
    k_start = sid * K_PER_SPLIT
    a_ptrs = (x_ptr + bid.to(tl.int64) * stride_xb + rows_i[:, None] * stride_xm
              + (k_start + offs_k)[None, :] * stride_xk)  # (BLOCK, BLOCK_K)
    bt_ptrs = (w_ptr + bid.to(tl.int64) * stride_wb + rows_j[None, :] * stride_wm
               + (k_start + offs_k)[:, None] * stride_wk)  # (BLOCK_K, BLOCK)

    acc = masked_dot(a_ptrs, bt_ptrs, stride_xk, stride_wk, k_start, K_PER_SPLIT, K, BLOCK, BLOCK, BLOCK_K)

    mask = (offs_i[:, None] < M) & (offs_j[None, :] < M)
    mask_t = (offs_j[:, None] < M) & (offs_i[None, :] < M)
    if PARTIAL:
        ob = out_ptr + (sid * tl.num_programs(1) + bid).to(tl.int64) * stride_ob
        tile = acc
    else:
        ob = out_ptr + bid.to(tl.int64) * stride_ob
        acc = acc * alpha
        if HAS_Y:
            y = tl.load(y_ptr + bid.to(tl.int64) * stride_yb + offs_i[:, None] * stride_ym
                        + offs_j[None, :] * stride_yn, mask=mask, other=0.0)
            acc += beta * y.to(tl.float32)
        tile = acc.to(out_ptr.dtype.element_ty)
    if ti == tj:  # a diagonal tile's upper half mirrors its lower half, so C is exactly symmetric
        tile = _symmetrized(tile, BLOCK)
    tl.store(ob + offs_i[:, None] * stride_om + offs_j[None, :] * stride_on, tile, mask=mask)
    if ti != tj:
        tl.store(ob + offs_j[:, None] * stride_om + offs_i[None, :] * stride_on, tl.trans(tile), mask=mask_t)


@triton.jit
def _lower_pair(p):
    """Tile pair (ti, tj), (ti, tj + 1) of the lower triangle, tj even; pairs numbered row by row. Rows 2r and
    2r + 1 hold r + 1 pairs each, so rows before 2r hold r (r + 1); the float root is fixed up by one either way.
    The pair's second tile is above the diagonal when tj = ti (and past the edge when tj + 1 = T)."""
    r = ((tl.sqrt(4.0 * p.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
    r = tl.where(r * (r + 1) > p, r - 1, r)
    r = tl.where((r + 1) * (r + 2) <= p, r + 1, r)
    q = p - r * (r + 1)
    return 2 * r + q // (r + 1), 2 * (q % (r + 1))


@triton.jit
def _store_mirrored(o_desc, y_desc, bid, ti, tj, acc, M, alpha, beta,
                    BLOCK: tl.constexpr, HAS_Y: tl.constexpr):
    """Epilogue of tile (ti, tj): ``alpha acc + beta Y`` stored at (ti, tj) and mirrored to (tj, ti). A diagonal
    tile's upper half is its lower half mirrored, so C is exactly symmetric. A tile above the diagonal (the unused
    half of a pair) and a diagonal tile's mirror go to row M, wholly outside C, where the copy engine writes nothing
    (a branch here would stop the compiler from flattening the loop nest)."""
    acc = acc * alpha
    if HAS_Y:
        acc += beta * y_desc.load([bid, ti * BLOCK, tj * BLOCK]).reshape(BLOCK, BLOCK).to(tl.float32)
    out = acc.to(o_desc.dtype)
    out_t = out.T
    rows = ti * BLOCK + tl.arange(0, BLOCK)
    cols = tj * BLOCK + tl.arange(0, BLOCK)
    out = tl.where(rows[:, None] < cols[None, :], out_t, out)  # above the diagonal only within a diagonal tile
    o_desc.store([bid, tl.where(tj <= ti, ti * BLOCK, M), tj * BLOCK], out.reshape(1, BLOCK, BLOCK))
    o_desc.store([bid, tl.where(tj < ti, tj * BLOCK, M), ti * BLOCK], out_t.reshape(1, BLOCK, BLOCK))


@triton.jit
def _syrk_tma_kernel(
    # tensor descriptors: X and W (batch, M, K) in (1, BLOCK, BLOCK_K) blocks, Y and out (batch, M, M) in
    # (1, BLOCK, BLOCK)
    x_desc, w_desc, y_desc, o_desc,
    # M x K matrices X; work items (tiles, or pairs of tiles) in the whole batch and per matrix; programs in the grid
    M, K, num_items, items_per_matrix, num_programs,
    # runtime coefficients
    alpha, beta,
    # meta-parameters; PAIR: each item is two tiles side by side on one row, (ti, tj) and (ti, tj + 1), which
    # share the row tile's loads (a BLOCK x 2 BLOCK output, as wide as the GEMMs that run fastest on Hopper)
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, HAS_Y: tl.constexpr, PAIR: tl.constexpr,
):
    # one program per SM; each walks items p, p + num_programs, ... of the batch. The flattened loop nest lets
    # the compiler pipeline the next item's loads under this item's epilogue.
    for item in tl.range(tl.program_id(0), num_items, num_programs, flatten=True):
        bid = item // items_per_matrix
        if PAIR:
            ti, tj = _lower_pair(item - bid * items_per_matrix)
        else:
            ti, tj = _lower_tile(item - bid * items_per_matrix)
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = x_desc.load([bid, ti * BLOCK, k]).reshape(BLOCK, BLOCK_K)
            b = w_desc.load([bid, tj * BLOCK, k]).reshape(BLOCK, BLOCK_K)
            acc = tl.dot(a, b.T, acc)
            if PAIR:
                b2 = w_desc.load([bid, (tj + 1) * BLOCK, k]).reshape(BLOCK, BLOCK_K)
                acc2 = tl.dot(a, b2.T, acc2)
        _store_mirrored(o_desc, y_desc, bid, ti, tj, acc, M, alpha, beta, BLOCK, HAS_Y)
        if PAIR:
            _store_mirrored(o_desc, y_desc, bid, ti, tj + 1, acc2, M, alpha, beta, BLOCK, HAS_Y)


@triton.jit
def _syrk_wide_kernel(
    # tensor descriptors: X (batch, M, K) in (1, BLOCK, BLOCK_K) blocks, W in (1, 2 BLOCK, BLOCK_K); Y in
    # (1, BLOCK, 2 BLOCK); the output C three times: in (1, BLOCK, 2 BLOCK), (1, 2 BLOCK, BLOCK) and
    # (1, BLOCK, BLOCK) blocks
    x_desc, w_desc, y_desc, o_desc, ot_desc, q_desc,
    # K columns of X and W; runtime coefficients
    K, alpha, beta,
    # meta-parameters
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, HAS_Y: tl.constexpr,
):
    # one program per BLOCK x 2 BLOCK output tile of the lower triangle (numbered as _lower_pair's pairs): the
    # shape of one Hopper warpgroup's MMA at BLOCK = 64, and ~72 programs for a single 1024-row C
    bid = tl.program_id(1)
    ti, tj = _lower_pair(tl.program_id(0))
    r0 = ti * BLOCK
    c0 = tj * BLOCK
    acc = tl.zeros((BLOCK, 2 * BLOCK), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = x_desc.load([bid, r0, k]).reshape(BLOCK, BLOCK_K)
        b = w_desc.load([bid, c0, k]).reshape(2 * BLOCK, BLOCK_K)
        acc = tl.dot(a, b.T, acc)
    acc = acc * alpha
    if HAS_Y:
        acc += beta * y_desc.load([bid, r0, c0]).reshape(BLOCK, 2 * BLOCK).to(tl.float32)
    out = acc.to(o_desc.dtype)
    if c0 + 2 * BLOCK <= r0:  # wholly below the diagonal: stored and mirrored whole
        o_desc.store([bid, r0, c0], out.reshape(1, BLOCK, 2 * BLOCK))
        ot_desc.store([bid, c0, r0], out.T.reshape(1, 2 * BLOCK, BLOCK))
    else:
        # the diagonal crosses one of the two halves: that half is symmetrized and stored once; a half below it is
        # stored and mirrored; a half above it is another tile's mirror, not stored. Every element of C is then
        # written once, or twice from one value: C is exactly symmetric
        left, right = tl.split(tl.reshape(out, (BLOCK, 2, BLOCK)).permute(0, 2, 1))
        if c0 == r0:
            q_desc.store([bid, r0, c0], _symmetrized(left, BLOCK).reshape(1, BLOCK, BLOCK))
        else:
            q_desc.store([bid, r0, c0], left.reshape(1, BLOCK, BLOCK))
            q_desc.store([bid, c0, r0], left.T.reshape(1, BLOCK, BLOCK))
            q_desc.store([bid, r0, c0 + BLOCK], _symmetrized(right, BLOCK).reshape(1, BLOCK, BLOCK))


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr, y_ptr, out_ptr,  # ws: (SPLIT, N) fp32; y, out: N contiguous elements
    N, SPLIT,
    alpha, beta,
    HAS_Y: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(ws_ptr + s * N + offs, mask=mask, other=0.0)
    acc = acc * alpha
    if HAS_Y:
        acc += beta * tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------- launcher


def _pairs(T: int) -> int:
    """Tile pairs (or wide tiles) covering the lower triangle of T x T tiles: row i holds i // 2 + 1."""
    return sum(i // 2 + 1 for i in range(T))


def _launch_tma(X: Tensor, W: Tensor, Y: Tensor | None, out: Tensor, alpha: float, beta: float,
                cfg: SyrkConfig) -> None:
    batch, m, k = X.shape
    T = triton.cdiv(m, cfg.block)
    per_matrix = _pairs(T) if cfg.pair else T * (T + 1) // 2
    items = batch * per_matrix
    programs = min(items, num_sms(X.device))
    x_desc = TensorDescriptor.from_tensor(X, [1, cfg.block, cfg.block_k])
    w_desc = x_desc if W is X else TensorDescriptor.from_tensor(W, [1, cfg.block, cfg.block_k])
    o_desc = TensorDescriptor.from_tensor(out, [1, cfg.block, cfg.block])
    y_desc = TensorDescriptor.from_tensor(Y, [1, cfg.block, cfg.block]) if Y is not None else o_desc
    launch_kernel(_syrk_tma_kernel, (programs,),
        x_desc, w_desc, y_desc, o_desc, m, k, items, per_matrix, programs, alpha, beta,
        BLOCK=cfg.block, BLOCK_K=cfg.block_k, HAS_Y=Y is not None, PAIR=cfg.pair,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _launch_wide(X: Tensor, W: Tensor, Y: Tensor | None, out: Tensor, alpha: float, beta: float,
                 cfg: SyrkConfig) -> None:
    batch, m, k = X.shape
    b, bk = cfg.block, cfg.block_k
    o_desc = TensorDescriptor.from_tensor(out, [1, b, 2 * b])
    launch_kernel(_syrk_wide_kernel, (_pairs(triton.cdiv(m, b)), batch),
        TensorDescriptor.from_tensor(X, [1, b, bk]), TensorDescriptor.from_tensor(W, [1, 2 * b, bk]),
        TensorDescriptor.from_tensor(Y, [1, b, 2 * b]) if Y is not None else o_desc, o_desc,
        TensorDescriptor.from_tensor(out, [1, 2 * b, b]), TensorDescriptor.from_tensor(out, [1, b, b]),
        k, alpha, beta, BLOCK=b, BLOCK_K=bk, HAS_Y=Y is not None, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def _launch(X: Tensor, W: Tensor, Y: Tensor | None, out: Tensor, alpha: float, beta: float,
            cfg: SyrkConfig) -> None:
    if cfg.persistent:
        _launch_tma(X, W, Y, out, alpha, beta, cfg)
        return
    if cfg.wide:
        _launch_wide(X, W, Y, out, alpha, beta, cfg)
        return
    batch, m, k = X.shape
    T = triton.cdiv(m, cfg.block)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    y = Y if Y is not None else out  # unread when HAS_Y is False
    partial = split > 1
    dst = torch.empty((split * batch, m, m), device=X.device, dtype=torch.float32) if partial else out
    launch_kernel(_syrk_kernel, (T * (T + 1) // 2, batch, split),
        X, W, y, dst, m, k, k_per_split,
        X.stride(0), X.stride(1), X.stride(2),
        W.stride(0), W.stride(1), W.stride(2),
        y.stride(0), y.stride(1), y.stride(2),
        dst.stride(0), dst.stride(1), dst.stride(2),
        alpha, beta,
        BLOCK=cfg.block, BLOCK_K=cfg.block_k, HAS_Y=Y is not None, PARTIAL=partial,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if partial:
        n = batch * m * m
        block = 1024
        launch_kernel(_splitk_reduce_kernel, (triton.cdiv(n, block),), dst, y, out, n, split, alpha, beta,
                      HAS_Y=Y is not None, BLOCK=block, num_warps=4)


def syrk(X: Tensor, alpha: float = 1.0, beta: float = 0.0, Y: Tensor | None = None, *, W: Tensor | None = None,
         config: SyrkConfig | None = None) -> Tensor:
    """``alpha X W^T + beta Y`` for a batch of matrices, computing only the lower-triangle tiles (W = X by default:
    ``alpha X X^T + beta Y``).

    X: ``(batch, m, k)``, bf16 or fp16 (fp32 works, with Triton's tf32 dot), any strides. W: None, or a tensor of
    X's shape and dtype with ``X W^T`` symmetric (the caller's promise: the upper tiles are mirrors of the lower
    ones, never computed). Y: ``(batch, m, m)`` symmetric, contiguous, or None. alpha, beta: Python floats (runtime
    values, no recompilation). Returns a contiguous ``(batch, m, m)`` tensor in X's dtype, accumulated in fp32.
    ``config`` overrides the tuned choice (tests use it to reach every code path at small sizes).
    """
    if X.ndim != 3:
        raise ValueError(f"syrk takes a (batch, m, k) tensor, got shape {tuple(X.shape)}")
    batch, m, _ = X.shape
    if Y is not None and (Y.shape != (batch, m, m) or not Y.is_contiguous()):
        raise ValueError(f"syrk's Y must be a contiguous (batch, m, m) = {(batch, m, m)} tensor, got shape "
                         f"{tuple(Y.shape)} with strides {Y.stride()}")
    if W is not None and (W.shape != X.shape or W.dtype != X.dtype or W.device != X.device):
        raise ValueError(f"syrk's W must match X: shape {tuple(X.shape)}, {X.dtype} on {X.device}; got shape "
                         f"{tuple(W.shape)}, {W.dtype} on {W.device}")
    W = X if W is None else W
    out = torch.empty((batch, m, m), device=X.device, dtype=X.dtype)
    tma = tma_compatible(X, W, out) if Y is None else tma_compatible(X, W, Y, out)
    if config is None:
        key = ("syrk", tuple(X.shape), X.stride(), W.stride(), X.dtype, X.device, Y is not None, tma)
        config = pick(key, lambda: get_syrk_configs(*X.shape, num_sms=num_sms(X.device), tma=tma),
                      lambda c: _launch(X, W, Y, out, alpha, beta, c), X.device)
    elif (config.persistent or config.wide) and not tma:
        raise ValueError("the TMA SYRK kernels need X (and W) with a contiguous last dimension and 16-byte "
                         "aligned rows (m and k multiples of 8 in bf16), Triton >= 3.3 and a compute capability "
                         f">= 9 GPU; got X of shape {tuple(X.shape)}, strides {X.stride()}, {X.dtype}: pass "
                         "config=None to let the tuner choose")
    _launch(X, W, Y, out, float(alpha), float(beta), config)
    return out


# ----------------------------------------------------------------------------------------------- torch reference


def syrk_reference(X: Tensor, alpha: float = 1.0, beta: float = 0.0, Y: Tensor | None = None, *,
                   W: Tensor | None = None) -> Tensor:
    """``alpha X W^T + beta Y`` (W = X by default) by ``torch.baddbmm`` (cuBLAS on CUDA): ``(batch, m, k)`` ->
    ``(batch, m, m)``, every tile computed."""
    Wt = (X if W is None else W).mT
    if Y is None:
        return torch.bmm(X, Wt) if alpha == 1.0 else torch.bmm(X, Wt).mul_(alpha)
    return torch.baddbmm(Y, X, Wt, beta=beta, alpha=alpha)
