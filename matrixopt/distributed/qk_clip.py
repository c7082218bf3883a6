"""QK-clip (MuonClip, Kimi K2): after the optimizer step, shrink the query and key rows of every attention head
whose largest pre-softmax logit exceeded a threshold.

For head h the step's max logit is the largest scaled score over the batch and the causal positions,

.. math::
    S^h_{\\max} = \\max_{X \\in B} \\max_{j \\le i} s\\, q^h_i \\cdot k^h_j, \\qquad s = 1/\\sqrt{d_{head}}
    \\text{ (or the model's scale)},

and with :math:`\\gamma_h = \\min(1, \\tau / S^h_{\\max})` the head's rows of :math:`W_q` and :math:`W_k` (and of
their biases) are each multiplied by :math:`\\sqrt{\\gamma_h}`. A logit is bilinear in (W_q, W_k), so it scales by
:math:`\\gamma_h`: the head's max logit on the same batch becomes exactly :math:`\\tau`. Heads at or below
:math:`\\tau` have :math:`\\gamma_h = 1` and are multiplied by exactly 1 (bitwise unchanged). Rotary embeddings
rotate within a head's rows, so they commute with the scale and do not change the row-to-head map.

Grouped-query attention (``n_kv_head < n_head``, query head h reading key head ``h // (n_head // n_kv_head)``):
the query rows of head h take :math:`\\sqrt{\\gamma_h}` and the key rows of KV head g take
:math:`\\sqrt{\\gamma_g}` with :math:`\\gamma_g = \\min_{h \\in g} \\gamma_h = \\min(1, \\tau / \\max_{h \\in g}
S^h_{\\max})`. The head of the group with the largest logit lands exactly on :math:`\\tau`; every other head h of
the group ends at :math:`\\tau \\sqrt{S^h_{\\max} / \\max_{h' \\in g} S^{h'}_{\\max}} \\le \\tau` (when clipped) or
at :math:`\\sqrt{\\gamma_g}\\,S^h_{\\max} < \\tau` (when not). Why: it keeps the paper's symmetric square-root split
between W_q and W_k, reduces to the paper's rule when every group has one head (MHA), and guarantees every head
of the group ends at or below :math:`\\tau`. The price is coupling: a shared key shrinks for every head of its
group, including heads that were below :math:`\\tau` (their query rows are untouched). Kimi K2's MLA recipe
avoids coupling for its one shared component instead (the shared rotary key :math:`k^R` is left alone and the
per-head rotary query takes the whole :math:`\\gamma_h`); applied to a whole GQA key head, that would put all of
the shrinkage on W_q and never shrink W_k. Here the shared key takes its square-root share, as in MHA.

Non-finite max logits (NaN, +Inf: a diverged forward) are skipped, not raised on: they leave their heads
unchanged (a scale of 0 would wipe the head) and are counted in :attr:`QKClipStats.nonfinite`, so the step needs
no host sync. -Inf means "no logit seen here" and is never clipped: under tensor parallelism a rank passes -Inf for
the heads it does not hold, and the MAX all-reduce over the whole group fills them in.

Distribution: max logits are MAX-reduced over ``process_group`` (data and context parallel ranks saw different
tokens), so every rank computes the same scales. Replicated weights (DDP, layer-wise) are then scaled identically
everywhere; a DTensor weight sharded by rows (FSDP2 ``fully_shard``, column-wise TP: ``Shard(0)``, or both:
``(_StridedShard(0), Shard(0))``) has its local rows scaled by the scales of the global rows it holds.

Reference: Kimi Team, "Kimi K2: Open Agentic Intelligence", 2025, sec. 2.1 (MuonClip),
https://arxiv.org/abs/2507.20534.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def _chunk_sizes(n: int, parts: int) -> list[int]:
    """How DTensor ``Shard`` and FSDP2 split n rows over ``parts`` ranks: ``ceil(n / parts)`` each, the remainder
    last, then empty shards."""
    step = -(-n // parts)
    return [max(0, min(step, n - i * step)) for i in range(parts)]


def _local_rows(t: Tensor, name: str) -> tuple[int, int]:
    """``(start, count)``: the global dim-0 rows this rank's local tensor of ``t`` holds (all rows for a plain
    tensor). DTensor placements may be ``Shard(0)`` (nested in mesh-dim order, as DTensor applies them),
    ``Replicate``, or FSDP2's ``_StridedShard(0)`` over a later ``Shard(0)`` (``fully_shard`` on top of column-wise
    TP: the TP shard's rows are split again, so that shard is applied first)."""
    if not isinstance(t, DTensor):
        return 0, t.shape[0]
    mesh, coord = t.device_mesh, t.device_mesh.get_coordinate()
    if coord is None:  # this rank is not in the mesh: it holds nothing
        return 0, 0
    start, count = 0, t.shape[0]
    dims = [i for i, pl in enumerate(t.placements) if isinstance(pl, (Shard, _StridedShard)) and pl.dim % t.ndim == 0]
    for i, placement in enumerate(t.placements):
        strided = isinstance(placement, _StridedShard)
        if not isinstance(placement, Replicate) and not (i in dims and (
                not strided or placement.split_factor == math.prod(mesh.size(j) for j in dims if j > i))):
            raise NotImplementedError(
                f"QK-clip scales rows of `{name}`, a DTensor with placements {t.placements} on a mesh of shape "
                f"{tuple(mesh.shape)}; {placement} is not supported (only Shard(0), Replicate, and FSDP2's "
                f"_StridedShard(0) over column-wise TP). Redistribute the weight or clip a Shard(0) copy")
    for mesh_dim in sorted(dims, key=lambda i: isinstance(t.placements[i], _StridedShard)):
        sizes = _chunk_sizes(count, mesh.size(mesh_dim))
        start += sum(sizes[: coord[mesh_dim]])
        count = sizes[coord[mesh_dim]]
    assert count == t.to_local().shape[0], (name, t.placements, start, count, t.to_local().shape)
    return start, count


def _check_weight(w: Tensor, name: str, rows: int, what: str, fix: str) -> None:
    if w.ndim != 2 or w.shape[0] != rows:
        raise ValueError(f"`{name}` has shape {tuple(w.shape)}, expected ({rows}, d_model) for {what}; {fix}")


def _check_bias(b: Tensor | None, name: str, rows: int) -> None:
    if b is not None and tuple(b.shape) != (rows,):
        raise ValueError(f"`{name}` has shape {tuple(b.shape)}, expected ({rows},) to match its weight's rows; pass "
                         f"the bias of the same projection, or None")


def _check_heads(name: str, n_head: int, n_kv_head: int | None) -> int:
    """Validate the head counts; returns n_kv_head (n_head when None: MHA)."""
    if isinstance(n_head, bool) or not isinstance(n_head, int) or n_head < 1:
        raise ValueError(f"{name}: n_head must be a positive int, got {n_head!r}")
    n_kv = n_head if n_kv_head is None else n_kv_head
    if isinstance(n_kv, bool) or not isinstance(n_kv, int) or n_kv < 1 or n_head % n_kv:
        raise ValueError(f"{name}: n_kv_head must be a positive int dividing n_head={n_head} (query head h reads "
                         f"KV head h // (n_head // n_kv_head)), got {n_kv_head!r}")
    return n_kv


@dataclass(kw_only=True)
class SplitQK:
    """An attention with separate query and key projections (``nn.Linear`` layout, rows = output features).

    Rows of ``q_weight`` ``(n_head * d_head, d_model)`` are heads in order, ``d_head`` contiguous rows each; rows of
    ``k_weight`` ``(n_kv_head * d_head, d_model)`` likewise. Parameters may be plain tensors or DTensors; pass the
    ones the optimizer updates (after ``fully_shard`` / ``parallelize_module``, which replace them)."""

    q_weight: Tensor
    """``(n_head * d_head, d_model)``: W_q."""
    k_weight: Tensor
    """``(n_kv_head * d_head, d_model)``: W_k."""
    n_head: int
    """Query heads."""
    n_kv_head: int | None = None
    """Key/value heads (GQA); must divide n_head. None: n_head (MHA)."""
    q_bias: Tensor | None = None
    """``(n_head * d_head,)``: the query projection's bias, scaled like its rows."""
    k_bias: Tensor | None = None
    """``(n_kv_head * d_head,)``: the key projection's bias."""
    name: str = "attention"
    """How errors name this attention, e.g. ``transformer.h.3.attn``."""

    def __post_init__(self) -> None:
        self.n_kv_head = _check_heads(self.name, self.n_head, self.n_kv_head)
        rows_q = self.q_weight.shape[0] if self.q_weight.ndim == 2 else -1
        if rows_q < 1 or rows_q % self.n_head:
            raise ValueError(f"`{self.name}.q_weight` has shape {tuple(self.q_weight.shape)}; expected "
                             f"(n_head * d_head, d_model) with n_head={self.n_head}: its rows must be a positive "
                             f"multiple of n_head. Check n_head or pass the query projection's weight")
        d = rows_q // self.n_head
        _check_weight(self.k_weight, f"{self.name}.k_weight", self.n_kv_head * d,
                      f"n_kv_head={self.n_kv_head} heads of d_head={d} (from q_weight)",
                      "check n_kv_head or pass the key projection's weight")
        _check_bias(self.q_bias, f"{self.name}.q_bias", rows_q)
        _check_bias(self.k_bias, f"{self.name}.k_bias", self.n_kv_head * d)

    def row_scales(self) -> list[tuple[str, Tensor, Tensor]]:
        """``(name, tensor, index)`` for every tensor to scale: ``index`` ``(rows,)`` int64 maps each global row to
        its entry of the scale vector ``[query heads (n_head) | KV heads (n_kv_head) | 1]``."""
        d = self.q_weight.shape[0] // self.n_head
        q = torch.arange(self.n_head * d) // d  # (n_head * d,)
        k = self.n_head + torch.arange(self.n_kv_head * d) // d  # (n_kv_head * d,)
        out = [(f"{self.name}.q_weight", self.q_weight, q), (f"{self.name}.k_weight", self.k_weight, k)]
        if self.q_bias is not None:
            out.append((f"{self.name}.q_bias", self.q_bias, q))
        if self.k_bias is not None:
            out.append((f"{self.name}.k_bias", self.k_bias, k))
        return out


@dataclass(kw_only=True)
class FusedQKV:
    """An attention with one fused projection ``(n_head * d_head + 2 * n_kv_head * d_head, d_model)``: rows are
    ``[Q; K; V]``, each block heads in order with ``d_head`` contiguous rows per head (the reference GPT's
    ``attn.c_attn.weight``, ``(3 * n_embd, n_embd)``, is this with n_kv_head = n_head).

    Other row layouts are that layout permuted: ``row_order`` ``(rows,)`` says that stored row i is row
    ``row_order[i]`` of ``[Q; K; V]`` (the weight is ``W_qkv[row_order]``). E.g. the reference GPT under tensor
    parallelism stores the rank-major ``[q_0; k_0; v_0; q_1; ...]``, which is
    ``row_order = matrixopt.train.parallelize.rank_major_qkv(n_embd, tp)``; a per-head interleaved
    ``(n_head, 3, d_head)`` layout is ``torch.arange(rows).view(3, n_head, d_head).transpose(0, 1).flatten()``."""

    weight: Tensor
    """``((n_head + 2 * n_kv_head) * d_head, d_model)``: the fused W_qkv (plain tensor or DTensor)."""
    n_head: int
    """Query heads."""
    n_kv_head: int | None = None
    """Key/value heads (GQA); must divide n_head. None: n_head (MHA)."""
    bias: Tensor | None = None
    """``((n_head + 2 * n_kv_head) * d_head,)``: the fused bias, scaled like its rows (V rows never change)."""
    row_order: Tensor | None = None
    """``(rows,)`` int64 permutation: stored row i holds row ``row_order[i]`` of the ``[Q; K; V]`` layout. None:
    the identity."""
    name: str = "attention"
    """How errors name this attention, e.g. ``transformer.h.3.attn.c_attn``."""

    def __post_init__(self) -> None:
        self.n_kv_head = _check_heads(self.name, self.n_head, self.n_kv_head)
        groups = self.n_head + 2 * self.n_kv_head
        rows = self.weight.shape[0] if self.weight.ndim == 2 else -1
        if rows < 1 or rows % groups:
            raise ValueError(
                f"`{self.name}.weight` has shape {tuple(self.weight.shape)}; expected ((n_head + 2 * n_kv_head) * "
                f"d_head, d_model) = ({groups} * d_head, d_model) for n_head={self.n_head}, "
                f"n_kv_head={self.n_kv_head}. Check the head counts or pass the fused QKV weight")
        _check_bias(self.bias, f"{self.name}.bias", rows)
        if self.row_order is not None:
            order = torch.as_tensor(self.row_order)
            if tuple(order.shape) != (rows,) or order.is_floating_point() or not torch.equal(
                    order.sort().values.cpu(), torch.arange(rows)):
                raise ValueError(f"{self.name}: row_order must be a permutation of the {rows} rows of `weight` "
                                 f"(an int tensor of shape ({rows},)), got shape {tuple(order.shape)}, dtype "
                                 f"{order.dtype}; build it as the index that takes [Q; K; V] to the stored order")
            self.row_order = order.long().cpu()

    def row_scales(self) -> list[tuple[str, Tensor, Tensor]]:
        """As :meth:`SplitQK.row_scales`."""
        H, Hkv = self.n_head, self.n_kv_head
        d = self.weight.shape[0] // (H + 2 * Hkv)
        index = torch.cat([
            torch.arange(H * d) // d,  # Q rows: query head
            H + torch.arange(Hkv * d) // d,  # K rows: KV head
            torch.full((Hkv * d,), H + Hkv),  # V rows: the constant 1
        ])  # ((H + 2 Hkv) d,), [Q; K; V] order
        if self.row_order is not None:
            index = index[self.row_order]  # stored order
        out = [(f"{self.name}.weight", self.weight, index)]
        if self.bias is not None:
            out.append((f"{self.name}.bias", self.bias, index))
        return out


AttentionSpec = SplitQK | FusedQKV


@dataclass
class QKClipStats:
    """What one :meth:`QKClip.step` did, as 0-d device tensors (reading them syncs; the step itself does not)."""

    clipped: Tensor
    """int64: query heads whose max logit exceeded the threshold (and so were scaled), over all attentions."""
    max_logit: Tensor
    """The largest reduced max logit over all heads (NaN if any is NaN), fp32 (fp64 for fp64 inputs)."""
    nonfinite: Tensor
    """int64: heads whose reduced max logit was NaN or +Inf, skipped (left unchanged)."""


class QKClip:
    """Per-head QK-clip of a model's attentions; model-independent (see the module docstring for the math).

    threshold: tau > 0, in the units of the max logits passed to :meth:`step` (scaled logits, as the model
    feeds softmax; Kimi K2 uses 100). attentions: one :class:`SplitQK` or :class:`FusedQKV` per attention layer.
    process_group: ranks whose max logits are MAX-reduced before clipping (data/context parallel, and tensor
    parallel ranks when each passes -Inf for heads it does not hold); None: no reduction. Build it after the
    model is parallelized (``fully_shard`` replaces parameters); every rank of ``process_group`` must call
    :meth:`step` together.

    Usage, after ``optimizer.step()``::

        stats = clip.step([layer_max_logits for each attention])  # each (n_head,)
    """

    def __init__(self, threshold: float, attentions: Sequence[AttentionSpec], *,
                 process_group: dist.ProcessGroup | None = None):
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
                math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"QK-clip threshold must be a finite number > 0 (the max logit tau a head may reach; "
                             f"Kimi K2 uses 100), got {threshold!r}")
        attentions = list(attentions)
        if not attentions:
            raise ValueError("QK-clip attentions is empty: pass one SplitQK or FusedQKV per attention layer")
        seen: dict[int, str] = {}
        self.threshold = float(threshold)
        self.attentions = attentions
        self.process_group = process_group
        self._targets: list[list[tuple[Tensor, Tensor]]] = []  # per attention: (tensor, local row index)
        for i, spec in enumerate(attentions):
            if not isinstance(spec, (SplitQK, FusedQKV)):
                raise ValueError(f"QK-clip attentions[{i}] is a {type(spec).__name__}; pass SplitQK or FusedQKV")
            targets = []
            for name, t, index in spec.row_scales():
                if id(t) in seen:
                    raise ValueError(f"`{name}` is also `{seen[id(t)]}`: a tensor listed twice would be scaled "
                                     f"twice. List each attention's projections once")
                seen[id(t)] = name
                start, count = _local_rows(t, name)
                targets.append((t, index[start: start + count].to(_local(t).device)))
            self._targets.append(targets)
        self.n_heads = [spec.n_head for spec in attentions]

    def reduce(self, max_logits: Tensor | Sequence[Tensor]) -> Tensor:
        """The max logits as one flat ``(sum of n_head,)`` tensor (a copy), MAX-reduced over ``process_group``:
        fp32, or fp64 for fp64 inputs. ``max_logits``: one ``(n_head,)`` tensor per attention, or
        ``(n_attention, n_head)``."""
        rows = list(max_logits.unbind(0)) if isinstance(max_logits, Tensor) and max_logits.ndim == 2 else max_logits
        if isinstance(rows, Tensor) or len(rows) != len(self.n_heads) or any(
                not isinstance(m, Tensor) or tuple(m.shape) != (h,) for m, h in zip(rows, self.n_heads)):
            got = (tuple(max_logits.shape) if isinstance(max_logits, Tensor)
                   else [tuple(m.shape) if isinstance(m, Tensor) else type(m).__name__ for m in max_logits])
            raise ValueError(f"QK-clip max_logits must be one (n_head,) tensor per attention, shapes "
                             f"{[(h,) for h in self.n_heads]}, or one ({len(self.n_heads)}, n_head) tensor; got "
                             f"{got}. Pass the max logits of every attention, in the order of `attentions`")
        dtype = torch.float64 if any(m.dtype == torch.float64 for m in rows) else torch.float32
        flat = torch.cat([m.reshape(-1).to(dtype) for m in rows])  # (sum n_head,), a fresh buffer
        if self.process_group is not None and dist.is_available() and dist.is_initialized():
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.process_group)
        return flat

    @torch.no_grad()
    def step(self, max_logits: Tensor | Sequence[Tensor]) -> QKClipStats:
        """Reduce ``max_logits`` (see :meth:`reduce`) and scale, in place, the query and key rows of every head
        whose max logit exceeds the threshold. No host sync: the scales are computed on the device."""
        S = self.reduce(max_logits)  # (sum n_head,)
        tau = self.threshold
        clip = torch.isfinite(S) & (S > tau)  # NaN/+Inf are skipped, -Inf never exceeds tau
        gamma = torch.where(clip, tau / S, torch.ones_like(S))  # min(1, tau / S), 1 where skipped
        one = gamma.new_ones(1)
        for spec, targets, g in zip(self.attentions, self._targets, gamma.split(self.n_heads)):
            g_kv = g.view(spec.n_kv_head, -1).amin(1)  # (n_kv_head,): the group's smallest gamma
            scale = torch.cat([g, g_kv, one]).sqrt()  # (n_head + n_kv_head + 1,): [query | KV | untouched]
            for t, index in targets:
                local = _local(t)
                s = scale.to(local.device)[index.to(local.device)]  # (local rows,)
                local.mul_(s.to(torch.promote_types(local.dtype, s.dtype)).view(-1, *[1] * (local.ndim - 1)))
        return QKClipStats(clipped=clip.sum(), max_logit=S.amax(),
                           nonfinite=(torch.isnan(S) | (S == math.inf)).sum())


def _local(t: Tensor) -> Tensor:
    """The tensor to write into: a DTensor's local shard (a view of its storage), or ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def max_logits_per_head(q: Tensor, k: Tensor, *, scale: float | None = None, causal: bool = True,
                        block: int = 128) -> Tensor:
    """The max pre-softmax logit of each query head over the batch and the attended positions.

    q: ``(B, H, T, d)``; k: ``(B, H_kv, T_k, d)`` with H_kv dividing H (query head h reads key head
    ``h // (H // H_kv)``, as GQA broadcasts). Any float dtype; the products are computed in fp32 (fp64 for fp64
    inputs). Returns ``(H,)`` in that dtype: ``max_{b, i, j} scale * q[b, h, i] . k[b, h_kv, j]`` over
    ``j <= i`` when ``causal`` (top-left aligned, as ``scaled_dot_product_attention(is_causal=True)``), over all j
    otherwise. ``scale``: the model's softmax scale, default ``1 / sqrt(d)``; must be > 0.

    Computed ``block`` queries at a time (keys only up to the block's end when causal), so the scores held at
    once are ``(B, H, block, T_k)``, never ``(B, H, T, T_k)``. On CUDA, with Triton, fp32/bf16/fp16 inputs go to
    :func:`matrixopt.kernels.max_logits.max_logits_triton`, which holds no scores in memory at all (exact products
    for bf16/fp16, IEEE fp32 for fp32); this function's loop is its torch reference.
    """
    if q.ndim != 4 or k.ndim != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or k.shape[1] < 1 or (
            q.shape[1] % k.shape[1]):
        raise ValueError(f"max_logits_per_head needs q (B, H, T, d) and k (B, H_kv, T_k, d) with the same B and d "
                         f"and H_kv dividing H; got q {tuple(q.shape)}, k {tuple(k.shape)}. Pass q and k after "
                         f"the head split (and RoPE), before any GQA repeat")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"max_logits_per_head scale must be a finite number > 0 (the softmax scale), got {scale!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"max_logits_per_head block must be a positive int (queries per chunk), got {block!r}")
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
    kernel = _max_logits_kernel(q, k)
    if kernel is not None:
        return kernel(q, k, causal) * scale
    B, H, T, d = q.shape
    H_kv, T_k = k.shape[1], k.shape[2]
    dtype = torch.float64 if torch.float64 in (q.dtype, k.dtype) else torch.float32
    qg = q.unflatten(1, (H_kv, H // H_kv))  # (B, H_kv, g, T, d)
    kt = k.to(dtype).transpose(-1, -2).unsqueeze(2)  # (B, H_kv, 1, d, T_k)
    best = torch.full((H_kv, H // H_kv), -math.inf, dtype=dtype, device=q.device)
    for i0 in range(0, T, block):
        i1 = min(i0 + block, T)
        kend = min(i1, T_k) if causal else T_k
        if kend == 0 or B == 0:
            continue
        s = qg[:, :, :, i0:i1].to(dtype) @ kt[..., :kend]  # (B, H_kv, g, i1 - i0, kend)
        if causal:
            i = torch.arange(i0, i1, device=q.device)[:, None]
            j = torch.arange(kend, device=q.device)[None, :]
            s = s.masked_fill(j > i, -math.inf)
        best = torch.maximum(best, s.amax(dim=(0, 3, 4)))  # (H_kv, g)
    return best.flatten() * scale  # (H,)


def _max_logits_kernel(q: Tensor, k: Tensor) -> Callable[[Tensor, Tensor, bool], Tensor] | None:
    """The Triton kernel for these inputs (CUDA, one supported dtype, Triton installed), or None."""
    if not (q.is_cuda and k.is_cuda and q.dtype == k.dtype) or torch.compiler.is_compiling():
        return None
    try:
        from matrixopt.kernels.max_logits import KERNEL_DTYPES, max_logits_triton
    except ImportError:
        return None
    return max_logits_triton if q.dtype in KERNEL_DTYPES else None
