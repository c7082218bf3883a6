"""Learning-rate (and weight-decay) sweeps, and comparisons built from each sweep's best run.

``sweep`` trains one optimizer over a grid with the same data, model, seed and token budget, one run folder per
point (``DIR/lr=0.002,wd=0.1``), and writes ``DIR/sweep.json`` (every point's final val loss, the best point, and
whether it lies on the grid's edge) and ``DIR/sweep.png`` (final val loss against lr). ``compare_best`` copies
the best run of several sweeps into one compare folder and writes the usual report there, with the sweep
curves beside it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
from pathlib import Path

import torch.distributed as dist

from matrixopt.train.config import TrainConfig
from matrixopt.train.report import write_report
from matrixopt.train.trainer import train

RUN_FILES = ("config.json", "metrics.jsonl", "run.json")


def point_name(lr: float, weight_decay: float) -> str:
    return f"lr={lr:g},wd={weight_decay:g}"


def sweep(base: TrainConfig, name: str, lrs: list[float], out: str | Path, *, weight_decays: list[float] | None = None,
          resume: bool = False, overwrite: bool = False, progress: bool = True) -> dict:
    """Train optimizer ``name`` at every (lr, weight decay) of the grid into ``out``; returns sweep.json's dict."""
    if len(lrs) < 2:
        raise ValueError(f"a sweep needs at least 2 learning rates, got {lrs}")
    if any(not lr > 0 for lr in lrs) or len(set(lrs)) != len(lrs):
        raise ValueError(f"sweep learning rates must be distinct and positive, got {lrs}")
    out = Path(out)
    wds = weight_decays or [base.optim.weight_decay]
    points = []
    for lr, wd in itertools.product(sorted(lrs), wds):
        cfg = dataclasses.replace(base, optim=dataclasses.replace(base.optim, name=name, lr=lr, weight_decay=wd))
        run = train(cfg, out / point_name(lr, wd), resume=resume, overwrite=overwrite, progress=progress)
        points.append(dict(lr=lr, weight_decay=wd, final_val_loss=run["final_val_loss"], dir=point_name(lr, wd)))
    best = min(points, key=lambda p: p["final_val_loss"])
    result = dict(optimizer=name, seed=base.seed, lrs=sorted(lrs), weight_decays=wds, points=points, best=best,
                  best_lr_at_edge=best["lr"] in (min(lrs), max(lrs)))
    if not dist.is_initialized() or dist.get_rank() == 0:  # under torchrun every rank trains, rank 0 writes
        (out / "sweep.json").write_text(json.dumps(result, indent=2) + "\n")
        plot_sweeps({name: result}, out / "sweep.png")
    return result


def read_sweep(path: str | Path) -> dict:
    path = Path(path)
    f = path / "sweep.json"
    if not f.is_file():
        raise FileNotFoundError(f"{path} holds no sweep.json; run `matrixopt sweep --out {path}` first")
    return json.loads(f.read_text())


def plot_sweeps(sweeps: dict[str, dict], dest: Path) -> None:
    """Final val loss against lr (log axis), one line per optimizer and weight decay."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for i, (name, s) in enumerate(sweeps.items()):
        for j, wd in enumerate(s["weight_decays"]):
            pts = sorted((p["lr"], p["final_val_loss"]) for p in s["points"] if p["weight_decay"] == wd)
            label = name if len(s["weight_decays"]) == 1 else f"{name} wd={wd:g}"
            ax.plot(*zip(*pts), marker="o", color=f"C{i}", linestyle=("-", "--", ":", "-.")[j % 4], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final val loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dest)
    plt.close(fig)


def compare_best(sweep_dirs: list[str | Path], out: str | Path, *, overwrite: bool = False,
                 target: str = "final") -> dict:
    """Copy each sweep's best run into ``out/OPTIMIZER`` and write the compare report, ``sweeps.json`` and
    ``sweeps.png`` there. Returns the summary, with each optimizer's sweep (grid, best lr, edge flag) added."""
    out = Path(out)
    sweeps = {}
    for d in sweep_dirs:
        s = read_sweep(d)
        if s["optimizer"] in sweeps:
            raise ValueError(f"two sweeps of {s['optimizer']!r} given; pass one sweep folder per optimizer")
        sweeps[s["optimizer"]] = s | {"path": str(d)}
    for name, s in sweeps.items():
        dest = out / name
        if dest.exists():
            if not overwrite:
                raise FileExistsError(f"{dest} already exists; pass --overwrite to replace it")
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        for f in RUN_FILES:
            shutil.copy2(Path(s["path"]) / s["best"]["dir"] / f, dest / f)
    summary = write_report(out, target=target)
    summary["sweeps"] = {name: {k: s[k] for k in ("lrs", "weight_decays", "best", "best_lr_at_edge", "points")}
                         for name, s in sweeps.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "sweeps.json").write_text(json.dumps(sweeps, indent=2) + "\n")
    plot_sweeps(sweeps, out / "sweeps.png")
    with (out / "report.md").open("a") as f:
        f.write("\n## Learning-rate sweeps\n\n"
                "| optimizer | grid | best lr | best final val loss | best on the grid's edge |\n"
                "|---|---|---|---|---|\n")
        for name, s in sweeps.items():
            f.write(f"| {name} | {', '.join(f'{lr:g}' for lr in s['lrs'])} | {s['best']['lr']:g} | "
                    f"{s['best']['final_val_loss']:.4f} | {'yes' if s['best_lr_at_edge'] else 'no'} |\n")
        f.write("\n![sweeps](sweeps.png)\n")
    return summary
