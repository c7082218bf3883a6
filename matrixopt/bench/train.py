"""``matrixopt bench train``: end-to-end training throughput with each optimizer, as a ratio to AdamW.

The trainer's loop cut down for timing (as nanoGPT's ``bench.py`` is to its ``train.py``): the reference GPT
of :mod:`matrixopt.train.model` with an untied head and vocab 50304 (512 for tiny-cpu), random tokens
(throughput does not depend on the data), bf16 autocast on CUDA, forward, backward, gradient clipping at 1.0
(the trainer's: matrixopt's optimizers apply the coefficient inside their step) and ``optimizer.step()``, with
the trainer's optimizer options (``deferred_nonfinite=True`` where taken, and one process's ``cuda_graph=True``
on a GPU: :class:`~matrixopt.distributed.SingleProcess`; ``muon+eager`` is Muon without the graph), and the peers
of :mod:`matrixopt.bench.peers` (``torch.optim.Muon``,
``emerging_optimizers Muon`` where installed: a missing one is recorded with the reason). Each optimizer gets a
freshly initialized model; ``warmup`` steps, then ``steps`` timed steps in ``reps`` blocks (median block).

MFU uses the model's ``estimate_flops_per_token`` (the matrix multiplies' FLOPs, as Megatron-LM counts model FLOPs) at
``PEAK_BF16_TFLOPS``.
"""

from __future__ import annotations

import functools
import gc
from typing import Any

import torch

from matrixopt.bench.common import PEAK_BF16_TFLOPS, environment, kernel_choices, table
from matrixopt.bench.peers import EMERGING, peer_muons
from matrixopt.device import resolve_device, time_ms
from matrixopt.distributed.parallelism import Parallelism, SingleProcess
from matrixopt.optim.registry import accepted
from matrixopt.train.model import QKV_SPLITS
from matrixopt.train.qk_clip import GPTQKClip

# preset -> (batch, block_size, vocab) of the benchmark's rows; "tiny-cpu" and "moe-tiny" keep the CPU tests fast.
# The mixtures of experts train their expert stacks with matrixopt's optimizers and AdamW only: the peers take 2-D
# parameters (bench step times them on per-expert copies).
BATCHES: dict[str, tuple[int, int, int]] = {"gpt2-small": (16, 1024, 50304), "gpt2-medium": (8, 1024, 50304),
                                            "1.3b": (4, 2048, 50304), "tiny-cpu": (2, 32, 512),
                                            "moe-small": (16, 1024, 50304), "moe-tiny": (2, 16, 512)}
# suffixes of an optimizer name: "muon+eager" is Muon without the trainer's CUDA graph (cuda_graph=False),
# "muon+standard" Muon with the standard Newton–Schulz form (ns_method="standard"), "muon+fused_qkv" Muon with the
# fused (3d, d) QKV weight orthogonalized whole, as the peers take it (the trainer splits it into Q, K and V:
# QKV_SPLITS), "muon+qk_clip" the trainer's --qk-clip QK_CLIP_TAU (per-head max logits tracked in the forward,
# the heads above tau clipped after the step); they combine
VARIANTS = {"eager": {"cuda_graph": False}, "standard": {"ns_method": "standard"}, "fused_qkv": {}, "qk_clip": {}}
QK_CLIP_TAU = 100.0  # Kimi K2's threshold
# the default row: AdamW, ours (and three variants), and the peers (emerging_optimizers recorded as missing where it
# is not installed)
DEFAULT_OPTIMIZERS = ("adamw", "muon", "muon+fused_qkv", "muon+standard", "muon+eager", "torch.optim.Muon", EMERGING)


def train_step(par: Parallelism, net: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor, qk_clip: GPTQKClip | None = None) -> None:
    with par.autocast():
        _, loss = net(x, y)
    loss.backward()
    par.clip_grad_norm_(1.0)  # as the trainer clips: inside the step for matrixopt's optimizers
    opt.step()
    if qk_clip is not None:
        qk_clip.step()
    for p in net.parameters():
        p.grad = None


class PeerMissing(RuntimeError):
    """A peer optimizer that can't run here (its package is not installed, or it needs a GPU)."""


def _optimizer(model: torch.nn.Module, name: str, par: Parallelism | None = None) -> torch.optim.Optimizer:
    """Optimizer ``name`` (a registered one with its +variants, or a peer) for ``model``, which ``par`` (default:
    one process on the model's device) wraps first."""
    par = par or SingleProcess(next(model.parameters()).device)
    par.wrap(model)
    peers = peer_muons(model, adamw_lr=6e-4)
    if name in peers:
        peer = peers[name]
        if isinstance(peer, str):
            raise PeerMissing(peer)
        if any(p.ndim > 2 for p in model.parameters()):
            raise PeerMissing(f"{name} takes 2-D parameters; this model's experts are (E, out, in) stacks (bench "
                              f"step times the peers on one 2-D copy per expert)")
        return peer()  # type: ignore[return-value]
    if name == "adamw":
        return par.build_optimizer(model, "adamw", lr=6e-4, weight_decay=0.1)
    base, *variants = name.split("+")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown optimizer variant(s) {unknown} in {name!r}; use +{', +'.join(VARIANTS)}")
    options = {"deferred_nonfinite": True}
    for v in variants:
        options |= VARIANTS[v]
    splits = {} if "fused_qkv" in variants else QKV_SPLITS
    return par.build_optimizer(model, base, lr=6e-4, weight_decay=0.1, splits=splits, **accepted(base, **options))


def run(model: str = "gpt2-small",
        optimizers: tuple[str, ...] = DEFAULT_OPTIMIZERS, *,
        device: torch.device | None = None, steps: int = 10, reps: int = 3, warmup: int = 3,
        batch: int | None = None, par: Parallelism | None = None) -> dict[str, Any]:
    """Tokens/s of each optimizer's training step on one device; returns the JSON record. ``par``: how the step
    runs (default: one process on ``device``, bf16 on CUDA)."""
    from matrixopt.train.model import GPT, PRESETS, GPTConfig

    if model not in BATCHES:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(BATCHES)}")
    device = device or resolve_device("auto")
    par = par or SingleProcess(device, bf16=device.type == "cuda")
    B, T, vocab = BATCHES[model]
    B = batch or B
    shape = dict(PRESETS[model], block_size=T)
    cfg = GPTConfig(vocab_size=vocab, tie_embeddings=False, **shape)
    results: dict[str, Any] = {}
    for name in optimizers:
        torch.manual_seed(0)
        with torch.device(device):
            net = GPT(cfg)
        try:
            opt = _optimizer(net, name, par)
        except PeerMissing as e:
            results[name] = {"status": str(e)}
            continue
        qk_clip = GPTQKClip(net, par, QK_CLIP_TAU) if "qk_clip" in name.split("+")[1:] else None
        x = torch.randint(0, vocab, (B, T), device=device)
        y = torch.randint(0, vocab, (B, T), device=device)
        t = time_ms(functools.partial(train_step, par, net, opt, x, y, qk_clip), device, reps=reps, inner=steps,
                    warmup=warmup)
        tok_s = B * T / (t["median"] / 1e3)
        results[name] = {"status": "ok", "step_ms": t, "tokens_per_s": tok_s,
                         "mfu": net.estimate_flops_per_token() * tok_s / (PEAK_BF16_TFLOPS * 1e12)}
        par.release()
        del net, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = results.get("adamw", {}).get("tokens_per_s")
    for r in results.values():
        if r["status"] == "ok":
            r["vs_adamw"] = r["tokens_per_s"] / base if base else None
    return {"benchmark": "train", "model": model, "batch": B, "block_size": T, "vocab": vocab,
            "env": environment(device), "results": results, **kernel_choices()}


def format_tables(record: dict[str, Any]) -> str:
    rows = [{"optimizer": name, "step ms": r.get("step_ms", {}).get("median"), "tokens/s": r.get("tokens_per_s"),
             "vs AdamW": r.get("vs_adamw"), "MFU": r.get("mfu"), "status": r.get("status", "ok")}
            for name, r in record["results"].items()]
    return (f"Training throughput, {record['model']}, batch {record['batch']}x{record['block_size']} (medians)\n"
            + table(rows, ["optimizer", "step ms", "tokens/s", "vs AdamW", "MFU", "status"]))
