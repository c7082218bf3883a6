"""Tensor-parallel Newton–Schulz and FSDP2 Muon on 2 GPUs: per-mode timings, the overlap's saving, and Muon
against AdamW under FSDP2. Prints a table and writes ``tp_gpu.json`` to ``--out`` (default ``$OUT``).

    torchrun --standalone --nproc_per_node 2 scripts/tp_gpu.py                 # 2 GPUs, nccl, bf16
    torchrun --standalone --nproc_per_node 2 scripts/tp_gpu.py --toy --out /tmp/x   # CPU, gloo, toy sizes

1. Newton–Schulz of 4096 x 14336 and 8192 x 8192 weights split over the ranks along dim 0 and dim 1, in each
   mode: duplicated, distributed (Gram all-reduce in 4 overlapped chunks), distributed unchunked (chunks=1),
   blockwise, and unsharded on one GPU for reference; plus the mode ``auto`` picks from the measured cost
   model. FLOPs of the full matrix: ``steps * (4 s^2 l + 2 s^3)`` with ``s, l = min, max(m, n)``.
2. FSDP2 (``fully_shard``, bf16 parameters, fp32 reduction) GPT training at 4096 tokens per GPU, presets
   gpt2-medium and 1.3b: tokens/s and optimizer-step ms for ShardedMuon and fused AdamW.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import time
import warnings
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from matrixopt.distributed import comm
from matrixopt.distributed.fsdp import apply_fsdp
from matrixopt.distributed.sharded import ShardedMuon
from matrixopt.distributed.tp import choose_mode, measure_cost_model, ns_step_flops, tp_newton_schulz
from matrixopt.distributed.tp_comm import chunk_sizes
from matrixopt.linalg.ortho import newton_schulz
from matrixopt.optim.routing import param_groups
from matrixopt.train.model import GPT, PRESETS, GPTConfig

NS_STEPS = 5
QKV_SPLITS = {r"attn\.c_attn\.weight$": 3}  # Q, K, V orthogonalized separately, as the trainer does
MODES = [("duplicated", 1), ("distributed", 4), ("distributed", 1), ("blockwise", 1)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, warmup: int, reps: int) -> list[float]:
    """Milliseconds of each of ``reps`` calls after ``warmup``; ranks start each call together."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def quantiles(ms: list[float]) -> dict[str, float]:
    """p20 / median / p80 in ms, slowest rank (a collective step is as slow as its slowest rank)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    q = torch.tensor(statistics.quantiles(ms, n=5, method="inclusive")[::3] + [statistics.median(ms)],
                     dtype=torch.float64, device=device)  # NCCL reduces CUDA tensors only
    dist.all_reduce(q, op=dist.ReduceOp.MAX)
    p20, p80, p50 = q.tolist()
    return {"p20_ms": p20, "median_ms": p50, "p80_ms": p80}


def bench_ns(shapes, device, dtype, warmup, reps) -> list[dict]:
    world, rank = dist.get_world_size(), dist.get_rank()
    cost = measure_cost_model(None, device)
    rows = []
    for m, n in shapes:
        G = torch.randn(m, n, device=device, generator=torch.Generator(device).manual_seed(0)).to(dtype)
        flops = NS_STEPS * ns_step_flops(min(m, n), max(m, n))
        ref = quantiles(timed(partial(newton_schulz, G, NS_STEPS, dtype=dtype), device, warmup, reps))
        rows.append(dict(shape=[m, n], shard_dim=None, mode="unsharded (1 GPU)", chunks=None, **ref,
                         tflops=flops / ref["median_ms"] / 1e9))
        for pd in (0, 1):
            local = G.split(chunk_sizes(G.shape[pd], world), dim=pd)[rank].contiguous()
            r, c = (n, m) if pd == 0 else (m, n)  # the contracted layout distributed mode iterates on
            picked = choose_mode(r, c, world, batch=1, steps=NS_STEPS, itemsize=dtype.itemsize, chunks=4, cost=cost)
            for mode, chunks in MODES:
                run = partial(tp_newton_schulz, local, pd, None, steps=NS_STEPS, dtype=dtype, mode=mode, chunks=chunks)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the long-side warning: recorded as long_side below
                    q = quantiles(timed(run, device, warmup, reps))
                rows.append(dict(shape=[m, n], shard_dim=pd, mode=mode, chunks=chunks, **q,
                                 tflops=flops / q["median_ms"] / 1e9, auto_picks=picked,
                                 long_side=mode == "distributed" and r > c))
    return rows


def bench_train(preset, optimizer, mesh, device, tokens_per_gpu, vocab, warmup, reps) -> dict:
    cfg = GPTConfig(**PRESETS[preset], vocab_size=vocab)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" \
        else None
    apply_fsdp(model, mesh, mp_policy=mp)
    if optimizer == "muon":
        opt = ShardedMuon(param_groups(model, splits=QKV_SPLITS), lr=3e-4)
    else:
        groups = param_groups(model, matrix_flag=None)
        for g in groups:
            g.pop("names")
        opt = torch.optim.AdamW(groups, lr=3e-4, fused=device.type == "cuda")
    B, T = max(1, tokens_per_gpu // cfg.block_size), cfg.block_size
    g = torch.Generator(device).manual_seed(dist.get_rank())
    x = torch.randint(0, vocab, (B, T + 1), device=device, generator=g)
    opt_ms = []

    def step():
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        sync(device)
        t0 = time.perf_counter()
        opt.step()
        sync(device)
        opt_ms.append((time.perf_counter() - t0) * 1e3)
        opt.zero_grad(set_to_none=True)

    step_ms = quantiles(timed(step, device, warmup, reps))
    opt_q = quantiles(opt_ms[warmup:])
    tokens = B * T * dist.get_world_size()
    return dict(preset=preset, optimizer=optimizer, params=model.num_params(), tokens_per_step=tokens,
                step_median_ms=step_ms["median_ms"], tokens_per_s=tokens / step_ms["median_ms"] * 1e3,
                opt_step_median_ms=opt_q["median_ms"],
                peak_mem_gb=torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None)


def bench_train_fresh(*args) -> dict:
    """:func:`bench_train`, then free its model and optimizer so the next run starts from empty memory."""
    out = bench_train(*args)
    device = args[3]
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return out


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--toy", action="store_true", help="CPU, gloo, toy sizes (a smoke test of the script)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder for tp_gpu.json (default $OUT)")
    ap.add_argument("--presets", nargs="*", default=None, help="model presets (default gpt2-medium 1.3b)")
    args = ap.parse_args()
    if args.toy:
        dist.init_process_group("gloo")
        device, dtype = torch.device("cpu"), torch.float32
        shapes, presets, tokens, vocab, warmup, reps = [(32, 112), (64, 64)], ["tiny-cpu"], 128, 65, 1, 3
    else:
        if not torch.cuda.is_available():
            raise SystemExit("scripts/tp_gpu.py needs CUDA GPUs (one per rank); use --toy to run on CPU with gloo")
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        device, dtype = torch.device("cuda", local_rank), torch.bfloat16
        shapes, presets, tokens, vocab, warmup, reps = [(4096, 14336), (8192, 8192)], ["gpt2-medium", "1.3b"], \
            4096, 50304, 3, 10
    presets = args.presets if args.presets is not None else presets
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    ns_rows = bench_ns(shapes, device, dtype, warmup, reps)
    train_rows = [bench_train_fresh(p, o, mesh, device, tokens, vocab, warmup, reps) for p in presets
                  for o in ("adamw", "muon")]
    if dist.get_rank() == 0:
        overlap = []
        for m, n in shapes:
            for pd in (0, 1):
                med = {(r["mode"], r["chunks"]): r["median_ms"] for r in ns_rows
                       if r["shape"] == [m, n] and r["shard_dim"] == pd}
                chunked, serial = med[("distributed", 4)], med[("distributed", 1)]
                overlap.append(dict(shape=[m, n], shard_dim=pd, chunked_ms=chunked, unchunked_ms=serial,
                                    saving=1 - chunked / serial))
        ratios = {}
        for p in presets:
            tps = {r["optimizer"]: r["tokens_per_s"] for r in train_rows if r["preset"] == p}
            ratios[p] = tps["muon"] / tps["adamw"]
        result = dict(
            env=dict(torch=torch.__version__, device=torch.cuda.get_device_name(device) if device.type == "cuda"
                     else "cpu", world_size=world, backend=dist.get_backend(), dtype=str(dtype), toy=args.toy,
                     git_commit=git_commit(), ns_steps=NS_STEPS, tokens_per_gpu=tokens),
            newton_schulz=ns_rows, overlap=overlap, train=train_rows, muon_over_adamw_tokens_per_s=ratios)
        print(f"\nNewton–Schulz, {NS_STEPS} steps, {dtype}, {world} ranks")
        print(f"{'shape':>14} {'shard':>5} {'mode':>18} {'chunks':>6} {'median ms':>10} {'TFLOPS':>7}  auto picks")
        for r in ns_rows:
            print(f"{str(tuple(r['shape'])):>14} {str(r['shard_dim']):>5} {r['mode']:>18} {str(r['chunks']):>6} "
                  f"{r['median_ms']:>10.3f} {r['tflops']:>7.1f}  {r.get('auto_picks', '')}"
                  f"{'  (long side)' if r.get('long_side') else ''}")
        print("\nOverlap of the Gram all-reduce (distributed mode, 4 chunks vs 1)")
        for o in overlap:
            print(f"{str(tuple(o['shape'])):>14} dim {o['shard_dim']}: {o['unchunked_ms']:.3f} -> "
                  f"{o['chunked_ms']:.3f} ms ({o['saving']:+.1%})")
        print(f"\nFSDP2 training, {tokens} tokens per GPU")
        print(f"{'preset':>12} {'optimizer':>9} {'tokens/s':>10} {'step ms':>8} {'opt ms':>8}")
        for r in train_rows:
            print(f"{r['preset']:>12} {r['optimizer']:>9} {r['tokens_per_s']:>10.0f} {r['step_median_ms']:>8.1f} "
                  f"{r['opt_step_median_ms']:>8.2f}")
        for p, ratio in ratios.items():
            print(f"{p}: Muon / AdamW tokens/s = {ratio:.3f}")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tp_gpu.json").write_text(json.dumps(result, indent=2))
        print(f"wrote {out / 'tp_gpu.json'}")
    comm.leave()  # destroys the group; no interpreter teardown (see its docstring)


if __name__ == "__main__":
    main()
