"""What the kernel families share: a small per-shape autotuner for the Triton kernels, and the switch that forces
a family's backend.

Triton's ``@triton.autotune`` times every config of a large space on the first call; here each kernel offers a
few hand-picked candidates (a plain function of the problem shape), they are timed once per key, as replays of a
CUDA graph of back-to-back launches (median), and the winner is cached for the life of the process. A candidate
that does not fit the GPU (Triton's OutOfResources) is passed over. On the CPU (the Triton interpreter, used by the
tests) the first candidate is taken without timing.

A shape's first call is mostly Triton compiling kernels, one after another as the code reaches them, and Triton's
compiler releases the GIL. Under :func:`compile_ahead` a thread only compiles: :func:`launch_kernel` (how our
kernels are launched) hands each kernel's compile to a thread pool instead of running it, :func:`pick` compiles
every candidate and chooses none, and the block waits for all the compiles at its end. :func:`pick` compiles its
candidates that way before timing them; a caller can run a whole computation once that way first (the Newton–
Schulz dispatcher does, for each new shape), so that every kernel it will need compiles at once.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any, TypeVar

import torch

from matrixopt.device import time_ms

C = TypeVar("C")

# Each candidate is timed as TUNE_REPS replays of a CUDA graph of TUNE_CALLS launches (the median decides).
TUNE_CALLS = 10
TUNE_REPS = 7

_CHOSEN: dict[Hashable, object] = {}
_AHEAD = threading.local()  # .jobs, .variants: this thread's compiles under compile_ahead (jobs unset otherwise)
_FIRST_USE = threading.Lock()
_POOL: ThreadPoolExecutor | None = None


def compiling() -> bool:
    """Whether this thread runs under :func:`compile_ahead` (kernels are compiled, not launched)."""
    return getattr(_AHEAD, "jobs", None) is not None


@contextlib.contextmanager
def compile_ahead(device: torch.device) -> Iterator[None]:
    """Inside the block this thread only compiles (module docstring); the block ends when every compile it
    started has. Nested blocks join the outer one. A failed compile is ignored here: the real launch meets it."""
    global _POOL
    if compiling():
        yield
        return
    if _POOL is None:
        # a few more threads than cores: a compile also waits on ptxas, a process of its own
        _POOL = ThreadPoolExecutor(max_workers=max(4, os.cpu_count() or 1), thread_name_prefix="matrixopt-compile")
    _AHEAD.jobs, _AHEAD.device, _AHEAD.variants = [], device, set()
    try:
        yield
    finally:
        jobs, _AHEAD.jobs = _AHEAD.jobs, None
        for job in jobs:
            job.exception()  # waits; the exception itself is left for the launch that meets it again


def _compile(kernel: Any, device: torch.device, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
    on_gpu = device.type == "cuda" and torch.cuda.is_available()  # (the tests fake CUDA kernels on the CPU)
    with torch.cuda.device(device) if on_gpu else contextlib.nullcontext():
        caches = getattr(kernel, "device_caches", None)
        if caches is not None and on_gpu:
            with _FIRST_USE:  # Triton makes a kernel's per-device cache on first use, unguarded: once, not per thread
                caches[torch.cuda.current_device()]
        compiled = kernel.warmup(*args, grid=grid, **kwargs)
        # Triton builds a kernel's launcher (a C extension, compiled on first use) and loads its binary at the first
        # launch, one kernel after another: do it here too
        init = getattr(compiled, "_init_handles", None)
        if init is not None:
            init()


def _spec(arg: Any) -> Hashable:
    """What of a launch argument Triton specializes a kernel on (near enough: a collision only leaves a variant to
    be compiled at its launch)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16
    if isinstance(arg, bool) or not isinstance(arg, int):
        base = getattr(arg, "base", None)  # a TMA descriptor: its block and dtype
        return type(arg).__name__, str(getattr(arg, "block_shape", "")), getattr(base, "dtype", None)
    return arg == 1, arg % 16


def launch_kernel(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``; under :func:`compile_ahead`, its compile handed to the thread pool
    instead, once per variant (Triton's ``warmup``: nothing runs on the GPU, and the outputs are left unwritten)."""
    if not compiling():
        kernel[grid](*args, **kwargs)
        return
    variant = (id(kernel), tuple(map(_spec, args)), tuple(sorted(kwargs.items())))
    if variant not in _AHEAD.variants:
        _AHEAD.variants.add(variant)
        _AHEAD.jobs.append(_POOL.submit(_compile, kernel, _AHEAD.device, grid, args, kwargs))


def import_triton(module: str) -> tuple[ModuleType, ModuleType]:
    """``(triton, triton.language)`` for the kernel module named ``module``; without Triton an ImportError that
    says what to install (the dispatchers catch it and fall back to the torch references)."""
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise ImportError(f"{module} needs Triton: pip install triton (or pip install matrixopt[triton])") from e
    return triton, tl


def _compile_all(candidates: Sequence[C], launch: Callable[[C], object]) -> None:
    """``launch`` each candidate under :func:`compile_ahead`; an error is left for the timing to meet again."""
    for c in candidates:
        try:
            launch(c)
        except Exception:  # noqa: BLE001 - reported when the candidate is timed
            pass


def time_replayed(fn: Callable[[], object], device: torch.device, calls: int = TUNE_CALLS,
                  reps: int = TUNE_REPS) -> float:
    """Median milliseconds per call of ``fn`` over ``reps`` replays of a CUDA graph of ``calls`` back-to-back
    calls: the GPU time with the operands warm in L2 and no launch gaps, as in a Newton–Schulz chain (each product
    reads what the last one wrote) and in a captured step."""
    return time_ms(fn, device, reps=reps, inner=calls, warmup=0, graph=True)["median"]


def pick(key: Hashable, candidates: Callable[[], Sequence[C]], launch: Callable[[C], object],
         device: torch.device) -> C:
    """The fastest of ``candidates()`` for ``key``, timing ``launch(candidate)`` on the first call only (later
    calls are one dictionary lookup: this runs on every kernel launch)."""
    if key in _CHOSEN:
        return _CHOSEN[key]  # type: ignore[return-value]
    candidates = candidates()
    if compiling():  # a compile-only pass: compile them all, choose none
        _compile_all(candidates, launch)
        return candidates[0]
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return candidates[0]  # nothing can be timed during a capture: the first candidate, not kept
    if len(candidates) == 1 or device.type != "cuda":
        best = candidates[0]
    else:
        import triton

        with compile_ahead(device):
            _compile_all(candidates, launch)
        times, failures = [], []
        for c in candidates:
            try:
                times.append(time_replayed(lambda c=c: launch(c), device))
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
