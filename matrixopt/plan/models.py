"""Model shapes for the planner: the matrices an optimizer steps, the vectors and tables AdamW steps, and the FLOPs
of a token.

:class:`Architecture` describes a decoder-only transformer by its widths (dense or mixture-of-experts, GPT-2 MLP or
gated SwiGLU, grouped-query attention); :data:`PRESETS` holds the trainer's GPT presets (untied head, vocab
50304, biases and LayerNorms, Q, K and V orthogonalized as three matrices as the trainer does) and two published
MoE shapes. A JSON file gives either the fields of :class:`Architecture` or an explicit list of matrices (see
:func:`load_model`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matrixopt.train.model import PRESETS as GPT_PRESETS
from matrixopt.train.model import GPTConfig, expert_ffn

GPT_VOCAB = 50304


@dataclass(frozen=True)
class Matrix:
    """``count`` matrices of shape ``(m, n)`` in the whole model. ``expert``: they belong to expert stacks (split
    over expert-parallel ranks); ``active``: how many of the ``count`` one token passes through."""

    name: str
    m: int
    n: int
    count: int
    expert: bool = False
    active: float | None = None

    @property
    def numel(self) -> int:
        return self.m * self.n * self.count

    @property
    def active_numel(self) -> float:
        return self.m * self.n * (self.count if self.active is None else self.active)


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """A decoder-only transformer. Widths in elements; ``ffn`` is the dense MLP's hidden width."""

    name: str
    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    context: int
    n_kv_head: int | None = None
    """Key/value heads (grouped-query attention); None: as many as query heads."""
    head_dim: int | None = None
    """None: d_model / n_head."""
    ffn: int | None = None
    """Dense MLP width; None: 4 d_model."""
    gated: bool = False
    """SwiGLU MLP (gate, up, down: three matrices) instead of GPT-2's two."""
    n_experts: int = 0
    expert_ffn: int = 0
    top_k: int = 0
    n_shared_experts: int = 0
    n_dense_layers: int = 0
    """Leading layers with a dense MLP in a mixture-of-experts model."""
    tied: bool = False
    biases: bool = False
    """Biases in every linear layer and LayerNorm (GPT-2), or none and RMSNorm."""
    position_table: bool = False
    """A learned position embedding (GPT-2) instead of rotary."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "vocab", "context"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model {self.name!r}: {name} must be an int >= 1, got {v!r}")
        if self.head_dim is None and self.d_model % self.n_head:
            raise ValueError(f"model {self.name!r}: d_model {self.d_model} is not divisible by n_head {self.n_head}; "
                             f"give head_dim")
        if self.n_head % self.kv_heads:
            raise ValueError(f"model {self.name!r}: n_kv_head {self.kv_heads} must divide n_head {self.n_head}")
        if self.n_experts and not (0 < self.top_k <= self.n_experts and self.expert_ffn > 0):
            raise ValueError(f"model {self.name!r}: a mixture of experts needs 0 < top_k <= n_experts and "
                             f"expert_ffn > 0, got top_k={self.top_k}, n_experts={self.n_experts}, "
                             f"expert_ffn={self.expert_ffn}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def hd(self) -> int:
        return self.head_dim or self.d_model // self.n_head

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    def matrices(self) -> list[Matrix]:
        """Every matrix an optimizer like Muon steps, grouped by shape and role (weights are ``(out, in)``)."""
        d, L, q, kv = self.d_model, self.n_layer, self.n_head * self.hd, self.kv_heads * self.hd
        out = [Matrix("attn.q", q, d, L), Matrix("attn.k", kv, d, L), Matrix("attn.v", kv, d, L),
               Matrix("attn.o", d, q, L)]
        dense = L - self.n_dense_layers if self.moe else 0
        dense_layers = L - dense

        def mlp(prefix: str, width: int, count: int, expert: bool = False, active: float | None = None) -> None:
            ins = 2 if self.gated else 1  # gate and up, or GPT-2's c_fc
            out.append(Matrix(f"{prefix}.in", width, d, ins * count, expert, None if active is None else ins * active))
            out.append(Matrix(f"{prefix}.out", d, width, count, expert, active))

        if dense_layers:
            mlp("mlp", self.ffn or 4 * d, dense_layers)
        if self.moe:
            out.append(Matrix("moe.router", self.n_experts, d, dense))
            mlp("moe.experts", self.expert_ffn, self.n_experts * dense, True, self.top_k * dense)
            if self.n_shared_experts:
                mlp("moe.shared", self.expert_ffn * self.n_shared_experts, dense)
        return [m for m in out if m.count]

    def vector_params(self) -> int:
        """Parameters AdamW steps besides the embedding tables: norms, biases (and the router's, none here)."""
        d, L = self.d_model, self.n_layer
        norms = (2 * L + 1) * d * (2 if self.biases else 1)
        if not self.biases:
            return norms
        return norms + sum(m.m * m.count for m in self.matrices() if not m.expert)

    def table_params(self) -> int:
        """Embedding tables and the head (AdamW): token embedding, untied head, position table."""
        tables = self.vocab * self.d_model * (1 if self.tied else 2)
        return tables + (self.context * self.d_model if self.position_table else 0)

    def matrix_params(self) -> int:
        return sum(m.numel for m in self.matrices())

    def total_params(self) -> int:
        return self.matrix_params() + self.vector_params() + self.table_params()

    def active_matmul_params(self) -> float:
        """Parameters one token multiplies by: its matrices' active share and the head (not the lookups)."""
        return sum(m.active_numel for m in self.matrices()) + self.vocab * self.d_model

    def flops_per_token(self) -> float:
        """Training FLOPs of one token: ``6 N_active`` (forward 2, backward 4 per multiply-add; Kaplan et al. 2020)
        plus attention's ``12 L q_dim T`` over a context of T (PaLM, Chowdhery et al. 2022, appendix B; no
        discount for the causal mask, as nanoGPT's ``estimate_mfu``)."""
        return 6 * self.active_matmul_params() + 12 * self.n_layer * self.n_head * self.hd * self.context

    def activation_bytes_per_token(self) -> float:
        """bf16 bytes kept for backward per token and layer, without recomputation and with flash attention (no
        scores): two norm outputs and two residuals (``4 d``), Q, K, V and the attention output (``2 q + 2 kv``),
        the MLP's inputs and activations (``3 f`` over the active width). For GPT that is 40 d bytes, near
        Korthikanti et al.'s 34 d (arXiv:2205.05198). A mixture of experts also keeps, per routed copy, its input
        in bf16 for the grouped GEMM and the experts' output before the gate weighting (``2 top_k d``:
        ``matrixopt.train.model.MoE.forward``)."""
        d, q, kv = self.d_model, self.n_head * self.hd, self.kv_heads * self.hd
        if self.moe:
            f = self.expert_ffn * (self.top_k + self.n_shared_experts) * (1.5 if self.gated else 1)
            routed = 2 * self.top_k * d
        else:
            f, routed = (self.ffn or 4 * d) * (1.5 if self.gated else 1), 0
        return 2.0 * (4 * d + 2 * q + 2 * kv + 3 * f + routed)


@dataclass(frozen=True)
class ExplicitModel:
    """A model given as its list of matrices (JSON ``{"name", "matrices": [...], "adamw_params", ...}``)."""

    name: str
    matrix_list: tuple[Matrix, ...]
    adamw_params: int
    flops_token: float
    act_bytes_token_layer: float
    n_layer: int
    d_model: int
    n_head: int
    moe: bool = False
    top_k: int = 0
    n_experts: int = 0
    context: int = 2048
    extra: dict[str, Any] = field(default_factory=dict)

    def matrices(self) -> list[Matrix]:
        return list(self.matrix_list)

    def vector_params(self) -> int:
        return self.adamw_params

    def table_params(self) -> int:
        return 0

    def matrix_params(self) -> int:
        return sum(m.numel for m in self.matrix_list)

    def total_params(self) -> int:
        return self.matrix_params() + self.adamw_params

    def flops_per_token(self) -> float:
        return self.flops_token

    def activation_bytes_per_token(self) -> float:
        return self.act_bytes_token_layer


def gpt(name: str, *, fused_qkv: bool = False) -> Architecture:
    """The trainer's GPT preset ``name`` as the scale benchmark builds it (untied head, vocab 50304, biases,
    LayerNorm, learned positions); a mixture-of-experts preset (``n_expert`` > 0) with its experts, GELU MLPs of
    width ``expert_ffn`` (the trainer's default, 4 d / topk, where the preset gives none) and no shared expert.
    ``fused_qkv``: the QKV weight as one ``(3d, d)`` matrix, as ``bench step`` steps it; the planner's default
    keeps Q, K and V apart (three ``(d, d)``), as the trainer does."""
    c = GPTConfig(vocab_size=GPT_VOCAB, **GPT_PRESETS[name])
    moe = dict(n_experts=c.n_expert, top_k=c.topk, expert_ffn=expert_ffn(c)) if c.n_expert else {}
    arch = Architecture(name=name, n_layer=c.n_layer, d_model=c.n_embd, n_head=c.n_head, vocab=GPT_VOCAB,
                        context=c.block_size, biases=True, position_table=True, **moe)
    return dataclasses.replace(arch, name=f"{name} (fused QKV)") if fused_qkv else arch


def fused_qkv_matrices(arch: Architecture) -> list[Matrix]:
    """``arch``'s matrices with Q, K and V as one ``(q + 2 kv, d)`` matrix per layer."""
    mats = [m for m in arch.matrices() if m.name not in ("attn.q", "attn.k", "attn.v")]
    q, kv = arch.n_head * arch.hd, arch.kv_heads * arch.hd
    return [Matrix("attn.qkv", q + 2 * kv, arch.d_model, arch.n_layer), *mats]


PRESETS: dict[str, Architecture] = {
    **{name: gpt(name) for name in ("gpt2-small", "gpt2-medium", "1.3b")},
    # Qwen3-30B-A3B's published config: 48 layers, width 2048, 32 query and 4 KV heads of 128, 128 experts of
    # width 768 (top 8), vocab 151936, untied, context 4096 (pre-training length).
    "qwen3-30b-a3b": Architecture(name="qwen3-30b-a3b", n_layer=48, d_model=2048, n_head=32, n_kv_head=4,
                                  head_dim=128, vocab=151936, context=4096, gated=True, n_experts=128,
                                  expert_ffn=768, top_k=8),
    # Kimi K2's shape with multi-head latent attention approximated as plain attention of 64 heads of 128:
    # 61 layers (the first dense, MLP width 18432), width 7168, 384 experts of width 2048 (top 8) and one shared
    # expert, vocab 163840, context 4096.
    "kimi-k2-like": Architecture(name="kimi-k2-like", n_layer=61, d_model=7168, n_head=64, head_dim=128,
                                 vocab=163840, context=4096, gated=True, ffn=18432, n_experts=384, expert_ffn=2048,
                                 top_k=8, n_shared_experts=1, n_dense_layers=1),
}


def load_model(spec: str) -> Architecture | ExplicitModel:
    """A preset name, or a JSON file holding either :class:`Architecture`'s fields or
    ``{"name", "n_layer", "d_model", "n_head", "matrices": [{"name", "shape": [m, n], "count", "expert",
    "active"}], "adamw_params", "flops_per_token", "activation_bytes_per_token_layer"}``."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if not path.suffix == ".json":
        raise ValueError(f"unknown model {spec!r}: use a preset ({', '.join(PRESETS)}) or a shapes .json file")
    try:
        d = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read model file {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"model file {path} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"model file {path} must hold one JSON object (its fields: see `matrixopt plan --help`), "
                         f"got a {type(d).__name__}")
    try:
        if "matrices" not in d:
            return Architecture(**d)
        mats = []
        for i, m in enumerate(d["matrices"]):
            shape = m.get("shape") if isinstance(m, dict) else None
            if not (isinstance(m, dict) and "name" in m and isinstance(shape, list) and len(shape) == 2):
                raise ValueError(f"matrices[{i}] must be an object with a \"name\" and a \"shape\" [m, n], got {m!r}")
            mats.append(Matrix(m["name"], *shape, m.get("count", 1), m.get("expert", False), m.get("active")))
        return ExplicitModel(name=d["name"], matrix_list=tuple(mats), adamw_params=d["adamw_params"],
                             flops_token=d["flops_per_token"],
                             act_bytes_token_layer=d["activation_bytes_per_token_layer"], n_layer=d["n_layer"],
                             d_model=d["d_model"], n_head=d["n_head"], moe=any(m.expert for m in mats),
                             top_k=d.get("top_k", 0), n_experts=d.get("n_experts", 0), context=d.get("context", 2048))
    except KeyError as e:
        raise ValueError(f"model file {path} lacks the field {e.args[0]!r}; see `matrixopt plan --help` for the "
                         f"format") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"model file {path}: {e}; see `matrixopt plan --help` for the format") from None
