r"""Adam's moments and its bias-corrected direction, shared by the AdamW groups of every matrixopt optimizer
(:mod:`matrixopt.optim.base`), Shampoo's Adam grafting and SOAP's Adam in the eigenbasis.

.. math::
    m_t = \beta_1 m_{t-1} + (1 - \beta_1) g_t, \qquad v_t = \beta_2 v_{t-1} + (1 - \beta_2) g_t^2, \qquad
    d_t = \eta\, \frac{m_t}{1 - \beta_1^t} \Big/ \Big(\frac{\sqrt{v_t}}{\sqrt{1 - \beta_2^t}} + \epsilon\Big)

computed as ``torch.optim.AdamW``'s foreach path computes it (Kingma & Ba, arXiv:1412.6980). Lists of float32
tensors, one foreach call per operation; step counts may be ints or 0-d float32 device tensors (no host sync).
"""

from __future__ import annotations

import torch
from torch import Tensor

from matrixopt.kernels import muon_elementwise


def ema_(averages: list[Tensor], values: list[Tensor], weight: float, live: Tensor | None = None) -> None:
    """``a <- a + weight (x - a)`` in place (a lerp). ``live``: an optional 0-d float32 device tensor, 1 for a step
    and 0 for a skipped one, whose values must then be zeros (:func:`matrixopt.optim.nonfinite.sanitized`): taken
    as ``a (1 - weight live) + weight x``, which leaves ``a`` as it was, bit for bit, when skipped (two passes on
    fast foreach kernels, where a lerp by a tensor weight would take torch's per-tensor path)."""
    if live is None:
        torch._foreach_lerp_(averages, values, weight)
    else:
        torch._foreach_mul_(averages, 1 - weight * live)
        torch._foreach_add_(averages, values, alpha=weight)


def adam_moments_(exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], grads: list[Tensor],
                  betas: tuple[float, float], live: Tensor | None = None) -> None:
    """``m <- beta1 m + (1 - beta1) g`` and ``v <- beta2 v + (1 - beta2) g^2``, in place. All float32, each
    ``grads[i]`` shaped like ``exp_avgs[i]`` and ``exp_avg_sqs[i]``. ``live``: as in :func:`ema_` (zero gradients
    on a skipped step, which leaves both moments as they were, bit for bit); no host sync."""
    beta1, beta2 = betas
    ema_(exp_avgs, grads, 1 - beta1, live)
    torch._foreach_mul_(exp_avg_sqs, beta2 if live is None else 1 - live * (1 - beta2))
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)


def adam_direction(exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], steps: list[int | Tensor],
                   betas: tuple[float, float], eps: float, lr: float | Tensor = 1.0) -> list[Tensor]:
    """``d_t`` (module docstring) per tensor, new float32 tensors. ``exp_avgs``: the first moments, or any
    numerator in their place (Shampoo's Nesterov momentum); ``steps``: each tensor's step count t >= 1."""
    beta1, beta2 = betas
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, [(1 - beta2**t) ** 0.5 for t in steps])
    torch._foreach_add_(denom, eps)
    out = torch._foreach_div(exp_avgs, denom)
    torch._foreach_mul_(out, [lr / (1 - beta1**t) for t in steps])
    return out


def adam_step(exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], grads: list[Tensor] | Tensor, steps: list[int],
              betas: tuple[float, float], eps: float, skip: Tensor | None = None,
              into_grads: bool = False) -> list[Tensor] | Tensor:
    """:func:`adam_moments_` then :func:`adam_direction` (lr 1): the moments updated in place, the directions
    returned as float32 tensors. Where every tensor is a float32 matrix with unit column stride (a block of a
    larger tensor too) on the GPU and the steps are one int, in one pass
    (:func:`matrixopt.kernels.muon_fused.adam_triton`: 24 bytes per element instead of about 90).
    ``skip``: a 0-d float32 device flag, nonzero for a step that must write nothing: the moments are left as they
    were, bit for bit, and the directions are zeros, whatever the gradients hold (NaN/Inf included), for a caller
    that applies them with weight ``1 - skip``. ``into_grads``: the directions are written over ``grads``
    and returned as them. ``grads`` may be a ``(n, R, C)`` float32 stack of the n gradients (then returned as it
    is with ``into_grads``)."""
    fused = muon_elementwise.fused_for(exp_avgs, exp_avg_sqs, grads) if len(set(steps)) == 1 and all(
        isinstance(t, int) for t in steps) else None
    if fused is not None:
        return fused.adam_triton(exp_avgs, exp_avg_sqs, grads, steps[0], betas, eps, skip,
                                 grads if into_grads else None)
    stack, grads = (grads, list(grads.unbind(0))) if isinstance(grads, Tensor) else (None, grads)
    if skip is None:
        adam_moments_(exp_avgs, exp_avg_sqs, grads, betas)
        out = adam_direction(exp_avgs, exp_avg_sqs, steps, betas, eps)
    else:  # the reference computes the step aside and keeps it where the flag is clear (the kernel masks its stores)
        new_m, new_v = [m.clone() for m in exp_avgs], [v.clone() for v in exp_avg_sqs]
        adam_moments_(new_m, new_v, grads, betas)
        keep = skip == 0
        for old, new in zip(exp_avgs + exp_avg_sqs, new_m + new_v):
            old.copy_(torch.where(keep, new, old))
        out = [torch.where(keep, d, 0.0) for d in adam_direction(new_m, new_v, steps, betas, eps)]
    if into_grads:
        torch._foreach_copy_(grads, out)
        return grads if stack is None else stack
    return out
