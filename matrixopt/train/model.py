"""The reference GPT, in the nanoGPT lineage.

One file holds the whole model: fused-QKV causal self-attention through ``scaled_dot_product_attention``,
a GELU MLP, pre-norm blocks (LayerNorm or RMSNorm), learned or rotary positions, and a tied or untied
``lm_head``; opt-in, each attention also tracks its heads' largest pre-softmax logit, for QK-clip
(:meth:`GPT.track_max_logits`). With ``n_expert > 0`` every MLP is a mixture of experts (:class:`MoE`: a top-k
softmax router and ``(E, out, in)`` expert stacks, each expert's matrix orthogonalized on its own by a matrix
optimizer). Parameter names follow nanoGPT (``transformer.h.0.attn.c_attn.weight``,
``lm_head.weight``), so the optimizer router sends hidden 2-D weights to the matrix optimizer and embeddings,
head, norms and biases to AdamW. References: nanoGPT ``model.py`` (https://github.com/karpathy/nanoGPT), RoPE
(Su et al. 2021, https://arxiv.org/abs/2104.09864).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from matrixopt.distributed.qk_clip import max_logits_per_head
from matrixopt.optim.layout import mark_experts

NORMS = ("layernorm", "rmsnorm")


@dataclass(kw_only=True)
class GPTOptions:
    """The GPT's options besides its shape (which presets set)."""

    dropout: float = 0.0
    """Dropout on attention weights, residual branches and embeddings, in [0, 1)."""
    bias: bool = False
    """Biases in Linear layers and norms (nanoGPT's shakespeare_char runs use none)."""
    norm: str = "layernorm"
    """'layernorm' or 'rmsnorm'."""
    rope: bool = False
    """Rotary position embeddings on q and k instead of a learned position table."""
    tie_embeddings: bool = True
    """Share the token embedding with lm_head."""
    shared_expert: bool = False
    """MoE: add a shared expert (a dense MLP of width expert_ffn that every token goes through)."""
    aux_loss_coef: float = 0.01
    """MoE: weight of the load-balancing loss added to the training loss (0 turns it off)."""
    router_bias_rate: float = 0.0
    """MoE: step size u of auxiliary-loss-free balancing (DeepSeek-V3): after each optimizer step every expert's
    selection bias moves by u towards balance (0 turns it off)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model dropout must be in [0, 1), got {self.dropout}")
        if self.norm not in NORMS:
            raise ValueError(f"model norm must be one of {', '.join(NORMS)}, got {self.norm!r}")
        for name in ("aux_loss_coef", "router_bias_rate"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"model {name} must be >= 0 (0 turns it off), got {getattr(self, name)}")


@dataclass(kw_only=True)
class GPTConfig(GPTOptions):
    """Shape and options of the GPT. Validated on construction."""

    vocab_size: int = 65
    """Number of token ids; every input id must be below it."""
    block_size: int = 256
    """Context length T in tokens."""
    n_layer: int = 6
    """Number of transformer blocks."""
    n_head: int = 6
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 384
    """Model width d."""
    n_expert: int = 0
    """Experts per block: 0 for the dense MLP, else a mixture of experts (:class:`MoE`) in every block."""
    topk: int = 2
    """MoE: experts per token, 1 <= topk <= n_expert."""
    expert_ffn: int = 0
    """MoE: hidden width of each expert (0: 4 * n_embd / topk)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} must be a positive integer, got {getattr(self, name)}")
        for name in ("n_expert", "expert_ffn"):
            if getattr(self, name) < 0:
                raise ValueError(f"model {name} must be >= 0, got {getattr(self, name)}")
        if self.n_expert and not 1 <= self.topk <= self.n_expert:
            raise ValueError(f"model topk={self.topk} must be between 1 and n_expert={self.n_expert} (each token "
                             f"goes to topk distinct experts); pass --topk <= {self.n_expert}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model n_embd={self.n_embd} is not divisible by n_head={self.n_head}; pick a width that is a "
                f"multiple of the head count"
            )
        if self.rope and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"RoPE needs an even head size, got n_embd/n_head = {self.n_embd // self.n_head}")
        super().__post_init__()


# Presets: shapes only; vocab_size comes from the data. "shakespeare-char" is nanoGPT's
# config/train_shakespeare_char.py; "gpt2-*" are GPT-2's shapes; "1.3b", "2.7b" and "6.7b" are GPT-3's XL, 2.7B and
# 6.7B shapes (24 x 2048, 32 x 2560, 32 x 4096).
PRESETS: dict[str, dict] = {
    "tiny-cpu": dict(n_layer=4, n_head=4, n_embd=128, block_size=64),
    "shakespeare-char": dict(n_layer=6, n_head=6, n_embd=384, block_size=256),
    "gpt2-small": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),
    "1.3b": dict(n_layer=24, n_head=16, n_embd=2048, block_size=2048),
    "2.7b": dict(n_layer=32, n_head=32, n_embd=2560, block_size=2048),
    "6.7b": dict(n_layer=32, n_head=32, n_embd=4096, block_size=2048),
    # Mixtures of experts. "qwen3-30b-a3b" has Qwen3-30B-A3B's depth, width and experts (48 x 2048, 128 experts of
    # width 768, top-8); its attention is approximated: Qwen3 has 32 query and 4 KV heads of 128 (GQA, q width
    # 4096), this GPT 16 heads of 128 with q = k = v width 2048. Pass --n-layer to run it at reduced depth.
    "moe-tiny": dict(n_layer=2, n_head=2, n_embd=32, block_size=16, n_expert=4, topk=2, expert_ffn=32),
    "moe-small": dict(n_layer=8, n_head=8, n_embd=512, block_size=1024, n_expert=16, topk=2, expert_ffn=1024),
    "qwen3-30b-a3b": dict(n_layer=48, n_head=16, n_embd=2048, block_size=4096, n_expert=128, topk=8,
                          expert_ffn=768),
    # "moe-2b": Qwen3-30B-A3B's expert layout (128 experts, top-8, expert width 3/8 of d) at half its width and
    # depth, the size of a 2-GPU expert-parallel benchmark: at vocab 50304, 2.573B parameters of which 309M active
    # per token (untied head: 2.625B, 360M). Its narrow experts keep Muon's per-expert Newton-Schulz cheap (its
    # FLOPs grow with the short side of each 384 x 1024 matrix).
    "moe-2b": dict(n_layer=24, n_head=16, n_embd=1024, block_size=2048, n_expert=128, topk=8, expert_ffn=384),
}
# The fused (3d, d) QKV weight, orthogonalized as Q, K and V (the ``splits`` of matrixopt.build_optimizer).
QKV_SPLITS = {r"attn\.c_attn\.weight$": 3}


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight (+ bias), over the last dimension."""

    def __init__(self, dim: int, bias: bool, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = F.rms_norm(x, (x.size(-1),), self.weight, self.eps)
        return y if self.bias is None else y + self.bias


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.n_embd, bias=config.bias)
    return nn.LayerNorm(config.n_embd, bias=config.bias)


def rope_tables(head_size: int, T: int, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """cos and sin tables, each ``(T, head_size // 2)`` in fp32."""
    inv_freq = base ** (-torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    angles = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)  # (T, hs/2)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x1, x2) of ``x``: ``(B, nh, T, hs)``; tables ``(T, hs/2)``."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, nh, T, hs/2) each
    y = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return y.type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # fused q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.head_size = config.n_embd // config.n_head
        self.dropout = config.dropout
        self.track_max_logits = False  # set by GPT.track_max_logits
        self.max_logits: Tensor | None = None  # (nh,) fp32 running max logit per head, while tracking

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
        B, T, _ = x.size()
        # the head count comes from the tensor: under tensor parallelism c_attn yields this rank's heads only
        q, k, v = self.c_attn(x).chunk(3, dim=2)  # (B, T, C) each, C = nh * hs (nh local under TP)
        C = q.size(-1)
        nh = C // self.head_size
        q = q.view(B, T, nh, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nh, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, nh, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.track_max_logits and self.training:
            self._track_max_logits(q, k)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))

    @torch.no_grad()
    def _track_max_logits(self, q: Tensor, k: Tensor) -> None:
        """Fold the max scaled logit of each head of ``q``, ``k`` ``(B, nh, T, hs)`` (after RoPE) into
        ``max_logits``: ``max_{b, j <= i} q_i . k_j / sqrt(hs)``, the softmax input of scaled_dot_product_attention
        (its default scale), in fp32, a block of queries at a time."""
        with torch.autocast(q.device.type, enabled=False):  # fp32 products, also under bf16 autocast
            m = max_logits_per_head(q.detach(), k.detach(), causal=True)  # (nh,)
        self.max_logits = m if self.max_logits is None else torch.maximum(self.max_logits, m)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


def expert_ffn(config: GPTConfig) -> int:
    """Hidden width of one expert: ``config.expert_ffn``, or 4 d / topk (the dense MLP's active width)."""
    return config.expert_ffn or max(1, 4 * config.n_embd // config.topk)


def grouped_mm(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """Row blocks of ``x`` times their group's matrix: ``x`` ``(M, in)`` with rows sorted by group, ``w``
    ``(G, out, in)`` (stored as nn.Linear weights), ``counts`` ``(G,)`` int64 rows per group (summing to M).
    Returns ``(M, out)``: rows ``counts[:g].sum()`` onwards of block g are ``x_block @ w[g].T``.

    On CUDA under bf16 a grouped GEMM (``torch._grouped_mm``, one kernel for every group, each group's rows
    padded to a multiple of ``GROUP_ALIGN``), else on CUDA a padded batched matmul (``(G, max count, in)``); on
    CPU (the reference) one matmul per group, empty groups included, so every expert's weight is in the graph and
    gets a (zero) gradient. Outside autocast, fp32 experts multiply low-precision rows in the rows' dtype (FSDP2's
    bf16 compute with expert stacks kept out of its mixed precision)."""
    if w.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
        w = w.to(x.dtype)
    if x.is_cuda:
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        if dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            return _grouped_mm_aligned(x.to(dtype), w.to(dtype), counts)
        return _padded_mm(x, w, counts)
    blocks = x.split(counts.tolist())  # G blocks (n_g, in)
    return torch.cat([b @ w[g].T for g, b in enumerate(blocks)])  # (M, out)


GROUP_ALIGN = 16  # rows: torch._grouped_mm wants group offsets aligned to 16 for bf16 (as torchtitan pads them)


def _grouped_mm_aligned(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """:func:`grouped_mm` by ``torch._grouped_mm`` on rows copied into groups padded to ``GROUP_ALIGN`` rows, in a
    buffer of ``M + G (GROUP_ALIGN - 1)`` rows (its size known without reading ``counts`` on the host)."""
    G, M, A = counts.numel(), x.size(0), GROUP_ALIGN
    padded = (counts + A - 1) // A * A  # (G,)
    ends = torch.cumsum(padded, 0)
    group = torch.repeat_interleave(torch.arange(G, device=x.device), counts, output_size=M)  # (M,)
    dest = (ends - padded)[group] + torch.arange(M, device=x.device) - (torch.cumsum(counts, 0) - counts)[group]
    xp = x.new_zeros(M + G * (A - 1), x.size(1)).index_copy(0, dest, x)  # (M', in)
    y = torch._grouped_mm(xp, w.transpose(-2, -1), offs=ends.to(torch.int32))  # (M', out)
    return y[dest]  # (M, out)


def _padded_mm(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """:func:`grouped_mm` as one batched matmul over groups padded to the largest count."""
    G, M = counts.numel(), x.size(0)
    starts = torch.cumsum(counts, 0) - counts  # (G,) first row of each group
    group = torch.repeat_interleave(torch.arange(G, device=x.device), counts, output_size=M)  # (M,)
    slot = torch.arange(M, device=x.device) - starts[group]  # (M,) row within its group
    cap = int(counts.max()) if M else 0
    padded = x.new_zeros(G, cap, x.size(1)).index_put((group, slot), x)  # (G, cap, in)
    y = torch.bmm(padded, w.to(padded.dtype).transpose(-2, -1))  # (G, cap, out)
    return y[group, slot]  # (M, out)


class Experts(nn.Module):
    """E expert MLPs, ``y = W2_e gelu(W1_e x)``, stored as stacks: ``c_fc`` ``(E, H, d)`` and ``c_proj``
    ``(E, d, H)``, each marked with :func:`matrixopt.mark_experts` so a matrix optimizer orthogonalizes every
    expert's matrix on its own (one batched call per stack).

    ``forward(x, counts)`` takes the routed copies of tokens ``x`` ``(M, d)`` sorted by expert and ``counts``
    ``(n_expert,)`` int64 copies per expert, and returns the expert outputs ``(M, d)`` in the same order. By
    default this module computes them itself; ``dispatch`` (set by expert parallelism,
    :func:`matrixopt.distributed.ep.shard_experts`) is a callable ``dispatch(compute, x, counts)`` that sends
    the rows to the ranks holding their experts and calls ``compute`` on the rows of this rank's stacks."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        E, H, C = config.n_expert, expert_ffn(config), config.n_embd
        self.n_expert = E  # over all ranks; the stacks hold E // ep under expert parallelism
        self.c_fc = mark_experts(nn.Parameter(torch.empty(E, H, C)))
        self.c_proj = mark_experts(nn.Parameter(torch.empty(E, C, H)))
        self.dispatch: Callable[..., Tensor] | None = None

    def compute(self, x: Tensor, counts: Tensor) -> Tensor:
        """The local stacks on rows ``x`` ``(M, d)`` sorted by local expert, ``counts`` ``(E_local,)``."""
        return grouped_mm(F.gelu(grouped_mm(x, self.c_fc, counts)), self.c_proj, counts)  # (M, d)

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        if self.dispatch is None:
            return self.compute(x, counts)
        return self.dispatch(self.compute, x, counts)


class Router(nn.Linear):
    """The mixture of experts' router: logits ``(N, E)`` for tokens ``(N, d)``, computed in fp32 (fp64 for a
    float64 model) also under autocast, since the softmax and the top-k choice turn small errors into other
    experts. A module of its own, so hooks on it (the layer-wise optimizer waits for its weight there) run."""

    def __init__(self, n_embd: int, n_expert: int):
        super().__init__(n_embd, n_expert, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        dt = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(dt), self.weight.to(dt))  # (N, E)


class MoE(nn.Module):
    """A mixture of experts in place of the MLP (Qwen3-MoE / DeepSeek style): a softmax router over E experts
    (computed in fp32, also under autocast), each token to its top-k, their outputs weighted by the router
    probabilities renormalized over the k; every token is computed (no capacity, nothing dropped); optionally a
    shared expert every token also goes through.

    Balancing: :attr:`aux_loss`, the load-balancing loss of the last training forward, ``E sum_e f_e P_e``
    (Switch Transformer, Fedus et al. 2021, https://arxiv.org/abs/2101.03961, eq. 4; f_e the share of the k T
    routed copies of a sequence that go to expert e, P_e the mean router probability of e over the sequence),
    averaged over the sequences of the batch, so it does not depend on how the batch is split over ranks; 1 when
    balanced. With ``router_bias_rate`` > 0, a per-expert bias is added to the probabilities for choosing the
    top k only (auxiliary-loss-free balancing, DeepSeek-V3, https://arxiv.org/abs/2412.19437, sec. 2.1.2), moved
    by :meth:`GPT.update_router_bias`. :attr:`counts` sums the routed copies per expert over training forwards
    (``(E,)`` fp32, no gradient) until :meth:`GPT.pop_moe_stats`."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.topk = config.topk
        self.router = Router(config.n_embd, config.n_expert)
        self.experts = Experts(config)
        self.shared = MLP(config, hidden=expert_ffn(config)) if config.shared_expert else None
        self.dropout = nn.Dropout(config.dropout)
        self.biased = config.router_bias_rate > 0
        self.register_buffer("router_bias", torch.zeros(config.n_expert))  # (E,) fp32, selection only
        self.aux_loss: Tensor | None = None
        self.counts = torch.zeros(config.n_expert)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        E, k = self.router.out_features, self.topk
        xf = x.reshape(B * T, C)  # (N, C), N = B T
        probs = self.router(xf).softmax(dim=-1)  # (N, E), fp32
        scores = probs + self.router_bias if self.biased else probs
        idx = scores.topk(k, dim=-1).indices  # (N, k)
        gate = probs.gather(-1, idx)
        gate = gate / gate.sum(dim=-1, keepdim=True)  # (N, k) renormalized over the chosen k
        flat = idx.flatten()  # (N k,) expert of each routed copy, token-major
        order = flat.argsort(stable=True)  # copies sorted by expert
        token = order // k  # (N k,) token of each sorted copy
        counts = torch.bincount(flat, minlength=E)  # (E,) int64
        y = self.experts(xf[token], counts)  # (N k, C)
        y = y * gate.flatten()[order, None].to(y.dtype)
        out = torch.zeros_like(xf).index_add_(0, token, y.to(xf.dtype))  # (N, C): sum over each token's k
        if self.shared is not None:
            out = out + self.shared(xf)
        if self.training:
            per_seq = torch.zeros(B, E, device=x.device).scatter_add_(
                1, idx.view(B, T * k), torch.ones(B, T * k, device=x.device))  # (B, E) copies per expert
            f = per_seq / (T * k)  # (B, E)
            P = probs.view(B, T, E).mean(dim=1)  # (B, E)
            self.aux_loss = E * (f * P).sum(dim=-1).mean()
            self.counts = self.counts.to(x.device) + per_seq.sum(dim=0)
        return self.dropout(out.view(B, T, C))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = MoE(config) if config.n_expert else MLP(config)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
        x = x + self.attn(self.ln_1(x), rope)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=make_norm(config),
            )
        )
        if not config.rope:
            self.transformer["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        else:
            cos, sin = rope_tables(config.n_embd // config.n_head, config.block_size)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        # nanoGPT's init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer) (GPT-2 paper).
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("experts.c_fc"):
                nn.init.normal_(p, mean=0.0, std=0.02)
            if name.endswith(("c_proj.weight", "experts.c_proj")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """Parameter count, shared (tied) tensors counted once."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """idx, targets: ``(B, T)`` int64 with T <= block_size. Returns logits ``(B, T, vocab)`` and the mean
        cross-entropy (fp32 scalar) when targets are given."""
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds the model's block_size {self.config.block_size}")
        x = self.transformer.wte(idx)  # (B, T, C)
        rope = None
        if self.config.rope:
            rope = (self.rope_cos[:T], self.rope_sin[:T])
        else:
            x = x + self.transformer.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x, rope)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
            if self.training and self.config.n_expert and self.config.aux_loss_coef > 0:
                loss = loss + self.config.aux_loss_coef * self.aux_loss()
        return logits, loss

    # ------------------------------------------------------------------------------------------ mixture of experts

    def moe_layers(self) -> list[MoE]:
        """The blocks' :class:`MoE` layers (empty for a dense GPT)."""
        return [block.mlp for block in self.transformer.h if isinstance(block.mlp, MoE)]

    def aux_loss(self) -> Tensor:
        """The load-balancing loss of the last training forward, averaged over the MoE layers (fp32 scalar with
        gradient; 1 when every layer is balanced). In training mode the forward adds ``aux_loss_coef`` times it to
        the loss it returns."""
        losses = [m.aux_loss for m in self.moe_layers()]
        if not losses or any(a is None for a in losses):
            raise RuntimeError("no load-balancing loss recorded: the model needs MoE layers (n_expert > 0) and a "
                               "forward in training mode (model.train()) first")
        return torch.stack(losses).mean()

    def pop_moe_stats(self) -> Tensor:
        """``(n_layer, n_expert)`` fp32: routed token copies per expert of each MoE layer over the training
        forwards since the last call (this process's tokens), and reset them."""
        counts = torch.stack([m.counts for m in self.moe_layers()])
        for m in self.moe_layers():
            m.counts = torch.zeros_like(m.counts)
        return counts

    @torch.no_grad()
    def update_router_bias(self, counts: Tensor) -> None:
        """Auxiliary-loss-free balancing: ``b_e += u sign(mean_e' c_e' - c_e)`` with u = router_bias_rate for
        every layer, from ``counts`` ``(n_layer, n_expert)`` (e.g. :meth:`pop_moe_stats` summed or averaged over
        the data-parallel ranks, so that every rank moves the same way). No-op when the rate is 0."""
        u = self.config.router_bias_rate
        if u > 0:
            for m, c in zip(self.moe_layers(), counts):
                m.router_bias += u * torch.sign(c.mean() - c).to(m.router_bias)

    def track_max_logits(self, on: bool = True) -> None:
        """Turn the max-logit trackers of every attention on (or off) and reset them. While on, each forward in
        training mode also computes every head's largest pre-softmax logit over the batch and the causal
        positions (after RoPE, with the attention's scale 1/sqrt(head_size)) and keeps the running max over
        forwards (e.g. the micro-batches of one optimizer step) until :meth:`reset_max_logits`. The attention
        output is unchanged; the scores are computed a block of queries at a time, without gradients. Off (the
        default), nothing extra is computed. For QK-clip: :class:`matrixopt.QKClip`."""
        for block in self.transformer.h:
            block.attn.track_max_logits = on
        self.reset_max_logits()

    def max_logits(self) -> Tensor:
        """``(n_layer, nh)`` fp32: each attention's running max logit per head since the last reset (nh: the heads
        this process computes, all n_head but under tensor parallelism)."""
        logits = [block.attn.max_logits for block in self.transformer.h]
        if any(m is None for m in logits):
            raise RuntimeError("no max logits recorded: call track_max_logits(True) and run a forward in training "
                               "mode (model.train()) first")
        return torch.stack(logits)

    def reset_max_logits(self) -> None:
        """Forget the recorded max logits (e.g. after each optimizer step)."""
        for block in self.transformer.h:
            block.attn.max_logits = None

    def estimate_flops_per_token(self) -> float:
        """Training FLOPs per token of the matrix multiplies, as Megatron-LM counts model FLOPs (Narayanan et al.
        2021, appendix; PaLM's ``6 N + 12 L T d``, Chowdhery et al. 2022, app. B): 6 per weight a token multiplies
        by (the forward's and the backward's two products, 2 FLOPs per multiply-add), N being every Linear's weights
        (attention, MLP, router, head) and, in each mixture-of-experts layer, topk experts' weights (one expert's
        from the stacks held here, so a shard under expert parallelism counts as the whole model); plus
        ``12 L T d`` for attention's scores and their product with V over ``T = block_size``. Embedding lookups,
        norms and biases are not matrix multiplies; no recomputation, no optimizer."""
        c = self.config
        n = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        for layer in self.moe_layers():
            n += c.topk * sum(p[0].numel() for p in layer.experts.parameters())
        return 6 * n + 12 * c.n_layer * c.block_size * c.n_embd

