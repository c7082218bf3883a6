"""The learning-rate schedule: linear warmup, then a cosine, warmup-stable-decay or constant multiplier on each
param group's initial lr, as a torch LR scheduler (:class:`LRSchedule`)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR

LR_SCHEDULES = ("cosine", "wsd", "constant")


@dataclass(kw_only=True)
class ScheduleConfig:
    """Learning-rate multiplier over steps: linear warmup, then cosine, warmup-stable-decay or constant."""

    schedule: str = "cosine"
    """'cosine' (decay over the whole run), 'wsd' (flat, then linear decay over the last decay_frac) or
    'constant'."""
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    """Final multiplier: nanoGPT decays lr 1e-3 to min_lr 1e-4."""
    decay_frac: float = 0.2
    """Share of steps spent decaying in 'wsd'."""

    def __post_init__(self) -> None:
        if self.schedule not in LR_SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.schedule!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 < self.decay_frac <= 1.0:
            raise ValueError(f"decay_frac must be in (0, 1], got {self.decay_frac}")


def lr_multiplier(step: int, steps: int, cfg: ScheduleConfig) -> float:
    """Multiplier on each group's initial lr for optimizer step ``step`` (0-based) of ``steps``.

    Warmup is nanoGPT's linear ramp (step + 1) / (warmup + 1); cosine then falls from 1 to min_lr_ratio at the
    last step; wsd holds 1 and falls linearly to min_lr_ratio over the last decay_frac of the steps."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    lo = cfg.min_lr_ratio
    match cfg.schedule:
        case "constant":
            return 1.0
        case "cosine":
            progress = (step - cfg.warmup_steps) / max(1, steps - 1 - cfg.warmup_steps)
            return lo + 0.5 * (1.0 - lo) * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        case "wsd":
            decay_start = steps - max(1, round(cfg.decay_frac * steps))
            if step < decay_start:
                return 1.0
            progress = (step - decay_start) / max(1, steps - 1 - decay_start)
            return 1.0 - (1.0 - lo) * min(progress, 1.0)
    raise NotImplementedError(f"schedule {cfg.schedule!r}")


class LRSchedule(LambdaLR):
    """Sets each param group's lr to its ``initial_lr`` (its lr when the schedule starts) times
    :func:`lr_multiplier` of the step; call ``step()`` after each ``optimizer.step()``. To resume, load the
    optimizer's state and this ``state_dict()``: the lrs are a pure function of the step, so a resumed run uses
    the lrs of an uninterrupted one, to the bit."""

    def __init__(self, optimizer: torch.optim.Optimizer, steps: int, cfg: ScheduleConfig) -> None:
        super().__init__(optimizer, functools.partial(lr_multiplier, steps=steps, cfg=cfg))
