"""A small per-shape autotuner shared by the Triton kernels.

Triton's ``@triton.autotune`` times every config of a large space on the first call; here each kernel offers a
few hand-picked candidates (a plain function of the problem shape), they are timed once per key with
``triton.testing.do_bench`` (median) and the winner is cached for the life of the process. On the CPU (the
Triton interpreter, used by the tests) the first candidate is taken without timing.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import torch

C = TypeVar("C")

# (warmup, rep) in milliseconds for each candidate: 5 ms + 20 ms keeps a 3-candidate shape near 0.1 s.
TUNE_WARMUP_MS = 5
TUNE_REP_MS = 20

_CHOSEN: dict[Hashable, object] = {}


def pick(key: Hashable, candidates: Sequence[C], launch: Callable[[C], object], device: torch.device) -> C:
    """The fastest of ``candidates`` for ``key``, timing ``launch(candidate)`` on the first call only."""
    if key in _CHOSEN:
        return _CHOSEN[key]  # type: ignore[return-value]
    if len(candidates) == 1 or device.type != "cuda":
        best = candidates[0]
    else:
        import triton.testing

        times = [triton.testing.do_bench(lambda c=c: launch(c), warmup=TUNE_WARMUP_MS, rep=TUNE_REP_MS,
                                         return_mode="median") for c in candidates]
        best = candidates[min(range(len(candidates)), key=times.__getitem__)]
    _CHOSEN[key] = best
    return best


def chosen() -> dict[Hashable, object]:
    """A copy of every cached choice, ``{key: config}`` (for benchmark reports)."""
    return dict(_CHOSEN)
