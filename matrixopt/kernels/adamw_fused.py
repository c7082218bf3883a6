"""AdamW's update of many tensors in one Triton launch per dtype pair (the dispatch and the torch reference live in
:mod:`matrixopt.kernels.muon_elementwise`).

Why not ``torch._fused_adamw_``: its multi-tensor launches take at most a few hundred chunks each, fewer than an
H100 keeps in flight, so the update of GPT-2's embeddings ran at ~2.4 TB/s where our other elementwise kernels
reach ~2.9 (docs/results/bench). Here every tensor is cut into chunks of :data:`CHUNK` elements and one launch
covers them all: program ``i`` reads its tensor and offset from a chunk map (cached by the tensors' sizes) and the
tensor's addresses from a table (cached by content, like the Muon kernels' tables). It also reads the
skip flag of the deferred non-finite check for parameters of any dtype, where the torch path checks bf16 ones on
the host. Per element, as ``torch.optim.AdamW``:

    w <- w (1 - lr wd);   m <- m + (1 - beta1)(g - m);   v <- beta2 v + (1 - beta2) g^2
    w <- w - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

with t the tensor's step count (a 0-d float32 tensor on the device, incremented by the caller), float32 math and
float32 moments for parameters of any dtype.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - the dispatcher falls back to the torch reference
    raise ImportError("matrixopt.kernels.adamw_fused needs Triton: pip install triton") from e

from matrixopt.kernels.muon_fused import _TL_DTYPES, _table

CHUNK = 1 << 16  # elements per program: ~1.2k programs for GPT-2-small's embeddings, several per SM
BLOCK = 1024  # elements per iteration of a program's loop (8 per thread at 4 warps)


@triton.jit
def _adamw_kernel(
    # (c, 2) int64 chunk map: the row of ``table`` and the element offset of each program's chunk
    chunks_ptr,
    # (k, 6) int64 table: parameter, gradient, exp_avg, exp_avg_sq and step addresses, number of elements
    table_ptr,
    # runtime values: learning rate (or its address when LR_PTR), betas, eps, weight decay
    lr, beta1, beta2, eps, weight_decay,
    # 0-d float32 flag read when HAS_SKIP: nonzero writes nothing
    skip_ptr,
    P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, LR_PTR: tl.constexpr, HAS_SKIP: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = table_ptr + tl.load(chunks_ptr + pid * 2) * 6
    start = tl.load(chunks_ptr + pid * 2 + 1)
    p_ptr = tl.load(row).to(tl.pointer_type(P_DTYPE)) + start
    g_ptr = tl.load(row + 1).to(tl.pointer_type(G_DTYPE)) + start
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32)) + start
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32)) + start
    t = tl.load(tl.load(row + 4).to(tl.pointer_type(tl.float32)))
    n = tl.minimum(tl.load(row + 5) - start, CHUNK)
    if HAS_SKIP:
        n = tl.where(tl.load(skip_ptr) == 0, n, 0)
    if LR_PTR:
        lr_value = tl.load(lr).to(tl.float32)
    else:
        lr_value = lr
    # bias corrections in float32 from t, as torch's fused AdamW (beta^t = 2^(t log2 beta))
    bc1 = 1.0 - tl.exp2(t * tl.log2(beta1))
    bc2_sqrt = tl.sqrt(1.0 - tl.exp2(t * tl.log2(beta2)))
    step_size = lr_value / bc1
    decay = 1.0 - lr_value * weight_decay
    for off in range(0, CHUNK, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        w = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = m + (1.0 - beta1) * (g - m)
        v = beta2 * v + (1.0 - beta2) * g * g
        w = w * decay - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(p_ptr + offs, w.to(P_DTYPE), mask=mask)


_CHUNK_MAPS: OrderedDict[tuple, Tensor] = OrderedDict()
_CHUNK_MAPS_KEPT = 64


def _chunk_map(sizes: tuple[int, ...], device: torch.device) -> Tensor:
    """``(c, 2)`` int64 on ``device``: ``(tensor index, element offset)`` of every chunk, cached by the sizes."""
    key = (device, sizes)
    chunks = _CHUNK_MAPS.get(key)
    if chunks is None:
        counts = torch.tensor([max(1, -(-n // CHUNK)) for n in sizes], dtype=torch.int64)
        index = torch.repeat_interleave(torch.arange(len(sizes)), counts)
        first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        offset = (torch.arange(len(index)) - first) * CHUNK
        chunks = _CHUNK_MAPS[key] = torch.stack([index, offset], 1).to(device, non_blocking=True)
        if len(_CHUNK_MAPS) > _CHUNK_MAPS_KEPT:
            _CHUNK_MAPS.popitem(last=False)
    else:
        _CHUNK_MAPS.move_to_end(key)
    return chunks


def adamw_triton(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                 exp_avg_sqs: Sequence[Tensor], steps: Sequence[Tensor], *, lr: float | Tensor, beta1: float,
                 beta2: float, eps: float, weight_decay: float, skip: Tensor | None = None) -> None:
    """One AdamW step on every tensor, in place (module docstring), after the caller incremented ``steps``.

    params: contiguous tensors of one float dtype (fp32, bf16 or fp16); grads: contiguous, their shapes, one float
    dtype; exp_avgs, exp_avg_sqs: contiguous float32, their shapes; steps: 0-d float32 each, all on one device. lr: a
    float or a 0-d tensor on that device. skip: a 0-d float32 device flag; where nonzero at run time nothing is
    written."""
    k = len(params)
    if not k:
        return
    for i, (p, g, m, v, t) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps)):
        if not (g.shape == m.shape == v.shape == p.shape and m.dtype == v.dtype == t.dtype == torch.float32
                and t.numel() == 1 and all(x.is_contiguous() for x in (p, g, m, v))):
            raise ValueError(f"adamw_triton: tensor {i} needs contiguous parameter, gradient and float32 moments of "
                             f"one shape and a float32 step; got {tuple(p.shape)}, {tuple(g.shape)} {g.dtype}, "
                             f"{tuple(m.shape)} {m.dtype}, {tuple(v.shape)} {v.dtype}, step {t.dtype}")
    if len({p.dtype for p in params}) > 1 or len({g.dtype for g in grads}) > 1:
        raise ValueError("adamw_triton: the parameters share one dtype, and so do the gradients")
    device = params[0].device
    table = _table([[p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), t.data_ptr(), p.numel()]
                    for p, g, m, v, t in zip(params, grads, exp_avgs, exp_avg_sqs, steps)], device)
    chunks = _chunk_map(tuple(p.numel() for p in params), device)
    lr_ptr = isinstance(lr, Tensor)
    _adamw_kernel[(chunks.shape[0],)](
        chunks, table, lr.to(device) if lr_ptr else float(lr), float(beta1), float(beta2), float(eps),
        float(weight_decay), table if skip is None else skip,
        P_DTYPE=_TL_DTYPES[params[0].dtype], G_DTYPE=_TL_DTYPES[grads[0].dtype], LR_PTR=lr_ptr,
        HAS_SKIP=skip is not None, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4)
