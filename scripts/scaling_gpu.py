"""Scaling on N GPUs: the trainer's parallel modes, AdamW against Muon, at GPT-2-medium and 1.3B shapes.

    torchrun --standalone --nproc-per-node 4 scripts/scaling_gpu.py --out $OUT          # N GPUs, NCCL
    torchrun --standalone --nproc-per-node 2 scripts/scaling_gpu.py --toy --out /tmp/x  # CPU, gloo, tiny GPT

Each configuration ``PARALLEL:OPTIMIZER[:tpN[:MODE]]`` (default ``ddp:adamw fsdp:adamw layerwise:muon
fsdp:muon``; e.g. ``fsdp:muon:tp2:distributed`` for tensor parallelism 2 in Newton–Schulz mode distributed)
builds the model and optimizer exactly as ``matrixopt train --parallel PARALLEL --optimizer OPTIMIZER --tp N
--tp-mode MODE`` does
(:func:`matrixopt.train.trainer.parallelize`: fp32 parameters with bf16 autocast under DDP and layer-wise, bf16
FSDP2 parameters with fp32 reduction), then times the trainer's step on random tokens: forward, backward,
global-norm clipping at 1.0, ``optimizer.step()``. Per configuration it records

- tokens/s of all ranks together and per GPU (``--tokens-per-gpu`` tokens per rank per step), from the wall time
  of ``--iters`` back-to-back steps that sync only as the trainer does (the loss is read where it logs, so
  between logs the host queues the next step behind the current one's GPU work, and only the optimizers' own
  checks sync), so communication left on other streams (layer-wise broadcasts, FSDP prefetches) overlaps the
  next step,
- the optimizer step per rank: median time ``optimizer.step()`` occupies the compute stream (CUDA events, as the
  trainer's ``opt_s``), the slowest rank being the one that counts,
- peak memory allocated per rank,
- exposed communication: from a profiler trace of ``--iters`` steps, the time NCCL kernels run while no compute
  kernel runs, as a share of the steps' wall time (slowest rank).

For the layer-wise step it also times our single-GPU Muon over the whole model (on every GPU at once), so the
step's scaling with N is the ratio of the two; and, per rank, the owner's own compute (its chunks' inner
``step()``) and its share of the matrix cost. Prints tables on rank 0 and writes ``scaling_gpu.json``.
Shapes: the presets with an untied head and vocab 50304, as in ``matrixopt bench``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from matrixopt.bench.common import environment, exposed_comm, sync, table, time_ms
from matrixopt.distributed import comm
from matrixopt.distributed.layerwise import LayerwiseOptimizer
from matrixopt.optim.registry import build_optimizer
from matrixopt.train.config import ModelConfig, OptimConfig, TrainConfig
from matrixopt.train.model import GPT
from matrixopt.train.trainer import QKV_SPLITS, StreamTimer, clip_gradients, device_mesh, parallelize

CONFIGS = ("ddp:adamw", "fsdp:adamw", "layerwise:muon", "fsdp:muon")
LR = {"adamw": 6e-4, "muon": 6e-4}  # throughput does not depend on it; Muon's match_adamw scale shares AdamW's


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def model_config(preset: str, toy: bool) -> ModelConfig:
    if toy:
        return ModelConfig(preset="tiny-cpu", n_layer=2, tie_embeddings=False)
    return ModelConfig(preset=preset, tie_embeddings=False)


def parse_spec(spec: str) -> tuple[str, str, int, str]:
    """``PARALLEL:OPTIMIZER[:tpN[:MODE]]`` -> (parallel, optimizer, tp, tp_mode)."""
    parts = spec.split(":")
    if len(parts) < 2 or len(parts) > 4 or (len(parts) > 2 and not parts[2].startswith("tp")):
        raise ValueError(f"bad config {spec!r}; use PARALLEL:OPTIMIZER[:tpN[:MODE]], e.g. fsdp:muon:tp2:distributed")
    tp = int(parts[2][2:]) if len(parts) > 2 else 1
    return parts[0], parts[1], tp, parts[3] if len(parts) > 3 else "auto"


def run_config(spec: str, preset: str, args, device: torch.device, vocab: int) -> dict:
    """Time one configuration; returns this rank's measurements."""
    parallel, name, tp, tp_mode = parse_spec(spec)
    cfg = TrainConfig(model=model_config(preset, args.toy), optim=OptimConfig(name=name, lr=LR[name]),
                      parallel=parallel, tp=tp, tp_mode=tp_mode if tp > 1 else "auto", device=device.type)
    gpt = cfg.model.gpt_config(vocab)
    use_bf16 = device.type == "cuda"
    torch.manual_seed(0)
    model = GPT(gpt).to(device)
    module, opt = parallelize(model, cfg, device_mesh(cfg, device, dist.get_world_size()), use_bf16)
    # A TP group shares its batch: tp * tokens_per_gpu tokens per data-parallel rank, so every GPU still carries
    # tokens_per_gpu of the step's tokens.
    B = max(1, args.tokens_per_gpu * tp // gpt.block_size)
    g = torch.Generator(device).manual_seed(1 + dist.get_rank() // tp)  # TP groups are consecutive ranks
    x = torch.randint(0, vocab, (B, gpt.block_size + 1), device=device, generator=g)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if use_bf16 and parallel != "fsdp" \
        else nullcontext
    opt_timer = StreamTimer(device)
    def step() -> None:
        with autocast():
            _, loss = module(x[:, :-1], x[:, 1:])
        loss.backward()
        clip_gradients(parallel, model, opt, 1.0)
        opt_timer.start()
        opt.step()
        opt_timer.stop()
        opt.zero_grad(set_to_none=True)  # no loss.item(): the trainer reads losses only where it logs

    for _ in range(args.warmup):
        step()
    inner = instrument_chunks(opt, device)  # after warm-up: the first step rebuilds the chunks
    dist.barrier()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        step()
    sync(device)
    step_ms = (time.perf_counter() - t0) * 1e3 / args.iters
    opt_ms = [1e3 * t for t in opt_timer.resolve()[args.warmup:args.warmup + args.iters]]
    exposed = {"comm_s": None, "exposed_comm_s": None, "profiled_wall_s": None}
    if device.type == "cuda":
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            sync(device)
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step()
            sync(device)
            wall = time.perf_counter() - t0
        comm, hidden_not = exposed_comm(prof)
        exposed = {"comm_s": comm, "exposed_comm_s": hidden_not, "profiled_wall_s": wall}
    out = dict(config=spec, preset=preset, rank=dist.get_rank(), params=model.num_params(),
               tokens_per_rank=B * gpt.block_size // tp, step_ms=step_ms, opt_step_ms=statistics.median(opt_ms),
               peak_mem_gb=torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
               **exposed, **inner_summary(opt, inner, args))
    return out  # the model and optimizer go with this frame; the caller frees the cache


def instrument_chunks(opt, device: torch.device) -> list[StreamTimer]:
    """For a layer-wise optimizer: a timer around each owner chunk's inner ``step()`` (its own compute)."""
    if not isinstance(opt, LayerwiseOptimizer):
        return []
    timers = []
    for chunk in opt.chunks:
        timer, inner_step = StreamTimer(device), chunk.optimizer.step

        def timed_step(*a, _timer=timer, _step=inner_step, **kw):
            _timer.start()
            out = _step(*a, **kw)
            _timer.stop()
            return out

        chunk.optimizer.step = timed_step
        timers.append(timer)
    return timers


def inner_summary(opt, timers: list[StreamTimer], args) -> dict:
    """This rank's share of the layer-wise matrix cost and the median ms of its chunks' compute per step."""
    if not isinstance(opt, LayerwiseOptimizer):
        return {}
    laps = [t.resolve()[:args.iters] for t in timers]
    per_step = [sum(chunk[i] for chunk in laps) * 1e3 for i in range(min(map(len, laps)))] if laps else [0.0]
    compute = opt.assignment.compute
    return dict(owned_cost_share=compute[opt.rank] / max(sum(compute), 1e-30),
                owned_params=opt.assignment.owner.count(opt.rank), inner_step_ms=statistics.median(per_step))


def single_gpu_muon_step(preset: str, args, device: torch.device, vocab: int) -> float:
    """Median ms of our Muon's step over the whole model on this one device (fp32 parameters)."""
    torch.manual_seed(0)
    model = GPT(model_config(preset, args.toy).gpt_config(vocab)).to(device)
    opt = build_optimizer(model, "muon", lr=LR["muon"], splits=QKV_SPLITS)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return time_ms(opt.step, device, reps=args.iters, warmup=args.warmup)["median"]  # caller frees the cache


def summarize(rows: list[list[dict]], world: int) -> list[dict]:
    """One line per (preset, config) from every rank's measurements: the slowest rank's times."""
    out = []
    for per_rank in rows:
        r0 = per_rank[0]
        step_ms = max(r["step_ms"] for r in per_rank)
        tokens = sum(r["tokens_per_rank"] for r in per_rank)
        shares = [r["exposed_comm_s"] / r["profiled_wall_s"] for r in per_rank if r["profiled_wall_s"]]
        out.append(dict(preset=r0["preset"], config=r0["config"], gpus=world, step_ms=step_ms,
                        tokens_per_s=tokens / step_ms * 1e3, tokens_per_s_per_gpu=tokens / step_ms * 1e3 / world,
                        opt_step_ms_max=max(r["opt_step_ms"] for r in per_rank),
                        opt_step_ms_min=min(r["opt_step_ms"] for r in per_rank),
                        peak_mem_gb_max=max((r["peak_mem_gb"] or 0.0) for r in per_rank) or None,
                        exposed_comm_share=max(shares) if shares else None,
                        inner_step_ms_max=max((r.get("inner_step_ms", 0.0) for r in per_rank), default=0.0) or None))
    for line in out:  # throughput against AdamW with DDP at the same preset
        base = next((b for b in out if b["preset"] == line["preset"] and b["config"] == "ddp:adamw"), None)
        line["vs_ddp_adamw"] = line["tokens_per_s"] / base["tokens_per_s"] if base else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--toy", action="store_true", help="tiny GPT on CPU with gloo (what the test runs)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for scaling_gpu.json (default $OUT)")
    ap.add_argument("--presets", nargs="+", default=["gpt2-medium", "1.3b"])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS),
                    help="PARALLEL:OPTIMIZER[:tpN[:MODE]], e.g. ddp:adamw or fsdp:muon:tp2:distributed")
    ap.add_argument("--tokens-per-gpu", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10, help="timed steps (and profiled steps)")
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    use_cuda = torch.cuda.is_available() and not args.toy
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = 512 if args.toy else 50304
    presets = ["tiny-cpu"] if args.toy else args.presets

    rows, single = [], {}
    for preset in presets:
        if any(c.startswith("layerwise:muon") for c in args.configs):
            single[preset] = single_gpu_muon_step(preset, args, device, vocab)
            free(device)
        for spec in args.configs:
            mine = run_config(spec, preset, args, device, vocab)
            free(device)
            everyone: list = [None] * world
            dist.all_gather_object(everyone, mine)
            rows.append(everyone)
            if rank == 0:
                print(f"{preset} {spec}: step {max(r['step_ms'] for r in everyone):.1f} ms, optimizer step "
                      f"{max(r['opt_step_ms'] for r in everyone):.2f} ms", flush=True)
    singles: list = [None] * world
    dist.all_gather_object(singles, single)
    if rank == 0:
        lines = summarize(rows, world)
        for line in lines:
            if line["config"] == "layerwise:muon":
                ref = statistics.median(s[line["preset"]] for s in singles)
                line["single_gpu_muon_step_ms"] = ref
                line["opt_step_vs_single_gpu"] = line["opt_step_ms_max"] / ref
        result = dict(env=environment(device), world_size=world, backend=dist.get_backend(),
                      tokens_per_gpu=args.tokens_per_gpu, iters=args.iters, warmup=args.warmup, toy=args.toy,
                      summary=lines, per_rank=rows)
        print(f"\n{world} x {result['env']['device']}, {args.tokens_per_gpu} tokens per GPU, torch {torch.__version__}")
        columns = ["preset", "config", "tokens_per_s_per_gpu", "vs_ddp_adamw", "step_ms", "opt_step_ms_max",
                   "opt_step_ms_min", "inner_step_ms_max", "opt_step_vs_single_gpu", "peak_mem_gb_max",
                   "exposed_comm_share"]
        print(table(lines, columns))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "scaling_gpu.json").write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {out / 'scaling_gpu.json'}")
    comm.leave()  # destroys the group; no interpreter teardown (see its docstring)


if __name__ == "__main__":
    main()
