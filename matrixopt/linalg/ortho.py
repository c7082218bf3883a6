"""Orthogonalization: Newton–Schulz iterations with named coefficient schedules, and the exact polar factor.

All functions here are pure math on local tensors: no optimizer state, no communication.

A Newton–Schulz step applies the odd polynomial ``p(x) = a x + b x^3 + c x^5`` to every singular value of X:

    A = X X^T                      (m, m), symmetric
    X <- a X + (b A + c A^2) X     (m, n)

Starting from ``X = G / ||G||_F`` (all singular values in (0, 1]) a good schedule of (a, b, c) drives every
singular value towards 1, so X tends to the polar factor ``U V^T`` of ``G = U S V^T``. The named schedules
(:data:`SCHEDULES`):

- ``"modded_nanogpt"`` (the default): the 5-step table of modded-nanogpt's Muon (:data:`MODDED_NANOGPT`);
- ``"quintic"``: Keller Jordan's one (a, b, c) = (3.4445, -4.7750, 2.0315) for every step (:data:`QUINTIC`), the
  default of torch.optim.Muon and Emerging-Optimizers (its old name here, ``"simple"``, still works, with a
  FutureWarning);
- ``"polar_express"``, ``"cans"``: computed for the number of steps (:func:`polar_express_schedule`,
  :func:`cans_schedule`).

Gram Newton–Schulz (Zhang, Amsel, Chen and Dao, 2026) computes the same iterates for a wide ``(m, n)`` X, m < n,
with most products on ``(m, m)`` matrices. Every iterate is ``X_t = Q_t X_0`` with ``Q_t`` a polynomial in the
Gram matrix ``R_0 = X_0 X_0^T``, so all of Q, R and ``Z_t = b R + c R^2`` are symmetric and commute:

    Z = b R + c R^2;   Q <- Q (a I + Z);   R <- (a I + Z) R (a I + Z)       all (m, m)
    X_t = Q_t X_0                                                             once, at the end

For five steps that is about 3r + 7 units of m^3 multiply-adds (r = n / m, symmetric products counted at half,
with the restart below) against 7.5 r + 2.5 for the standard form: 36% fewer at r = 3, 42% at r = 4, none for
square matrices. Two things keep it accurate in 16-bit arithmetic: it runs in float16 (three more mantissa bits
than bfloat16 at the same tensor-core speed; every matrix here is bounded, so the range suffices), and it
restarts after three steps (``X <- Q X`` and a fresh Gram matrix), which stops the round-off of the small-singular-
value directions of Q from growing with the steps (:data:`GRAM_PHASE`).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from matrixopt.kernels.muon_elementwise import frobenius_normalize
from matrixopt.kernels.ns_step import compile_ahead_once, gram, launches_replayed, left_mul, ns_step, sym_mul

Coefficients = tuple[float, float, float]

# Keller Jordan's quintic (github.com/KellerJordan/Muon), what torch.optim.Muon and NVIDIA's Emerging-Optimizers
# also call "quintic": one (a, b, c) for every step. a = 3.4445 makes p'(0) large so tiny singular values grow
# fast; the price is that the fixed point is not 1: singular values end in a band of roughly [0.7, 1.2], which
# Muon tolerates.
QUINTIC: tuple[Coefficients, ...] = ((3.4445, -4.7750, 2.0315),)

# The 5-step schedule of modded-nanogpt's Muon (KellerJordan/modded-nanogpt, train_gpt.py, 2025), our default:
# Polar Express polynomials computed for 5 iterations with a 2e-2 safety factor and cushion 2, applied after a
# Frobenius normalization. Published values; `schedule_band` documents where they send singular values.
MODDED_NANOGPT: tuple[Coefficients, ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def minimax_odd_quintic(lo: float, hi: float, iters: int = 100) -> tuple[Coefficients, float]:
    """The odd quintic p minimizing ``max_{x in [lo, hi]} |1 - p(x)|``, by the Remez exchange algorithm.

    The optimum equioscillates at four points ``lo < x1 < x2 < hi`` with errors ``+E, -E, +E, -E``; x1, x2 are the
    critical points of p. Returns ``((a, b, c), E)``. Computed in float64.
    """
    if not 0.0 < lo < hi:
        raise ValueError(f"minimax_odd_quintic needs 0 < lo < hi, got lo={lo}, hi={hi}")
    if hi - lo < 1e-4 * hi:
        # a narrow interval around 1: the exchange is ill-conditioned and the minimax quintic has converged to
        # the classical Newton–Schulz quintic (15 x - 10 x^3 + 3 x^5) / 8, whose fixed point 1 is superattracting
        coeffs = (15 / 8, -10 / 8, 3 / 8)
        lo_img, hi_img = _image(coeffs, lo, hi)
        return coeffs, max(abs(1 - lo_img), abs(1 - hi_img))
    pts = [lo + (hi - lo) * (1 - math.cos(math.pi * i / 3)) / 2 for i in range(4)]
    coeffs, err = (0.0, 0.0, 0.0), 0.0
    for _ in range(iters):
        M = torch.tensor([[x, x**3, x**5, (-1) ** i] for i, x in enumerate(pts)], dtype=torch.float64)
        a, b, c, err = torch.linalg.solve(M, torch.ones(4, dtype=torch.float64)).tolist()
        coeffs = (a, b, c)
        # critical points of p: a + 3b y + 5c y^2 = 0 with y = x^2
        disc = 9 * b * b - 20 * a * c
        if c == 0 or disc < 0:
            break
        ys = sorted(((-3 * b - s * math.sqrt(disc)) / (10 * c)) for s in (1, -1))
        crit = [math.sqrt(y) for y in ys if y > 0 and lo < math.sqrt(y) < hi]
        if len(crit) != 2:
            break
        new = [lo, crit[0], crit[1], hi]
        if max(abs(p - q) for p, q in zip(new, pts)) < 1e-15 * hi:
            break
        pts = new
    return coeffs, abs(err)


def _poly(coeffs: Coefficients, x: Tensor) -> Tensor:
    a, b, c = coeffs
    return a * x + b * x**3 + c * x**5


def _image(coeffs: Coefficients, lo: float, hi: float) -> tuple[float, float]:
    """The range of p over [lo, hi] (dense float64 grid plus the endpoints)."""
    x = torch.linspace(lo, hi, 20001, dtype=torch.float64)
    y = _poly(coeffs, x)
    return y.min().item(), y.max().item()


@functools.lru_cache(maxsize=32)
def polar_express_schedule(steps: int, lo: float = 1e-3, safety: float = 1.01) -> tuple[Coefficients, ...]:
    """Polar Express (Amsel et al., arXiv:2505.16932): at each step the minimax odd quintic on the current
    interval [l_t, u_t] of singular values; the next interval is its image. Every step but the last is applied
    to ``x / safety`` (coefficients ``a/s, b/s^3, c/s^5``) so bf16 round-off cannot push a singular value past
    the interval the polynomial was built for. Starts from [lo, 1]: singular values below ``lo`` of the
    Frobenius-normalized input converge more slowly."""
    lo_t, hi_t = lo, 1.0
    out: list[Coefficients] = []
    for t in range(steps):
        (a, b, c), _ = minimax_odd_quintic(lo_t, hi_t)
        if t < steps - 1:
            a, b, c = a / safety, b / safety**3, c / safety**5
        out.append((a, b, c))
        lo_t, hi_t = _image((a, b, c), lo_t, hi_t)
    return tuple(out)


@functools.lru_cache(maxsize=32)
def cans_schedule(steps: int, lo: float = 1e-3, delta: float = 0.3) -> tuple[Coefficients, ...]:
    """CANS (Grishina et al., arXiv:2506.10935): Chebyshev-alternance (minimax) odd quintics for
    delta-orthogonalization. Muon only needs singular values in ``[1 - delta, 1 + delta]``, so as soon as a
    minimax step on [l_t, u_t] would land inside that band, CANS instead takes the polynomial whose minimax error
    is exactly ``delta`` on the widest interval ``[l', u_t]`` (l' found by bisection): the remaining steps then
    grow small singular values faster than an exact-polar schedule, while the band is kept."""
    lo_t, hi_t = lo, 1.0
    out: list[Coefficients] = []
    for _ in range(steps):
        coeffs, err = minimax_odd_quintic(lo_t, hi_t)
        if err < delta:
            left, right = 1e-9, lo_t  # error(left) > delta >= error(right)
            for _ in range(60):
                mid = math.sqrt(left * right)
                if minimax_odd_quintic(mid, hi_t)[1] > delta:
                    left = mid
                else:
                    right = mid
            coeffs, _ = minimax_odd_quintic(right, hi_t)
        out.append(coeffs)
        lo_t, hi_t = _image(coeffs, lo_t, hi_t)
    return tuple(out)


# name -> the schedule for a number of steps
_SCHEDULES: dict[str, Callable[[int], Sequence[Coefficients]]] = {
    "quintic": lambda steps: QUINTIC,
    "modded_nanogpt": lambda steps: MODDED_NANOGPT,
    "polar_express": polar_express_schedule,
    "cans": cans_schedule,
}
SCHEDULES = tuple(_SCHEDULES)
DEFAULT_SCHEDULE = "modded_nanogpt"
# old name -> the name to use; the old name still works, with a FutureWarning
RENAMED_SCHEDULES = {"simple": "quintic"}


def resolve_schedule(coefficients: str | Sequence[Sequence[float]], steps: int) -> tuple[Coefficients, ...]:
    """The (a, b, c) of each of ``steps`` iterations; a schedule shorter than ``steps`` repeats its last step.

    coefficients: a name in :data:`SCHEDULES` or a list of (a, b, c)."""
    if steps < 1:
        raise ValueError(f"Newton–Schulz needs steps >= 1, got {steps}")
    if isinstance(coefficients, str):
        if coefficients in RENAMED_SCHEDULES:
            new = RENAMED_SCHEDULES[coefficients]
            warnings.warn(f"the Newton–Schulz schedule {coefficients!r} is now called {new!r}; use {new!r} (the "
                          f"same coefficients)", FutureWarning, stacklevel=2)
            coefficients = new
        if coefficients not in _SCHEDULES:
            raise ValueError(f"Unknown Newton–Schulz schedule {coefficients!r}; use one of {SCHEDULES} "
                             "or a list of (a, b, c) tuples")
        sched: Sequence[Coefficients] = _SCHEDULES[coefficients](steps)
    else:
        sched = [tuple(float(v) for v in abc) for abc in coefficients]  # type: ignore[misc]
        if len(sched) == 0 or any(len(abc) != 3 for abc in sched):
            raise ValueError(f"ns coefficients must be a non-empty list of (a, b, c) tuples, got {coefficients!r}")
        if not all(math.isfinite(v) for abc in sched for v in abc):
            raise ValueError(f"ns coefficients must be finite, got {coefficients!r}")
    sched = list(sched)
    return tuple(sched[min(i, len(sched) - 1)] for i in range(steps))


def schedule_band(coefficients: str | Sequence[Sequence[float]], steps: int, lo: float) -> tuple[float, float]:
    """Where a schedule sends singular values: the min and max of the composed polynomial over [lo, 1], in
    float64. ``newton_schulz`` output for an input whose normalized singular values lie in [lo, 1] has its
    singular values in this band, up to the round-off of the iteration dtype."""
    x = torch.logspace(math.log10(lo), 0, 20001, dtype=torch.float64)
    for abc in resolve_schedule(coefficients, steps):
        x = _poly(abc, x)
    return x.min().item(), x.max().item()


METHODS = ("auto", "standard", "gram")

# "auto" takes the Gram form for matrices at least this much wider than tall (long / short side). Below it the
# FLOPs saved (3r + 7 against 7.5r + 2.5, see the module docstring) do not pay for the extra, smaller launches.
GRAM_MIN_ASPECT = 1.5
# Launched eagerly on CUDA, the Gram form's ~22 launches for five steps (against 15) cost the host more than its
# FLOPs save on small stacks. Measured on an H100 (docs/results/bench): 1 x 1024 x 4096 took 1.29 ms against
# 0.60, 12 x 768 x 2304 1.32 against 1.20, while 24 x 768 x 3072 took 2.10 against 2.36. So eagerly "auto" also
# needs batch * m^2 * n of at least this; replayed from a CUDA graph, launches are cheap and the aspect suffices.
GRAM_MIN_EAGER_WORK = 2**34

# Gram Newton–Schulz restarts every three steps. Measured in float16 against a float64 iteration (256 x 1024,
# singular values spread over 1e-2..1e-5, modded_nanogpt and Polar Express): restarting after steps 3 (phases 3 + 2)
# gave half the error of restarting after step 2 (2 + 3), 0.5-2% against 1.3-3.4%; without a restart the
# iteration diverged (top singular value 2.9-5.8). The bfloat16 standard form erred by 3-17% on the same inputs.
GRAM_PHASE = 3


# The Gram form runs in float16 only while every matrix it forms stays below this (in absolute value, for inputs
# with singular values in [0, 1]): the named schedules peak at 41-140 (Q's eigenvalues for the smallest singular
# values), which float16 holds to about 0.07. A schedule peaking higher would lose accuracy, then overflow (65504).
GRAM_FLOAT16_PEAK = 1024.0


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"Unknown Newton–Schulz method {method!r}; use one of {METHODS}")
    return method


@functools.lru_cache(maxsize=64)
def gram_peak(schedule: tuple[Coefficients, ...]) -> float:
    """The largest absolute value the Gram form's matrices (R, Z, R (a I + Z), Q) reach for an input with singular
    values in [0, 1]. Each is a polynomial in the input's singular values, evaluated here on a float64 grid."""
    x = torch.linspace(0, 1, 4097, dtype=torch.float64)  # the input's singular values
    peak, t = 0.0, 0
    for length in gram_phases(len(schedule)):
        r, q = x * x, torch.ones_like(x)  # eigenvalues of R and Q
        for a, b, c in schedule[t:t + length]:
            z = b * r + c * r * r
            for v in (r, z, r * (a + z), q * (a + z)):
                peak = max(peak, v.abs().max().item())
            r, q = r * (a + z) ** 2, q * (a + z)
        x, t = q * x, t + length
    return peak


def uses_gram(method: str, batch: int, m: int, n: int, eager_cuda: bool = False,
              schedule: tuple[Coefficients, ...] | None = None) -> bool:
    """Whether ``method`` runs a ``(batch, m, n)`` stack (m <= n) in the Gram form; ``eager_cuda``: launched on
    CUDA and not replayed from a graph (see :data:`GRAM_MIN_EAGER_WORK`). "auto" also keeps the standard form for
    a ``schedule`` whose Gram form would not fit float16 (:data:`GRAM_FLOAT16_PEAK`)."""
    if check_method(method) != "auto":
        return method == "gram"
    return (n >= GRAM_MIN_ASPECT * m and (not eager_cuda or batch * m * m * n >= GRAM_MIN_EAGER_WORK)
            and (schedule is None or gram_peak(tuple(schedule)) <= GRAM_FLOAT16_PEAK))


def gram_dtype(dtype: torch.dtype, schedule: Sequence[Coefficients] = ()) -> torch.dtype:
    """The Gram form's iteration dtype: float16 where bfloat16 is asked for (see the module docstring); float32
    instead of either 16-bit type for a schedule whose matrices would not fit float16 (:func:`gram_peak`)."""
    if dtype in (torch.bfloat16, torch.float16):
        return torch.float16 if gram_peak(tuple(schedule)) <= GRAM_FLOAT16_PEAK else torch.float32
    return dtype


def gram_phases(steps: int) -> list[int]:
    """Steps between restarts of Gram Newton–Schulz: ``[3, 3, ..., rest]`` adding up to ``steps``."""
    return [GRAM_PHASE] * (steps // GRAM_PHASE) + ([steps % GRAM_PHASE] if steps % GRAM_PHASE else [])


@dataclass(frozen=True, kw_only=True)
class NewtonSchulzConfig:
    """How a Newton–Schulz iteration runs: what :func:`newton_schulz` takes as arguments, as one value for Muon,
    the sharded and the tensor-parallel Newton–Schulz to pass around. Checks itself when built (ValueError).
    Two configs are equal when they compute the same iteration (same resolved ``schedule``)."""

    steps: int = 5
    """Iterations, >= 1."""
    coefficients: str | Sequence[Sequence[float]] = field(default=DEFAULT_SCHEDULE, compare=False)
    """A name in :data:`SCHEDULES` or a list of (a, b, c); a list shorter than ``steps`` repeats its last entry."""
    dtype: torch.dtype | None = None
    """The iteration dtype; None means bfloat16 on CUDA, float32 elsewhere."""
    method: str = "auto"
    """One of :data:`METHODS`: the standard form, the Gram form, or "auto" (:func:`uses_gram`)."""
    schedule: tuple[Coefficients, ...] = field(init=False, repr=False)
    """The (a, b, c) of each step, resolved from ``coefficients`` (:func:`resolve_schedule`)."""

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"Newton–Schulz steps must be an int >= 1, got {self.steps!r}")
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise ValueError(f"Newton–Schulz dtype must be a floating-point torch.dtype or None (the device's "
                             f"default), got {self.dtype!r}")
        check_method(self.method)
        object.__setattr__(self, "schedule", resolve_schedule(self.coefficients, self.steps))

    def iteration_dtype(self, device: torch.device) -> torch.dtype:
        """``dtype``, or the default for ``device``: bfloat16 on CUDA, float32 elsewhere."""
        return self.dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)


# ----------------------------------------------------------------------------------------------------------
# FLOPs: dense counts, 2 per multiply-add (the work a GEMM library does; a SYRK does about half of a symmetric
# product). ``batch`` matrices of the same shape cost ``batch`` times one.


def gram_flops(m: int, k: int, batch: int = 1) -> int:
    """The Gram matrix ``X X^T`` of an ``(m, k)`` X: ``2 m^2 k``."""
    return 2 * batch * m * m * k


def ns_apply_flops(m: int, n: int, batch: int = 1) -> int:
    """The rest of a standard step on an ``(m, n)`` X once its ``(m, m)`` Gram matrix A is known: ``A A`` and
    ``B X`` with ``B = b A + c A^2``, ``2 m^3 + 2 m^2 n``."""
    return batch * (2 * m**3 + 2 * m * m * n)


def ns_step_flops(m: int, n: int, batch: int = 1) -> int:
    """One standard step on an ``(m, n)`` X iterating on its ``(m, m)`` Gram matrix (``X X^T``, ``A A``,
    ``B X``): ``4 m^2 n + 2 m^3``. :func:`newton_schulz` takes ``m`` as the short side; tensor-parallel Newton–
    Schulz contracts the sharded side, which may be the long one."""
    return gram_flops(m, n, batch) + ns_apply_flops(m, n, batch)


def newton_schulz_flops(m: int, n: int, steps: int = 5, method: str = "auto", batch: int = 1) -> int:
    """FLOPs of ``steps`` iterations on ``batch`` ``(m, n)`` matrices as :func:`newton_schulz` computes them, with
    ``s = min(m, n)``, ``l = max(m, n)``. Standard form: ``steps`` times :func:`ns_step_flops` ``(s, l)``,
    ``4 s^2 l + 2 s^3`` per step. Gram form, per phase of k steps (:func:`gram_phases`): a Gram matrix and a final
    ``Q X`` (``4 s^2 l``) and ``4 k - 3`` products of ``(s, s)`` matrices (``2 s^3`` each). ``method`` as for
    :func:`newton_schulz` ("auto" decides by the aspect alone, as on the CPU or replayed from a CUDA graph)."""
    s, l = min(m, n), max(m, n)
    if not uses_gram(method, 1, s, l):
        return steps * ns_step_flops(s, l, batch)
    return batch * sum(2 * gram_flops(s, l) + (4 * k - 3) * 2 * s**3 for k in gram_phases(steps))


def gram_newton_schulz(Y: Tensor, schedule: Sequence[Coefficients]) -> Tensor:
    """The Newton–Schulz iterates of a normalized batch computed in the Gram form, restarting per
    :func:`gram_phases`.

    Y: ``(b, m, n)`` with ``m <= n``, singular values in [0, 1], any float dtype (the iteration's). Returns the
    same shape and dtype, equal to ``len(schedule)`` standard steps up to round-off.
    """
    Y = Y.contiguous()
    t = 0
    for length in gram_phases(len(schedule)):
        phase, t = schedule[t:t + length], t + length
        R = gram(Y)  # (b, m, m) = Y Y^T
        Q: Tensor | None = None  # this phase's polynomial so far; None is the identity
        for i, (a, b, c) in enumerate(phase):
            Z = sym_mul(R, R, c, b)  # b R + c R^2, so the step's polynomial is a I + Z
            if i == length - 1:
                # the last step of a phase needs no new R; with Q = I it is the standard step a Y + Z Y
                Y = left_mul(Z, Y, a) if Q is None else left_mul(sym_mul(Q, Z, 1.0, a), Y, 0.0)
                break
            RP = sym_mul(R, Z, 1.0, a)  # R (a I + Z)
            R = sym_mul(RP, Z, 1.0, a)  # (a I + Z) R (a I + Z): the Gram matrix of (a I + Z) Y
            if Q is None:  # Q = a I + Z, written over Z, which is not needed any more (no copy)
                Q = Z
                Q.diagonal(dim1=-2, dim2=-1).add_(a)
            else:
                Q = sym_mul(Q, Z, 1.0, a)  # Q (a I + Z)
    return Y


def newton_schulz_short_side(X: Tensor, config: NewtonSchulzConfig, parts: Tensor | None = None) -> Tensor:
    """The iteration proper, on a batch already laid out short side first.

    X: ``(b, m, n)`` with ``m <= n``, any float dtype. Returns ``(b, m, n)`` in the iteration dtype (no cast back):
    ``config.iteration_dtype``, except float16 for the Gram form asked for bfloat16 (or float32 for a schedule
    float16 can't hold, :func:`gram_dtype`). Each matrix is divided by its Frobenius norm, accumulated in float64
    so that gradients of any finite scale (1e-30 to 1e30) neither overflow nor underflow, and cast to the
    iteration dtype in the same pass. ``config.method``: "standard", "gram" or "auto" (the Gram form for
    ``n >= GRAM_MIN_ASPECT m``, and eagerly on CUDA for stacks of at least ``GRAM_MIN_EAGER_WORK``). ``parts``:
    ``(b, T)`` float64 partial sums of X's squares (rows summing to each squared Frobenius norm), as
    :func:`matrixopt.kernels.muon_elementwise.momentum_pack` returns them: the normalization then reads X once.
    """
    schedule, dtype = config.schedule, config.iteration_dtype(X.device)
    gram_form = uses_gram(config.method, *X.shape, eager_cuda=X.is_cuda and not launches_replayed(),
                          schedule=schedule)

    def iterate() -> Tensor:
        if gram_form:
            return gram_newton_schulz(frobenius_normalize(X, gram_dtype(dtype, schedule), parts), schedule)
        Y = frobenius_normalize(X, dtype, parts)  # every singular value in [0, 1]; keeps X's layout (see ns_step)
        for a, b, c in schedule:
            Y = ns_step(Y, a, b, c)
        return Y

    # a new shape: compile every kernel the iteration can use at once, before its products are measured
    compile_ahead_once(("newton_schulz", tuple(X.shape), X.stride(), X.dtype, dtype, gram_form, parts is None),
                       iterate, X.device)
    return iterate()


def newton_schulz(G: Tensor, steps: int = 5, coefficients: str | Sequence[Sequence[float]] = DEFAULT_SCHEDULE, *,
                  dtype: torch.dtype | None = None, method: str = "auto") -> Tensor:
    """Approximate polar factor ``U V^T`` of G by a Newton–Schulz iteration.

    G: ``(m, n)`` or a batch ``(b, m, n)``, floating point. Returns the same shape and dtype as G.
    Iterates on the short side (transposes when m > n, so the Gram matrix is min(m, n) square), normalizes
    each matrix by its Frobenius norm, and runs in ``dtype`` (default bfloat16 on CUDA, float32 elsewhere).
    A zero matrix maps to zero. ``coefficients``: "modded_nanogpt" (default: modded-nanogpt's 5-step table),
    "quintic" (Keller Jordan's single (a, b, c), torch.optim.Muon's default), "polar_express", "cans", or a
    list of (a, b, c); a list shorter than ``steps`` repeats its last entry. ``method``: "standard", "gram" (the
    Gram form, in float16 where ``dtype`` is bfloat16) or "auto" (default: Gram for matrices whose long side is at
    least ``GRAM_MIN_ASPECT`` times the short one, see :func:`uses_gram`).
    """
    return newton_schulz_with(G, NewtonSchulzConfig(steps=steps, coefficients=coefficients, dtype=dtype,
                                                    method=method))


def newton_schulz_with(G: Tensor, config: NewtonSchulzConfig) -> Tensor:
    """:func:`newton_schulz` with its settings given as one :class:`NewtonSchulzConfig`."""
    if G.ndim not in (2, 3):
        raise ValueError(f"newton_schulz takes (m, n) or (b, m, n) input, got shape {tuple(G.shape)}")
    if not G.is_floating_point():
        raise ValueError(f"newton_schulz needs a real floating-point input, got {G.dtype}")
    X = G.unsqueeze(0) if G.ndim == 2 else G  # (b, m, n)
    transposed = X.size(-2) > X.size(-1)
    X = newton_schulz_short_side(X.mT if transposed else X, config)  # (b, short, long)
    X = (X.mT if transposed else X).to(G.dtype)
    return X.squeeze(0) if G.ndim == 2 else X


def polar(G: Tensor) -> Tensor:
    """Exact polar factor ``U V^T`` of G (``(m, n)`` or ``(b, m, n)``) by an SVD in float64.

    Returns the input's shape and dtype. For rank-deficient G the factor on the null space is zero.
    """
    if G.ndim not in (2, 3):
        raise ValueError(f"polar takes (m, n) or (b, m, n) input, got shape {tuple(G.shape)}")
    if not G.is_floating_point():
        raise ValueError(f"polar needs a real floating-point input, got {G.dtype}")
    X = G.double()
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    # drop directions whose singular value is round-off, so a zero matrix maps to zero
    keep = S > S.amax(dim=-1, keepdim=True) * max(X.shape[-2:]) * torch.finfo(torch.float64).eps
    out = (U * keep.unsqueeze(-2).to(U.dtype)) @ Vh
    return out.to(G.dtype)
