"""``matrixopt bench profile step|train|launch``: where one GPU's time goes, from ``torch.profiler`` traces.

- ``step``: an optimizer's step on a model's parameter set (``bench step``'s, with the trainer's deferred
  non-finite check where the optimizer takes it): GPU time per kernel and step, the kernels launched per step,
  and the host's time to issue a step (``step()`` returning, the queue drained before each: where it exceeds the
  step's GPU time, the step is bound by its host). Muon (the default) eager and replayed from a CUDA graph; other
  optimizers (``--optimizers soap shampoo``) eager, with their defaults, so a refresh every
  ``precondition_frequency`` steps falls in some of the timed and traced steps.
- ``train``: training steps of ``bench train`` (its loop, model and optimizers, e.g. ``muon+eager``): the GPU's
  busy time against the step's span and the largest idle gaps, with the kernels on either side. The profiler
  slows the host, so gaps are upper bounds of the unprofiled run's.
- ``launch``: host microseconds per eager call of our Triton kernels (pointer and TMA launches, the tuned
  wrappers) beside an empty Triton kernel and cuBLAS. A long ``torch.cuda._sleep`` keeps the GPU busy so that
  the host never waits for it: the time is the launch path alone.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from matrixopt.bench import train as bench_train
from matrixopt.bench.common import environment, kernel_choices, table
from matrixopt.bench.step import MODELS, param_set
from matrixopt.device import host_ms, sync, time_ms
from matrixopt.distributed.parallelism import SingleProcess
from matrixopt.optim.registry import accepted, build_optimizer
from matrixopt.train.model import GPT, PRESETS, GPTConfig

PROFILED_STEPS = 5
TOP_KERNELS = 20
TOP_GAPS = 6


def kernel_intervals(prof: Any) -> list[tuple[int, int, str]]:
    """``(start, end, name)`` of every GPU kernel in a trace (microseconds), in start order."""
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)


def per_kernel_ms(kernels: Sequence[tuple[int, int, str]], steps: int) -> dict[str, float]:
    """Milliseconds per step spent in each kernel (summed over its launches), largest first."""
    out: dict[str, float] = {}
    for start, end, name in kernels:
        out[name] = out.get(name, 0.0) + (end - start) / steps / 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def busy_and_gaps(kernels: Sequence[tuple[int, int, str]], steps: int) -> dict[str, Any]:
    """Per step: the span from the first kernel's start to the last one's end, the time some kernel runs, the
    idle rest; and the ``TOP_GAPS`` longest gaps (ms) with the kernel that ended before and the one after."""
    busy, gaps = 0, []
    end, last = kernels[0][0], kernels[0][2]
    for start, stop, name in kernels:
        if start > end:
            gaps.append({"ms": (start - end) / 1e3, "after": last, "before": name})
        busy += max(0, stop - max(start, end))
        if stop >= end:
            end, last = stop, name
    span = (max(k[1] for k in kernels) - kernels[0][0]) / 1e3 / steps
    return {"span_ms": span, "busy_ms": busy / 1e3 / steps, "idle_ms": span - busy / 1e3 / steps,
            "gaps": sorted(gaps, key=lambda g: -g["ms"])[:TOP_GAPS]}


def traced(fn: Callable[[], object], device: torch.device, steps: int = PROFILED_STEPS) -> list[tuple[int, int, str]]:
    """The GPU kernels of ``steps`` calls of ``fn`` (after the caller's warm-up)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    return kernel_intervals(prof)


def free(device: torch.device) -> None:
    gc.collect()
    torch.cuda.empty_cache()


def profile_step(model: str, device: torch.device, reps: int, names: Sequence[str] = ("muon",)) -> dict[str, Any]:
    """Each optimizer's step on ``model``'s parameter set: median ms (GPU), the host's ms to issue it, kernel ms
    and kernels launched per step. Muon's variants are keyed ``eager`` and ``CUDA graph``, the other optimizers by
    name."""
    ps = param_set(model, device)
    variants = []  # (key, name, options)
    for name in names:
        if name == "muon":
            variants += [("eager", name, {"cuda_graph": False}), ("CUDA graph", name, {"cuda_graph": True})]
        else:
            variants.append((name, name, {}))
    out = {}
    for key, name, options in variants:
        opt = build_optimizer(ps, name, lr=1e-3, **accepted(name, deferred_nonfinite=True), **options)
        t = time_ms(opt.step, device, reps=reps, inner=5, warmup=5)
        host = host_ms(opt.step, device, reps=5 * reps)
        intervals = traced(opt.step, device)
        kernels = per_kernel_ms(intervals, PROFILED_STEPS)
        out[key] = {"ms": t, "host_ms": host, "launches": len(intervals) / PROFILED_STEPS,
                    "kernel_ms": sum(kernels.values()), "kernels": dict(list(kernels.items())[:TOP_KERNELS])}
        del opt
        free(device)
    return out


def training_step(model: str, name: str, device: torch.device) -> Callable[[], None]:
    """One step of ``bench train``'s loop on ``model`` (its preset and batch, one process in bf16) with optimizer
    ``name``, on a fresh model and random tokens."""
    B, T, vocab = bench_train.BATCHES[model]
    torch.manual_seed(0)
    with torch.device(device):
        net = GPT(GPTConfig(vocab_size=vocab, tie_embeddings=False, **dict(PRESETS[model], block_size=T)))
    par = SingleProcess(device, bf16=True)
    opt = bench_train._optimizer(net, name, par)
    x = torch.randint(0, vocab, (B, T), device=device)
    return functools.partial(bench_train.train_step, par, net, opt, x, x.roll(1, 1))


def profile_train(model: str, optimizers: Sequence[str], device: torch.device) -> dict[str, Any]:
    """``bench train``'s step on ``model`` with each optimizer: busy time, span and idle gaps per step."""
    out = {}
    for name in optimizers:
        step = training_step(model, name, device)
        for _ in range(PROFILED_STEPS):
            step()
        sync(device)
        out[name] = busy_and_gaps(traced(step, device), PROFILED_STEPS)
        del step
        free(device)
    return out


def host_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Host microseconds per call of ``fn`` while the GPU is kept busy (nothing waits for it)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))  # a few seconds of GPU cycles: every launch below queues behind them
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return t


def profile_launch(device: torch.device) -> dict[str, float]:
    """Host microseconds per launch of the kernels of a GPT-2-small QKV stack's Newton–Schulz step."""
    import triton

    from matrixopt.kernels.ns_update import GemmConfig, ns_update
    from matrixopt.kernels.syrk import SyrkConfig, syrk

    @triton.jit
    def _noop(x_ptr):
        pass

    X = (torch.randn(12, 768, 2304, device=device) / 48).bfloat16()
    A = (torch.randn(12, 768, 768, device=device) / 768).bfloat16()
    calls = {
        "empty Triton kernel": lambda: _noop[(1,)](X),
        "torch.bmm X X^T (cuBLAS)": lambda: torch.bmm(X, X.mT),
        "SYRK, pointer kernel": lambda: syrk(X, config=SyrkConfig(128, 64, 1, 8, 4)),
        "SYRK, TMA kernel": lambda: syrk(X, config=SyrkConfig(128, 64, 1, 8, 4, persistent=True)),
        "syrk() (tuned)": lambda: syrk(X),
        "update, pointer kernel": lambda: ns_update(A, X, 2.0, config=GemmConfig(128, 128, 64, 8, 4, 4)),
        "update, TMA kernel": lambda: ns_update(A, X, 2.0, config=GemmConfig(128, 128, 64, 8, 4, 4, persistent=True)),
        "ns_update() (tuned)": lambda: ns_update(A, X, 2.0),
    }
    return {name: host_us(fn) for name, fn in calls.items()}


OPTIMIZERS = {"step": ("muon",), "train": ("adamw", "muon", "muon+eager")}
"""Each profile's optimizers unless others are given."""


def run(what: str, *, model: str, optimizers: Sequence[str] | None = None, device: torch.device,
        reps: int = 10) -> dict[str, Any]:
    """Profile ``what`` (step, train or launch); returns the JSON record. ``optimizers``: step's and train's
    (None: :data:`OPTIMIZERS`)."""
    if device.type != "cuda":
        raise ValueError(f"matrixopt bench profile {what} reads GPU kernels from CUDA traces; device {device} has "
                         f"none. Run it on a CUDA GPU (--device cuda); on the CPU, `matrixopt bench step` and "
                         f"`matrixopt bench train` give the times without the breakdown")
    models = {"step": MODELS, "train": bench_train.BATCHES}
    if what in models and model not in models[what]:
        raise ValueError(f"unknown model {model!r} for profile {what}; choose one of {', '.join(models[what])}")
    optimizers = list(optimizers or OPTIMIZERS.get(what, ()))
    match what:
        case "step":
            results = profile_step(model, device, reps, optimizers)
        case "train":
            results = profile_train(model, optimizers, device)
        case "launch":
            results = profile_launch(device)
        case _:
            raise ValueError(f"unknown profile {what!r}; choose step, train or launch")
    return {"benchmark": "profile", "profile": what, "model": None if what == "launch" else model,
            "profiled_steps": PROFILED_STEPS, "env": environment(device), "results": results, **kernel_choices()}


def format_tables(record: dict[str, Any]) -> str:
    res = record["results"]
    match record["profile"]:
        case "step":
            parts = []
            for variant, r in res.items():
                rows = [{"kernel": name[:100], "ms per step": ms} for name, ms in r["kernels"].items()]
                what = f"Muon step, {record['model']} parameter set, {variant}" if variant in ("eager", "CUDA graph") \
                    else f"{variant} step, {record['model']} parameter set"
                parts.append(f"{what}: {r['ms']['median']:.3f} ms (median), host {r['host_ms']['median']:.3f} ms to "
                             f"issue it, kernels {r['kernel_ms']:.3f} ms in {r['launches']:.0f} launches\n"
                             + table(rows, ["kernel", "ms per step"]))
            return "\n\n".join(parts)
        case "train":
            rows = [{"optimizer": name, "span ms": r["span_ms"], "busy ms": r["busy_ms"], "idle ms": r["idle_ms"],
                     "largest gaps": "; ".join(f"{g['ms']:.3f} ms after {g['after'][:40]} before {g['before'][:40]}"
                                               for g in r["gaps"][:3])} for name, r in res.items()]
            return (f"Training step, {record['model']}, per step under the profiler (which slows the host)\n"
                    + table(rows, ["optimizer", "span ms", "busy ms", "idle ms", "largest gaps"]))
        case _:
            return "Host time per eager call, GPU kept busy\n" + table(
                [{"call": name, "host us": us} for name, us in res.items()], ["call", "host us"])
