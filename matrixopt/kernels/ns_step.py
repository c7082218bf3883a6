"""The batched matrix products of Newton–Schulz, each dispatched between cuBLAS and our Triton kernels.

This module is the single entry point the orthogonalization engine (``linalg/ortho.py``) calls for its products:
- :func:`ns_step`: one step ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``;
- for Gram Newton–Schulz: :func:`gram` (``X X^T``), :func:`sym_mul` (``alpha S T + beta S`` for commuting
  symmetric S and T) and :func:`left_mul` (``a X + Q X``).
Each runs either the pure-PyTorch reference (cuBLAS batched GEMMs on CUDA) or the Triton path (the SYRK, which
computes only the lower-triangle tiles of a symmetric result, and the X update with ``a X`` fused into its
epilogue), choosing per op and shape by measurement. The module imports without Triton; the Triton kernels are
imported on first use.

Dispatch (backend ``"auto"``, the default):
- CPU tensors, dtypes other than bf16/fp16, no Triton, or inside ``torch.compile``: the reference.
- CUDA bf16/fp16: the first call of each op for each set of shapes, dtype and device times both paths (median of a few
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

from matrixopt.kernels._tuning import BackendSwitch, compile_ahead, compiling, time_replayed

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


def gram_reference(X: Tensor) -> Tensor:
    """``X X^T``: ``(batch, m, n)`` -> ``(batch, m, m)``, by cuBLAS on CUDA."""
    return torch.bmm(X, X.mT)


def gram_triton(X: Tensor) -> Tensor:
    """``X X^T`` by the SYRK (lower tiles, mirrored); X row-major for 16-byte loads."""
    from matrixopt.kernels.syrk import syrk

    return syrk(X if X.stride(-1) == 1 else X.contiguous())


def sym_mul_reference(S: Tensor, T: Tensor, alpha: float, beta: float) -> Tensor:
    """``alpha S T + beta S`` for symmetric S, T that commute: ``(batch, m, m)`` twice -> ``(batch, m, m)``."""
    return torch.baddbmm(S, S, T, beta=beta, alpha=alpha)


def sym_mul_triton(S: Tensor, T: Tensor, alpha: float, beta: float) -> Tensor:
    """``alpha S T + beta S`` computing only the lower tiles: S T is symmetric (S and T commute) and equals
    ``S T^T`` (T is symmetric), the SYRK's two-operand form. S and T contiguous."""
    from matrixopt.kernels.syrk import syrk

    return syrk(S, alpha=alpha, beta=beta, Y=S, W=T)


def left_mul_reference(Q: Tensor, X: Tensor, a: float) -> Tensor:
    """``a X + Q X``: Q ``(batch, m, m)``, X ``(batch, m, n)`` -> ``(batch, m, n)``; X is not read when a = 0."""
    return torch.baddbmm(X, Q, X, beta=a, alpha=1.0)


def left_mul_triton(Q: Tensor, X: Tensor, a: float) -> Tensor:
    """``a X + Q X`` by the update kernel (``a X`` in its epilogue)."""
    from matrixopt.kernels.ns_update import ns_update

    return ns_update(Q, X if X.stride(-1) == 1 else X.contiguous(), a)


def triton_available() -> bool:
    """Whether the Triton kernels can be imported."""
    try:
        import matrixopt.kernels.ns_update  # noqa: F401
        import matrixopt.kernels.syrk  # noqa: F401
    except ImportError:
        return False
    return True


_for_graphs = False  # set by for_cuda_graphs(): decide for steps that will be replayed from a CUDA graph

# op name -> (reference, Triton) implementations, looked up at call time so tests can replace them
_OPS = {"step": ("ns_step_reference", "ns_step_triton"), "gram": ("gram_reference", "gram_triton"),
        "sym_mul": ("sym_mul_reference", "sym_mul_triton"), "left_mul": ("left_mul_reference", "left_mul_triton")}


def _paths(op: str) -> dict[str, Callable[..., Tensor]]:
    reference, triton_fn = _OPS[op]
    return {"triton": globals()[triton_fn], "torch": globals()[reference]}


def _key(op: str, args: tuple, graphed: bool) -> tuple:
    tensors = [t for t in args if isinstance(t, Tensor)]
    return (op, tuple((tuple(t.shape), t.stride(-1) == 1) for t in tensors), tensors[0].dtype, tensors[0].device,
            graphed)


def _measure(op: str, args: tuple, graphed: bool) -> dict[str, float | str]:
    """Median ms of each path of ``op`` on ``args`` (after a warm-up that compiles and tunes), and the faster
    backend. Eager timings include the host's launch overhead where it shows; ``graphed`` times replays of a CUDA
    graph, the GPU time alone, as a captured step will run."""
    paths = _paths(op)
    for fn in paths.values():
        fn(*args)
        fn(*args)
    if graphed:
        medians = {name: time_replayed(lambda fn=fn: fn(*args), args[0].device, _MEASURE_CALLS, _MEASURE_REPS)
                   for name, fn in paths.items()}
    else:
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(_MEASURE_REPS):  # the paths alternate, so a slow moment of the machine hits both
            for name, fn in paths.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(_MEASURE_CALLS):
                    fn(*args)
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / _MEASURE_CALLS)
        medians = {name: statistics.median(t) for name, t in times.items()}
    t_triton, t_torch = medians["triton"], medians["torch"]
    return {"triton_ms": t_triton, "torch_ms": t_torch,
            "backend": "triton" if t_triton < TRITON_MARGIN * t_torch else "torch"}


def launches_replayed() -> bool:
    """Whether the products issued now will be replayed from a CUDA graph (during capture, or under
    :func:`for_cuda_graphs`): each launch then costs the GPU a few microseconds and the host nothing."""
    return _for_graphs or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _choose(op: str, args: tuple) -> str:
    if compiling():  # a compile-only pass (compile_ahead_once): walk the Triton path, decide nothing
        return "triton"
    if _switch.name != "auto":
        return _switch.name
    X = args[0]
    if not X.is_cuda or X.dtype not in (torch.bfloat16, torch.float16) or torch.compiler.is_compiling():
        return "torch"
    capturing = torch.cuda.is_current_stream_capturing()
    graphed = capturing or _for_graphs
    key = _key(op, args, graphed)
    decision = _decisions.get(key)
    if decision is None:
        if capturing or not triton_available():
            return "torch"
        decision = _decisions[key] = _measure(op, args, graphed)
    return decision["backend"]  # type: ignore[return-value]


_ahead_done: set[tuple] = set()


def compile_ahead_once(key: tuple, fn: Callable[[], object], device: torch.device) -> None:
    """The first time ``key`` is seen on a CUDA device where the Triton path may be taken: run ``fn`` once with
    every kernel only compiled (:func:`matrixopt.kernels._tuning.compile_ahead`, each product on its Triton path
    and every tuning candidate), so that all the kernels a new shape needs compile at once, on a thread pool,
    instead of one after another as the measurements reach them. ``fn``'s result is thrown away; it must only
    compute (its Triton outputs are left unwritten)."""
    if (key in _ahead_done or device.type != "cuda" or _switch.name == "torch" or compiling()
            or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing() or not triton_available()):
        return
    _ahead_done.add(key)
    with compile_ahead(device):
        fn()


def _run(op: str, *args) -> Tensor:
    return _paths(op)[_choose(op, args)](*args)


def ns_step(X: Tensor, a: float, b: float, c: float) -> Tensor:
    """Dispatching step: ``(batch, m, n)`` with ``m <= n`` -> same shape and dtype (see the module docstring)."""
    return _run("step", X, a, b, c)


def gram(X: Tensor) -> Tensor:
    """Dispatching ``X X^T``: ``(batch, m, n)`` -> ``(batch, m, m)`` in X's dtype, accumulated in fp32."""
    return _run("gram", X)


def sym_mul(S: Tensor, T: Tensor, alpha: float, beta: float) -> Tensor:
    """Dispatching ``alpha S T + beta S`` for symmetric ``(batch, m, m)`` S and T that commute (polynomials in one
    symmetric matrix, as in Gram Newton–Schulz): the Triton path computes only the lower tiles, reading T's rows
    as its columns, so T must be symmetric to the bit, as every SYRK output is. Contiguous S, T."""
    return _run("sym_mul", S, T, alpha, beta)


def left_mul(Q: Tensor, X: Tensor, a: float) -> Tensor:
    """Dispatching ``a X + Q X``: Q ``(batch, m, m)``, X ``(batch, m, n)`` -> ``(batch, m, n)``."""
    return _run("left_mul", Q, X, a)


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
    """The measured decisions so far, ``{"op shapes dtype device": {"triton_ms", "torch_ms", "backend"}}``, e.g.
    ``"step 24x768x3072 bfloat16 cuda:0"``; a shape is marked "(transposed)" when not row-major, and keys end in
    "(graphed)" for decisions taken for CUDA graph replay."""
    def shape(dims: tuple, row_major: bool) -> str:
        return "x".join(map(str, dims)) + ("" if row_major else " (transposed)")

    return {f"{op} {' '.join(shape(*t) for t in tensors)} {str(dt).removeprefix('torch.')} {dev}"
            f"{' (graphed)' if graphed else ''}": dict(d)
            for (op, tensors, dt, dev, graphed), d in _decisions.items()}
