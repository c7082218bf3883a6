"""Newton–Schulz against the exact polar factor (float64 SVD), schedules' defining properties."""

import math

import pytest
import torch

import matrixopt.linalg.ortho as ortho
from matrixopt import newton_schulz, polar
from matrixopt.linalg.ortho import (
    MODDED_NANOGPT,
    QUINTIC,
    SCHEDULES,
    NewtonSchulzConfig,
    _poly,
    gram_phases,
    minimax_odd_quintic,
    polar_express_schedule,
    resolve_schedule,
    schedule_band,
    uses_gram,
)

# float32 iteration: singular values land in the scalar band up to round-off of a few float32 matmuls
BAND_SLACK = 1e-3
LO = 1e-3  # smallest normalized singular value of the test matrices


def conditioned(shape, lo=LO, seed=0):
    """Random float64 matrices with singular values log-spaced over [lo, 1] (a condition number of 1/lo)."""
    g = torch.Generator().manual_seed(seed)
    *b, m, n = shape
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(*b, m, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(*b, n, k, generator=g, dtype=torch.float64))
    s = torch.logspace(0, math.log10(lo), k, dtype=torch.float64)
    return (U * s.unsqueeze(-2)) @ V.mT


SHAPES = [(64, 64), (48, 96), (96, 40), (3, 33, 50), (4, 50, 33)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_singular_values_in_documented_band(shape, schedule):
    G = conditioned(shape).float()
    X = newton_schulz(G, steps=5, coefficients=schedule)
    assert X.shape == G.shape and X.dtype == G.dtype
    # the Frobenius-normalized singular values lie in [lo_in, 1], so the output's lie in the band over it
    s_in = torch.linalg.svdvals(G.double() / torch.linalg.vector_norm(G.double(), dim=(-2, -1), keepdim=True))
    lo_in = s_in.min().item()
    band_lo, band_hi = schedule_band(schedule, 5, lo_in)
    s_out = torch.linalg.svdvals(X.double())
    assert s_out.min() >= band_lo - BAND_SLACK, (s_out.min(), band_lo)
    assert s_out.max() <= band_hi + BAND_SLACK, (s_out.max(), band_hi)
    # and the singular vectors are the polar factor's: X = P H with H symmetric positive (X^T P symmetric PSD)
    P = polar(G.double())
    H = P.mT @ X.double()
    assert torch.allclose(H, H.mT, atol=5e-4)


@pytest.mark.parametrize("shape", SHAPES)
def test_polar_express_8_steps_close_to_exact_polar(shape):
    G = conditioned(shape, lo=1e-2).float()
    X = newton_schulz(G, steps=10, coefficients="polar_express")
    P = polar(G.double())
    rel = (X.double() - P).norm() / P.norm()
    assert rel < 1e-3, rel  # float32 round-off; a 5-step quintic is ~1e-1 away
    X5 = newton_schulz(G, steps=5, coefficients="quintic")
    assert (X5.double() - P).norm() / P.norm() > 10 * rel


def test_polar_express_equioscillation():
    """The defining property: each step's (unscaled) polynomial is the minimax approximation of 1 on its interval:
    the error equioscillates with equal magnitude at 4 points, and no perturbation of the coefficients beats it."""
    (a, b, c), E = minimax_odd_quintic(1e-3, 1.0)
    x = torch.linspace(1e-3, 1.0, 200001, dtype=torch.float64)
    err = 1 - _poly((a, b, c), x)
    assert abs(err.abs().max().item() - E) < 1e-9
    crit = torch.tensor([1e-3, 1.0], dtype=torch.float64)
    assert torch.allclose(1 - _poly((a, b, c), crit), torch.tensor([E, -E], dtype=torch.float64), atol=1e-9)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        d = torch.randn(3, generator=g, dtype=torch.float64) * 1e-3
        other = (a + d[0].item(), b + d[1].item(), c + d[2].item())
        assert (1 - _poly(other, x)).abs().max().item() >= E - 1e-12
    # first coefficients are in the range the paper reports for [1e-3, 1] (a ≈ 8.3–8.5)
    assert 8.0 < a < 8.6


def test_polar_express_schedule_converges_to_cubic_newton():
    sched = polar_express_schedule(10)
    a, b, c = sched[-1]
    # on [1 - e, 1 + e] with tiny e the minimax quintic tends to the classical (15, -10, 3)/8 Newton–Schulz
    assert abs(a - 15 / 8) < 1e-3 and abs(b + 10 / 8) < 1e-3 and abs(c - 3 / 8) < 1e-3


def test_named_schedules_and_repeat():
    assert resolve_schedule("modded_nanogpt", 5) == MODDED_NANOGPT
    assert resolve_schedule("modded_nanogpt", 7)[5:] == (MODDED_NANOGPT[-1], MODDED_NANOGPT[-1])
    assert resolve_schedule([(3.0, -3.2, 1.2)], 3) == ((3.0, -3.2, 1.2),) * 3
    assert resolve_schedule("quintic", 2) == ((3.4445, -4.7750, 2.0315),) * 2
    lo, hi = schedule_band("cans", 5, 1e-3)
    assert lo >= 0.7 - 1e-6 and hi <= 1.3 + 1e-6  # CANS keeps the delta = 0.3 band


def test_schedule_names():
    """"quintic" is Keller Jordan's (a, b, c), as in torch.optim.Muon; the default is modded-nanogpt's 5-step
    table, unchanged under its own name."""
    assert QUINTIC == ((3.4445, -4.7750, 2.0315),)
    assert len(MODDED_NANOGPT) == 5 and MODDED_NANOGPT[0] == (8.156554524902461, -22.48329292557795, 15.878769915207462)
    assert "simple" not in SCHEDULES and {"quintic", "modded_nanogpt"} <= set(SCHEDULES)
    G = torch.randn(2, 12, 20, generator=torch.Generator().manual_seed(3))
    assert torch.equal(newton_schulz(G), newton_schulz(G, coefficients=[list(abc) for abc in MODDED_NANOGPT]))
    assert NewtonSchulzConfig().schedule == MODDED_NANOGPT
    assert not torch.equal(newton_schulz(G), newton_schulz(G, coefficients="quintic"))


def test_simple_is_a_deprecated_alias_of_quintic():
    with pytest.warns(FutureWarning, match="'simple' is now called 'quintic'"):
        sched = resolve_schedule("simple", 3)
    assert sched == resolve_schedule("quintic", 3)
    G = torch.randn(6, 10, generator=torch.Generator().manual_seed(4))
    with pytest.warns(FutureWarning, match="use 'quintic'"):
        X = newton_schulz(G, coefficients="simple")
    assert torch.equal(X, newton_schulz(G, coefficients="quintic"))


@pytest.mark.parametrize("kwargs, match", [
    (dict(steps=0), "steps must be an int >= 1, got 0"),
    (dict(steps=2.0), "steps must be an int >= 1, got 2.0"),
    (dict(coefficients="nope"), "Unknown Newton–Schulz schedule 'nope'"),
    (dict(dtype=torch.int32), "dtype must be a floating-point torch.dtype"),
    (dict(method="fast"), "Unknown Newton–Schulz method 'fast'"),
])
def test_config_checks_itself(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NewtonSchulzConfig(**kwargs)


def test_config_equality_is_the_iteration():
    named = NewtonSchulzConfig(coefficients="modded_nanogpt")
    listed = NewtonSchulzConfig(coefficients=[list(abc) for abc in MODDED_NANOGPT])
    assert named == listed and hash(named) == hash(listed)  # a list is hashable once resolved
    assert named != NewtonSchulzConfig(coefficients="quintic") and named != NewtonSchulzConfig(method="gram")
    assert NewtonSchulzConfig().iteration_dtype(torch.device("cpu")) == torch.float32
    assert NewtonSchulzConfig().iteration_dtype(torch.device("cuda")) == torch.bfloat16
    assert NewtonSchulzConfig(dtype=torch.float64).iteration_dtype(torch.device("cuda")) == torch.float64


@pytest.mark.parametrize("bad", ["nope", [], [(1.0, 2.0)], [(1.0, float("nan"), 0.0)]])
def test_bad_schedule(bad):
    with pytest.raises(ValueError):
        newton_schulz(torch.randn(4, 4), coefficients=bad)


def test_bad_inputs():
    with pytest.raises(ValueError, match="shape"):
        newton_schulz(torch.randn(4))
    with pytest.raises(ValueError, match="floating"):
        newton_schulz(torch.ones(4, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="steps"):
        newton_schulz(torch.randn(4, 4), steps=0)


def test_batched_equals_per_matrix():
    G = torch.randn(5, 24, 40, dtype=torch.float32)
    Xb = newton_schulz(G)
    for i in range(5):
        torch.testing.assert_close(Xb[i], newton_schulz(G[i]), rtol=1e-5, atol=1e-5)


def test_zero_and_tiny_and_huge():
    assert torch.equal(newton_schulz(torch.zeros(8, 12)), torch.zeros(8, 12))
    G = torch.randn(16, 24, dtype=torch.float64)
    X = newton_schulz(G.float())
    for scale in (1e-30, 1e30):
        Xs = newton_schulz((G * scale).float())
        assert torch.isfinite(Xs).all()
        torch.testing.assert_close(Xs, X, rtol=1e-4, atol=1e-4)


def test_dtype_option_and_return_dtype():
    G = torch.randn(16, 24)
    Xb = newton_schulz(G, dtype=torch.bfloat16)
    assert Xb.dtype == torch.float32
    assert (Xb - newton_schulz(G)).norm() / Xb.norm() < 5e-2  # bf16 iteration is close to the fp32 one
    assert newton_schulz(G.double()).dtype == torch.float64


def test_polar_exact():
    G = torch.randn(3, 20, 12, dtype=torch.float64)
    P = polar(G)
    torch.testing.assert_close(P.mT @ P, torch.eye(12, dtype=torch.float64).expand(3, 12, 12), rtol=0, atol=1e-12)
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    torch.testing.assert_close(P, U @ Vh)
    assert torch.equal(polar(torch.zeros(4, 6)), torch.zeros(4, 6))


# ---------------------------------------------------------------------------------------- Gram Newton–Schulz


@pytest.mark.parametrize("shape", [(2, 40, 120), (3, 48, 64), (90, 30)])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("steps", [1, 3, 5, 7])
def test_gram_form_is_the_standard_iteration_in_float64(shape, schedule, steps):
    G = conditioned(shape, lo=1e-2)
    gram = newton_schulz(G, steps, schedule, dtype=torch.float64, method="gram")
    standard = newton_schulz(G, steps, schedule, dtype=torch.float64, method="standard")
    assert ((gram - standard).norm() / standard.norm()).item() < 1e-10


def test_gram_form_in_float16_beats_bfloat16_and_needs_its_restart(monkeypatch):
    G = conditioned((2, 128, 512), lo=1e-3, seed=1)
    ref = newton_schulz(G, dtype=torch.float64, method="standard")

    def err(X):
        return ((X.double() - ref).norm() / ref.norm()).item()

    gram = newton_schulz(G.float(), dtype=torch.bfloat16, method="gram")  # iterates in float16
    standard = newton_schulz(G.float(), dtype=torch.bfloat16, method="standard")
    assert err(gram) < 0.03 and err(gram) < err(standard) / 2  # measured 1.6e-2 against 9e-2
    assert torch.linalg.svdvals(gram.double()).max() < 1.2  # the quintic's band tops at ~1.14
    monkeypatch.setattr(ortho, "GRAM_PHASE", 5)  # no restart: round-off in Q's small directions grows
    assert torch.linalg.svdvals(newton_schulz(G.float(), dtype=torch.bfloat16, method="gram").double()).max() > 1.5


def test_flop_counts_of_both_forms():
    s = 512
    assert ortho.newton_schulz_flops(s, 4 * s, 5, "standard") == 5 * (16 + 2) * s**3
    assert ortho.newton_schulz_flops(4 * s, s, 5, "gram") == 2 * 16 * s**3 + (9 + 5) * 2 * s**3  # phases 3 + 2
    assert ortho.newton_schulz_flops(s, 4 * s) == ortho.newton_schulz_flops(s, 4 * s, method="gram")
    assert ortho.newton_schulz_flops(s, s) == ortho.newton_schulz_flops(s, s, method="standard")


def test_flop_model_parts():
    m, n, b = 96, 320, 3
    assert ortho.gram_flops(m, n, b) == b * 2 * m * m * n  # X X^T
    assert ortho.ns_step_flops(m, n, b) == ortho.gram_flops(m, n, b) + ortho.ns_apply_flops(m, n, b)
    assert ortho.ns_step_flops(m, n) == 4 * m * m * n + 2 * m**3
    for method in ("standard", "gram"):  # a batch costs batch times one matrix, in either form
        assert ortho.newton_schulz_flops(n, m, 5, method, batch=b) == b * ortho.newton_schulz_flops(m, n, 5, method)
    assert ortho.newton_schulz_flops(m, n, 4, "standard") == 4 * ortho.ns_step_flops(m, n)


def test_gram_phases_and_auto_rule():
    assert gram_phases(5) == [3, 2] and gram_phases(7) == [3, 3, 1] and gram_phases(1) == [1]
    assert gram_phases(6) == [3, 3]
    assert uses_gram("auto", 1, 100, 150) and not uses_gram("auto", 1, 100, 149)
    assert uses_gram("gram", 1, 64, 64) and not uses_gram("standard", 1, 10, 1000)
    # launched eagerly on CUDA, small stacks stay standard: the Gram form's extra launches cost more than it saves
    assert not uses_gram("auto", 1, 1024, 4096, eager_cuda=True) and uses_gram("auto", 24, 768, 3072, eager_cuda=True)
    assert uses_gram("gram", 1, 1024, 4096, eager_cuda=True)
    with pytest.raises(ValueError, match="Unknown Newton–Schulz method 'fast'"):
        newton_schulz(torch.randn(4, 8), method="fast")


def test_gram_form_stays_in_float16_only_for_schedules_it_fits():
    for name in SCHEDULES:  # the named schedules peak at 41-140
        schedule = resolve_schedule(name, 5)
        assert 40 < ortho.gram_peak(schedule) < 150 and ortho.gram_dtype(torch.bfloat16, schedule) == torch.float16
    wild = ((30.0, -60.0, 31.0),) * 5  # Q's eigenvalues grow past float16's range
    assert ortho.gram_peak(wild) > ortho.GRAM_FLOAT16_PEAK
    assert ortho.gram_dtype(torch.bfloat16, wild) == torch.float32  # an explicit "gram" then iterates in float32
    assert not uses_gram("auto", 1, 64, 256, schedule=wild) and uses_gram("auto", 1, 64, 256, schedule=MODDED_NANOGPT)
    X = ortho.newton_schulz_short_side(torch.randn(2, 8, 24),
                                       NewtonSchulzConfig(coefficients=wild, dtype=torch.bfloat16, method="gram"))
    assert X.dtype == torch.float32


def test_gram_form_keeps_zero_matrices_and_its_float16_output():
    assert torch.equal(newton_schulz(torch.zeros(2, 8, 24), method="gram"), torch.zeros(2, 8, 24))
    X = ortho.newton_schulz_short_side(torch.randn(2, 8, 24),
                                       NewtonSchulzConfig(coefficients="modded_nanogpt", dtype=torch.bfloat16,
                                                          method="gram"))
    assert X.dtype == torch.float16 and X.shape == (2, 8, 24)
