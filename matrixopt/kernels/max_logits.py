r"""The largest pre-softmax logit of each attention head, without the scores in memory: a Triton kernel for
QK-clip's per-head max (:func:`matrixopt.distributed.qk_clip.max_logits_per_head` dispatches to it on CUDA and holds
the torch reference).

For query head h (key head ``h // g`` under grouped-query attention, ``g = H / H_kv``) it computes
:math:`\max_{b, i, j \le i} q_{b,h,i} \cdot k_{b,h//g,j}` (all j without ``causal``), as flash attention forms
its scores: tile by tile in registers, each tile reduced to its max at once. The scores are never written: a
``(B, H, T, T)`` fp32 score tensor at GPT-2-small's shape is 800 MB per layer, read and written twice by the
torch reference.

Blocked algorithm, one program per (batch x head, query block)::

    q = Q[b, h, i0:i0+BLOCK_M, :]                       (BLOCK_M, D), zero past T and past d
    best = -inf per query
    for j0 in 0 .. (i0 + BLOCK_M if causal else T_k) step BLOCK_N:
        s = q @ K[b, h // g, j0:j0+BLOCK_N, :]^T        fp32 accumulation
        s = -inf where j >= T_k, i >= T, or (causal) j > i
        best = max(best, rowmax(s))
    out[b * H + h, block] = max(best)

Products of bf16 or fp16 inputs are exact in the fp32 accumulator; fp32 inputs are multiplied in IEEE fp32
(``input_precision="ieee"``), not TF32, so the max is the model's logit to fp32 rounding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from matrixopt.kernels._tuning import import_triton

triton, tl = import_triton(__name__)

# ----------------------------------------------------------------------------------------------- configs

# 64 x 64 score tiles: a head_size-64 q block and k block are 8 KB each in bf16; memory-light, so no tuning.
BLOCK_M, BLOCK_N, NUM_WARPS = 64, 64, 4
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# ----------------------------------------------------------------------------------------------- kernel


@triton.jit
def _max_logits_kernel(
    # q (B, H, T, d), k (B, H_kv, T_k, d), any strides; out (B * H, cdiv(T, BLOCK_M)) fp32
    q_ptr, k_ptr, out_ptr,
    # sizes: heads, query heads per key head, queries, keys, head size
    H, G, T, T_k, d,
    # strides of q and k (batch, head, position, feature)
    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d,
    # meta-parameters: D = head size rounded up to a power of two (>= 16)
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
):
    bh = tl.program_id(0)  # batch x head on the large grid dim (B * H may pass 65535)
    pid_m = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q_ptrs = q_ptr + b.to(tl.int64) * sq_b + h * sq_h + offs_m[:, None] * sq_t + offs_d[None, :] * sq_d
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < T) & (offs_d[None, :] < d), other=0.0)
    k_base = k_ptr + b.to(tl.int64) * sk_b + (h // G) * sk_h
    best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    if CAUSAL:
        k_end = tl.minimum((pid_m + 1) * BLOCK_M, T_k)
    else:
        k_end = T_k
    for j0 in range(0, k_end, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + offs_n[None, :] * sk_t + offs_d[:, None] * sk_d,
                    mask=(offs_n[None, :] < T_k) & (offs_d[:, None] < d), other=0.0)  # (D, BLOCK_N)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        valid = (offs_m[:, None] < T) & (offs_n[None, :] < T_k)
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        best = tl.maximum(best, tl.max(tl.where(valid, s, float("-inf")), axis=1))
    tl.store(out_ptr + bh * tl.num_programs(1) + pid_m, tl.max(best, axis=0))


# ----------------------------------------------------------------------------------------------- launcher


def max_logits_triton(q: Tensor, k: Tensor, causal: bool = True) -> Tensor:
    """``(H,)`` fp32: each query head's max unscaled logit ``q . k`` (module docstring); -inf for a head with no
    attended position. q ``(B, H, T, d)``, k ``(B, H_kv, T_k, d)`` with H_kv dividing H, both one of
    :data:`KERNEL_DTYPES`, any strides, on the same device."""
    B, H, T, d = q.shape
    H_kv, T_k = k.shape[1], k.shape[2]
    if q.dtype not in KERNEL_DTYPES or k.dtype != q.dtype or H % H_kv or k.shape[0] != B or k.shape[3] != d:
        raise ValueError(f"max_logits_triton takes q (B, H, T, d) and k (B, H_kv, T_k, d) of one dtype among "
                         f"{KERNEL_DTYPES}, H_kv dividing H; got q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} "
                         f"{k.dtype}")
    blocks = triton.cdiv(T, BLOCK_M)
    out = torch.full((B * H, max(blocks, 1)), -math.inf, dtype=torch.float32, device=q.device)
    if B * H * T * T_k:
        _max_logits_kernel[(B * H, blocks)](q, k, out, H, H // H_kv, T, T_k, d, *q.stride(), *k.stride(),
                                            CAUSAL=causal, IEEE=q.dtype == torch.float32, BLOCK_M=BLOCK_M,
                                            BLOCK_N=BLOCK_N, D=max(16, triton.next_power_of_2(d)),
                                            num_warps=NUM_WARPS)
    return out.view(B, H, -1).amax(dim=(0, 2))
