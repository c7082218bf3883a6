r"""Inverse p-th roots of symmetric positive semi-definite matrices (Shampoo) and their eigenbases (SOAP).

All functions here are pure math on local tensors, batched over a leading dim: ``A`` is ``(b, n, n)``.

Damping is relative: every matrix is regularized as :math:`A + \epsilon\,\lambda_{\max}(A)\,I` (in the Newton
iteration :math:`\lambda_{\max}` is a power-iteration estimate, a lower bound within a few percent), so the result does
not depend on the scale of A (an EMA, a sum or a bias-corrected EMA give the same root up to a scalar) and the
condition number the iteration sees is at most about :math:`1/\epsilon`.

**Coupled Newton iteration** (Guo & Higham, SIAM J. Matrix Anal. Appl. 28(3), 2006; as used by Anil et al.,
arXiv:2002.09018): with :math:`z = (p + 1) / (2 \lambda_{\max})`,

.. math::
    X_0 = z^{1/p} I,\quad M_0 = z A,\qquad
    T_k = \frac{(p + 1) I - M_k}{p},\quad X_{k+1} = X_k T_k,\quad M_{k+1} = T_k^p M_k .

The invariant :math:`M_k = X_k^p A` holds throughout, and :math:`M_k \to I`, so :math:`X_k \to A^{-1/p}`. Every
eigenvalue of :math:`M_0` must lie in :math:`(0, p + 1)`; any :math:`\lambda` estimate above
:math:`\lambda_{\max}/2` gives that. Only matmuls: it runs in fp32 on any device, and small eigenvalues grow by
about :math:`(1 + 1/p)^p` per step, so a condition number of :math:`10^6` takes about 20 steps. In fp32 the
result's relative error grows like :math:`\sqrt{\kappa}\,u` (about 1e-3 at :math:`\kappa = 10^6`).

In exact arithmetic every eigenvalue of :math:`M_k` moves strictly closer to 1 at each step, so
:math:`\|M_k - I\|_F` decreases monotonically; a step that does not decrease it means round-off or divergence.

**Fallback**: a matrix whose iteration stops improving before :math:`\|M - I\|_F/\sqrt{n} <` ``tolerance``, or meets a
non-finite value, is recomputed by an eigendecomposition in float64. A matrix with a non-finite entry, or whose
eigendecomposition fails, is reported as failed (its output is the identity, never NaN) so the caller can keep
its previous root.

**Eigenbases** (SOAP, Vyas et al., arXiv:2409.11321): :func:`eigenbasis` by float64 ``eigh`` at the first
refresh; :func:`refresh_eigenbasis` afterwards by one step of power iteration followed by QR, starting from the
previous basis with its columns sorted by the estimated eigenvalues :math:`\operatorname{diag}(Q^\top A Q)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

_POWER_ITERS = 32  # power steps estimating lambda_max: matvecs, cheap next to the n^3 Newton steps
REFRESH_SHIFT = 1e-6  # refresh_eigenbasis: the power step's shift, relative to the largest eigenvalue estimate


@dataclass(frozen=True, kw_only=True)
class InverseRootConfig:
    """How inverse roots are computed.

    max_iters: coupled Newton steps at most (>= 1). About 20 reach fp32 accuracy at condition number 1e6.
    tolerance: the iteration has converged when the RMS eigenvalue error ``||M - I||_F / sqrt(n) < tolerance``
        (in (0, 1)). Its fp32 floor is about 1.5e-7 for n from 64 to 1536 (measured); near convergence the error
        squares each step, so the default 1e-5 costs at most one step more than 1e-4.
    """

    max_iters: int = 50
    tolerance: float = 1e-5

    def __post_init__(self) -> None:
        if not isinstance(self.max_iters, int) or self.max_iters < 1:
            raise ValueError(f"Invalid InverseRootConfig.max_iters: {self.max_iters!r} (must be an int >= 1)")
        if not 0.0 < self.tolerance < 1.0:
            raise ValueError(f"Invalid InverseRootConfig.tolerance: {self.tolerance!r} (must be in (0, 1))")


class RootResult(NamedTuple):
    """Result of :func:`inverse_root`.

    root: ``(b, n, n)`` float32, :math:`(A + \\epsilon \\lambda_{\\max} I)^{-1/p}`; the identity where ``failed``.
    fell_back: ``(b,)`` bool, the Newton iteration did not converge and float64 ``eigh`` gave the root.
    failed: ``(b,)`` bool, no root could be computed (non-finite input, or ``eigh`` failed).
    """

    root: Tensor
    fell_back: Tensor
    failed: Tensor


def _check_square(A: Tensor, fn: str) -> None:
    if A.ndim != 3 or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"{fn} takes a batch of square matrices (b, n, n), got shape {tuple(A.shape)}")
    if not A.is_floating_point():
        raise ValueError(f"{fn} needs a real floating-point input, got {A.dtype}")


def _check_root(p: int, epsilon: float) -> None:
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"Invalid root order p: {p!r} (must be an int >= 1; the result is A^(-1/p))")
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"Invalid damping epsilon: {epsilon!r} (must be in [0, 1), relative to lambda_max)")


def max_eigenvalue(A: Tensor) -> Tensor:
    """A lower bound of the largest eigenvalue of each PSD matrix, close to it: the Rayleigh quotient after
    ``_POWER_ITERS`` power steps from the column of A with the largest diagonal entry, or ``||A||_F / sqrt(n)`` if
    larger. ``A``: ``(b, n, n)`` float32; returns ``(b,)`` float32 (0 for a zero matrix). No host sync."""
    n = A.shape[-1]
    idx = A.diagonal(dim1=-2, dim2=-1).argmax(dim=-1)  # (b,)
    v = torch.take_along_dim(A, idx[:, None, None].expand(-1, n, 1), dim=-1)  # (b, n, 1): A e_i
    for _ in range(_POWER_ITERS):
        v = v / torch.linalg.vector_norm(v, dim=-2, keepdim=True).clamp_min(1e-30)
        v = A @ v
    v = v / torch.linalg.vector_norm(v, dim=-2, keepdim=True).clamp_min(1e-30)
    rayleigh = (v.mT @ A @ v).reshape(-1)  # (b,)
    frob = torch.linalg.matrix_norm(A) / n**0.5  # ||A||_F <= sqrt(n) lambda_max
    return torch.maximum(rayleigh, frob)


def newton_inverse_root(A: Tensor, p: int, epsilon: float = 0.0, config: InverseRootConfig | None = None, *,
                        early_exit: bool = True) -> tuple[Tensor, Tensor]:
    """The coupled Newton iteration for :math:`(A + \\epsilon \\lambda_{\\max} I)^{-1/p}`, batched, in float32.

    A: ``(b, n, n)`` symmetric PSD, any float dtype. Returns ``(X, converged)``: ``X`` ``(b, n, n)`` float32 (the
    best iterate of each matrix; may hold NaN/Inf where not converged) and ``converged`` ``(b,)`` bool.
    Each matrix stops at convergence or when ``||M - I||_F`` stops decreasing (keeping the better iterate).
    ``early_exit=True`` leaves the loop once every matrix has stopped (one host sync per step); ``False`` runs
    ``max_iters`` steps with no host sync, for a side CUDA stream. An all-zero matrix gives the
    identity (nothing to precondition).
    """
    _check_square(A, "newton_inverse_root")
    _check_root(p, epsilon)
    config = config or InverseRootConfig()
    A = A.float()
    b, n, _ = A.shape
    eye = torch.eye(n, dtype=A.dtype, device=A.device).expand(b, n, n)
    lam = max_eigenvalue(A)  # (b,)
    zero = lam <= 0
    A = torch.where(zero[:, None, None], eye, A)
    lam = torch.where(zero, torch.ones_like(lam), lam) * (1.0 + epsilon)
    A = A + (epsilon * lam / (1.0 + epsilon))[:, None, None] * eye  # damping relative to lambda_max
    z = (p + 1) / (2.0 * lam)  # (b,): eigenvalues of M_0 in (0, (p + 1) / 2] when lam = lambda_max
    M = z[:, None, None] * A  # (b, n, n)
    X = z.pow(1.0 / p)[:, None, None] * eye
    err = torch.linalg.matrix_norm(M - eye) / n**0.5  # (b,) RMS eigenvalue error
    active = err >= config.tolerance
    for _ in range(config.max_iters):
        if early_exit and not bool(active.any()):
            break
        T = ((p + 1) * eye - M) / p
        X_next = X @ T
        M_next = torch.linalg.matrix_power(T, p) @ M
        err_next = torch.linalg.matrix_norm(M_next - eye) / n**0.5
        improved = active & (err_next < err)  # False for NaN
        keep = improved[:, None, None]
        X = torch.where(keep, X_next, X)
        M = torch.where(keep, M_next, M)
        err = torch.where(improved, err_next, err)
        active = improved & (err >= config.tolerance)
    return X, err < config.tolerance


def eigh_inverse_root(A: Tensor, p: int, epsilon: float = 0.0) -> Tensor:
    """Reference :math:`(A + \\epsilon \\lambda_{\\max} I)^{-1/p}` by ``eigh`` in float64.

    A: ``(b, n, n)`` symmetric PSD and finite. Returns ``(b, n, n)`` float64. Negative round-off eigenvalues are
    clamped to 0; an all-zero matrix gives the identity. Raises ``torch.linalg.LinAlgError`` if eigh fails."""
    _check_square(A, "eigh_inverse_root")
    _check_root(p, epsilon)
    lam, Q = torch.linalg.eigh(A.double())  # (b, n), (b, n, n)
    lam = lam.clamp_min(0)
    lmax = lam.amax(dim=-1, keepdim=True)  # (b, 1)
    lam = torch.where(lmax > 0, lam + epsilon * lmax, torch.ones_like(lam))
    return (Q * lam.pow(-1.0 / p).unsqueeze(-2)) @ Q.mT


def fall_back(A: Tensor, X: Tensor, converged: Tensor, p: int, epsilon: float) -> RootResult:
    """Finish a Newton result: recompute by float64 eigh where ``converged`` is False or X is not finite; mark
    matrices with non-finite entries (or whose eigh fails) as failed and give them the identity. One host sync.

    A: ``(b, n, n)``; X: ``(b, n, n)`` float32 from :func:`newton_inverse_root`; converged: ``(b,)`` bool."""
    ok = converged & torch.isfinite(X).all(dim=(-2, -1))
    finite_in = torch.isfinite(A).all(dim=(-2, -1))
    fell_back = ~ok & finite_in
    failed = ~ok & ~finite_in
    idx = fell_back.nonzero().flatten()  # host sync
    X = torch.where(ok[:, None, None], X, torch.eye(X.shape[-1], dtype=X.dtype, device=X.device))
    if idx.numel():
        try:
            X[idx] = eigh_inverse_root(A[idx], p, epsilon).to(X.dtype)
        except torch.linalg.LinAlgError:
            fell_back, failed = torch.zeros_like(fell_back), failed | fell_back
    return RootResult(X, fell_back, failed)


def inverse_root(A: Tensor, p: int, epsilon: float = 0.0, config: InverseRootConfig | None = None) -> RootResult:
    """:math:`(A + \\epsilon \\lambda_{\\max} I)^{-1/p}` for a batch of symmetric PSD matrices: the coupled Newton
    iteration in fp32, float64 eigh where it does not converge. See :class:`RootResult`.

    A: ``(b, n, n)``, any float dtype; p: int >= 1; epsilon: relative damping in [0, 1)."""
    X, converged = newton_inverse_root(A, p, epsilon, config)
    return fall_back(A, X, converged, p, epsilon)


def finite_matrices(X: Tensor) -> Tensor:
    """``(b,)`` bool: whether each matrix of ``(b, m, n)`` X is finite, judged by its sum: one reduction over X
    instead of the elementwise passes of ``isfinite(X).all()`` (about a fifth of their time on an H100). A NaN or
    Inf entry makes the sum non-finite, and so do finite entries whose sum overflows, which no usable factor,
    basis or root has."""
    return torch.isfinite(X.sum(dim=(-2, -1)))


def eigenbasis(A: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvectors of symmetric matrices by float64 eigh, columns in descending eigenvalue order.

    A: ``(b, n, n)``. Returns ``(Q, ok)``: ``Q`` ``(b, n, n)`` float32, orthogonal; ``ok`` ``(b,)`` bool, False
    (and Q the identity) where A is not finite or eigh failed."""
    _check_square(A, "eigenbasis")
    b, n, _ = A.shape
    ok = finite_matrices(A)
    eye = torch.eye(n, dtype=torch.float64, device=A.device).expand(b, n, n)
    A64 = torch.where(ok[:, None, None], A.double(), eye)
    try:
        _, Q = torch.linalg.eigh(A64)  # ascending
    except torch.linalg.LinAlgError:
        return eye.float().clone(), torch.zeros_like(ok)
    return Q.flip(-1).float(), ok


TF32_MASK = -(1 << 13)  # an int32 mask keeping a float32's sign, exponent and top 10 mantissa bits: TF32's


def split_tf32_bmm(A: Tensor, B: Tensor) -> Tensor:
    """``A @ B`` for float32 ``(b, m, k)`` and ``(b, k, n)`` to about float32 accuracy from three products whose
    operands TF32 holds exactly (the 3xTF32 scheme): each operand split as ``hi + lo``, ``hi`` its leading 11
    significant bits and ``lo = x - hi`` (exact), then ``lo_A hi_B + hi_A lo_B + hi_A hi_B`` with float32
    accumulation; the dropped ``lo_A lo_B`` is about ``2^-22`` of the product. Under TF32 matmuls (about 8 times the
    IEEE float32 rate on an H100) that is about 2.7 times faster than one IEEE product; under IEEE matmuls it only
    costs three products."""
    def split(x: Tensor) -> tuple[Tensor, Tensor]:
        hi = (x.view(torch.int32) & TF32_MASK).view(torch.float32)
        return hi, x - hi

    (a_hi, a_lo), (b_hi, b_lo) = split(A.float().contiguous()), split(B.float().contiguous())
    return torch.baddbmm(torch.baddbmm(torch.bmm(a_lo, b_hi), a_hi, b_lo), a_hi, b_hi)


BMM_OUT_DTYPE = hasattr(torch.ops.aten.bmm, "dtype")  # torch.bmm(..., out_dtype): bf16 operands, float32 result


def bf16_bmm(A: Tensor, B: Tensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """``A @ B`` for ``(b, m, k)`` and ``(b, k, n)`` with both operands rounded to bfloat16 (8 significant bits) and
    the products summed in float32; the result in ``out_dtype`` (float32, or bfloat16 for a product that feeds
    another one). On CUDA one bf16 tensor-core product (about twice the TF32 rate on an H100, and half the operand
    bytes); a torch whose ``bmm`` takes no ``out_dtype`` rounds the result to bfloat16 before widening it.
    Elsewhere the rounded operands are multiplied in float32: the same rounding, so CPU results show what the GPU's
    will."""
    A16, B16 = A.to(torch.bfloat16), B.to(torch.bfloat16)
    if A.is_cuda and BMM_OUT_DTYPE and out_dtype == torch.float32:
        return torch.bmm(A16, B16, torch.float32)
    if A.is_cuda:
        return torch.bmm(A16, B16).to(out_dtype)
    return torch.bmm(A16.float(), B16.float()).to(out_dtype)


def rayleigh_quotients(A: Tensor, Q: Tensor, bmm: Callable[[Tensor, Tensor], Tensor] = torch.bmm) -> Tensor:
    """``diag(Q^T A Q)``, the eigenvalue estimates of A's eigenvectors approximated by Q's columns (one product,
    ``bmm``: the current matmul precision, or :func:`split_tf32_bmm`): ``(b, n, n)`` x ``(b, n, n)`` -> ``(b, n)``
    float32."""
    A, Q = A.float(), Q.float()
    return (Q * bmm(A, Q)).sum(dim=-2)


CHOLESKY_LEAF = 128  # inverse_cholesky: blocks this size or smaller are factored directly
TRIANGLE_LEAF = 256  # lower_gram, times_lower_t: blocks this wide or narrower are multiplied whole


def lower_gram(Y: Tensor, leaf: int = TRIANGLE_LEAF, out: Tensor | None = None) -> Tensor:
    """The lower triangle of :math:`Y^\\top Y` for ``Y`` ``(b, m, n)``, by recursive halving of the columns: the
    two diagonal halves recursively, the block below them as one product, nothing above (5/8 of the full product's
    FLOPs at n = 4 ``leaf``). Returns ``(b, n, n)``: every diagonal block of at most ``leaf`` columns whole, the rest
    of the lower triangle, and zeros above it elsewhere. ``out``: where to write it (a view is written in place)."""
    n = Y.shape[-1]
    if out is None:
        out = Y.new_zeros(Y.shape[0], n, n)
    if n <= leaf:
        return torch.bmm(Y.mT, Y, out=out)
    h = n // 2
    lower_gram(Y[..., :h], leaf, out[:, :h, :h])
    torch.bmm(Y[..., h:].mT, Y[..., :h], out=out[:, h:, :h])
    lower_gram(Y[..., h:], leaf, out[:, h:, h:])
    return out


def times_lower_t(X: Tensor, L: Tensor, leaf: int = TRIANGLE_LEAF, out: Tensor | None = None) -> Tensor:
    """:math:`X L^\\top` for ``X`` ``(b, m, n)`` and a lower-triangular ``L`` ``(b, n, n)``, without the
    products of the zeros above L's diagonal: :math:`[X_1 L_{11}^\\top,\\ X_1 L_{21}^\\top + X_2 L_{22}^\\top]`,
    recursively. L's diagonal blocks of at most ``leaf`` rows are read whole (zero above the diagonal there), the
    rest of it below the diagonal only. Returns ``(b, m, n)``, into ``out`` if given."""
    n = L.shape[-1]
    if out is None:
        out = X.new_empty(X.shape[0], X.shape[1], n)
    if n <= leaf:
        return torch.bmm(X, L.mT, out=out)
    h = n // 2
    times_lower_t(X[..., :h], L[:, :h, :h], leaf, out[..., :h])
    times_lower_t(X[..., h:], L[:, h:, h:], leaf, out[..., h:])
    out[..., h:].baddbmm_(X[..., :h], L[:, h:, :h].mT)
    return out


def inverse_cholesky(G: Tensor, leaf: int | None = None) -> tuple[Tensor, Tensor]:
    """:math:`L^{-1}` for :math:`G = L L^\\top` (L lower triangular, diagonal positive), by recursive halving:
    with :math:`L_{11}^{-1}` of the leading half, :math:`L_{21} = G_{21} L_{11}^{-\\top}`, the trailing half's
    :math:`L_{22}^{-1}` of :math:`G_{22} - L_{21} L_{21}^\\top`, and
    :math:`(L^{-1})_{21} = -L_{22}^{-1} L_{21} L_{11}^{-1}`. Blocks of at most ``leaf`` rows (default
    :data:`CHOLESKY_LEAF`) are factored by ``torch.linalg.cholesky_ex`` and inverted by a triangular solve, the rest
    is batched matrix products: a factorization that runs one matrix after another (as torch's does for large
    matrices on CUDA) becomes a few dozen launches over the whole batch. Multiplying by explicit inverses instead
    of solving costs accuracy
    :math:`\\kappa(L)\\,u`; run it in float64.

    G: ``(b, n, n)`` symmetric positive definite, read on and below the diagonal only, and its diagonal blocks of
    at most ``leaf`` rows whole (as :func:`lower_gram` leaves them for a ``leaf`` no larger than its own). Returns
    ``(L^{-1}, ok)``: ``(b, n, n)``, and ``(b,)`` bool, False where a block's factorization failed (G not positive
    definite to working precision, or not finite). No host sync."""
    Linv = G.new_zeros(G.shape)  # the upper triangle stays zero; the halving writes the rest in place
    return Linv, _inverse_cholesky_into(G, Linv, leaf or CHOLESKY_LEAF)


def _inverse_cholesky_into(G: Tensor, out: Tensor, leaf: int) -> Tensor:
    """:func:`inverse_cholesky` of G written into the lower triangle of ``out`` (a view of G's shape, zero above
    the diagonal); returns ``ok``."""
    n = G.shape[-1]
    if n <= leaf:
        L, info = torch.linalg.cholesky_ex(G)
        eye = torch.eye(n, dtype=G.dtype, device=G.device).expand_as(G)
        out.copy_(torch.linalg.solve_triangular(L, eye, upper=False))
        return info == 0
    h = n // 2
    I11, I22 = out[:, :h, :h], out[:, h:, h:]
    ok1 = _inverse_cholesky_into(G[:, :h, :h], I11, leaf)
    L21 = times_lower_t(G[:, h:, :h], I11)
    ok2 = _inverse_cholesky_into(torch.baddbmm(G[:, h:, h:], L21, L21.mT, alpha=-1.0), I22, leaf)
    out[:, h:, :h] = torch.bmm(I22 @ L21, I11).neg_()
    return ok1 & ok2


def cholesky_qr(Y: Tensor, leaf: int | None = None) -> tuple[Tensor, Tensor]:
    """The Q factor of ``Y = QR`` with R's diagonal positive, by CholeskyQR in float64 with a Newton–Schulz
    correction: :math:`Q = Y L^{-\\top}` with :math:`Y^\\top Y = L L^\\top` (:func:`inverse_cholesky`), whose
    orthogonality error :math:`E = I - Q^\\top Q` is about :math:`u \\kappa(Y)^2` (Fukaya et al., SIAM J. Sci.
    Comput. 42(1), 2020), then :math:`Q \\leftarrow Q (I + E / 2)`, which leaves an error of order :math:`E^2`.
    The products that set the accuracy (the Gram matrices, the inverse factor, :math:`Y L^{-\\top}`) run in
    float64; the correction's product :math:`Q E` in float32 at the current matmul precision (it is of the size of
    E). Q differs from the exact factor by order E (about 1e-4 at :math:`\\kappa(Y) = 10^6`): a rotation that
    small, which a power step does not see. The Gram matrix and :math:`Y L^{-\\top}` skip the blocks of the
    triangles they need not compute (:func:`lower_gram`, :func:`times_lower_t`: 5/8 of their FLOPs at n = 1024).

    Y: ``(b, m, n)``, m >= n, any float dtype. Returns ``(Q, ok)``: ``Q`` ``(b, m, n)`` float32; ``ok`` ``(b,)``
    bool, False where the factorization failed or left Q farther than 1e-2 (Frobenius) from orthogonal before the
    correction (Y rank-deficient or too ill-conditioned for float64, about :math:`\\kappa(Y) > 10^7`, or not
    finite), and there Q is not usable. No host sync."""
    Y = Y.double()
    leaf = leaf or CHOLESKY_LEAF
    Linv, ok = inverse_cholesky(lower_gram(Y, max(leaf, TRIANGLE_LEAF)), leaf)
    Q = times_lower_t(Y, Linv)
    E = torch.baddbmm(torch.eye(Q.shape[-1], dtype=Q.dtype, device=Q.device), Q.mT, Q, alpha=-1.0)  # I - Q^T Q
    ok &= torch.linalg.matrix_norm(E) < 1e-2
    Q = Q.float()
    Q = torch.baddbmm(Q, Q, E.float(), alpha=0.5)
    return Q, ok & finite_matrices(Q)


def refresh_eigenbasis(A: Tensor, Q: Tensor, shift: float = REFRESH_SHIFT,
                       bmm: Callable[[Tensor, Tensor], Tensor] = torch.bmm) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One QR power-iteration step towards the eigenvectors of A, from the previous basis Q.

    A: ``(b, n, n)`` symmetric positive semi-definite; Q: ``(b, n, n)`` orthogonal. Returns
    ``(Q_new, order, ok, estimates)``:

    - ``order`` ``(b, n)`` int64: the columns of Q sorted by descending :math:`\\operatorname{diag}(Q^\\top A Q)`;
      column j of ``Q_new`` continues column ``order[j]`` of Q (permute anything stored in Q's coordinates, such
      as SOAP's second moment, by ``order``).
    - ``Q_new`` ``(b, n, n)`` float32: the Q factor, with R's diagonal positive (a converged basis maps to
      itself), of :math:`(A + s I)\\,Q[:, \\mathrm{order}]`, by :func:`cholesky_qr` (to order 1e-4). The shift
      :math:`s = \\text{shift} \\cdot \\max_j (Q^\\top A Q)_{jj}` leaves the eigenvectors as they are and bounds the
      product's condition number by about 1/shift, which CholeskyQR needs; it slows the step's convergence only
      among eigenvalues below s.
    - ``ok`` ``(b,)`` bool: False where A or the result is not finite or the factorization failed; there
      ``Q_new`` is ``Q`` (unsorted) and ``order`` the identity permutation. No host sync.
    - ``estimates`` ``(b, n)`` float32: the eigenvalue estimates :math:`\\operatorname{diag}(Q^\\top A Q)` in
      ``order``, one for each column of ``Q_new``. They are the Rayleigh quotients of the columns the power step
      started from, which differ from those of ``Q_new``'s by the square of the step's rotation (a Rayleigh
      quotient is stationary at an eigenvector), and they cost no product beyond the power step's own.

    The product AQ is ``bmm``'s (the current matmul precision, or :func:`split_tf32_bmm`); the factorization runs
    mostly in float64.
    """
    _check_square(A, "refresh_eigenbasis")
    A, Q = A.float(), Q.float()
    n = A.shape[-1]
    AQ = bmm(A, Q)
    est = (Q * AQ).sum(dim=-2)  # (b, n): diag(Q^T A Q)
    order = est.argsort(dim=-1, descending=True)  # (b, n)
    idx = order[:, None, :].expand(-1, n, -1)
    s = shift * est.amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)  # (b,)
    Y = torch.gather(torch.addcmul(AQ, Q, s[:, None, None]), -1, idx)  # (A + s I) Q, columns sorted
    Q_new, ok = cholesky_qr(Y)
    ok &= finite_matrices(A)
    order = torch.where(ok[:, None], order, torch.arange(n, device=A.device).expand_as(order))
    return torch.where(ok[:, None, None], Q_new, Q), order, ok, torch.gather(est, -1, order)
