"""``matrixopt bench step``: how long is one optimizer step for a model's parameter set?

The parameter set of a GPT (vocab 50304, untied head, fused QKV, MLP (d, 4d) and (4d, d), biases and LayerNorms
as in GPT-2), or of one mixture-of-experts layer (``qwen3-30b-a3b``: grouped-query attention and 128 SwiGLU
experts, gate and up (768, 2048) and down (2048, 768), as three expert stacks), is built as plain parameters with
random fp32 gradients, no model forward. Every hidden matrix (each expert's own) goes to the matrix optimizer, the
embeddings, head, router, norms and biases to AdamW. Compared on the same parameters:

- ``adamw (fused)``: ``torch.optim.AdamW(fused=True)`` on everything (foreach on the CPU);
- the peers of :mod:`matrixopt.bench.peers`: ``torch.optim.Muon``, and ``emerging_optimizers Muon`` with and
  without its SYRK where that package is installed (recorded as missing otherwise), each on the hidden matrices
  plus fused AdamW on the rest, stepped together;
- ``matrixopt <name>``: every matrix optimizer in ``matrixopt.OPTIMIZERS`` through ``build_optimizer``; those with
  a ``precondition_frequency`` (Shampoo, SOAP) as ``matrixopt <name>, frequency F`` for F in 1 and 10,
  preconditioning from the first step and timed in blocks of whole refresh periods, so a figure is the cost per
  step amortized over the refresh, and each again as ``matrixopt <name>, frequency F, TF32 products``
  (``matmul_precision="tf32"``) and ``..., bf16 products`` (``"bf16"``); Muon also with the Newton–Schulz
  dispatcher forced to cuBLAS or to Triton, with its elementwise passes as foreach ops instead of the fused
  kernels, with ``cuda_graph=True``, and with ``deferred_nonfinite=True`` (no host sync in the step; what the
  trainer uses), alone and with the graph;
  and ``matrixopt muon, after the clip, deferred check, CUDA graph``: the step as the trainer runs it on one GPU,
  each ``step()`` after the trainer's clip through the optimizer (``clip_grad_norm_(1.0)``, not timed), which hands
  the step each gradient's norm: the step scales the gradients as it reads them and takes the norms as its
  non-finite check instead of reading every gradient once more.

Limit of a Muon step: the Newton–Schulz FLOPs at ``PEAK_BF16_TFLOPS`` plus the fewest bytes at ``COPY_TBPS``:
    FLOPs = sum over hidden matrices of the fewer of the two forms' dense counts
            (:func:`matrixopt.linalg.ortho.newton_schulz_flops`): the Gram form's for matrices at least 1.5 times
            longer than wide, else the standard form's, steps * (4 m^2 n + 2 m^3) with m <= n
            (``standard_gflop`` keeps the standard form's total)
    bytes = 20 per Muon parameter (read grad and momentum, write momentum, read and write the fp32 weight)
          + 28 per AdamW parameter (read grad, weight, m, v; write weight, m, v)
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from matrixopt.bench.common import COPY_TBPS, PEAK_BF16_TFLOPS, environment, kernel_choices, table
from matrixopt.bench.peers import peer_muons, split_hidden
from matrixopt.device import StreamTimer, ms_summary, resolve_device, time_ms
from matrixopt.kernels.muon_elementwise import elementwise_backend
from matrixopt.kernels.ns_step import ns_backend, triton_available
from matrixopt.linalg.ortho import newton_schulz_flops
from matrixopt.optim.layout import mark_experts
from matrixopt.optim.registry import OPTIMIZERS, accepted, build_optimizer
from matrixopt.plan.models import PRESETS as ARCHITECTURES
from matrixopt.plan.models import Architecture
from matrixopt.train.config import TrainConfig


@dataclass(frozen=True)
class MoELayer:
    """One decoder layer of a mixture-of-experts model: grouped-query attention (``n_head`` query and ``n_kv_head``
    key/value heads of ``head_dim``) and ``experts`` experts, each a SwiGLU (``gated``: gate and up ``(expert_ffn,
    d)`` and down ``(d, expert_ffn)``) or a GELU MLP (up and down), stored as ``(E, out, in)`` stacks, with a
    ``(E, d)`` router."""

    d: int
    n_head: int
    n_kv_head: int
    head_dim: int
    experts: int
    expert_ffn: int
    gated: bool

    @classmethod
    def of(cls, arch: Architecture) -> MoELayer:
        """One MoE layer of the planner's architecture ``arch`` (:mod:`matrixopt.plan.models`)."""
        return cls(d=arch.d_model, n_head=arch.n_head, n_kv_head=arch.kv_heads, head_dim=arch.hd,
                   experts=arch.n_experts, expert_ffn=arch.expert_ffn, gated=arch.gated)


# GPTs as (n_layer, n_embd, block_size, vocab): GPT-2 small and medium, a 1.3B GPT; "toy" keeps the CPU test fast.
# One layer of Qwen3-30B-A3B (its published shapes, from the planner's preset).
MODELS: dict[str, tuple[int, int, int, int] | MoELayer] = {
    "gpt2-small": (12, 768, 1024, 50304),
    "gpt2-medium": (24, 1024, 1024, 50304),
    "1.3b": (24, 2048, 2048, 50304),
    "toy": (2, 64, 32, 512),
    "qwen3-30b-a3b": MoELayer.of(ARCHITECTURES["qwen3-30b-a3b"]),
    "toy-moe": MoELayer(d=64, n_head=4, n_kv_head=2, head_dim=16, experts=4, expert_ffn=32, gated=True),
}
NS_STEPS = 5
LR = 1e-3
PRECONDITION_FREQUENCIES = (1, 10)  # Shampoo's and SOAP's root / eigenbasis refresh: every step, and the default
# Shampoo's and SOAP's matmul_precision: row suffix
MATMUL_PRECISIONS = {"fp32": "", "tf32": ", TF32 products", "bf16": ", bf16 products"}


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.ModuleDict(dict(c_attn=nn.Linear(d, 3 * d), c_proj=nn.Linear(d, d)))  # weights (3d, d), (d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(d, 4 * d), c_proj=nn.Linear(4 * d, d)))  # (4d, d), (d, 4d)


class ParamSet(nn.Module):
    """GPT-2's parameters by name (no forward): ``transformer.wte``, ``wpe``, ``h.{i}``, ``ln_f``, ``lm_head``."""

    def __init__(self, n_layer: int, d: int, block_size: int, vocab: int):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(vocab, d), wpe=nn.Embedding(block_size, d),
                                              h=nn.ModuleList([Block(d) for _ in range(n_layer)]),
                                              ln_f=nn.LayerNorm(d)))
        self.lm_head = nn.Linear(d, vocab, bias=False)  # untied


class _MoE(nn.Module):
    def __init__(self, spec: MoELayer):
        super().__init__()
        self.router = nn.Linear(spec.d, spec.experts, bias=False)
        self.experts = nn.Module()
        shapes = dict(up=(spec.experts, spec.expert_ffn, spec.d), down=(spec.experts, spec.d, spec.expert_ffn))
        if spec.gated:
            shapes["gate"] = shapes["up"]
        for name, shape in shapes.items():
            self.experts.register_parameter(name, mark_experts(nn.Parameter(torch.randn(shape) * 0.02)))


class MoELayerSet(nn.Module):
    """One :class:`MoELayer`'s parameters by name (no forward): ``transformer.h.0.attn.{q,k,v,o}_proj``,
    ``.mlp.router``, ``.mlp.experts.{up,down,gate}`` (marked with :func:`matrixopt.mark_experts`), two norms."""

    def __init__(self, spec: MoELayer):
        super().__init__()
        q, kv = spec.n_head * spec.head_dim, spec.n_kv_head * spec.head_dim
        attn = nn.ModuleDict(dict(q_proj=nn.Linear(spec.d, q, bias=False), k_proj=nn.Linear(spec.d, kv, bias=False),
                                  v_proj=nn.Linear(spec.d, kv, bias=False), o_proj=nn.Linear(q, spec.d, bias=False)))
        layer = nn.ModuleDict(dict(ln_1=nn.LayerNorm(spec.d), attn=attn, ln_2=nn.LayerNorm(spec.d), mlp=_MoE(spec)))
        self.transformer = nn.ModuleDict(dict(h=nn.ModuleList([layer])))


def layer_spec(model: str, ep: int = 1) -> tuple[int, int, int, int] | MoELayer:
    """``model``'s shapes, for a mixture of experts as one rank holds them under expert parallelism ``ep``: its
    ``experts / ep`` experts (and the whole attention and router)."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    spec = MODELS[model]
    if ep == 1:
        return spec
    if not isinstance(spec, MoELayer):
        raise ValueError(f"--ep {ep} shards experts; {model!r} has none (use a mixture of experts, e.g. "
                         f"qwen3-30b-a3b)")
    if ep < 1 or spec.experts % ep:
        raise ValueError(f"--ep {ep} must be a positive divisor of {model!r}'s {spec.experts} experts")
    return dataclasses.replace(spec, experts=spec.experts // ep)


def param_set(model: str, device: torch.device, ep: int = 1) -> nn.Module:
    """The parameter set with random gradients (scaled like real ones, ~1e-3): a :class:`ParamSet` or a
    :class:`MoELayerSet` (with one expert-parallel rank's ``experts / ep`` experts)."""
    torch.manual_seed(0)
    spec = layer_spec(model, ep)
    with torch.device(device):
        ps = MoELayerSet(spec) if isinstance(spec, MoELayer) else ParamSet(*spec)
    for p in ps.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return ps


def hidden_matrices(ps: ParamSet) -> list[nn.Parameter]:
    return split_hidden(ps)[0]


def _one_stream(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    opt.overlap_adamw = False  # AdamW after the matrix groups, on the same stream
    return opt


@dataclass
class Candidate:
    """An optimizer to time: ``factory()`` builds it inside ``context()``. A preconditioner refreshed every
    ``period`` steps is timed in blocks of whole periods, so the median block gives the cost per step amortized
    over the refresh. ``clip``: each step follows the trainer's clip through the optimizer, untimed
    (:func:`time_after_clip`)."""

    factory: Callable[[], Any]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    period: int = 1
    clip: bool = False


def time_after_clip(opt: Any, device: torch.device, *, reps: int, inner: int, warmup: int = 3) -> dict[str, float]:
    """Milliseconds per ``opt.step()`` when each follows ``opt.clip_grad_norm_`` at the trainer's max norm, as in
    training; only the steps are timed (events around each on the compute stream, summed over blocks of
    ``inner``). Returns :func:`~matrixopt.device.ms_summary`'s record."""
    timer = StreamTimer(device)
    for i in range(warmup + reps * inner):
        opt.clip_grad_norm_(TrainConfig.grad_clip)
        if i >= warmup:
            timer.start()
        opt.step()
        if i >= warmup:
            timer.stop()
    laps = timer.resolve()
    return ms_summary([1e3 * sum(laps[b * inner:(b + 1) * inner]) / inner for b in range(reps)])


def candidates(ps: ParamSet, device: torch.device) -> dict[str, Candidate | str]:
    """name -> the candidate, or a string saying why it is missing."""
    fused = device.type == "cuda"
    out: dict[str, Candidate | str] = {
        "adamw (fused)": Candidate(lambda: torch.optim.AdamW(ps.parameters(), lr=LR, weight_decay=0.1, fused=fused,
                                                             foreach=None if fused else True)),
    }
    for name, peer in peer_muons(ps, ns_steps=NS_STEPS, adamw_lr=LR).items():
        out[name] = peer if isinstance(peer, str) else Candidate(peer)
    for name, factory in OPTIMIZERS.items():
        if getattr(factory, "matrix_flag", None) is None or name == "mop":
            continue  # plain AdamW is the fused row above; MOP is the slow SVD reference
        if not accepted(name, precondition_frequency=1):
            out[f"matrixopt {name}"] = Candidate(lambda name=name: build_optimizer(ps, name, lr=LR))
            if name != "muon" and accepted(name, deferred_nonfinite=True):  # Muon's variants follow below
                out[f"matrixopt {name}, deferred check"] = Candidate(
                    lambda name=name: build_optimizer(ps, name, lr=LR, deferred_nonfinite=True))
                out[f"matrixopt {name}, deferred check, CUDA graph"] = Candidate(
                    lambda name=name: build_optimizer(ps, name, lr=LR, **accepted(name, deferred_nonfinite=True,
                                                                                  cuda_graph=True)))
            continue
        for freq in PRECONDITION_FREQUENCIES:  # preconditioning from the first step, roots every freq steps
            for precision, suffix in MATMUL_PRECISIONS.items():
                hp = ({"precondition_frequency": freq} | accepted(name, start_preconditioning_step=1)
                      | accepted(name, matmul_precision=precision))
                out[f"matrixopt {name}, frequency {freq}{suffix}"] = Candidate(
                    lambda name=name, hp=hp: build_optimizer(ps, name, lr=LR, **hp), period=freq)

    def muon(context=contextlib.nullcontext, **options: Any) -> Candidate:
        return Candidate(lambda: build_optimizer(ps, "muon", lr=LR, **options), context)

    out["matrixopt muon, cuBLAS only"] = muon(lambda: ns_backend("torch"))
    out["matrixopt muon, Triton only"] = (muon(lambda: ns_backend("triton")) if fused and triton_available()
                                          else "skipped: the Triton kernels need a CUDA device with Triton")
    out["matrixopt muon, CUDA graph"] = muon(cuda_graph=True)
    out["matrixopt muon, deferred check"] = muon(deferred_nonfinite=True)
    out["matrixopt muon, deferred check, CUDA graph"] = muon(deferred_nonfinite=True, cuda_graph=True)
    out["matrixopt muon, after the clip, deferred check, CUDA graph"] = dataclasses.replace(
        muon(deferred_nonfinite=True, cuda_graph=True), clip=True)
    out["matrixopt muon, deferred check, CUDA graph, one stream"] = Candidate(
        lambda: _one_stream(build_optimizer(ps, "muon", lr=LR, deferred_nonfinite=True, cuda_graph=True)))
    out["matrixopt muon, standard NS, deferred check, CUDA graph"] = muon(deferred_nonfinite=True, cuda_graph=True,
                                                                          ns_method="standard")
    out["matrixopt muon, standard NS, deferred check"] = muon(deferred_nonfinite=True, ns_method="standard")
    out["matrixopt muon, unfused elementwise"] = muon(lambda: elementwise_backend("torch"))
    return out


def step_limit(ps: ParamSet) -> dict[str, float]:
    hidden = hidden_matrices(ps)
    flops = sum(newton_schulz_flops(*p.shape, NS_STEPS, "auto") for p in hidden)
    n_muon = sum(p.numel() for p in hidden)
    n_adamw = sum(p.numel() for p in ps.parameters()) - n_muon
    nbytes = 20 * n_muon + 28 * n_adamw
    standard = sum(newton_schulz_flops(*p.shape, NS_STEPS, "standard") for p in hidden)
    return {"ns_gflop": flops / 1e9, "standard_gflop": standard / 1e9, "bytes_gb": nbytes / 1e9,
            "flop_ms": flops / (PEAK_BF16_TFLOPS * 1e12) * 1e3, "byte_ms": nbytes / (COPY_TBPS * 1e12) * 1e3,
            "muon_limit_ms": flops / (PEAK_BF16_TFLOPS * 1e12) * 1e3 + nbytes / (COPY_TBPS * 1e12) * 1e3,
            "adamw_limit_ms": 28 * (n_muon + n_adamw) / (COPY_TBPS * 1e12) * 1e3,
            "muon_params": n_muon, "adamw_params": n_adamw}


def run(model: str = "gpt2-small", *, device: torch.device | None = None, reps: int = 10,
        inner: int = 5, only: list[str] | None = None, ep: int = 1) -> dict[str, Any]:
    """Time every candidate's ``step()`` on ``model``'s parameter set (one rank's under expert parallelism
    ``ep``); returns the JSON record."""
    spec = layer_spec(model, ep)
    device = device or resolve_device("auto")
    ps = param_set(model, device, ep)
    limit = step_limit(ps)
    results: dict[str, Any] = {}
    for name, entry in candidates(ps, device).items():
        if only is not None and name not in only:
            continue
        if isinstance(entry, str):
            results[name] = {"status": entry}
            continue
        block = -(-inner // entry.period) * entry.period  # inner steps, rounded up to whole refresh periods
        with entry.context():
            opt = entry.factory()
            t = (time_after_clip(opt, device, reps=reps, inner=block) if entry.clip
                 else time_ms(opt.step, device, reps=reps, inner=block, warmup=3))
        results[name] = {"status": "ok", "ms": t, "steps_per_block": block}
        del opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    adamw_ms = results.get("adamw (fused)", {}).get("ms", {}).get("median")
    for name, r in results.items():
        if r.get("status") != "ok":
            continue
        med = r["ms"]["median"]
        r["vs_adamw"] = med / adamw_ms if adamw_ms else None
        r["of_limit"] = (limit["adamw_limit_ms"] if name.startswith("adamw") else limit["muon_limit_ms"]) / med
    shape = (asdict(spec) if isinstance(spec, MoELayer)
             else dict(zip(("n_layer", "n_embd", "block_size", "vocab"), spec)))
    return {"benchmark": "step", "model": model, "ep": ep, "shape": shape,
            "params": sum(p.numel() for p in ps.parameters()), "ns_steps": NS_STEPS, "env": environment(device),
            "limit": limit, "results": results, **kernel_choices()}


def format_tables(record: dict[str, Any]) -> str:
    rows = [{"optimizer": name, "ms": r.get("ms", {}).get("median"), "p20": r.get("ms", {}).get("p20"),
             "p80": r.get("ms", {}).get("p80"), "vs AdamW": r.get("vs_adamw"), "of limit": r.get("of_limit"),
             "status": r["status"]} for name, r in record["results"].items()]
    lim = record["limit"]
    ep = f", one rank of expert parallelism {record['ep']}" if record.get("ep", 1) > 1 else ""
    return (f"Optimizer step, {record['model']} parameter set{ep} ({record['params'] / 1e6:.1f}M params), medians\n"
            + table(rows, ["optimizer", "ms", "p20", "p80", "vs AdamW", "of limit", "status"])
            + f"\nMuon limit {lim['muon_limit_ms']:.3g} ms = {lim['ns_gflop']:.0f} GFLOP at {PEAK_BF16_TFLOPS:.0f}"
              f" TFLOP/s ({lim['flop_ms']:.3g} ms) + {lim['bytes_gb']:.2f} GB at {COPY_TBPS} TB/s "
              f"({lim['byte_ms']:.3g} ms); AdamW limit {lim['adamw_limit_ms']:.3g} ms")
