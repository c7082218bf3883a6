"""Layer-wise Muon on N GPUs against single-GPU Muon and DDP AdamW, at GPT 1.3B shapes.

    torchrun --nproc-per-node 2 scripts/layerwise_gpu.py            # 2 GPUs, NCCL: 24 x 2048, vocab 50304, 4k tok/GPU
    torchrun --nproc-per-node 2 scripts/layerwise_gpu.py --toy      # CPU, gloo, a tiny GPT (what the tests run)

Measures, per rank:
- the optimizer step: ``opt.step()`` of layer-wise Muon (reduce wait + the owner's Newton–Schulz/AdamW + the
  broadcast launches) vs ``step()`` of our single-GPU Muon over the whole model (same parameters, on each GPU);
  medians over ``--iters`` of CUDA-synchronised wall time;
- training tokens/s (all ranks together) of layer-wise Muon vs AdamW under DDP, same model, data and loop
  (forward, backward, clip to 1.0, step), bf16 autocast over fp32 parameters;
- optimizer-state bytes on each rank vs the single-GPU Muon's (plus fp32 masters when parameters are bf16);
- exposed communication: from a torch.profiler trace of ``--iters`` layer-wise iterations, the time NCCL kernels run
  while no compute kernel runs, over the iterations' wall time.

Prints a table on rank 0 and writes ``$OUT/layerwise_gpu.json`` (``$OUT`` defaults to the current directory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import matrixopt.distributed as mdist
from matrixopt import build_optimizer
from matrixopt.bench.common import exposed_comm
from matrixopt.distributed import comm
from matrixopt.train.model import GPT, GPTConfig

SPLITS = {r"attn\.c_attn\.weight$": 3}  # Q, K, V orthogonalized separately, as the trainer does
SHAPES = {
    "1.3b": dict(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=2048, tokens_per_rank=4096),
    "toy": dict(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=64, tokens_per_rank=64),
}
LR = 3e-4


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


def layerwise_state_bytes(opt: mdist.LayerwiseOptimizer) -> int:
    masters = sum(m.numel() * m.element_size() for m in opt.masters.values())
    return masters + sum(state_bytes(c.optimizer) for c in opt.chunks)


def make_model(shape: dict, device: torch.device, dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(**{k: v for k, v in shape.items() if k != "tokens_per_rank"})
    return GPT(cfg).to(device=device, dtype=dtype)


def batches(shape: dict, device: torch.device, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's own random tokens: ``(B, T)`` with B * T = tokens_per_rank."""
    T = shape["block_size"]
    B = shape["tokens_per_rank"] // T
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    out = []
    for _ in range(n):
        x = torch.randint(0, shape["vocab_size"], (B, T + 1), generator=g).to(device)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def single_gpu_step(shape: dict, device: torch.device, dtype: torch.dtype, iters: int) -> dict:
    """Our Muon over the whole model on one device: step time and state bytes."""
    model = make_model(shape, device, dtype)
    opt = build_optimizer(model, "muon", lr=LR, splits=SPLITS)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    times = [timed(opt.step, device) for _ in range(iters + 2)][2:]
    out = {"step_ms": 1e3 * statistics.median(times), "state_bytes": state_bytes(opt)}
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def clip(model: nn.Module, opt) -> None:
    if isinstance(opt, mdist.LayerwiseOptimizer):
        opt.clip_grad_norm_(1.0)  # global norm over all ranks' owned gradients
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def train_loop(model: nn.Module, opt, data, device: torch.device, autocast, step_times: list[float]) -> float:
    """One pass over ``data``; returns the wall time. Appends each ``opt.step()`` time to ``step_times``."""
    sync(device)
    start = time.perf_counter()
    for x, y in data:
        with autocast():
            _, loss = model(x, y)
        loss.backward()
        clip(model, opt)
        step_times.append(timed(opt.step, device))
        opt.zero_grad(set_to_none=True)
    sync(device)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--toy", action="store_true", help="tiny GPT on CPU with gloo (for tests)")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations per measurement")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32")
    args = ap.parse_args()

    use_cuda = torch.cuda.is_available() and not args.toy
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    shape = SHAPES["toy" if args.toy else "1.3b"]
    dtype = torch.bfloat16 if args.param_dtype == "bf16" else torch.float32

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if use_cuda else nullcontext()

    n = args.warmup + args.iters
    data = batches(shape, device, n)
    single = single_gpu_step(shape, device, dtype, args.iters)

    # layer-wise Muon
    model, opt = mdist.layerwise(make_model(shape, device, dtype), "muon", lr=LR, splits=SPLITS)
    lw_steps: list[float] = []
    train_loop(model, opt, data[:args.warmup], device, autocast, [])
    lw_time = train_loop(model, opt, data[args.warmup:], device, autocast, lw_steps)
    lw_state = layerwise_state_bytes(opt)
    profiled = {"comm_s": None, "exposed_comm_s": None, "wall_s": None}
    if use_cuda:
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            wall = train_loop(model, opt, data[args.warmup:], device, autocast, [])
        c, e = exposed_comm(prof)
        profiled = {"comm_s": c, "exposed_comm_s": e, "wall_s": wall}
    opt.wait_params()  # the last step's broadcasts are in flight: finish them before dropping the optimizer
    summary = opt.assignment
    del model, opt
    if use_cuda:
        torch.cuda.empty_cache()

    # AdamW under DDP
    model, ddp_opt = mdist.setup(make_model(shape, device, dtype), "adamw", parallel="ddp", lr=LR)
    train_loop(model, ddp_opt, data[:args.warmup], device, autocast, [])
    ddp_time = train_loop(model, ddp_opt, data[args.warmup:], device, autocast, [])
    del model, ddp_opt

    tokens = world * shape["tokens_per_rank"] * args.iters
    mine = {"rank": rank, "layerwise_step_ms": 1e3 * statistics.median(lw_steps), "single_step_ms": single["step_ms"],
            "layerwise_state_bytes": lw_state, "single_state_bytes": single["state_bytes"], **profiled}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        worst_step = max(r["layerwise_step_ms"] for r in everyone)
        worst_state = max(r["layerwise_state_bytes"] for r in everyone)
        exposed = [r["exposed_comm_s"] / r["wall_s"] for r in everyone if r["wall_s"]]
        result = {
            "shape": shape, "world_size": world, "param_dtype": args.param_dtype, "iters": args.iters,
            "autocast": "bf16" if use_cuda else None, "backend": dist.get_backend(),
            "device": torch.cuda.get_device_name(device) if use_cuda else "cpu", "torch": torch.__version__,
            "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                         cwd=Path(__file__).parent).stdout.strip() or None,
            "ownership": {"matrix_cost_imbalance": summary.imbalance, "state_imbalance": summary.state_imbalance,
                          "params_per_rank": [summary.owner.count(r) for r in range(world)]},
            "per_rank": everyone,
            "step_ratio": worst_step / single["step_ms"],
            "tokens_per_s": {"layerwise_muon": tokens / lw_time, "ddp_adamw": tokens / ddp_time},
            "tokens_ratio": ddp_time / lw_time,
            "state_ratio": worst_state / single["state_bytes"],
            "exposed_comm_share": max(exposed) if exposed else None,
        }
        rows = [
            ("optimizer step, ms (max rank / single GPU)", f"{worst_step:.2f} / {single['step_ms']:.2f}",
             f"{result['step_ratio']:.3f}", "<= 0.55"),
            ("tokens/s (layerwise Muon / DDP AdamW)",
             f"{result['tokens_per_s']['layerwise_muon']:.0f} / {result['tokens_per_s']['ddp_adamw']:.0f}",
             f"{result['tokens_ratio']:.3f}", ">= 0.78"),
            ("optimizer state, GB (max rank / single GPU)",
             f"{worst_state / 1e9:.2f} / {single['state_bytes'] / 1e9:.2f}", f"{result['state_ratio']:.3f}",
             "<= 0.55"),
            ("exposed communication share", "-" if not exposed else f"{max(exposed):.3f}", "", ""),
        ]
        print(f"layerwise Muon on {world} x {result['device']}, {summary.summary()}")
        for name, vals, ratio, target in rows:
            print(f"{name:<46} {vals:>24} {ratio:>8} {target:>8}")
        out = Path(os.environ.get("OUT", ".")) / "layerwise_gpu.json"
        out.write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {out}")
    comm.leave()  # destroys the group; no interpreter teardown (see its docstring)


if __name__ == "__main__":
    main()
