"""Summary, plots and report of a comparison folder, rebuilt from the runs' metrics alone.

A comparison folder holds one run folder per optimizer (``DIR/adamw/``, ``DIR/muon/``, each with
config.json, metrics.jsonl and run.json). ``write_report(DIR)`` writes

* ``summary.json``: ``target`` ("final" or "best"), ``target_val_loss`` (the baseline's final or lowest val
  loss; the baseline is adamw when present) and ``optimizers``: name -> ``final_val_loss``,
  ``steps_to_target`` and ``seconds_to_target`` (the first evaluation at or below the target; null when never
  reached), ``tokens_per_s``, ``peak_mem_mb``, ``lr``,
  ``opt_share`` (share of training time inside ``optimizer.step()``), ``state_mb``;
* ``loss_vs_steps.png`` and ``loss_vs_seconds.png``: train loss (thin) and val loss (markers) per optimizer,
  the target dashed;
* for mixtures of experts, ``expert_load.png``: per optimizer, the busiest expert's load over the mean
  (``expert_max_load``, worst layer; 1 is balanced) against steps, and each expert's share of the routed tokens
  over the whole run;
* ``report.md`` and ``report.html``: the table and the plots.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from matrixopt.train.rundir import read_metrics

BASELINE = "adamw"
TARGETS = ("final", "best")
PLOTS = {"loss_vs_steps.png": ("step", "optimizer steps"), "loss_vs_seconds.png": ("elapsed_s", "training seconds")}


def find_runs(root: Path) -> dict[str, Path]:
    """Run folders under ``root`` that hold a finished run, baseline first, then by name."""
    runs = {p.name: p for p in sorted(root.iterdir()) if (p / "run.json").is_file() and (p / "metrics.jsonl").is_file()}
    if not runs:
        raise ValueError(
            f"{root} holds no finished runs (folders with run.json and metrics.jsonl); run "
            f"`matrixopt compare --out {root}` first"
        )
    order = sorted(runs, key=lambda name: (name != BASELINE, name))
    return {name: runs[name] for name in order}


def first_reaching(metrics: list[dict], target: float) -> dict | None:
    """The first evaluation line with ``val_loss <= target``, or None."""
    return next((m for m in metrics if m.get("val_loss") is not None and m["val_loss"] <= target), None)


def summarize(root: Path, target: str = "final") -> dict:
    """The comparison. ``target``: "final" measures steps and seconds to the baseline's final val loss, "best" to
    its lowest val loss (fairer when the runs overfit and the final loss is past the minimum)."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; use one of {TARGETS}")
    runs = find_runs(root)
    metrics = {name: read_metrics(path / "metrics.jsonl") for name, path in runs.items()}
    info = {name: json.loads((path / "run.json").read_text()) for name, path in runs.items()}
    baseline = next(iter(runs))
    if target == "final":
        target_loss = info[baseline]["final_val_loss"]
    else:
        target_loss = min(m["val_loss"] for m in metrics[baseline] if m.get("val_loss") is not None)
    optimizers = {}
    for name in runs:
        hit = first_reaching(metrics[name], target_loss)
        run = info[name]
        optimizers[name] = dict(
            final_val_loss=run["final_val_loss"],
            steps=run["steps"],
            steps_to_target=None if hit is None else hit["step"],
            seconds_to_target=None if hit is None else round(hit["elapsed_s"], 2),
            tokens_per_s=round(run["tokens_per_s"], 1),
            peak_mem_mb=run["peak_mem_mb"],
            state_mb=run["state_mb"],
            lr=run["lr"],
            opt_share=round(run["opt_share"], 4),
            elapsed_s=round(run["elapsed_s"], 2),
        )
    base = optimizers[baseline]
    for row in optimizers.values():
        reached = row["steps_to_target"] is not None
        row["steps_ratio"] = round(row["steps_to_target"] / base["steps_to_target"], 3) if reached else None
    return dict(
        baseline=baseline,
        target=target,
        target_val_loss=target_loss,
        eval_every=json.loads((runs[baseline] / "config.json").read_text())["eval_every"],
        device=info[baseline]["device"],
        data=info[baseline]["data"],
        num_params=info[baseline]["num_params"],
        tokens_per_step=info[baseline]["tokens_per_step"],
        optimizers=optimizers,
    )


def plot(root: Path, summary: dict) -> list[str]:
    """Write the PNG plots; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for fname, (x_key, x_label) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
        for i, name in enumerate(summary["optimizers"]):
            metrics = read_metrics(root / name / "metrics.jsonl")
            color = f"C{i}"
            train = [(m[x_key], m["loss"]) for m in metrics if m.get("loss") is not None]
            val = [(m[x_key], m["val_loss"]) for m in metrics if m.get("val_loss") is not None]
            ax.plot(*zip(*train), color=color, alpha=0.35, linewidth=1, label=f"{name} train")
            ax.plot(*zip(*val), color=color, marker="o", markersize=3, linewidth=1.8, label=f"{name} val")
        ax.axhline(summary["target_val_loss"], color="gray", linestyle="--", linewidth=1,
                   label=f"target {summary['target_val_loss']:.3f}")
        best = min(r["final_val_loss"] for r in summary["optimizers"].values())
        ax.set_ylim(min(best, summary["target_val_loss"]) - 0.1, summary["target_val_loss"] + 1.5)
        ax.set_xlabel(x_label)
        ax.set_ylabel("loss")
        ax.set_title(f"{summary['data']}: loss vs {x_label}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(root / fname)
        plt.close(fig)
    return list(PLOTS) + _plot_expert_load(root, summary, plt)


def _plot_expert_load(root: Path, summary: dict, plt: Any) -> list[str]:
    """``expert_load.png`` when the runs logged routing statistics (a mixture of experts), else nothing."""
    loads = {name: [m for m in read_metrics(root / name / "metrics.jsonl") if "expert_max_load" in m]
             for name in summary["optimizers"]}
    if not any(loads.values()):
        return []
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=120)
    width = 0.8 / len(loads)
    for i, (name, lines) in enumerate(loads.items()):
        if not lines:
            continue
        ax.plot([m["step"] for m in lines], [m["expert_max_load"] for m in lines], color=f"C{i}", label=name)
        share = [sum(col) / len(lines) for col in zip(*(m["expert_load"] for m in lines))]
        bx.bar([e + i * width for e in range(len(share))], share, width=width, color=f"C{i}", label=name)
        bx.axhline(1 / len(share), color="gray", linestyle="--", linewidth=1)
    ax.axhline(1, color="gray", linestyle="--", linewidth=1)
    ax.set(xlabel="optimizer steps", ylabel="busiest expert / mean load (worst layer)", title="load balance")
    bx.set(xlabel="expert", ylabel="share of routed tokens (mean over layers and logs)",
           title="expert load over the run (dashed: even)")
    for a in (ax, bx):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(root / "expert_load.png")
    plt.close(fig)
    return ["expert_load.png"]


def table(summary: dict) -> tuple[list[str], list[list[str]]]:
    header = ["optimizer", "lr", "final val loss", f"steps to {summary['target_val_loss']:.3f}", "seconds to target",
              "tokens/s", "peak mem (MB)", "params + opt state (MB)", "optimizer-step share"]
    rows = []
    for name, r in summary["optimizers"].items():
        reached = r["steps_to_target"] is not None
        rows.append([
            name,
            f"{r['lr']:g}",
            f"{r['final_val_loss']:.4f}",
            f"{r['steps_to_target']} ({r['steps_ratio']:.2f}x)" if reached else "not reached",
            f"{r['seconds_to_target']:.1f}" if reached else "not reached",
            f"{r['tokens_per_s']:.0f}",
            f"{r['peak_mem_mb']:.0f}",
            f"{r['state_mb']:.1f}",
            f"{100 * r['opt_share']:.1f}%",
        ])  # fmt: skip
    return header, rows


def notes(summary: dict) -> list[str]:
    return [
        f"Target: {summary['baseline']}'s {summary.get('target', 'final')} val loss, {summary['target_val_loss']:.4f}. "
        f"Steps and seconds to "
        f"target are those of the first evaluation at or below it (evaluations every {summary['eval_every']} steps; "
        f"seconds exclude evaluation and checkpointing).",
        f"Model: {summary['num_params']:,} parameters, {summary['tokens_per_step']:,} tokens per step, data "
        f"{summary['data']}, device {summary['device']}.",
        "Peak memory is CUDA memory allocated on GPU, the process's peak resident set on CPU.",
    ]


def write_report(root: str | Path, target: str = "final") -> dict:
    """Rebuild summary.json, the plots, report.md and report.html in ``root``; returns the summary."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"report folder {root} does not exist; pass the --out folder of a compare run")
    summary = summarize(root, target)
    (root / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    images = plot(root, summary)
    header, rows = table(summary)

    md = ["# Optimizer comparison", ""]
    md += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(row) + " |" for row in rows]
    md += [""] + notes(summary) + [""]
    md += [f"![{name}]({name})" for name in images]
    (root / "report.md").write_text("\n".join(md) + "\n")

    def cells(row: list[str], tag: str) -> str:
        return "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in row)

    page = [
        "<!doctype html><html><head><meta charset='utf-8'><title>Optimizer comparison</title>",
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}</style></head><body>",
        "<h1>Optimizer comparison</h1>",
        "<table><tr>" + cells(header, "th") + "</tr>",
        *("<tr>" + cells(row, "td") + "</tr>" for row in rows),
        "</table>",
        *(f"<p>{html.escape(n)}</p>" for n in notes(summary)),
        *(f"<img src='{name}' alt='{name}'>" for name in images),
        "</body></html>",
    ]
    (root / "report.html").write_text("\n".join(page) + "\n")
    return summary
