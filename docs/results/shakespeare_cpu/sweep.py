"""Learning-rate sweep behind the defaults of `matrixopt compare` (nanoGPT's CPU quick-start, 2000 steps).

From the repository root:

    python docs/results/shakespeare_cpu/sweep.py [OUT]            # train every grid point (resuming runs in OUT)
    python docs/results/shakespeare_cpu/sweep.py OUT --collect    # only tabulate what OUT holds

Each grid point trains the default TrainConfig with one optimizer and peak lr into OUT/NAME_LR. The final val
loss (null for a run that was stopped early), the steps done and the val curve of each go to sweep.json beside
this file.
"""

import json
import sys
from pathlib import Path

from matrixopt.train.config import OptimConfig, TrainConfig
from matrixopt.train.rundir import read_metrics
from matrixopt.train.trainer import train

GRID = [("adamw", 1e-3), ("muon", 2e-3), ("muon", 4e-3), ("muon", 8e-3)]

out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/sweep")
collect_only = "--collect" in sys.argv
results = []
for name, lr in GRID:
    run_dir = out / f"{name}_{lr:g}"
    cfg = TrainConfig(optim=OptimConfig(name=name, lr=lr))
    if not collect_only:
        train(cfg, run_dir, resume=True, progress=False)
    metrics = read_metrics(run_dir / "metrics.jsonl")
    curve = [[m["step"], round(m["val_loss"], 4)] for m in metrics if "val_loss" in m]
    finished = bool(metrics) and metrics[-1]["step"] == cfg.steps
    results.append(dict(optimizer=name, lr=lr, steps_done=metrics[-1]["step"] if metrics else 0,
                        final_val_loss=curve[-1][1] if finished else None, val_loss_by_step=curve))
Path(__file__).with_name("sweep.json").write_text(json.dumps(results, indent=1) + "\n")
