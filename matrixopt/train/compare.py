"""Train the same model on the same data, seed and token budget with several optimizers, then report.

The defaults are the README's main job: AdamW against Muon on TinyShakespeare at nanoGPT's CPU quick-start
size (``TrainConfig()``), each at the peak learning rate chosen by the sweep recorded in
docs/results/shakespeare_cpu/ (DEFAULT_LRS).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch.distributed as dist

from matrixopt.train.config import TrainConfig
from matrixopt.train.report import write_report
from matrixopt.train.trainer import train

DEFAULT_OPTIMIZERS = ("adamw", "muon")
# Peak lrs from the 2000-step CPU sweep (docs/results/shakespeare_cpu/sweep.json). AdamW keeps nanoGPT's 1e-3.
DEFAULT_LRS = {"adamw": 1e-3, "muon": 4e-3}


def check_optimizers(names: list[str]) -> None:
    from matrixopt.optim.registry import OPTIMIZERS

    if not names:
        raise ValueError("--optimizers is empty; pass a comma-separated list such as adamw,muon")
    for name in names:
        if name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(sorted(OPTIMIZERS))}")
    if len(set(names)) != len(names):
        raise ValueError(f"--optimizers lists a name twice: {','.join(names)}")


def run_configs(base: TrainConfig, names: list[str], lrs: dict[str, float],
                hparams: dict[str, dict]) -> dict[str, TrainConfig]:
    """One config per optimizer: ``base`` with the optimizer's name, lr (``lrs``, else DEFAULT_LRS, else
    base's) and extra hyperparameters."""
    check_optimizers(names)
    for name in lrs.keys() | hparams.keys():
        if name not in names:
            raise ValueError(f"a setting names optimizer {name!r}, which is not in --optimizers {','.join(names)}")
    configs = {}
    for name in names:
        optim = dataclasses.replace(
            base.optim, name=name, lr=lrs.get(name, DEFAULT_LRS.get(name, base.optim.lr)),
            hparams=base.optim.hparams | hparams.get(name, {}),
        )  # fmt: skip
        configs[name] = dataclasses.replace(base, optim=optim)
    return configs


def compare(configs: dict[str, TrainConfig], out: str | Path, *, resume: bool = False, overwrite: bool = False,
            progress: bool = True, target: str = "final") -> dict | None:
    """Train each config into ``out/NAME`` and write the report (``target``: see ``write_report``); returns the
    summary. Under torchrun every rank trains each run and rank 0 alone writes the report; the other ranks
    return None."""
    out = Path(out)
    for name, cfg in configs.items():
        train(cfg, out / name, resume=resume, overwrite=overwrite, progress=progress)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return write_report(out, target=target)
