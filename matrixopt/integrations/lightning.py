"""Train with a matrixopt optimizer under Lightning.

In your ``LightningModule``:

    def configure_optimizers(self):
        return matrixopt.integrations.lightning.configure_optimizers(
            self, "muon", lr=3e-3, weight_decay=0.1, schedule=lambda step: min(1.0, (step + 1) / 100))

and, to clip inside the optimizer's step and surface a deferred non-finite check, the callback:

    trainer = lightning.Trainer(callbacks=[matrixopt.integrations.lightning.MatrixoptCallback(max_norm=1.0)])

Lightning's own ``gradient_clip_val`` works as well (it clips the gradients in place before ``step()``); use one
of the two, not both. Checkpoints hold the optimizer's ``state_dict`` and ``fit(ckpt_path=...)`` resumes exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

try:
    from lightning.pytorch import Callback
except ImportError as e:  # the standalone package of older releases
    try:
        from pytorch_lightning import Callback
    except ImportError:
        raise ImportError("matrixopt.integrations.lightning needs Lightning: pip install 'matrixopt[lightning]'") from e

from matrixopt.optim.registry import build_optimizer


def configure_optimizers(module: nn.Module, name: str = "muon", *, schedule: Callable[[int], float] | None = None,
                         interval: str = "step", verbose: bool = False, **hparams: Any) -> dict[str, Any]:
    """What ``LightningModule.configure_optimizers`` returns: ``{"optimizer": opt}`` with the optimizer registered
    as ``name`` over ``module`` (routed by :func:`matrixopt.param_groups`), plus ``"lr_scheduler"`` when
    ``schedule`` is given: a ``LambdaLR`` whose factor ``schedule(step)`` multiplies every group's lr, stepped
    every ``interval`` ("step" or "epoch"). hparams (and ``adamw``/``matrix``/``splits``/``experts`` routing
    overrides) go to :func:`matrixopt.build_optimizer`."""
    if interval not in ("step", "epoch"):
        raise ValueError(f"interval must be 'step' or 'epoch', got {interval!r}")
    opt = build_optimizer(module, name, verbose=verbose, **hparams)
    out: dict[str, Any] = {"optimizer": opt}
    if schedule is not None:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        out["lr_scheduler"] = {"scheduler": sched, "interval": interval, "frequency": 1}
    return out


def _unwrap(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` wrapper, if wrapped."""
    return getattr(optimizer, "_optimizer", optimizer)


class MatrixoptCallback(Callback):
    """Gradient clipping by the optimizer itself, and the deferred non-finite check at the end of ``fit``.

    Args:
        max_norm: clip the gradients to this total norm before each step with the optimizer's
            ``clip_grad_norm_`` (Muon applies the coefficient inside its step, saving passes over the gradients);
            None (default) clips nothing. Leave the Trainer's ``gradient_clip_val`` unset when you use it.
        norm_type: the norm's p (default 2).
        log_grad_norm: log the total norm (before clipping) as ``grad_norm``.

    With ``deferred_nonfinite=True`` a NaN/Inf gradient's step is skipped on the GPU and the error is raised by
    the next ``step()`` or ``state_dict()`` (so a checkpoint never holds a bad step silently); this callback also
    checks after the last step of ``fit``.
    """

    def __init__(self, max_norm: float | None = None, norm_type: float = 2.0, log_grad_norm: bool = False) -> None:
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm must be > 0 (or None to not clip), got {max_norm!r}")
        self.max_norm, self.norm_type, self.log_grad_norm = max_norm, norm_type, log_grad_norm

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.max_norm is None:
            return
        opt = _unwrap(optimizer)
        if hasattr(opt, "clip_grad_norm_"):
            norm = opt.clip_grad_norm_(self.max_norm, self.norm_type)
        else:  # a torch optimizer: clip its parameters as torch does
            params = [p for g in opt.param_groups for p in g["params"]]
            norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm, self.norm_type)
        if self.log_grad_norm:
            pl_module.log("grad_norm", norm)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        for opt in trainer.optimizers:
            check = getattr(_unwrap(opt), "raise_deferred_nonfinite", None)
            if check is not None:
                check()
