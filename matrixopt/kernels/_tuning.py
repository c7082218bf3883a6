"""What the kernel families share: a small per-shape autotuner for the Triton kernels, and the switch that forces
a family's backend.

Triton's ``@triton.autotune`` times every config of a large space on the first call; here each kernel offers a
few hand-picked candidates (a plain function of the problem shape), they are timed once per key with
``triton.testing.do_bench`` (median) and the winner is cached for the life of the process. A candidate that does
not fit the GPU (Triton's OutOfResources) is passed over. On the CPU (the Triton interpreter, used by the tests)
the first candidate is taken without timing.

A shape's first call is mostly Triton compiling each candidate, and Triton's compiler releases the GIL: so before
timing, :func:`pick` compiles the candidates at once on a thread pool (:func:`launch_kernel` is how the tuned
kernels are launched: it only compiles while a worker precompiles).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

C = TypeVar("C")

# (warmup, rep) in milliseconds for each candidate: 5 ms + 20 ms keeps a 3-candidate shape near 0.1 s.
TUNE_WARMUP_MS = 5
TUNE_REP_MS = 20

_CHOSEN: dict[Hashable, object] = {}
_COMPILING = threading.local()  # .on: this thread only compiles what launch_kernel is given
_FIRST_USE = threading.Lock()


def launch_kernel(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``; in a worker of :func:`pick`'s precompile, only the compile (Triton's
    ``warmup``: nothing runs on the GPU)."""
    if not compiling():
        kernel[grid](*args, **kwargs)
        return
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        with _FIRST_USE:  # Triton makes a kernel's per-device cache on first use, unguarded: once, not per thread
            caches[torch.cuda.current_device()]
    kernel.warmup(*args, grid=grid, **kwargs)


def compiling() -> bool:
    """Whether this thread is one of :func:`pick`'s precompile workers."""
    return getattr(_COMPILING, "on", False)


def _precompile(candidates: Sequence[C], launch: Callable[[C], object], device: torch.device) -> None:
    """Compile every candidate's kernels at once, one thread each (launches turned into compiles). A failure is
    left for the timing, which meets it again in order."""
    def compile_one(c: C) -> None:
        _COMPILING.on = True
        try:
            on_gpu = device.type == "cuda" and torch.cuda.is_available()  # (the tests fake CUDA launches)
            with torch.cuda.device(device) if on_gpu else contextlib.nullcontext():
                launch(c)
        except Exception:  # noqa: BLE001 - reported when the candidate is timed
            pass
        finally:
            _COMPILING.on = False

    with ThreadPoolExecutor(max_workers=len(candidates)) as pool:  # a handful; the compiler's own threads
        list(pool.map(compile_one, candidates))


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

        _precompile(candidates, launch, device)
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
