"""Where a training step's time goes, per parallel configuration: forward, backward, clipping and optimizer step.

    torchrun --standalone --nproc-per-node 2 scripts/step_phases_gpu.py fsdp:adamw fsdp:muon ddp:adamw layerwise:muon
    torchrun --standalone --nproc-per-node 2 scripts/step_phases_gpu.py layerwise:muon,step_chunks=4,cuda_graph=True

Builds each ``PARALLEL:OPTIMIZER[,KEY=VALUE...]`` configuration (the pairs are optimizer keyword arguments, as
``--opt`` gives them to the trainer) as ``scripts/scaling_gpu.py`` does (the trainer's
``parallelize``, 1.3B shapes, 4096 tokens per GPU) and runs the trainer's step. Per rank it reports, as medians
over 6 steps:

- the GPU span of each phase (CUDA events on the compute stream, so waits on other streams count) and the host's
  time issuing it (``item`` is the host waiting for the loss), which shows whether a phase is bound by the host;
- garbage-collector pauses, and the caching allocator's device allocations and retries during those steps;
- from a profile of 2 steps: GPU time with a compute kernel running, with any kernel running, the span, and the
  kernels and CUDA runtime calls that take the most time.

Prints a summary on rank 0 and writes ``$OUT/step_phases_gpu.json``; with ``STEP_TRACE=1`` also each rank's profile
as a Chrome trace, ``$OUT/trace_<config>_rank<r>.json``. Needs CUDA and NCCL.
"""

from __future__ import annotations

import ast
import gc
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from scaling_gpu import LR, model_config  # noqa: E402

from matrixopt.distributed import comm  # noqa: E402
from matrixopt.train.config import OptimConfig, TrainConfig  # noqa: E402
from matrixopt.train.model import GPT  # noqa: E402
from matrixopt.train.trainer import clip_gradients, device_mesh, parallelize  # noqa: E402

PHASES = ("fwd", "bwd", "clip", "step")
GC = {"t0": 0.0, "total": 0.0, "n": 0}


def _gc_timer(phase: str, info: dict) -> None:
    if phase == "start":
        GC["t0"] = time.perf_counter()
    else:
        GC["total"] += time.perf_counter() - GC["t0"]
        GC["n"] += 1


def union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for s, t in sorted(intervals):
        if end is None or s > end:
            total, end = total + (t - s), t
        elif t > end:
            total, end = total + (t - end), t
    return total / 1e3


def measure(spec: str, dev: torch.device, steps: int = 6) -> dict:
    head, *pairs = spec.split(",")
    parallel, name = head.split(":")
    hparams = {k: ast.literal_eval(v) for k, v in (pair.split("=", 1) for pair in pairs)}
    cfg = TrainConfig(model=model_config("1.3b", False), optim=OptimConfig(name=name, lr=LR[name], hparams=hparams),
                      parallel=parallel, device="cuda")
    gpt = cfg.model.gpt_config(50304)
    torch.manual_seed(0)
    model = GPT(gpt).to(dev)
    module, opt = parallelize(model, cfg, device_mesh(cfg, dev, dist.get_world_size()), True)
    x = torch.randint(0, 50304, (4096 // gpt.block_size, gpt.block_size + 1), device=dev)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if parallel != "fsdp" else nullcontext
    laps = []

    def step(record: bool) -> None:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)]
        host = [time.perf_counter()]
        events[0].record()
        with autocast():
            _, loss = module(x[:, :-1], x[:, 1:])
        events[1].record()
        host.append(time.perf_counter())
        loss.backward()
        events[2].record()
        host.append(time.perf_counter())
        clip_gradients(parallel, model, opt, 1.0)
        events[3].record()
        host.append(time.perf_counter())
        opt.step()
        opt.zero_grad(set_to_none=True)
        events[4].record()
        host.append(time.perf_counter())
        loss.item()
        host.append(time.perf_counter())
        if record:
            laps.append((events, host))

    for _ in range(3):
        step(False)
    torch.cuda.synchronize()
    dist.barrier()
    GC["total"], GC["n"] = 0.0, 0
    before = torch.cuda.memory_stats(dev)
    for _ in range(steps):
        step(True)
    after = torch.cuda.memory_stats(dev)
    torch.cuda.synchronize()
    out = {
        "gpu_ms": {p: statistics.median(e[i].elapsed_time(e[i + 1]) for e, _ in laps) for i, p in enumerate(PHASES)},
        "host_ms": {p: statistics.median(1e3 * (h[i + 1] - h[i]) for _, h in laps)
                    for i, p in enumerate((*PHASES, "item"))},
        "wall_ms": statistics.median(1e3 * (h[-1] - h[0]) for _, h in laps),
        "gc_ms_per_step": GC["total"] * 1e3 / steps, "gc_collections": GC["n"],
        "allocator": {k: after.get(k, 0) - before.get(k, 0)
                      for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")},
    }
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step(False)
        torch.cuda.synchronize()
    if os.environ.get("STEP_TRACE") == "1":  # the whole timeline, for chrome://tracing or a script
        tag = spec.replace(":", "_").replace(",", "_")
        prof.export_chrome_trace(os.path.join(os.environ.get("OUT", "."), f"trace_{tag}_rank{dist.get_rank()}.json"))
    kernels, runtime, busy = {}, {}, []
    for e in prof.events():
        ms = (e.time_range.end - e.time_range.start) / 2e3  # per step
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] = kernels.get(e.name, 0.0) + ms
            busy.append((e.time_range.start, e.time_range.end, "nccl" in e.name.lower()))
        elif e.name.startswith("cuda"):
            runtime[e.name] = runtime.get(e.name, 0.0) + ms
    span = (max(t for _, t, _ in busy) - min(s for s, _, _ in busy)) / 2e3 if busy else 0.0
    out["profiled_per_step_ms"] = {"compute_busy": union_ms([(s, t) for s, t, c in busy if not c]) / 2,
                                   "any_busy": union_ms([(s, t) for s, t, _ in busy]) / 2, "span": span}
    out["top_kernels_ms"] = sorted(kernels.items(), key=lambda kv: -kv[1])[:20]
    out["top_runtime_ms"] = sorted(runtime.items(), key=lambda kv: -kv[1])[:6]
    return out  # the model and optimizer go with this frame; the caller frees the cache


def main() -> None:
    configs = sys.argv[1:] or ["fsdp:adamw", "fsdp:muon"]
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    gc.callbacks.append(_gc_timer)
    result = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "nccl_high_priority": os.environ.get("TORCH_NCCL_HIGH_PRIORITY", "0"),
              "world_size": dist.get_world_size(), "configs": {}}
    for spec in configs:
        mine = measure(spec, dev)
        gc.collect()
        torch.cuda.empty_cache()
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        result["configs"][spec] = everyone
        if rank == 0:
            print(f"=== {spec}: wall {max(r['wall_ms'] for r in everyone):.1f} ms per step", flush=True)
            for r, d in enumerate(everyone):
                p = d["profiled_per_step_ms"]
                print(f"  rank {r} GPU " + " ".join(f"{k}={v:.1f}" for k, v in d["gpu_ms"].items())
                      + " | host " + " ".join(f"{k}={v:.1f}" for k, v in d["host_ms"].items())
                      + f" | gc {d['gc_ms_per_step']:.1f} | allocator {d['allocator']}"
                      + f" | busy compute {p['compute_busy']:.1f} any {p['any_busy']:.1f} span {p['span']:.1f}")
            for name, ms in everyone[0]["top_kernels_ms"][:10]:
                print(f"    {ms:8.2f}  {name[:100]}")
    if rank == 0:
        path = os.path.join(os.environ.get("OUT", "."), "step_phases_gpu.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
    comm.leave()


if __name__ == "__main__":
    main()
