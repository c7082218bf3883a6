"""The reference GPT, in the nanoGPT lineage.

One file holds the whole model: fused-QKV causal self-attention through ``scaled_dot_product_attention``,
a GELU MLP, pre-norm blocks (LayerNorm or RMSNorm), learned or rotary positions, and a tied or untied
``lm_head``; opt-in, each attention also tracks its heads' largest pre-softmax logit, for QK-clip
(:meth:`GPT.track_max_logits`). Parameter names follow nanoGPT (``transformer.h.0.attn.c_attn.weight``,
``lm_head.weight``), so the optimizer router sends hidden 2-D weights to the matrix optimizer and embeddings,
head, norms and biases to AdamW. References: nanoGPT ``model.py`` (https://github.com/karpathy/nanoGPT), RoPE
(Su et al. 2021, https://arxiv.org/abs/2104.09864).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from matrixopt.distributed.qk_clip import max_logits_per_head

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

    def __post_init__(self) -> None:
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model dropout must be in [0, 1), got {self.dropout}")
        if self.norm not in NORMS:
            raise ValueError(f"model norm must be one of {', '.join(NORMS)}, got {self.norm!r}")


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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} must be a positive integer, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model n_embd={self.n_embd} is not divisible by n_head={self.n_head}; pick a width that is a "
                f"multiple of the head count"
            )
        if self.rope and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"RoPE needs an even head size, got n_embd/n_head = {self.n_embd // self.n_head}")
        super().__post_init__()


# Presets: shapes only; vocab_size comes from the data. "shakespeare-char" is nanoGPT's
# config/train_shakespeare_char.py; "gpt2-*" are GPT-2's shapes; "1.3b" is GPT-3 XL's 24 x 2048.
PRESETS: dict[str, dict] = {
    "tiny-cpu": dict(n_layer=4, n_head=4, n_embd=128, block_size=64),
    "shakespeare-char": dict(n_layer=6, n_head=6, n_embd=384, block_size=256),
    "gpt2-small": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),
    "1.3b": dict(n_layer=24, n_head=16, n_embd=2048, block_size=2048),
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
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

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
            if name.endswith("c_proj.weight"):
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
        return logits, loss

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
        """Training FLOPs per token: 6 N + 12 L T d for attention (PaLM, Chowdhery et al. 2022, app. B)."""
        c = self.config
        return 6 * self.num_params() + 12 * c.n_layer * c.block_size * c.n_embd

