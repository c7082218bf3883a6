"""Optimizer-step time of Shampoo and SOAP at precondition_frequency 1 and 10 beside fused AdamW and our Muon,
on the GPT-2-small parameter set of ``matrixopt bench step`` (issue 3's measurement).

A frequency-10 step is timed as the mean over blocks of 20 consecutive steps (two root refreshes each), so the
figure is the amortized cost per step. Usage: ``python scripts/shampoo_step_gpu.py [--model toy] [--json PATH]``.
"""

import argparse
import json

import torch

from matrixopt import build_optimizer
from matrixopt.bench.common import environment, resolve_device, table, time_ms
from matrixopt.bench.step import MODELS, param_set


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="gpt2-small", choices=list(MODELS))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = resolve_device(args.device)
    ps = param_set(args.model, device)
    runs = [("adamw (fused)", "adamw", {}, 5), ("muon", "muon", {}, 5)]
    for name in ("shampoo", "soap"):
        for freq in (1, 10):
            hp = dict(precondition_frequency=freq) | (dict(start_preconditioning_step=1) if name == "shampoo" else {})
            runs.append((f"{name}, frequency {freq}", name, hp, 5 if freq == 1 else 20))
    rows, record = [], {"env": environment(device), "model": args.model, "results": {}}
    for label, name, hp, inner in runs:
        opt = build_optimizer(ps, name, lr=1e-3, **hp)
        t = time_ms(opt.step, device, reps=3, inner=inner, warmup=3)
        record["results"][label] = {**t, "hparams": hp, "inner": inner}
        rows.append({"optimizer": label, "ms": t["median"], "min ms": t["min"]})
        del opt
        torch.cuda.empty_cache() if device.type == "cuda" else None
    base = record["results"]["adamw (fused)"]["median"]
    for r in rows:
        r["vs AdamW"] = r["ms"] / base
    print(f"Optimizer step, {args.model} parameter set, {device}")
    print(table(rows, ["optimizer", "ms", "min ms", "vs AdamW"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
