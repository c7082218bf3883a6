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

Memory (CUDA; None elsewhere), from one more step after the timed ones, in GB of 2**30 bytes (:func:`memory`):
``peak_gb`` the peak allocated over the whole step, ``step_extra_gb`` the peak of ``optimizer.step()`` above what
was allocated when it began, ``state_gpu_gb`` the optimizer state held on the GPU after it, and ``optimizer_gpu_gb``
their sum: the GPU memory the optimizer needs at its peak. ``+offload`` (state in CPU memory) and ``+bf16``/``+int8``
(compact state) are the options that shrink it. A captured step (``cuda_graph=True``, the default of Muon and its
kin on a GPU) keeps its workspace in the graph's private pool, allocated at capture: ``peak_gb`` counts it, the
optimizer's fields do not (use ``+eager`` for the step's transient memory).
"""

from __future__ import annotations

import functools
import gc
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from matrixopt.bench.common import PEAK_BF16_TFLOPS, environment, kernel_choices, table
from matrixopt.bench.peers import EMERGING, PEER_NAMES, peer_muons
from matrixopt.device import resolve_device, time_ms
from matrixopt.distributed.parallelism import Parallelism, SingleProcess
from matrixopt.optim.registry import OPTIMIZERS, accepted
from matrixopt.train.model import QKV_SPLITS
from matrixopt.train.qk_clip import GPTQKClip

# preset -> (batch, block_size, vocab) of the benchmark's rows; "tiny-cpu" and "moe-tiny" keep the CPU tests fast.
# The mixtures of experts train their expert stacks with matrixopt's optimizers and AdamW only: the peers take 2-D
# parameters (bench step times them on per-expert copies).
BATCHES: dict[str, tuple[int, int, int]] = {"gpt2-small": (16, 1024, 50304), "gpt2-medium": (8, 1024, 50304),
                                            "1.3b": (4, 2048, 50304), "6.7b": (1, 2048, 50304),
                                            "tiny-cpu": (2, 32, 512),
                                            "moe-small": (16, 1024, 50304), "moe-tiny": (2, 16, 512)}
# suffixes of an optimizer name: "muon+eager" is Muon without the trainer's CUDA graph (cuda_graph=False),
# "muon+standard" Muon with the standard Newton–Schulz form (ns_method="standard"), "muon+fused_qkv" Muon with the
# fused (3d, d) QKV weight orthogonalized whole, as the peers take it (the trainer splits it into Q, K and V:
# QKV_SPLITS), "muon+qk_clip" the trainer's --qk-clip QK_CLIP_TAU (per-head max logits tracked in the forward,
# the heads above tau clipped after the step), "muon+offload" its state in CPU memory (offload="cpu"), "muon+bf16"
# and "muon+int8" its state compact (state_dtype); they combine, e.g. "muon+offload+bf16"
VARIANTS = {"eager": {"cuda_graph": False}, "standard": {"ns_method": "standard"}, "fused_qkv": {}, "qk_clip": {},
            "offload": {"offload": "cpu"}, "bf16": {"state_dtype": "bf16"}, "int8": {"state_dtype": "int8"}}
# the variants that set where and how the state is kept: passed as they are (an optimizer without them is an error,
# not a silent row of the plain optimizer)
STATE_VARIANTS = ("offload", "bf16", "int8")
MEMORY = ("peak_gb", "step_extra_gb", "state_gpu_gb", "optimizer_gpu_gb")  # each row's memory fields (see memory)
QK_CLIP_TAU = 100.0  # Kimi K2's threshold
# the default row: AdamW, ours (and three variants), and the peers (emerging_optimizers recorded as missing where it
# is not installed)
DEFAULT_OPTIMIZERS = ("adamw", "muon", "muon+fused_qkv", "muon+standard", "muon+eager", "torch.optim.Muon", EMERGING)


def train_step(par: Parallelism, net: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor, qk_clip: GPTQKClip | None = None) -> None:
    backward(par, net, x, y)
    opt.step()
    after_step(net, qk_clip)


def backward(par: Parallelism, net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """A training step up to ``opt.step()``: forward, backward and the clip."""
    with par.autocast():
        _, loss = net(x, y)
    loss.backward()
    par.clip_grad_norm_(1.0)  # as the trainer clips: inside the step for matrixopt's optimizers


def after_step(net: torch.nn.Module, qk_clip: GPTQKClip | None = None) -> None:
    """A training step after ``opt.step()``: QK-clip, and the gradients dropped."""
    if qk_clip is not None:
        qk_clip.step()
    for p in net.parameters():
        p.grad = None


def memory(par: Parallelism, net: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
           qk_clip: GPTQKClip | None = None) -> dict[str, float | None]:
    """One more training step, measured: GB (2**30 bytes) of CUDA memory allocated at the step's peak
    (``peak_gb``), at ``opt.step()``'s peak above what was allocated when it began (``step_extra_gb``), held by
    the optimizer's state after it (``state_gpu_gb``), and the optimizer's need at its peak, ``state_gpu_gb +
    step_extra_gb`` (``optimizer_gpu_gb``). On other devices the step runs and every field is None."""
    device = x.device
    if device.type != "cuda":
        train_step(par, net, opt, x, y, qk_clip)
        return dict.fromkeys(MEMORY)
    torch.cuda.reset_peak_memory_stats(device)
    backward(par, net, x, y)
    peak = torch.cuda.max_memory_allocated(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    opt.step()
    step_extra = torch.cuda.max_memory_allocated(device) - before
    after_step(net, qk_clip)
    peak = max(peak, torch.cuda.max_memory_allocated(device))
    state = state_gpu_bytes(opt)
    return {"peak_gb": peak / 2**30, "step_extra_gb": step_extra / 2**30, "state_gpu_gb": state / 2**30,
            "optimizer_gpu_gb": (state + step_extra) / 2**30}


def state_gpu_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the CUDA tensors in ``opt``'s state (a peer's stepper: its optimizers'), found through dicts, lists
    and tuples, each storage counted once (whole, as allocated)."""
    storages: dict[int, int] = {}

    def walk(v: Any) -> None:
        if isinstance(v, DTensor):
            v = v.to_local()
        if isinstance(v, torch.Tensor):
            if v.is_cuda:
                storage = v.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(v, dict):
            for item in v.values():
                walk(item)
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item)

    for o in getattr(opt, "opts", (opt,)):  # a peer's Stepper steps several optimizers
        walk(o.state)
    return sum(storages.values())


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
    base, hparams = _options(name)
    splits = {} if "fused_qkv" in name.split("+")[1:] else QKV_SPLITS
    return par.build_optimizer(model, base, lr=6e-4, weight_decay=0.1, splits=splits, **hparams)


def _options(name: str) -> tuple[str, dict[str, Any]]:
    """``(registered name, options)`` of optimizer ``name`` with its +variants (not a peer): the trainer's options
    that it takes, and those of its state variants, which it must take. ValueError naming what is wrong."""
    base, *variants = name.split("+")
    if base not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {base!r} in {name!r}; use a registered one ({', '.join(OPTIMIZERS)}) "
                         f"or a peer ({', '.join(map(repr, PEER_NAMES))})")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown optimizer variant(s) {unknown} in {name!r}; use +{', +'.join(VARIANTS)}")
    options = {"deferred_nonfinite": True}
    state: dict[str, Any] = {}
    for v in variants:
        if v in STATE_VARIANTS:
            state |= VARIANTS[v]
        else:
            options |= VARIANTS[v]
    if accepted(base, **state) != state:
        takers = [n for n in OPTIMIZERS if accepted(n, **state) == state]
        why = " (torch.optim.AdamW: float32 state on the parameters' device)" if base == "adamw" else ""
        raise ValueError(f"{name!r}: {base}{why} does not take {state}; the state variants "
                         f"+{', +'.join(STATE_VARIANTS)} apply to {', '.join(takers)}")
    return base, accepted(base, **options) | state


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
    for name in optimizers:  # misspelled names and variants fail now, not after the rows before them
        if name not in PEER_NAMES and name != "adamw":
            _options(name)
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
        except (ValueError, NotImplementedError) as e:  # the optimizer rejects this setting (here)
            results[name] = {"status": f"error: {e}"}
            par.release()
            continue
        qk_clip = GPTQKClip(net, par, QK_CLIP_TAU) if "qk_clip" in name.split("+")[1:] else None
        x = torch.randint(0, vocab, (B, T), device=device)
        y = torch.randint(0, vocab, (B, T), device=device)
        try:
            t = time_ms(functools.partial(train_step, par, net, opt, x, y, qk_clip), device, reps=reps, inner=steps,
                        warmup=warmup)
            tok_s = B * T / (t["median"] / 1e3)
            results[name] = {"status": "ok", "step_ms": t, "tokens_per_s": tok_s,
                             "mfu": net.estimate_flops_per_token() * tok_s / (PEAK_BF16_TFLOPS * 1e12),
                             **memory(par, net, opt, x, y, qk_clip)}
        except torch.cuda.OutOfMemoryError as e:  # a row that does not fit (say, without offload) is a result too
            results[name] = {"status": "out of memory: " + str(e).split(". ")[0]}
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
             "vs AdamW": r.get("vs_adamw"), "MFU": r.get("mfu"), "peak GB": r.get("peak_gb"),
             "opt GB": r.get("optimizer_gpu_gb"), "status": r.get("status", "ok")}
            for name, r in record["results"].items()]
    return (f"Training throughput, {record['model']}, batch {record['batch']}x{record['block_size']} (medians; peak "
            f"GB: the step's peak allocated, opt GB: optimizer state on the GPU plus its step's transient peak)\n"
            + table(rows, ["optimizer", "step ms", "tokens/s", "vs AdamW", "MFU", "peak GB", "opt GB", "status"]))
