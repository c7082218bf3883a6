"""One Newton–Schulz step, X <- a X + (b A + c A^2) X with A = X X^T.

This module is the single entry point the orthogonalization engine calls per iteration. :func:`ns_step` runs
either the pure-PyTorch reference (three cuBLAS batched GEMMs on CUDA) or the Triton path (two SYRKs that compute
only the lower-triangle tiles, and the X update with ``a X`` fused into its epilogue), choosing per shape by
measurement. The module imports without Triton; the Triton kernels are imported on first use.

Dispatch (backend ``"auto"``, the default):
- CPU tensors, dtypes other than bf16/fp16, no Triton, or inside ``torch.compile``: the reference.
- CUDA bf16/fp16: the first call for each ``(batch, m, n, dtype, device)`` times both paths (median of a few
  back-to-back runs with CUDA events, after the Triton kernels have compiled and tuned) and keeps the Triton
  path only if it was faster than cuBLAS by ``TRITON_MARGIN``; later calls reuse the decision. Under
  :func:`for_cuda_graphs` (and during capture) shapes are decided apart, by timing graph replays of both paths:
  GPU time without launch overhead, which is what a captured step costs. A shape first seen during capture, where
  nothing can be timed, uses the reference.
:func:`ns_backend` forces a backend for a block of code (benchmarks, tests).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from matrixopt.kernels._tuning import BackendSwitch

BACKENDS = BackendSwitch.CHOICES

# Keep Triton only where it beat cuBLAS by at least 2%: within that margin the timings are noise, and the
# reference is the safer default.
TRITON_MARGIN = 0.98
# Each timing covers _MEASURE_CALLS back-to-back steps, as the Newton–Schulz loop runs them, so the host's launch
# overhead overlaps the GPU work as it does in use; the median of _MEASURE_REPS such timings decides.
_MEASURE_CALLS = 3
_MEASURE_REPS = 7

_switch = BackendSwitch("Newton–Schulz")
_decisions: dict[tuple, dict[str, float | str]] = {}


def ns_step_reference(X: Tensor, a: float, b: float, c: float) -> Tensor:
    """Reference step on a batch of short-side-first matrices.

    X: ``(batch, m, n)`` with ``m <= n``, any float dtype; returns the same shape and dtype. A transposed view
    of a contiguous ``(batch, n, m)`` stack (tall matrices seen short side first) keeps that layout: the step
    is computed as ``a X^T + X^T B`` on the stack itself, so no transposed copy is ever made.
    """
    if X.stride(-1) != 1 and X.mT.is_contiguous():
        Xt = X.mT  # (batch, n, m) contiguous
        A = torch.bmm(Xt.mT, Xt)  # (batch, m, m) = X X^T
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        return torch.baddbmm(Xt, Xt, B, beta=a, alpha=1.0).mT  # (a X + B X)^T = a X^T + X^T B, B symmetric
    A = torch.bmm(X, X.mT)  # (batch, m, m), symmetric
    B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A @ A
    return torch.baddbmm(X, B, X, beta=a, alpha=1.0)  # a X + B @ X


def ns_step_triton(X: Tensor, a: float, b: float, c: float) -> Tensor:
    """The step through the Triton kernels: ``(batch, m, n)`` bf16/fp16 -> same shape and dtype.

    Raises ImportError (saying what to install) when Triton is missing."""
    from matrixopt.kernels.ns_update import ns_update
    from matrixopt.kernels.syrk import syrk

    if X.stride(-1) != 1:
        X = X.contiguous()  # row-major tiles load 16 bytes per thread; a transposed view would not
    A = syrk(X)  # (batch, m, m) = X X^T, lower tiles mirrored
    B = syrk(A, alpha=c, beta=b, Y=A)  # b A + c A A^T, and A A^T = A^2 since A is symmetric
    return ns_update(B, X, a)  # a X + B X


def triton_available() -> bool:
    """Whether the Triton kernels can be imported."""
    try:
        import matrixopt.kernels.ns_update  # noqa: F401
        import matrixopt.kernels.syrk  # noqa: F401
    except ImportError:
        return False
    return True


_for_graphs = False  # set by for_cuda_graphs(): decide for steps that will be replayed from a CUDA graph


def _key(X: Tensor, graphed: bool) -> tuple:
    return (*X.shape, X.dtype, X.device, X.stride(-1) == 1, graphed)


def _replay(fn, X: Tensor, a: float, b: float, c: float) -> Callable[[], None]:
    """``_MEASURE_CALLS`` back-to-back calls of ``fn`` captured in one CUDA graph; returns its replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(_MEASURE_CALLS):
            fn(X, a, b, c)
    return graph.replay


def _measure(X: Tensor, a: float, b: float, c: float, graphed: bool) -> dict[str, float | str]:
    """Median ms of each path on X (after a warm-up that compiles and tunes), and the faster backend. Eager
    timings include the host's launch overhead where it shows; ``graphed`` times replays of a CUDA graph, the GPU
    time alone, as a captured step will run."""
    paths = {"triton": ns_step_triton, "torch": ns_step_reference}
    for fn in paths.values():
        fn(X, a, b, c)
        fn(X, a, b, c)
    if graphed:
        torch.cuda.synchronize(X.device)
        runs = {name: _replay(fn, X, a, b, c) for name, fn in paths.items()}
    else:
        runs = {name: (lambda fn=fn: [fn(X, a, b, c) for _ in range(_MEASURE_CALLS)]) for name, fn in paths.items()}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(_MEASURE_REPS):
        for name, run in runs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / _MEASURE_CALLS)
    t_triton, t_torch = statistics.median(times["triton"]), statistics.median(times["torch"])
    return {"triton_ms": t_triton, "torch_ms": t_torch,
            "backend": "triton" if t_triton < TRITON_MARGIN * t_torch else "torch"}


def _choose(X: Tensor, a: float, b: float, c: float) -> str:
    if _switch.name != "auto":
        return _switch.name
    if not X.is_cuda or X.dtype not in (torch.bfloat16, torch.float16) or torch.compiler.is_compiling():
        return "torch"
    capturing = torch.cuda.is_current_stream_capturing()
    graphed = capturing or _for_graphs
    key = _key(X, graphed)
    decision = _decisions.get(key)
    if decision is None:
        if capturing or not triton_available():
            return "torch"
        decision = _decisions[key] = _measure(X, a, b, c, graphed)
    return decision["backend"]  # type: ignore[return-value]


def ns_step(X: Tensor, a: float, b: float, c: float) -> Tensor:
    """Dispatching step: ``(batch, m, n)`` with ``m <= n`` -> same shape and dtype (see the module docstring)."""
    if _choose(X, a, b, c) == "triton":
        return ns_step_triton(X, a, b, c)
    return ns_step_reference(X, a, b, c)


def ns_backend(name: str) -> contextlib.AbstractContextManager[None]:
    """Force ``"torch"`` (reference), ``"triton"`` (any device; on the CPU only under ``TRITON_INTERPRET=1``)
    or ``"auto"`` inside a ``with`` block."""
    return _switch.forced(name)


@contextlib.contextmanager
def for_cuda_graphs() -> Iterator[None]:
    """Inside the block, shapes are decided for replay from a CUDA graph: by the GPU time of captured calls,
    without the host's launch overhead (which favours cuBLAS on small shapes when run eagerly). Run a step's
    Newton–Schulz once under it before capturing the step; during capture ``ns_step`` uses these decisions."""
    global _for_graphs
    previous, _for_graphs = _for_graphs, True
    try:
        yield
    finally:
        _for_graphs = previous


def dispatch_table() -> dict[str, dict[str, float | str]]:
    """The measured decisions so far, ``{"batch x m x n dtype device": {"triton_ms", "torch_ms", "backend"}}``
    (keys end in "(graphed)" for decisions taken for CUDA graph replay)."""
    return {f"{b}x{m}x{n} {str(dt).removeprefix('torch.')} {dev}{'' if row_major else ' (transposed)'}"
            f"{' (graphed)' if graphed else ''}": dict(d)
            for (b, m, n, dt, dev, row_major, graphed), d in _decisions.items()}
