"""The 1.3B's Muon steps on one GPU at the clock training sustains, against the cost model.

    PYTHONPATH=. python scripts/sustained_step_gpu.py --out docs/results/plan/sustained_h200/sustained_step_h200.json

1. Burst against sustained: a 2048-wide bf16 batched product timed in bursts of ten after an idle second, then
   blocks of fifty for three seconds; the whole model's eager Muon step with a second's pause before each and back
   to back; the SM clock and power sampled by ``nvidia-smi`` meanwhile.
2. The trainer's 1.3B (QKV split in three), Muon eager with the trainer's arguments at lr 0, each step right after
   half a second of the same step: the whole model, and each of two layer-wise owners' shares
   (:func:`matrixopt.distributed.balance.assign` over 2 ranks) in the owner's two chunks, as
   ``LayerwiseOptimizer`` steps them, without any communication; beside each, the cost model's step with the
   shipped profile of the device (``--profile``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from matrixopt.bench.common import environment
from matrixopt.bench.scale import LR, VOCAB, model_config
from matrixopt.device import time_ms
from matrixopt.distributed import balance
from matrixopt.distributed.cost import shipped_profile
from matrixopt.optim.muon import Muon
from matrixopt.optim.routing import param_groups
from matrixopt.plan.validate import owner_step_ms
from matrixopt.train.config import OptimConfig
from matrixopt.train.model import GPT, QKV_SPLITS


def event() -> torch.cuda.Event:
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def burst_and_sustained(step, dev: torch.device) -> dict:
    A = torch.randn(8, 2048, 2048, device=dev, dtype=torch.bfloat16)
    X = torch.randn(8, 2048, 8192, device=dev, dtype=torch.bfloat16)
    flops = 2 * 8 * 2048 * 2048 * 8192

    def products(n: int) -> float:
        s = event()
        for _ in range(n):
            torch.bmm(A, X)
        e = event()
        e.synchronize()
        return flops * n / (s.elapsed_time(e) / 1e3)

    time.sleep(1.0)
    burst = [products(10) for _ in range(5)]
    until, sustained = time.perf_counter() + 3.0, []
    while time.perf_counter() < until:
        sustained.append(products(50))
    steps = {}
    for pause in (1.0, 0.0):
        time.sleep(1.0)
        ms = []
        for _ in range(20):
            time.sleep(pause)
            s = event()
            step()
            e = event()
            e.synchronize()
            ms.append(s.elapsed_time(e))
        steps[f"pause_{pause:g}s"] = ms
    return dict(bmm_burst_tflops=[r / 1e12 for r in burst], bmm_sustained_tflops=[r / 1e12 for r in sustained],
                whole_step_ms=steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile", default="h200")
    args = ap.parse_args()
    dev = torch.device("cuda")
    prof = shipped_profile(args.profile)
    smi_log = tempfile.NamedTemporaryFile("w+", suffix=".csv")
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=smi_log)

    with dev:
        model = GPT(model_config("1.3b", False).gpt_config(VOCAB))
    groups = param_groups(model, splits=QKV_SPLITS)
    matrix = {id(p) for g in groups if g.get("use_muon") for p in g["params"]}
    gen = torch.Generator(dev).manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, device=dev, generator=gen) * 1e-3
    kwargs = OptimConfig(name="muon", lr=LR).optimizer_kwargs()

    def optimizer(params: list[torch.Tensor]) -> Muon:
        keep = {id(p) for p in params}
        sub = [{k: v for k, v in g.items() if k not in ("params", "names")}
               | {"params": [p for p in g["params"] if id(p) in keep]} for g in groups]
        opt = Muon([g for g in sub if g["params"]], **kwargs)
        for g in opt.param_groups:
            g["lr"] = 0.0
        return opt

    def stacks(params: list[torch.Tensor]) -> dict:
        """The matrices Muon steps in ``params`` (QKV in three pieces) and the values on its AdamW."""
        shapes: dict[tuple[int, int], int] = {}
        for p in params:
            if id(p) in matrix:
                m, n = p.shape
                pieces = 3 if m == 3 * n else 1
                shapes[(m // pieces, n)] = shapes.get((m // pieces, n), 0) + pieces
        return dict(shapes=[[m, n, c] for (m, n), c in shapes.items()],
                    adamw_numel=sum(p.numel() for p in params if id(p) not in matrix))

    params = [p for _, p in model.named_parameters()]
    whole = optimizer(params)
    for _ in range(3):
        whole.step()
    record = dict(env=environment(dev), profile=prof.name,
                  clock=burst_and_sustained(whole.step, dev), steps=[])

    assignment = balance.assign(params, [id(p) in matrix for p in params], 2, balance.muon_cost,
                                lambda p, m: 4 * p.numel() * (1 if m else 2))
    cases = [("whole model, one process", [params])]
    for rank in (0, 1):
        own = [p for p, r in zip(params, assignment.owner) if r == rank]
        half, acc, cut = sum(p.numel() for p in own) / 2, 0, len(own)
        for i, p in enumerate(own):  # two chunks of about equal size, in forward order
            acc += p.numel()
            if acc >= half:
                cut = i + 1
                break
        cases.append((f"owner {rank} of 2 (layer-wise), two chunks", [own[:cut], own[cut:]]))
    print(f"{'step':42s} {'measured ms':>12s} {'model ms':>9s} {'error':>7s} {'model host':>10s}")
    for name, chunks in cases:
        opts = [optimizer(c) for c in chunks]

        def step(opts: list[Muon] = opts) -> None:
            for o in opts:
                o.step()

        t = time_ms(step, dev, reps=7, warmup=2, heat_s=0.5)
        parts = [stacks(c) for c in chunks]
        device_ms, host = owner_step_ms(prof, parts)
        record["steps"].append(dict(step=name, measured_ms=t["median"], p20=t["p20"], p80=t["p80"], chunks=parts))
        print(f"{name:42s} {t['median']:12.2f} {max(device_ms, host):9.2f} "
              f"{max(device_ms, host) / t['median'] - 1:+7.1%} {host:10.2f}")
        del opts
    smi.terminate()
    smi.wait()
    smi_log.seek(0)
    samples = [[float(x) for x in line.split(", ")] for line in smi_log.read().strip().splitlines()
               if line.replace(", ", "").replace(".", "").isdigit()]
    loaded = [mhz for mhz, watts in samples if watts >= 0.85 * max(w for _, w in samples)]
    record["clock"]["sm_mhz"] = dict(highest=max(mhz for mhz, _ in samples), under_load=statistics.median(loaded),
                                     under_load_min=min(loaded), power_max_w=max(w for _, w in samples))
    c = record["clock"]
    print(f"bf16 product: burst {statistics.median(c['bmm_burst_tflops']):.0f} TFLOP/s, sustained "
          f"{statistics.median(c['bmm_sustained_tflops']):.0f}; whole step with pauses "
          f"{statistics.median(c['whole_step_ms']['pause_1s']):.1f} ms, back to back "
          f"{statistics.median(c['whole_step_ms']['pause_0s']):.1f}; SM clock {c['sm_mhz']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
