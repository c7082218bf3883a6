r"""Weight decay, in the three forms every matrixopt optimizer offers (``weight_decay_mode=``), for the matrix
groups and the AdamW groups alike. With learning rate :math:`\eta`, decay :math:`\lambda` and the step's update
direction :math:`U` (what the optimizer subtracts, times :math:`\eta`):

- ``"decoupled"`` (default; AdamW, Loshchilov & Hutter, arXiv:1711.05101):
  :math:`W \leftarrow (1 - \eta\lambda) W - \eta U`.
- ``"independent"``: the decay does not follow the learning rate (nor its schedule):
  :math:`W \leftarrow (1 - \lambda) W - \eta U`, so ``weight_decay`` is the fraction removed per step (e.g. the
  decoupled ``lr * weight_decay`` at the peak lr), as in Emerging-Optimizers and Distributed Shampoo.
- ``"cautious"`` (Chen et al., "Cautious Weight Decay", arXiv:2510.12402): decoupled decay only where it moves
  a weight the way the update does: :math:`W \leftarrow W - \eta\big(U + \lambda\, \mathbb{1}[U \odot W \ge 0]
  \odot W\big)`, the mask taken on the weights before the step.

:func:`decay_` applies the decay in place before the update is added (the fused Muon kernel computes the same
elementwise, :mod:`matrixopt.kernels.muon_fused`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

WEIGHT_DECAY_MODES = ("decoupled", "independent", "cautious")


def check_weight_decay_mode(mode: object) -> None:
    """ValueError naming the mode unless it is one of :data:`WEIGHT_DECAY_MODES`."""
    if mode not in WEIGHT_DECAY_MODES:
        raise ValueError(f"Invalid weight_decay_mode: {mode!r}; use one of {', '.join(WEIGHT_DECAY_MODES)} "
                         f"(decoupled: W *= 1 - lr*wd; independent: W *= 1 - wd; cautious: decoupled, only where "
                         f"the update and the weight agree in sign)")


def decay_(params: Sequence[Tensor], lr: float | Tensor, weight_decay: float, mode: str,
           directions: Sequence[Tensor] | None = None, live: Tensor | None = None) -> None:
    """Decay ``params`` in place as ``mode`` says (module docstring), before the update is added. ``lr``: a float
    or a 0-d tensor on the parameters' device. ``directions``: for ``"cautious"``, each parameter's update
    direction ``U`` (any positive multiple of it: only its sign is read), same shapes. ``live``: an optional 0-d
    float32 tensor on the parameters' device that multiplies the decay (0: a skipped step, which decays nothing)."""
    params = list(params)
    if weight_decay == 0 or not params:
        return
    if live is not None:
        lr = lr * live
        if mode == "independent":
            torch._foreach_mul_(params, 1 - weight_decay * live)
            return
    match mode:
        case "decoupled":
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        case "independent":
            torch._foreach_mul_(params, 1 - weight_decay)
        case "cautious":
            if directions is None:
                raise ValueError("cautious weight decay needs the update directions")
            for p, u in zip(params, directions):
                agree = (u * p >= 0).to(p.dtype)  # 1 where the update shrinks |w| too
                p.mul_(1 - (lr * weight_decay) * agree)
        case _:
            check_weight_decay_mode(mode)
