r"""The Newton–Schulz X update with its epilogue fused: ``out = a X + B X`` for ``B (batch, m, m)``,
``X (batch, m, n)``.

A batched GEMM whose epilogue reads the X tile at the output position and adds ``a X`` before the single store,
so ``a X`` never takes a pass of its own through memory. ``a`` is a runtime argument.

Blocked algorithm, one program per (output tile, matrix)::

    acc = 0                                            (BLOCK_M, BLOCK_N) fp32
    for k in 0..m step BLOCK_K:
        acc += B[rows, k:k+BLOCK_K] @ X[k:k+BLOCK_K, cols]
    out[rows, cols] = acc + a X[rows, cols]

Output tiles are visited in groups of GROUP_M rows so that consecutive programs share B and X tiles in L2
(the ordering of Triton's matrix-multiplication tutorial).

As for the SYRK (``syrk.py``), two kernels compute the same tiles and the tuner times both where both apply: one
program per tile with pointer loads (any strides), and a persistent grid with TMA loads and stores (contiguous
last dimensions, 16-byte aligned rows, compute capability 9 or newer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from matrixopt.kernels._tuning import import_triton, launch_kernel, pick
from matrixopt.kernels.syrk import NUM_SMS_H100, TensorDescriptor, masked_dot, num_sms, tma_compatible

triton, tl = import_triton(__name__)

# ----------------------------------------------------------------------------------------------- autotune configs


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    persistent: bool = False  # the persistent TMA kernel


def get_ns_update_configs(batch: int, m: int, n: int, num_sms: int = NUM_SMS_H100,
                          tma: bool = False) -> list[GemmConfig]:
    """Candidates: Hopper-friendly 128 x 128 and 128 x 256 tiles; 64 x 128 only where 128 x 128 tiles cannot fill
    the SMs; with ``tma`` the persistent TMA kernel at 128 x 128 too. As for the SYRK (``get_syrk_configs``) every
    candidate costs a compile on a shape's first call: a persistent 8-warp variant never won over the 18 update
    decisions of ``docs/results/bench/ns_run14.json`` and is gone."""
    out = [GemmConfig(128, 128, 64, 8, 8, 4), GemmConfig(128, 256, 64, 8, 8, 3)]
    if batch * triton.cdiv(m, 128) * triton.cdiv(n, 128) < num_sms:
        out.append(GemmConfig(64, 128, 64, 8, 4, 4))
    if tma:  # 128 x 256 tiles with the TMA epilogue need more shared memory than an H100 has
        out.append(GemmConfig(128, 128, 64, 8, 4, 4, persistent=True))
    return out


# ----------------------------------------------------------------------------------------------- kernel


@triton.jit
def _grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Output tile (pid_m, pid_n) of program ``pid``, visiting tiles in groups of GROUP_M tile rows."""
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    return first_m + ((pid % group) % size_m), (pid % group) // size_m


@triton.jit
def _ns_update_kernel(
    # pointers
    b_ptr, x_ptr, out_ptr,
    # sizes: B is M x M, X and out are M x N
    M, N,
    # strides (batch, row, col)
    stride_bb, stride_bm, stride_bk,
    stride_xb, stride_xm, stride_xn,
    stride_ob, stride_om, stride_on,
    # runtime coefficient
    a,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    bid = tl.program_id(1).to(tl.int64)
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows / cols past the edge wrap around (always in bounds); masked at the store
    rows = offs_m % M
    cols = offs_n % N
    b_ptrs = b_ptr + bid * stride_bb + rows[:, None] * stride_bm + offs_k[None, :] * stride_bk  # (BLOCK_M, BLOCK_K)
    x_ptrs = x_ptr + bid * stride_xb + offs_k[:, None] * stride_xm + cols[None, :] * stride_xn  # (BLOCK_K, BLOCK_N)

    acc = masked_dot(b_ptrs, x_ptrs, stride_bk, stride_xm, 0, M, M, BLOCK_M, BLOCK_N, BLOCK_K)

    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    x_tile = tl.load(x_ptr + bid * stride_xb + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn,
                     mask=mask, other=0.0)
    acc += a * x_tile.to(tl.float32)
    tl.store(out_ptr + bid * stride_ob + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ns_update_tma_kernel(
    # tensor descriptors: B (batch, M, M) in (1, BLOCK_M, BLOCK_K) blocks; X (batch, M, N) in (1, BLOCK_K, BLOCK_N)
    # blocks for the product and (1, BLOCK_M, BLOCK_N) for the epilogue; out (batch, M, N) in (1, BLOCK_M, BLOCK_N)
    b_desc, x_desc, xe_desc, o_desc,
    # sizes; tiles in the whole batch; programs in the grid
    M, N, num_tiles, num_programs,
    # runtime coefficient
    a,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    tiles_per_matrix = num_m * num_n
    for tile in tl.range(tl.program_id(0), num_tiles, num_programs, flatten=True):
        bid = tile // tiles_per_matrix
        pid_m, pid_n = _grouped_tile(tile - bid * tiles_per_matrix, num_m, num_n, GROUP_M)
        row, col = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, M, BLOCK_K):  # reads past M are zero-filled by the copy engine
            bt = b_desc.load([bid, row, k]).reshape(BLOCK_M, BLOCK_K)
            xt = x_desc.load([bid, k, col]).reshape(BLOCK_K, BLOCK_N)
            acc = tl.dot(bt, xt, acc)
        acc += a * xe_desc.load([bid, row, col]).reshape(BLOCK_M, BLOCK_N).to(tl.float32)
        o_desc.store([bid, row, col], acc.to(o_desc.dtype).reshape(1, BLOCK_M, BLOCK_N))


# ----------------------------------------------------------------------------------------------- launcher


def _launch_tma(B: Tensor, X: Tensor, out: Tensor, a: float, cfg: GemmConfig) -> None:
    batch, m, n = X.shape
    num_tiles = batch * triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    programs = min(num_tiles, num_sms(X.device))
    launch_kernel(_ns_update_tma_kernel, (programs,),
        TensorDescriptor.from_tensor(B, [1, cfg.block_m, cfg.block_k]),
        TensorDescriptor.from_tensor(X, [1, cfg.block_k, cfg.block_n]),
        TensorDescriptor.from_tensor(X, [1, cfg.block_m, cfg.block_n]),
        TensorDescriptor.from_tensor(out, [1, cfg.block_m, cfg.block_n]),
        m, n, num_tiles, programs, a,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _launch(B: Tensor, X: Tensor, out: Tensor, a: float, cfg: GemmConfig) -> None:
    if cfg.persistent:
        _launch_tma(B, X, out, a, cfg)
        return
    batch, m, n = X.shape
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), batch)
    launch_kernel(_ns_update_kernel, grid,
        B, X, out, m, n,
        B.stride(0), B.stride(1), B.stride(2),
        X.stride(0), X.stride(1), X.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        a,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def ns_update(B: Tensor, X: Tensor, a: float, *, config: GemmConfig | None = None) -> Tensor:
    """``a X + B X``: B ``(batch, m, m)``, X ``(batch, m, n)``, same float dtype (bf16 or fp16 for the tensor
    cores), any strides. Returns a contiguous ``(batch, m, n)`` tensor in X's dtype, accumulated in fp32.
    ``config`` overrides the tuned choice."""
    if X.ndim != 3 or B.shape != (X.shape[0], X.shape[1], X.shape[1]):
        raise ValueError(f"ns_update takes B (batch, m, m) and X (batch, m, n); got B {tuple(B.shape)}, "
                         f"X {tuple(X.shape)}")
    out = torch.empty(X.shape, device=X.device, dtype=X.dtype)
    tma = tma_compatible(B, X, out)
    if config is None:
        key = ("ns_update", tuple(X.shape), X.stride(), B.stride(), X.dtype, X.device, tma)
        config = pick(key, lambda: get_ns_update_configs(*X.shape, num_sms=num_sms(X.device), tma=tma),
                      lambda c: _launch(B, X, out, a, c), X.device)
    elif config.persistent and not tma:
        raise ValueError("the persistent TMA update needs B and X with contiguous last dimensions and 16-byte "
                         "aligned rows (m and n multiples of 8 in bf16), Triton >= 3.3 and a compute capability "
                         ">= 9 GPU; got B "
                         f"strides {B.stride()}, X of shape {tuple(X.shape)} and strides {X.stride()}: pass "
                         "config=None to let the tuner choose")
    _launch(B, X, out, float(a), config)
    return out


# ----------------------------------------------------------------------------------------------- torch reference


def ns_update_reference(B: Tensor, X: Tensor, a: float) -> Tensor:
    """``a X + B X`` by ``torch.baddbmm`` (cuBLAS on CUDA)."""
    return torch.baddbmm(X, B, X, beta=a, alpha=1.0)
