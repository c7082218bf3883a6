"""``matrixopt bench tp``: Newton–Schulz of one weight sharded over tensor-parallel ranks, in each mode.

    torchrun --standalone --nproc-per-node 2 -m matrixopt bench tp --json tp.json         # N GPUs, NCCL, bf16
    torchrun --standalone --nproc-per-node 2 -m matrixopt bench tp --toy --json tp.json   # CPU, gloo, toy sizes

Each ``(m, n)`` weight (default 4096 x 14336 and 8192 x 8192) is split over all ranks along dim 0 and along dim 1
and orthogonalized by :func:`matrixopt.distributed.tp.tp_newton_schulz` in each mode: ``duplicated`` (all-gather,
every rank iterates on the whole matrix), ``distributed`` (the Gram matrix all-reduced whole, the default, and in
4 row blocks overlapped with their products) and ``blockwise`` (each shard on its own); and unsharded on one device
for reference. Rows record the mode ``auto`` picks there from the measured cost model, and ``long_side`` where
distributed mode iterates on the long side of the shard layout. Times are the slowest rank's p20 / median / p80
(ranks start each call together). The overlap table sets 4 chunks against 1.

FLOPs of the full matrix, standard form: ``steps * (4 s^2 l + 2 s^3)`` with ``s, l = min, max(m, n)``
(:func:`matrixopt.linalg.ortho.newton_schulz_flops`). FSDP2 training with Muon against AdamW, with or without
tensor parallelism: ``matrixopt bench scale --configs fsdp:adamw fsdp:muon fsdp:muon:tp2``.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from matrixopt.bench.common import environment, table
from matrixopt.device import sync
from matrixopt.distributed import comm
from matrixopt.distributed.cost import TP_GRAM_CHUNKS
from matrixopt.distributed.tp import choose_mode, measure_cost_model, tp_newton_schulz
from matrixopt.linalg.ortho import NewtonSchulzConfig, newton_schulz, newton_schulz_flops

DEFAULT_SHAPES = [(4096, 14336), (8192, 8192)]
TOY_SHAPES = [(32, 112), (64, 64)]
NS_STEPS = 5
MODES = [("duplicated", 1), ("distributed", 4), ("distributed", 1), ("blockwise", 1)]  # (mode, Gram chunks)


def join(toy: bool) -> torch.device:
    """Join torchrun's process group and return this rank's device: its GPU (``LOCAL_RANK``) with NCCL, or the
    CPU with gloo (``toy``, or no GPU)."""
    if "RANK" not in os.environ:
        raise ValueError("matrixopt bench tp runs one process per rank: launch it with `torchrun --nproc-per-node N "
                         "-m matrixopt bench tp ...` (--toy: 2 ranks on the CPU)")
    if toy or not torch.cuda.is_available():
        dist.init_process_group("gloo")
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return device


def slowest(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> dict[str, float]:
    """p20 / median / p80 ms of ``fn`` over ``reps`` calls after ``warmup``, each started together on every rank
    (a barrier, then the device drained), the slowest rank's: a collective step is as slow as its slowest rank.
    Collective."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(times, n=5, method="inclusive")
    mine = torch.tensor([q[0], statistics.median(times), q[3]], dtype=torch.float64, device=comm.object_device(None))
    p20, p50, p80 = comm.all_reduce_max(mine, None).tolist()
    return {"p20_ms": p20, "median_ms": p50, "p80_ms": p80}


def run(shapes: Sequence[tuple[int, int]] = DEFAULT_SHAPES, *, device: torch.device, dtype: torch.dtype,
        warmup: int = 3, reps: int = 10, steps: int = NS_STEPS) -> dict[str, Any]:
    """Time every mode on every shape and shard dim over the default process group; returns the JSON record
    (the same on every rank). Collective."""
    world, rank = comm.world_size(None), comm.rank(None)
    if world < 2:
        raise ValueError(f"matrixopt bench tp shards each weight over the ranks, but this run has {world}; launch 2 "
                         f"or more (torchrun --nproc-per-node 2)")
    cost = measure_cost_model(None, device)
    ns = NewtonSchulzConfig(steps=steps, dtype=dtype)
    rows = []
    for m, n in shapes:
        G = torch.randn(m, n, device=device, generator=torch.Generator(device).manual_seed(0)).to(dtype)
        flops = newton_schulz_flops(m, n, steps, "standard")
        ref = slowest(partial(newton_schulz, G, steps, ns.coefficients, dtype=dtype), device, warmup, reps)
        rows.append(dict(shape=[m, n], shard_dim=None, mode="unsharded (1 device)", chunks=None, **ref,
                         tflops=flops / ref["median_ms"] / 1e9))
        for pd in (0, 1):
            local = G.split(comm.chunk_sizes(G.shape[pd], world), dim=pd)[rank].contiguous()
            r, c = (n, m) if pd == 0 else (m, n)  # the contracted layout distributed mode iterates on
            picked = choose_mode(r, c, world, batch=1, steps=steps, itemsize=dtype.itemsize, chunks=TP_GRAM_CHUNKS,
                                 cost=cost)
            for mode, chunks in MODES:
                fn = partial(tp_newton_schulz, local, pd, None, config=ns, mode=mode, chunks=chunks)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the long-side warning: recorded as long_side
                    q = slowest(fn, device, warmup, reps)
                rows.append(dict(shape=[m, n], shard_dim=pd, mode=mode, chunks=chunks, **q,
                                 tflops=flops / q["median_ms"] / 1e9, auto_picks=picked,
                                 long_side=mode == "distributed" and r > c))
    overlap = []
    for m, n in shapes:
        for pd in (0, 1):
            med = {r["chunks"]: r["median_ms"] for r in rows
                   if r["shape"] == [m, n] and r["shard_dim"] == pd and r["mode"] == "distributed"}
            overlap.append(dict(shape=[m, n], shard_dim=pd, chunked_ms=med[4], unchunked_ms=med[1],
                                saving=1 - med[4] / med[1]))
    return {"benchmark": "tp", "env": environment(device), "world_size": world, "backend": dist.get_backend(),
            "dtype": str(dtype), "ns_steps": steps, "cost_model": dataclasses.asdict(cost), "newton_schulz": rows,
            "overlap": overlap}


def format_tables(record: dict[str, Any]) -> str:
    rows = [{"shape": "x".join(map(str, r["shape"])), "shard dim": r["shard_dim"], "mode": r["mode"],
             "chunks": r["chunks"], "median ms": r["median_ms"], "TFLOP/s": r["tflops"],
             "auto picks": r.get("auto_picks"), "long side": r.get("long_side")} for r in record["newton_schulz"]]
    overlap = [{"shape": "x".join(map(str, o["shape"])), "shard dim": o["shard_dim"], "1 chunk ms": o["unchunked_ms"],
                "4 chunks ms": o["chunked_ms"], "saving": o["saving"]} for o in record["overlap"]]
    return (f"Tensor-parallel Newton–Schulz, {record['ns_steps']} steps, {record['dtype']}, {record['world_size']} "
            f"ranks ({record['backend']}), slowest rank\n"
            + table(rows, ["shape", "shard dim", "mode", "chunks", "median ms", "TFLOP/s", "auto picks", "long side"])
            + "\n\nOverlap of the Gram all-reduce (distributed mode, 4 chunks against 1)\n"
            + table(overlap, ["shape", "shard dim", "1 chunk ms", "4 chunks ms", "saving"]))
