"""The QK-clip figure of this folder: each run's largest pre-softmax logit per logged step (before that step's
clip), log scale. Run from the repository root: python docs/results/muon_family/qk_clip_plot.py"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
RUNS = {"lr2e-2_noclip": "lr 2e-2", "lr2e-2_tau30": "lr 2e-2, QK-clip tau 30",
        "lr5e-2_noclip": "lr 5e-2", "lr5e-2_tau30": "lr 5e-2, QK-clip tau 30"}

fig, ax = plt.subplots(figsize=(7, 4))
for name, label in RUNS.items():
    lines = [json.loads(line) for line in (HERE / "qk_clip" / f"{name}.jsonl").read_text().splitlines()]
    steps = [m["step"] for m in lines if m.get("max_logit") is not None]
    ax.plot(steps, [m["max_logit"] for m in lines if m.get("max_logit") is not None], label=label,
            linestyle="--" if "tau" in name else "-")
ax.axhline(30, color="gray", linewidth=0.8)
ax.set_yscale("log")
ax.set_xlabel("step")
ax.set_ylabel("largest pre-softmax logit (before the step's clip)")
ax.set_title("Muon on shakespeare-char, weight decay 0")
ax.legend()
fig.tight_layout()
fig.savefig(HERE / "qk_clip.png", dpi=120)
