"""``matrixopt bench plot``: a PNG from benchmark JSON records, one function per record kind.

    matrixopt bench plot step_gpt2-small.json step_gpt2-medium.json step_1.3b.json --out step.png
    matrixopt bench plot train_gpt2-small.json train_gpt2-medium.json --out train.png
    matrixopt bench plot scale_1.3b_2gpu.json scale_4gpu.json --out scale.png

- ``step`` (``matrixopt bench step``): optimizer-step time per parameter set, one bar per optimizer, median with
  its p20–p80 range, log axis;
- ``train`` (``matrixopt bench train``): training tokens/s as a fraction of AdamW's, per model;
- ``scale`` (``matrixopt bench scale``): tokens/s per GPU of every parallel configuration, per preset and GPU count.

matplotlib is an optional dependency (``pip install matrixopt[plots]``), imported only when a plot is drawn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Record = dict[str, Any]


def kind(record: Record) -> str:
    """The record's ``benchmark`` field; scaling records that predate the field are known by their ``summary``."""
    if "benchmark" in record:
        return record["benchmark"]
    if "summary" in record:
        return "scale"
    raise ValueError(f"not a benchmark record (keys: {', '.join(sorted(record))}); pass the JSON that "
                     "`matrixopt bench step|train|scale --json PATH` wrote")


def _device(records: Sequence[Record]) -> str:
    env = records[0].get("env", {})
    return f"{env.get('device', '?')}, torch {env.get('torch', '?')}"


def plot_step(records: Sequence[Record], ax) -> None:
    """Optimizer-step time (ms) per parameter set, one bar per optimizer; the whiskers span p20–p80."""
    models = [r["model"] for r in records]
    names = list(dict.fromkeys(n for r in records for n, v in r["results"].items() if v.get("status") == "ok"))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        label = name  # on the first bar of this optimizer only
        for g, r in enumerate(records):
            v = r["results"].get(name, {})
            if v.get("status") != "ok":
                continue
            ms = v["ms"]
            x = g + (i - (len(names) - 1) / 2) * width
            ax.bar(x, ms["median"], width, yerr=[[ms["median"] - ms["p20"]], [ms["p80"] - ms["median"]]],
                   color=f"C{i}", label=label, capsize=2)
            label = None
            ax.annotate(f"{ms['median']:.3g}", (x, ms["median"]), ha="center", va="bottom", fontsize=7,
                        xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(models)), models)
    ax.set_yscale("log")
    ax.set_ylabel("optimizer step, ms (median; log scale)")
    ax.set_title(f"Optimizer step: {_device(records)}")


def plot_train(records: Sequence[Record], ax) -> None:
    """Training tokens/s as a fraction of AdamW's in the same record, per model."""
    models = [f"{r['model']} ({r['batch']}×{r['block_size']})" for r in records]
    names = list(dict.fromkeys(n for r in records for n, v in r["results"].items() if v.get("status") == "ok"))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        bars = [(g + (i - (len(names) - 1) / 2) * width, r["results"][name]["vs_adamw"])
                for g, r in enumerate(records) if r["results"].get(name, {}).get("status") == "ok"]
        ax.bar_label(ax.bar(*zip(*bars), width, label=name, color=f"C{i}"), fmt="%.3f", fontsize=7)
    ax.set_xticks(range(len(models)), models)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_ylabel("tokens/s, fraction of AdamW's")
    ax.set_title(f"Training throughput: {_device(records)}")


def plot_scale(records: Sequence[Record], ax) -> None:
    """Tokens/s per GPU of every configuration, one horizontal bar each, labelled by preset and GPU count."""
    rows = [s for r in records for s in r["summary"]]
    labels = [f"{s['preset']}, {s['gpus']} GPUs: {s['config']}" for s in rows]
    groups = list(dict.fromkeys((s["preset"], s["gpus"]) for s in rows))
    ys = range(len(rows))[::-1]
    bars = ax.barh(list(ys), [s["tokens_per_s_per_gpu"] / 1e3 for s in rows],
                   color=[f"C{groups.index((s['preset'], s['gpus']))}" for s in rows])
    ax.bar_label(bars, fmt="%.1fk", fontsize=7, padding=2)
    ax.set_yticks(list(ys), labels, fontsize=8)
    ax.set_xlabel("tokens/s per GPU (thousands)")
    ax.set_title(f"Parallel modes: {_device(records)}")


PLOTTERS = {"step": plot_step, "train": plot_train, "scale": plot_scale}


def plot_files(paths: Sequence[str | Path], out: str | Path) -> Path:
    """Read the records at ``paths`` (all of one kind), draw them, write the PNG ``out``; returns its path."""
    records = [json.loads(Path(p).read_text()) for p in paths]
    kinds = {kind(r) for r in records}
    if len(kinds) != 1:
        raise ValueError(f"the records are of kinds {sorted(kinds)}; plot one kind at a time")
    (k,) = kinds
    if k not in PLOTTERS:
        raise ValueError(f"no plot for {k!r} records; plots exist for {', '.join(PLOTTERS)}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    height = 1.2 + 0.28 * sum(len(r["summary"]) for r in records) if k == "scale" else 4.5
    fig, ax = plt.subplots(figsize=(8, height), dpi=120)
    PLOTTERS[k](records, ax)
    ax.grid(alpha=0.3, axis="x" if k == "scale" else "y")
    if k != "scale":
        ax.legend(fontsize=7, ncols=3, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)
    return out
