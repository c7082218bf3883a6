"""One Newton–Schulz step, X <- a X + (b A + c A^2) X with A = X X^T.

This module is the single entry point the orthogonalization engine calls per iteration. It holds the
pure-PyTorch reference; faster kernels plug in behind :func:`ns_step` without changing its contract.
"""

from __future__ import annotations

import torch
from torch import Tensor


def ns_step_reference(X: Tensor, a: float, b: float, c: float) -> Tensor:
    """Reference step on a batch of short-side-first matrices.

    X: ``(batch, m, n)`` with ``m <= n``, any float dtype; returns the same shape and dtype.
    """
    A = torch.bmm(X, X.mT)  # (batch, m, m), symmetric
    B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A @ A
    return torch.baddbmm(X, B, X, beta=a, alpha=1.0)  # a X + B @ X


def ns_step(X: Tensor, a: float, b: float, c: float) -> Tensor:
    """Dispatching step: ``(batch, m, n)`` with ``m <= n`` -> same shape and dtype."""
    return ns_step_reference(X, a, b, c)
