"""What the kernel families share: a small per-shape autotuner for the Triton kernels, and the switch that forces
a family's backend.

Triton's ``@triton.autotune`` times every config of a large space on the first call; here each kernel offers a
few hand-picked candidates (a plain function of the problem shape), they are timed once per key with
``triton.testing.do_bench`` (median) and the winner is cached for the life of the process. A candidate that does
not fit the GPU (Triton's OutOfResources) is passed over. On the CPU (the Triton interpreter, used by the tests)
the first candidate is taken without timing.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TypeVar

import torch

C = TypeVar("C")

# (warmup, rep) in milliseconds for each candidate: 5 ms + 20 ms keeps a 3-candidate shape near 0.1 s.
TUNE_WARMUP_MS = 5
TUNE_REP_MS = 20

_CHOSEN: dict[Hashable, object] = {}


def pick(key: Hashable, candidates: Callable[[], Sequence[C]], launch: Callable[[C], object],
         device: torch.device) -> C:
    """The fastest of ``candidates()`` for ``key``, timing ``launch(candidate)`` on the first call only (later
    calls are one dictionary lookup: this runs on every kernel launch)."""
    if key in _CHOSEN:
        return _CHOSEN[key]  # type: ignore[return-value]
    candidates = candidates()
    if len(candidates) == 1 or device.type != "cuda":
        best = candidates[0]
    else:
        import triton
        import triton.testing

        times, failures = [], []
        for c in candidates:
            try:
                times.append(triton.testing.do_bench(lambda c=c: launch(c), warmup=TUNE_WARMUP_MS, rep=TUNE_REP_MS,
                                                     return_mode="median"))
            except triton.runtime.errors.OutOfResources as e:  # more shared memory or registers than there are
                times.append(math.inf)
                failures.append(f"{c}: {e}")
        if len(failures) == len(candidates):
            raise RuntimeError(f"no kernel config fits this GPU for {key}: " + "; ".join(failures))
        best = candidates[min(range(len(candidates)), key=times.__getitem__)]
    _CHOSEN[key] = best
    return best


def chosen() -> dict[Hashable, object]:
    """A copy of every cached choice, ``{key: config}`` (for benchmark reports)."""
    return dict(_CHOSEN)


class BackendSwitch:
    """Which implementation a kernel family runs: ``"auto"`` (its dispatcher decides), ``"torch"`` (the
    references) or ``"triton"``; :meth:`forced` sets it for a ``with`` block."""

    CHOICES = ("auto", "torch", "triton")

    def __init__(self, family: str) -> None:
        self.family, self.name = family, "auto"

    @contextlib.contextmanager
    def forced(self, name: str) -> Iterator[None]:
        if name not in self.CHOICES:
            raise ValueError(f"unknown {self.family} backend {name!r}; use one of {self.CHOICES}")
        previous, self.name = self.name, name
        try:
            yield
        finally:
            self.name = previous
