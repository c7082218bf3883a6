"""Inverse roots and eigenbases against float64 eigh."""

import math

import pytest
import torch

from matrixopt.linalg.roots import (
    InverseRootConfig,
    cholesky_qr,
    eigenbasis,
    eigh_inverse_root,
    inverse_cholesky,
    inverse_root,
    lower_gram,
    max_eigenvalue,
    newton_inverse_root,
    refresh_eigenbasis,
    times_lower_t,
)

# fp32 coupled Newton: relative Frobenius error measured at 0.9e-3 (p=4) to 9e-3 (p=1) for condition 1e6 and about
# 1e-6 for condition 10 (n=96); it grows like sqrt(cond) * u. Allowed: RTOL_PER_SQRT_COND * sqrt(cond), 2x margin.
RTOL_PER_SQRT_COND = 2e-5
# float32 round-off of an orthogonal matrix / a projection, n <= 64
ORTHO_TOL = 1e-5


def spd(n: int, cond: float, b: int = 3, seed: int = 0) -> torch.Tensor:
    """``(b, n, n)`` float64 SPD with eigenvalues log-spaced in [s / cond, s], s random in (0, 100)."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(b, n, n, generator=g, dtype=torch.float64))
    ev = torch.logspace(0, -math.log10(cond), n, dtype=torch.float64)
    scale = 100 * torch.rand(b, 1, generator=g, dtype=torch.float64)
    return (Q * (ev * scale)[:, None, :]) @ Q.mT


def rel_err(X: torch.Tensor, ref: torch.Tensor) -> float:
    return (torch.linalg.matrix_norm(X.double() - ref) / torch.linalg.matrix_norm(ref)).max().item()


@pytest.mark.parametrize("cond", [1.0, 1e2, 1e4, 1e6])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [8, 64])
def test_inverse_root_matches_eigh(cond, p, n):
    A = spd(n, cond)
    res = inverse_root(A.float(), p)
    assert res.root.dtype == torch.float32 and res.root.shape == A.shape
    assert not res.fell_back.any() and not res.failed.any()  # Newton converged on its own
    assert rel_err(res.root, eigh_inverse_root(A, p)) < RTOL_PER_SQRT_COND * math.sqrt(cond)


def test_damping_is_relative_to_lambda_max():
    A = spd(16, 10.0)
    A[:, :, :4] = 0
    A[:, :4, :] = 0  # singular
    lam = max_eigenvalue(A.float()).double()  # the estimate the damping uses
    for eps in (1e-3, 1e-1):
        res = inverse_root(A.float(), 4, eps)
        damped = A + (eps * lam)[:, None, None] * torch.eye(16, dtype=torch.float64)
        assert rel_err(res.root, eigh_inverse_root(damped, 4)) < RTOL_PER_SQRT_COND * math.sqrt(1 / eps)
        scaled = inverse_root(1e4 * A.float(), 4, eps).root  # scale-free up to (1e4)^(-1/4)
        assert rel_err(scaled * 10.0, res.root.double()) < 1e-4


def test_zero_matrix_gives_identity():
    res = inverse_root(torch.zeros(2, 5, 5), 4, 1e-6)
    torch.testing.assert_close(res.root, torch.eye(5).expand(2, 5, 5))
    assert not res.fell_back.any() and not res.failed.any()


def test_fallback_when_newton_does_not_converge():
    A = spd(16, 1e4)
    res = inverse_root(A.float(), 4, 0.0, InverseRootConfig(max_iters=2))  # far too few steps
    assert res.fell_back.all() and not res.failed.any()
    assert rel_err(res.root, eigh_inverse_root(A.float(), 4)) < 1e-6  # the float64 result, rounded to fp32


def test_non_finite_input_fails_without_nan():
    A = spd(8, 10.0).float()
    A[1, 2, 3] = float("nan")
    A[2, 0, 0] = float("inf")
    res = inverse_root(A, 4)
    assert res.failed.tolist() == [False, True, True]
    assert torch.isfinite(res.root).all()
    torch.testing.assert_close(res.root[1:], torch.eye(8).expand(2, 8, 8))


def test_sync_free_newton_matches_early_exit():
    A = spd(32, 1e3).float()
    X1, c1 = newton_inverse_root(A, 4, 1e-6)
    X2, c2 = newton_inverse_root(A, 4, 1e-6, early_exit=False)
    assert c1.all() and c2.all()
    torch.testing.assert_close(X1, X2, rtol=1e-5, atol=1e-6)


def test_max_eigenvalue_is_a_close_lower_bound():
    A = spd(64, 1e3)
    true = torch.linalg.eigvalsh(A)[:, -1]
    est = max_eigenvalue(A.float()).double()
    assert (est <= true * (1 + 1e-5)).all() and (est >= 0.97 * true).all()  # measured: within 0.3%


def test_eigenbasis_sorted_and_orthogonal():
    A = spd(24, 1e3)
    Q, ok = eigenbasis(A.float())
    assert ok.all() and Q.dtype == torch.float32
    torch.testing.assert_close(Q.mT @ Q, torch.eye(24).expand_as(Q), atol=ORTHO_TOL, rtol=0)
    D = Q.double().mT @ A @ Q.double()
    d = D.diagonal(dim1=-2, dim2=-1)
    assert (d[:, :-1] >= d[:, 1:]).all()  # descending
    off = D - torch.diag_embed(d)
    assert (torch.linalg.matrix_norm(off) / torch.linalg.matrix_norm(A)).max() < ORTHO_TOL


def test_refresh_eigenbasis_power_iteration():
    A = spd(12, 1e2)
    Q0 = torch.linalg.qr(torch.randn(3, 12, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))[0]
    Q = Q0.float()
    for _ in range(300):  # repeated single steps converge to the eigenvectors (subspace iteration)
        Q_old = Q
        Q, order, ok, est = refresh_eigenbasis(A.float(), Q)
        assert ok.all()
    # the estimates: the Rayleigh quotients of the columns the step started from, in the new columns' order
    rayleigh = (Q_old.double().mT @ A @ Q_old.double()).diagonal(dim1=-2, dim2=-1)
    torch.testing.assert_close(est.double(), torch.gather(rayleigh, -1, order), atol=1e-5, rtol=1e-5)
    ref, _ = eigenbasis(A)
    torch.testing.assert_close((Q.mT @ ref).abs(), torch.eye(12).expand(3, 12, 12), atol=1e-3, rtol=0)
    # one step from a permuted converged basis: columns are re-sorted and ``order`` says how
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(2))
    Q1, order, ok, est = refresh_eigenbasis(A.float(), ref[:, :, perm])
    assert torch.equal(perm[order], torch.arange(12).expand(3, 12))
    torch.testing.assert_close(est.double(), torch.linalg.eigvalsh(A).flip(-1), rtol=1e-5, atol=0)  # descending
    torch.testing.assert_close(Q1, ref, atol=1e-4, rtol=0)  # signs kept: a converged basis maps to itself


@pytest.mark.parametrize("n, leaf", [(24, 128), (37, 8), (64, 16), (5, 1)])
@pytest.mark.parametrize("cond", [1.0, 1e4, 1e10])
def test_inverse_cholesky_matches_the_factorization(n, leaf, cond):
    """The recursive halving (leaf < n) against torch's Cholesky factor, float64, up to condition 1e10."""
    G = spd(n, cond)
    Linv, ok = inverse_cholesky(G, leaf)
    assert ok.all() and Linv.dtype == torch.float64
    assert torch.equal(Linv, Linv.tril())  # lower triangular
    ref = torch.linalg.inv(torch.linalg.cholesky(G))
    assert rel_err(Linv, ref) < 1e-15 * cond + 1e-13  # explicit inverses: about u * cond(G)


@pytest.mark.parametrize("n, leaf", [(37, 4), (64, 16), (20, 32)])
def test_triangle_products_match_the_dense_ones(n, leaf):
    g = torch.Generator().manual_seed(6)
    Y = torch.randn(3, n + 5, n, generator=g, dtype=torch.float64)
    L = torch.randn(3, n, n, generator=g, dtype=torch.float64).tril()
    G = lower_gram(Y, leaf)
    dense = Y.mT @ Y
    torch.testing.assert_close(G.tril(), dense.tril(), rtol=1e-13, atol=1e-12)  # the lower triangle, exactly
    if n > leaf:  # above the diagonal only the diagonal blocks of at most leaf columns are computed
        assert torch.equal(G[:, : n // 2, n // 2:], torch.zeros(3, n // 2, n - n // 2, dtype=torch.float64))
    torch.testing.assert_close(times_lower_t(Y, L, leaf), Y @ L.mT, rtol=1e-13, atol=1e-12)
    out = torch.zeros(3, n + 5, 2 * n, dtype=torch.float64)  # written into a view in place
    times_lower_t(Y, L, leaf, out[..., n:])
    assert torch.equal(out[..., :n], torch.zeros(3, n + 5, n))
    torch.testing.assert_close(out[..., n:], Y @ L.mT, rtol=1e-13, atol=1e-12)
    if n > leaf:  # above the diagonal of L, outside its leaf blocks, nothing is read
        junk = L.clone()
        junk[:, : n // 2, n // 2:] = float("nan")
        torch.testing.assert_close(times_lower_t(Y, junk, leaf), Y @ L.mT, rtol=1e-13, atol=1e-12)


@pytest.mark.parametrize("n, gram_leaf, leaf", [(37, 8, 4), (64, 16, 16), (33, 4, 4)])
def test_inverse_cholesky_reads_only_what_lower_gram_computes(n, gram_leaf, leaf):
    Y = torch.randn(3, n + 3, n, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    G = lower_gram(Y, gram_leaf)
    h = n // 2
    G[:, :h, h:] = float("nan")  # above the diagonal outside the leaf blocks: never computed, never read
    Linv, ok = inverse_cholesky(G, leaf)
    ref, ok_ref = inverse_cholesky(Y.mT @ Y, leaf)
    assert ok.all() and ok_ref.all()
    torch.testing.assert_close(Linv, ref, rtol=1e-10, atol=1e-12)


def test_inverse_cholesky_reports_blocks_that_are_not_positive_definite():
    G = spd(16, 10.0, b=3)
    G[0, 12, 12] = -1e3  # the trailing half's leaf fails
    G[1, 0, 0] = float("nan")
    assert inverse_cholesky(G, 4)[1].tolist() == [False, False, True]


@pytest.mark.parametrize("leaf", [128, 4])
@pytest.mark.parametrize("cond", [1.0, 1e3, 1e6])
def test_cholesky_qr_matches_householder_qr(cond, leaf):
    g = torch.Generator().manual_seed(3)
    U = torch.linalg.qr(torch.randn(4, 40, 24, generator=g, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(4, 24, 24, generator=g, dtype=torch.float64))[0]
    Y = (U * torch.logspace(0, -math.log10(cond), 24, dtype=torch.float64)) @ V.mT  # (4, 40, 24), condition cond
    Q, ok = cholesky_qr(Y.float(), leaf)
    assert ok.all() and Q.dtype == torch.float32 and Q.shape == Y.shape
    H, R = torch.linalg.qr(Y.float().double())
    H = H * torch.sign(R.diagonal(dim1=-2, dim2=-1))[:, None, :]  # R's diagonal positive
    assert (Q - H).abs().max() < 1e-15 * cond**2 + 1e-6  # the first pass's orthogonality error u * cond^2, fp32
    torch.testing.assert_close(Q.mT @ Q, torch.eye(24).expand(4, 24, 24), atol=ORTHO_TOL, rtol=0)


def test_cholesky_qr_reports_rank_deficient_ill_conditioned_and_non_finite():
    g = torch.Generator().manual_seed(4)
    Y = torch.randn(4, 8, 5, dtype=torch.float64, generator=g)
    Y[0, :, 4] = Y[0, :, 3]  # rank-deficient
    Y[1, 2, 2] = float("nan")
    U, V = torch.linalg.qr(torch.randn(8, 5, dtype=torch.float64, generator=g))[0], torch.linalg.qr(
        torch.randn(5, 5, dtype=torch.float64, generator=g))[0]
    Y[2] = (U * torch.logspace(0, -8.5, 5, dtype=torch.float64)) @ V.T  # condition 3e8: u * cond^2 > 1e-2
    assert cholesky_qr(Y)[1].tolist() == [False, False, False, True]


def test_refresh_eigenbasis_of_a_singular_factor():
    A = spd(16, 1e2)
    A[:, :, 8:] = 0
    A[:, 8:, :] = 0  # rank 8 of 16 (a factor of few gradient rows): the shift keeps the step's product full rank
    Q = torch.linalg.qr(torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(5)))[0]
    for _ in range(200):
        Q, _, ok, _ = refresh_eigenbasis(A.float(), Q)
        assert ok.all()
    torch.testing.assert_close(Q.mT @ Q, torch.eye(16).expand(3, 16, 16), atol=ORTHO_TOL, rtol=0)
    D = Q.double().mT @ A @ Q.double()  # the range is found: the basis diagonalizes A
    off = D - torch.diag_embed(D.diagonal(dim1=-2, dim2=-1))
    assert (torch.linalg.matrix_norm(off) / torch.linalg.matrix_norm(A)).max() < 1e-4


def test_refresh_eigenbasis_keeps_basis_on_non_finite():
    A = spd(6, 10.0).float()
    A[0, 1, 1] = float("inf")
    Q = torch.linalg.qr(torch.randn(3, 6, 6))[0]
    Q1, order, ok, est = refresh_eigenbasis(A, Q)
    assert ok.tolist() == [False, True, True]
    assert torch.equal(Q1[0], Q[0]) and torch.equal(order[0], torch.arange(6))
    rayleigh = (Q[1:].mT @ A[1:] @ Q[1:]).diagonal(dim1=-2, dim2=-1)
    torch.testing.assert_close(est[1:], torch.sort(rayleigh, descending=True)[0])


@pytest.mark.parametrize("kwargs, match", [
    (dict(p=0), "root order p"), (dict(p=2.5), "root order p"), (dict(epsilon=-1e-3), "damping epsilon"),
    (dict(epsilon=1.0), "damping epsilon"), (dict(A=torch.zeros(4, 4)), r"\(b, n, n\)"),
    (dict(A=torch.zeros(2, 4, 3)), r"\(b, n, n\)"), (dict(A=torch.zeros(1, 3, 3, dtype=torch.int64)), "floating"),
])
def test_bad_inputs(kwargs, match):
    args = dict(A=torch.eye(3)[None], p=4, epsilon=0.0) | kwargs
    with pytest.raises(ValueError, match=match):
        inverse_root(args["A"], args["p"], args["epsilon"])


@pytest.mark.parametrize("kwargs, match", [(dict(max_iters=0), "max_iters"), (dict(max_iters=2.0), "max_iters"),
                                           (dict(tolerance=0.0), "tolerance"), (dict(tolerance=1.5), "tolerance")])
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        InverseRootConfig(**kwargs)


def test_split_tf32_product_keeps_float32_accuracy():
    """The 3xTF32 product: each operand splits exactly into a part TF32 holds (the low 13 mantissa bits zero) and
    the rest, and the three products of the parts give A @ B to float32 accuracy, where the product of the
    TF32-held parts alone (what one TF32 product computes) is off by about 2^-11."""
    from matrixopt.linalg.roots import TF32_MASK, split_tf32_bmm

    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(3, 64, 48, generator=g), torch.randn(3, 48, 32, generator=g)
    want = A.double() @ B.double()
    hi = (A.view(torch.int32) & TF32_MASK).view(torch.float32)
    assert torch.equal(hi + (A - hi), A) and not (hi.view(torch.int32) & 0x1FFF).any()
    b_hi = (B.view(torch.int32) & TF32_MASK).view(torch.float32)

    def err(x: torch.Tensor) -> float:
        return (torch.linalg.matrix_norm(x.double() - want) / torch.linalg.matrix_norm(want)).max().item()

    assert err(split_tf32_bmm(A, B)) < 1e-6 < 1e-4 < err(hi.double() @ b_hi.double())


def test_bf16_product_rounds_the_operands_and_sums_in_float32():
    """bf16_bmm: the product of the operands rounded to bfloat16 (float64 of the rounded operands to float32
    accuracy), about 2^-9 from the exact product; a bfloat16 result on request."""
    from matrixopt.linalg.roots import bf16_bmm

    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(3, 64, 48, generator=g), torch.randn(3, 48, 32, generator=g)
    exact = A.double() @ B.double()
    rounded = A.bfloat16().double() @ B.bfloat16().double()

    def err(x: torch.Tensor, want: torch.Tensor) -> float:
        return (torch.linalg.matrix_norm(x.double() - want) / torch.linalg.matrix_norm(want)).max().item()

    out = bf16_bmm(A, B)
    assert out.dtype == torch.float32 and err(out, rounded) < 1e-6 < 1e-3 < err(out, exact) < 1e-2
    assert err(bf16_bmm(A, B.mT.contiguous().mT), rounded) < 1e-6  # a transposed operand as it is
    half = bf16_bmm(A, B, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and err(half, rounded) < 1e-2
