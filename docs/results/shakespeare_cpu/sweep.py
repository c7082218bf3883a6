"""Learning-rate sweep behind the defaults of `matrixopt compare` (nanoGPT's CPU quick-start, 2000 steps).

Run from the repository root: python docs/results/shakespeare_cpu/sweep.py [OUT]. Each run trains the default
TrainConfig with one optimizer and peak lr (finished runs in OUT are reused); final val losses and val curves
go to sweep.json beside this file.
"""

import json
import sys
from pathlib import Path

from matrixopt.train.config import OptimConfig, TrainConfig
from matrixopt.train.trainer import read_metrics, train

GRID = [
    ("adamw", 1e-3), ("muon", 4e-3), ("muon", 2e-3), ("muon", 8e-3), ("adamw", 2e-3), ("adamw", 5e-4), ("muon", 1e-3),
]  # fmt: skip

out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/sweep")
results = []
for name, lr in GRID:
    run_dir = out / f"{name}_{lr:g}"
    run = train(TrainConfig(optim=OptimConfig(name=name, lr=lr)), run_dir, resume=True, progress=False)
    curve = [[m["step"], round(m["val_loss"], 4)] for m in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in m]
    results.append({k: run[k] for k in ("optimizer", "lr", "final_val_loss", "elapsed_s", "opt_share")})
    results[-1]["val_loss_by_step"] = curve
    Path(__file__).with_name("sweep.json").write_text(json.dumps(results, indent=2) + "\n")
