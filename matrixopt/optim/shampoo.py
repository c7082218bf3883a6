r"""Shampoo: Kronecker-factored preconditioning, with Adam grafting so AdamW learning rates transfer.

For each matrix block G (``(m, n)``; see *Blocks* below) at step t (Gupta et al., arXiv:1802.09568; Anil et al.,
arXiv:2002.09018; Shi et al., arXiv:2309.06497):

.. math::
    L_t = \beta_L L_{t-1} + (1 - \beta_L) G G^\top, \qquad R_t = \beta_L R_{t-1} + (1 - \beta_L) G^\top G
    \qquad (\beta_L = 1:\ \text{plain sums})

    B_t = \beta_1 B_{t-1} + (1 - \beta_1) G, \qquad D = \mathrm{nesterov}\ ?\ (1 - \beta_1) G + \beta_1 B_t : B_t

    S = \hat L^{-1/r} D \hat R^{-1/r}, \qquad
    A = \frac{D / (1 - \beta_1^t)}{\sqrt{V_t / (1 - \beta_2^t)} + \epsilon}, \quad
    V_t = \beta_2 V_{t-1} + (1 - \beta_2) G^2

    U = \frac{\|A\|_F}{\|S\|_F} S \ \ (\text{grafting} = \text{"adam"}) \quad\text{or}\quad U = S\ \ (\text{"none"}),
    \qquad W_t = (1 - \eta\lambda) W_{t-1} - \eta U

``r`` is ``inverse_root`` (4: the standard :math:`-1/4` on each side of a matrix). The roots
:math:`\hat L^{-1/r}, \hat R^{-1/r}` are recomputed every ``precondition_frequency`` steps from step
``start_preconditioning_step`` on, by :func:`matrixopt.linalg.roots.inverse_root` (coupled Newton in fp32,
float64 eigh fallback, damping ``damping`` relative to the largest eigenvalue); the stale roots serve in between.
``root_method="eigenbasis"`` tracks each factor's eigenbasis instead, as SOAP does: float64 ``eigh`` at the first
root, then one QR power-iteration step per refresh from the previous basis
(:func:`matrixopt.linalg.roots.refresh_eigenbasis`), and the root
:math:`Q \operatorname{diag}((d + \epsilon \max d)^{-1/r}) Q^\top` with d the eigenvalue estimates (clamped at 0):
at the first root eigh's basis' :math:`\operatorname{diag}(Q^\top L Q)`, then the Rayleigh quotients the power step
computes of the columns it starts from, which differ from the new basis' by the square of the step's rotation.
Its roots are those of the basis at hand, which lags the factor's eigenvectors where eigenvalues
are close; a refresh costs about a sixth of the Newton iteration's on an H100 (two products and a float64
CholeskyQR per factor, :func:`matrixopt.linalg.roots.cholesky_qr`, against about 80 fp32 products), and the bases
take another ``4 (m^2 + n^2) / (m n)`` bytes per parameter.
Before ``start_preconditioning_step`` the update is the grafted Adam update A (or D without grafting).

Grafting (Agarwal et al., arXiv:2002.11803) gives each block the Frobenius norm of the Adam update, so Shampoo
takes the step size of Adam and an AdamW learning rate works as is; Shampoo only chooses the direction.

Blocks. A parameter is seen as matrices as in Muon (conv kernels flattened, experts, splits; see
:mod:`matrixopt.optim.layout`). A matrix dim above ``max_preconditioner_dim`` is cut into
``ceil(dim / max_preconditioner_dim)`` near-equal blocks; each block has its own factors (and graft norm).
With ``one_sided_ratio``, a matrix whose long side exceeds ``one_sided_ratio`` times its short side is
preconditioned on its short side only, with :math:`L^{-2/r}` (the same degree, -1, in the gradient's scale).

Same-size work is batched: factor updates and preconditioning over the blocks of one shape, roots over the
factors of one size, each in batches of at most :data:`matrixopt.optim.layout.BUCKET_NUMEL` values per stacked
operand (:func:`~matrixopt.optim.layout.capped_runs`), so the workspace stays bounded however many blocks a
model has. Factors and roots are stored in ``factor_dtype`` (float32, or bfloat16 to halve their memory); the
math is fp32.

Matrix products on CUDA (``matmul_precision``). ``"fp32"`` (default) runs the optimizer's products in IEEE fp32,
whatever torch's global setting is; ``"tf32"`` runs the factor products :math:`GG^\top, G^\top G` and the
preconditioning :math:`\hat L^{-1/r} D \hat R^{-1/r}` on TF32 tensor cores (inputs rounded to 10 mantissa bits, fp32
accumulation; about 8 times the fp32 rate on an H100). That is the factor of a gradient perturbed by :math:`2^{-11}`
relative per entry, and a preconditioned block off by about 3e-4 relative (measured at n = 512), less than bfloat16
storage of the roots (``factor_dtype``) already costs. With ``root_method="eigenbasis"`` it also runs the root's product
:math:`Q \operatorname{diag}(s) Q^\top` in TF32 (its operands rounded as the preconditioning's are), while the product
:math:`LQ` of the refresh's power step, which gives the basis and the eigenvalue estimates d and on which the small
eigenvalues depend, keeps float32 accuracy through three TF32 products (:func:`matrixopt.linalg.roots.split_tf32_bmm`):
one TF32 product there rounds :math:`LQ` by about 5e-4 of the largest eigenvalue, which swamps the eigenvalues below it
and mixes their eigenvectors, whose inverse roots are the largest (with the power step in one TF32 product the root was
23% off at condition number 1e6 on an H200, against 5e-4 in float32). The Newton roots always run in fp32: the coupled
Newton iteration does not survive TF32 products (simulated at n = 512: its residual stalls near 8e-4, above the 1e-5
tolerance, so every root would take the float64 fallback; the root is 2.5% off at condition number 1e4 and
50% off at 1e6). ``"bf16"`` runs the factor products and the preconditioning from bfloat16 operands summed in
float32 (:func:`step_product`: one bf16 tensor-core product, twice the TF32 rate, on CUDA; the same rounding
emulated in float32 elsewhere) and everything else as ``"tf32"``: the preconditioned block off by about 3e-3
relative (the roots rounded to bfloat16 for the product, as ``factor_dtype=torch.bfloat16`` stores them).
The setting is scoped (:func:`cuda_matmul_precision`): torch's own is restored after each step, also on an
exception, so the model's products never see it. CPU products are fp32 under ``"fp32"`` and ``"tf32"``.

Memory per matrix parameter of a block ``(m, n)`` with both factors, besides the parameter and its gradient:
state ``8 + 8 (m^2 + n^2) / (m n)`` bytes in float32 (momentum, the graft's second moment, two factors and two
roots: 24 bytes for a square block; ``factor_dtype=torch.bfloat16`` makes the factor part half, 16 bytes for a
square block). A step's workspace is three float32 tensors of the parameter's shape (Nesterov momentum, Adam
direction, update: 12 bytes) plus a few stacked batches, bounded as above. A synchronous refresh computes and
installs one batch at a time; with ``side_stream`` every factor's fp32 snapshot and new root are held from one
refresh to the next (another ``8 (m^2 + n^2) / (m n)`` bytes, 16 for a square block).
A failed root (see :class:`matrixopt.linalg.roots.RootResult`) keeps the previous root; roots that needed the
float64 fallback are counted in ``root_fallbacks`` and failed ones in ``root_failures``. A non-finite factor
contribution (fp32 overflow of :math:`GG^\top`) is dropped, and a non-finite preconditioned block falls back to
the Adam update, so no NaN reaches the weights or the state.

``side_stream=True`` (CUDA): each refresh launches the root computation on a side CUDA stream, where it
overlaps the following forward/backward passes, and installs the results at the next refresh (one refresh
late); the first refresh, and the first after a ``load_state_dict``, is synchronous. Results still in flight are
not part of ``state_dict()``. On CPU the option is accepted and every refresh is synchronous.

``stagger_refresh=True``: every root is computed at ``start_preconditioning_step`` (SOAP: every eigenbasis at the
first step), and after that each parameter's roots are recomputed every ``precondition_frequency`` steps from its
own phase, the group's parameters packed into the ``precondition_frequency`` phases by the cost of their
refreshes (:meth:`KroneckerOptimizer._phase`). Each step then refreshes about ``1 / precondition_frequency`` of
the roots instead of one step in ``precondition_frequency`` refreshing all of them: the same work, no step that
stalls for it, and under data parallelism (each matrix's state on one owner rank) no rank that waits for another's
refresh. The phases depend on the group's parameter list only, so the FSDP2 optimizers
(:mod:`matrixopt.distributed.sharded_precond`) step exactly as this one does, and spread each step's refreshes
over their owners; under layer-wise training each owner packs the phases of the matrices it owns (the same work
per step, on a schedule of its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from matrixopt.kernels import muon_elementwise
from matrixopt.linalg.roots import (
    InverseRootConfig,
    bf16_bmm,
    eigenbasis,
    fall_back,
    finite_matrices,
    inverse_root,
    newton_inverse_root,
    rayleigh_quotients,
    refresh_eigenbasis,
    split_tf32_bmm,
)
from matrixopt.optim.adam import adam_direction, adam_moments_, ema_
from matrixopt.optim.base import (
    MatrixOptimizer,
    _check_finite,
    adamw_group_defaults,
    check_betas,
    check_decay,
    check_lr,
)
from matrixopt.optim.layout import capped_runs, lpt, matrix_pieces
from matrixopt.optim.nonfinite import sanitized
from matrixopt.optim.offload import Offload

GRAFTINGS = ("adam", "none")
ROOT_METHODS = ("newton", "eigenbasis")
FACTOR_DTYPES = (torch.float32, torch.bfloat16)
FACTOR_DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # what a command line passes
MATMUL_PRECISIONS = ("fp32", "tf32", "bf16")


@contextlib.contextmanager
def cuda_matmul_precision(precision: str) -> Iterator[None]:
    """Run the block's float32 CUDA matrix products in ``precision``: ``"fp32"`` (IEEE) or ``"tf32"`` (TF32 tensor
    cores; also for ``"bf16"``, whose bfloat16 products are explicit, :func:`step_product`), then restore torch's
    setting as it was, also on an exception. The setting is torch's process-wide one
    (it has no per-thread setting), so it holds for any thread's CUDA products while the block runs; CPU products
    are unaffected. Uses ``torch.backends.cuda.matmul.fp32_precision`` where torch has it (2.9 and later; setting
    the legacy ``allow_tf32`` there would make torch refuse to read a state mixed from the two), else
    ``allow_tf32``."""
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"Invalid matmul_precision: {precision!r} (use one of {MATMUL_PRECISIONS})")
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        name, value = "fp32_precision", "ieee" if precision == "fp32" else "tf32"
    else:
        name, value = "allow_tf32", precision != "fp32"
    saved = getattr(matmul, name)
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, saved)


def _operand_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


def step_product(A: Tensor, B: Tensor, precision: str, inner: bool = False) -> Tensor:
    """``A @ B`` of a step's stacks (``(b, m, k)`` and ``(b, k, n)``: factor products, preconditioning, rotations)
    in the group's ``matmul_precision``: for ``"bf16"`` bfloat16 operands summed in float32
    (:func:`~matrixopt.linalg.roots.bf16_bmm`, also on CPU); else a float32 product under the scoped setting
    (:func:`cuda_matmul_precision`). The result is float32, or, for an ``inner`` product that feeds another one,
    in the operands' dtype (:func:`step_operands`)."""
    if precision == "bf16":
        return bf16_bmm(A, B, _operand_dtype(precision) if inner else torch.float32)
    return A.float() @ B.float()


def step_operands(tensors: list[Tensor], precision: str) -> Tensor:
    """``tensors`` (matrices of one shape: state matrices, or blocks of larger tensors) stacked ``(b, m, n)`` as the
    step's products take them: bfloat16 for ``matmul_precision="bf16"`` (rounded once for all of a stack's
    products), else float32; converted while stacked, one launch on the GPU
    (:func:`~matrixopt.kernels.muon_elementwise.copy_matrices`)."""
    out = torch.empty((len(tensors), *tensors[0].shape), dtype=_operand_dtype(precision), device=tensors[0].device)
    muon_elementwise.copy_matrices(out, tensors)
    return out


def resolve_factor_dtype(value: Any) -> Any:
    """``"fp32"`` / ``"bf16"`` as torch dtypes; anything else as it is (validated with the group)."""
    return FACTOR_DTYPE_NAMES.get(value, value) if isinstance(value, str) else value


# ----------------------------------------------------------------------------------------------- blocks
@dataclass(frozen=True)
class Block:
    """Rows ``r0:r1`` and columns ``c0:c1`` of matrix piece ``piece`` of a parameter (of expert ``expert`` for
    stacked experts). ``left`` / ``right``: whether the block has a left (rows) / right (columns) factor."""

    piece: int
    expert: int | None
    r0: int
    r1: int
    c0: int
    c1: int
    left: bool
    right: bool
    grid: tuple[int, int | None, int | None] | None = None
    """On the first block of each piece of a :func:`block_plan`: the piece's block count (all experts), and the
    block height and width where every block of the piece has the same ones (else None), which
    :func:`block_views` then cuts by one view instead of one slice per block."""

    @property
    def key(self) -> tuple[int, int, bool, bool]:
        """Blocks with equal keys are batched together."""
        return self.r1 - self.r0, self.c1 - self.c0, self.left, self.right


def split_dim(d: int, max_dim: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges cutting ``d`` into ``ceil(d / max_dim)`` pieces whose sizes differ by at most 1."""
    k = -(-d // max_dim)
    bounds = [d * i // k for i in range(k + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def block_plan(p: Tensor, max_dim: int, one_sided_ratio: float | None) -> list[Block]:
    """The blocks of parameter ``p``: each matrix piece cut along every preconditioned dim above ``max_dim``
    (pieces in order, each piece's experts in order, each matrix's blocks row-major)."""
    out = []
    for i, piece in enumerate(matrix_pieces(p, p.detach())):
        m, n = piece.shape[-2:]
        left = right = True
        if one_sided_ratio is not None and max(m, n) > one_sided_ratio * min(m, n):
            left, right = m <= n, m > n
        rows = split_dim(m, max_dim) if left else [(0, m)]
        cols = split_dim(n, max_dim) if right else [(0, n)]
        experts = range(piece.shape[0]) if piece.ndim == 3 else [None]
        heights, widths = {r1 - r0 for r0, r1 in rows}, {c1 - c0 for c0, c1 in cols}
        even = len(heights) == 1 and len(widths) == 1
        grid = (len(experts) * len(rows) * len(cols), heights.pop() if even else None, widths.pop() if even else None)
        first = len(out)
        for e in experts:
            out += [Block(i, e, r0, r1, c0, c1, left, right) for r0, r1 in rows for c0, c1 in cols]
        out[first] = dataclasses.replace(out[first], grid=grid)
    return out


def block_views(p: Tensor, plan: list[Block], t: Tensor) -> list[Tensor]:
    """Views of ``t`` (shaped like ``p``, contiguous when written through) as the blocks of ``plan``. An evenly cut
    piece (its first block's :attr:`Block.grid`) is cut by one view (a step takes these views several times per
    parameter, so the host's time per block counts); other blocks are sliced one by one."""
    pieces = matrix_pieces(p, t)
    out: list[Tensor] = []
    start = 0
    while start < len(plan):
        b = plan[start]
        count, r, c = b.grid if b.grid is not None else (1, None, None)
        if r is None:
            for b in plan[start:start + count]:
                x = pieces[b.piece] if b.expert is None else pieces[b.piece][b.expert]
                out.append(x[b.r0:b.r1, b.c0:b.c1])
        else:
            x = pieces[b.piece]
            m, n = x.shape[-2:]
            grid = x.view(*x.shape[:-2], m // r, r, n // c, c).transpose(-3, -2)  # ([E,] R, C, r, c)
            mats = grid.unbind(0) if grid.ndim == 5 else (grid,)
            out += [v for g in mats for row in g.unbind(0) for v in row.unbind(0)]
        start += count
    return out


class Layout:
    """The blocks of a list of parameters, and which of them share a shape. ``entries[j] = (i, k, block)``: block
    k of parameter i; ``buckets[key]``: the entry indices of blocks with that :attr:`Block.key`."""

    def __init__(self, plans: list[list[Block]]) -> None:
        self.entries = [(i, k, b) for i, plan in enumerate(plans) for k, b in enumerate(plan)]
        self.buckets: dict[tuple[int, int, bool, bool], list[int]] = defaultdict(list)
        for j, (_, _, b) in enumerate(self.entries):
            self.buckets[b.key].append(j)

    def runs(self, params: set[int] | None = None) -> Iterator[tuple[tuple[int, int, bool, bool], list[tuple]]]:
        """``(key, entries)`` per batch of same-key blocks (of the parameter indices ``params``; default all), in
        :func:`capped_runs` of a ``(m, n)`` block standing for ``max(m, n)^2`` values, its largest stacked operand
        (a factor, a root or an eigenbasis): a batch's stacks stay within :data:`~matrixopt.optim.layout.BUCKET_NUMEL`
        values each."""
        for key, idx in self.buckets.items():
            ents = [self.entries[j] for j in idx if params is None or self.entries[j][0] in params]
            for run in capped_runs(ents, max(key[0], key[1]) ** 2):
                yield key, run


def finite_blocks(X: Tensor) -> Tensor:
    """``(b, 1, 1)`` bool: whether each block of ``(b, m, n)`` float32 ``X`` is finite, judged by its sum
    (:func:`~matrixopt.linalg.roots.finite_matrices`)."""
    return finite_matrices(X)[:, None, None]


def accumulate(factors: list[Tensor], GG: Tensor, beta: float, live: Tensor | None = None) -> None:
    """``F = beta F + (1 - beta) GG`` (``F += GG`` for beta = 1) for each factor; a block of GG that is not finite
    (:func:`finite_blocks`) contributes nothing. factors: b tensors ``(d, d)``; GG: ``(b, d, d)`` float32.
    ``live``: an optional 0-d float32 device flag, 0 for a skipped step, which leaves the factors as they were
    (GG, whatever it holds, then counts as zero; the average as :func:`~matrixopt.optim.adam.ema_` takes it).
    float32 factors on the GPU take one pass (:func:`matrixopt.kernels.muon_fused.factor_ema_triton`)."""
    fused = muon_elementwise.fused_for(factors, GG)
    if fused is not None:  # one pass (12 bytes per element instead of 28)
        fused.factor_ema_triton(factors, GG, finite_blocks(GG).flatten(), 1.0 if beta == 1.0 else 1.0 - beta,
                                live, sum_=beta == 1.0)
        return
    ok = finite_blocks(GG) if live is None else finite_blocks(GG) & (live > 0)
    GG = list(torch.where(ok, GG, 0.0).to(factors[0].dtype).unbind(0))
    if beta == 1.0:
        torch._foreach_add_(factors, GG)
    else:
        ema_(factors, GG, 1.0 - beta, live)


# ----------------------------------------------------------------------------------------------- shared base
class KroneckerOptimizer(MatrixOptimizer):
    """What Shampoo and SOAP share: hyperparameter checks, block plans and layouts, Kronecker factor updates,
    and the side-stream schedule of refreshes. Subclasses implement ``_init_state`` and the update."""

    matrix_flag = "use_shampoo"

    def __init__(self, params: Iterable[Any], matrix_defaults: dict[str, Any], adamw_defaults: dict[str, Any],
                 *, skip_nonfinite: bool = False, deferred_nonfinite: bool = False, state_dtype: Any = None,
                 offload: str | Offload | None = None) -> None:
        self.root_fallbacks = 0  # roots or eigenbases that needed the float64 fallback
        self.root_failures = 0  # roots or eigenbases that could not be computed (the previous one was kept)
        self._plans: dict[int, list[Block]] = {}
        self._phases: dict[int, tuple[int, int]] = {}  # id(param) -> (precondition_frequency, its refresh phase)
        self._layouts: dict[tuple[int, ...], Layout] = {}
        self._pending: dict[int, Any] = {}  # group index -> side-stream refresh in flight
        self._operand_cache: dict[tuple, tuple] = {}  # the step's kept stacks (_step_stack)
        self._stacks_used: set[tuple] = set()  # the keys of those the current group step took
        self._later: list[Callable[[], None]] = []  # refreshes that follow the current group step's updates
        self._view_cache: dict[tuple[int, str], tuple[Tensor, list[Tensor]]] = {}  # _state_views
        self._side_streams: dict[torch.device, Any] = {}
        super().__init__(params, matrix_defaults, adamw_defaults, skip_nonfinite=skip_nonfinite,
                         deferred_nonfinite=deferred_nonfinite, state_dtype=state_dtype, offload=offload)

    def __getstate__(self) -> dict[str, Any]:
        return super().__getstate__() | {"root_fallbacks": self.root_fallbacks, "root_failures": self.root_failures}

    @property
    def root_failures(self) -> int:
        """Roots or eigenbases that could not be computed (the previous ones were kept). Counted on the device where
        a refresh runs without a host sync: reading this syncs."""
        if self._failures_on_device is not None:
            self._root_failures += int(self._failures_on_device)
            self._failures_on_device = None
        return self._root_failures

    @root_failures.setter
    def root_failures(self, value: int) -> None:
        self._root_failures, self._failures_on_device = value, None

    def _count_failures(self, failed: Tensor) -> None:
        """Add the ``(b,)`` bool ``failed`` to :attr:`root_failures` without a host sync."""
        n = failed.sum()
        self._failures_on_device = n if self._failures_on_device is None else self._failures_on_device + n

    def _installable(self, ok: Tensor, live: Tensor | None) -> Tensor:
        """Which of a refresh's ``(b,)`` results to write: those computed (``ok``), none on a step skipped on the
        device (``live`` 0). The failures are counted, a skipped step's not."""
        if live is not None:
            ok, skipped = ok | (live == 0), live == 0
            self._count_failures(~ok)
            return ok & ~skipped
        self._count_failures(~ok)
        return ok

    def _state_chunks(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor]) -> list[list[int]]:
        """A matrix group's compact or offloaded state moves as one chunk: its refreshes are scheduled per group
        step and its factor updates and roots batched over the whole group, which a split step would change."""
        if group[self.matrix_flag]:
            return [list(range(len(params)))]
        return super()._state_chunks(group, params, grads)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Caches keyed by parameter identity, streams and refreshes in flight do not survive a pickle."""
        failures = state.pop("root_failures", None)  # a property: not an entry of __dict__
        state.pop("_root_failures", None), state.pop("_failures_on_device", None)
        super().__setstate__(state)
        if failures is not None or "_root_failures" not in self.__dict__:
            self.root_failures = failures or 0
        self._plans, self._phases, self._layouts, self._pending, self._side_streams = {}, {}, {}, {}, {}
        self._operand_cache, self._stacks_used, self._view_cache, self._later = {}, set(), {}, []
        for group in self.param_groups:  # pickled before these options existed
            if group[self.matrix_flag]:
                group.setdefault("matmul_precision", "fp32")
                group.setdefault("stagger_refresh", False)

    # group options newer than some saved state dicts: loading one without them keeps this optimizer's values
    _added_options = ("weight_decay_mode", "matmul_precision", "stagger_refresh")

    # ----------------------------------------------------------------------------------- validation
    def _validate_matrix_group(self, group: dict[str, Any]) -> None:
        check_lr(group["lr"])
        check_betas(group["betas"])
        sb = group["shampoo_beta"]
        if sb is not None:
            _check_finite("shampoo_beta", sb)
            if not 0.0 <= sb <= 1.0:
                raise ValueError(f"Invalid shampoo_beta: {sb} (must be in [0, 1]; 1 sums the factors; None uses "
                                 f"betas[1])")
        _check_finite("eps", group["eps"])
        if group["eps"] < 0:
            raise ValueError(f"Invalid eps value: {group['eps']} (must be >= 0.0)")
        check_decay(group)
        _check_finite("damping", group["damping"])
        if not 0.0 <= group["damping"] < 1.0:
            raise ValueError(f"Invalid damping: {group['damping']} (relative to the largest eigenvalue; must be in "
                             f"[0, 1))")
        for name in ("precondition_frequency", "max_preconditioner_dim"):
            v = group[name]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Invalid {name}: {v!r} (must be an int >= 1)")
        r = group["one_sided_ratio"]
        if r is not None and (not isinstance(r, int | float) or not math.isfinite(r) or r < 1):
            raise ValueError(f"Invalid one_sided_ratio: {r!r} (must be None or a finite number >= 1)")
        if group["factor_dtype"] not in FACTOR_DTYPES:
            raise ValueError(f"Invalid factor_dtype: {group['factor_dtype']!r} (use torch.float32 or torch.bfloat16, "
                             f"or 'fp32' or 'bf16')")
        for name in ("side_stream", "stagger_refresh"):
            if not isinstance(group[name], bool):
                raise ValueError(f"Invalid {name}: {group[name]!r} (must be True or False)")
        if group["side_stream"] and group["stagger_refresh"]:
            raise ValueError("side_stream and stagger_refresh both keep the refreshes from stalling a step (one "
                             "overlaps each refresh with the next steps, the other spreads the refreshes over the "
                             "steps between two refreshes); set one of them")
        if group["matmul_precision"] not in MATMUL_PRECISIONS:
            raise ValueError(f"Invalid matmul_precision: {group['matmul_precision']!r} (use one of "
                             f"{MATMUL_PRECISIONS}: the precision of the optimizer's float32 matrix products on CUDA)")

    # ----------------------------------------------------------------------------------- blocks and state
    def _block_plan(self, group: dict[str, Any], p: Tensor) -> list[Block]:
        """The blocks of ``p`` under the group's ``max_preconditioner_dim`` and ``one_sided_ratio`` (not cached)."""
        return block_plan(p, group["max_preconditioner_dim"], group["one_sided_ratio"])

    def _plan(self, group: dict[str, Any], p: Tensor) -> list[Block]:
        plan = self._plans.get(id(p))
        if plan is None:
            plan = self._plans[id(p)] = self._block_plan(group, p)
        return plan

    def _layout(self, group: dict[str, Any], params: list[Tensor]) -> Layout:
        key = tuple(id(p) for p in params)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = Layout([self._plan(group, p) for p in params])
        return layout

    def _state(self, group: dict[str, Any], p: Tensor) -> dict[str, Any]:
        st = self.state[p]
        if not st:
            st["step"] = 0
            self._init_state(group, st, p)
        return st

    def _init_state(self, group: dict[str, Any], st: dict[str, Any], p: Tensor) -> None:
        raise NotImplementedError

    def _init_factors(self, group: dict[str, Any], st: dict[str, Any], p: Tensor,
                      inverse: str) -> list[tuple[str, int, int]]:
        """For each side of each block k of ``p``: a zero factor ``{side}{k}`` and an identity
        ``{side}_{inverse}{k}`` (its root or eigenbasis), ``(d, d)`` in ``factor_dtype``. Returns their
        ``(side, k, d)``."""
        dt = group["factor_dtype"]
        made = []
        for k, b in enumerate(self._plan(group, p)):
            for side, d in (("left", b.r1 - b.r0), ("right", b.c1 - b.c0)):
                if getattr(b, side):
                    st[f"{side}{k}"] = torch.zeros(d, d, dtype=dt, device=p.device)
                    st[f"{side}_{inverse}{k}"] = torch.eye(d, dtype=dt, device=p.device)
                    made.append((side, k, d))
        return made

    @staticmethod
    def _shampoo_beta(group: dict[str, Any]) -> float:
        return group["betas"][1] if group["shampoo_beta"] is None else group["shampoo_beta"]

    def _update_factors(self, group: dict[str, Any], layout: Layout, states: list[dict[str, Any]],
                        gviews: list[list[Tensor]], live: Tensor | None = None) -> None:
        """``L = EMA(G G^T)``, ``R = EMA(G^T G)`` for every block, batched by shape (:meth:`Layout.runs`)."""
        beta, precision = self._shampoo_beta(group), group["matmul_precision"]
        for key, ents in layout.runs():
            G = step_operands([gviews[i][k] for i, k, _ in ents], precision)
            self._accumulate_factors(states, ents, G, key, beta, precision, live)

    @staticmethod
    def _accumulate_factors(states: list[dict[str, Any]], ents: list[tuple[int, int, Block]], G: Tensor,
                            key: tuple[int, int, bool, bool], beta: float, precision: str,
                            live: Tensor | None = None) -> None:
        """``L = EMA(G G^T)``, ``R = EMA(G^T G)`` for one run's stack ``G (b, m, n)`` of blocks sharing ``key``,
        the products in ``precision`` (:func:`step_product`; ``live``: see :func:`accumulate`)."""
        _, _, left, right = key
        if left:
            accumulate([states[i][f"left{k}"] for i, k, _ in ents], step_product(G, G.mT, precision), beta, live)
        if right:
            accumulate([states[i][f"right{k}"] for i, k, _ in ents], step_product(G.mT, G, precision), beta, live)

    def _step_stack(self, group: dict[str, Any], params: list[Tensor], states: list[dict[str, Any]],
                    ents: list[tuple[int, int, Block]], name: str) -> Tensor:
        """The state matrices ``{name}{k}`` of a run's blocks ``ents`` (``(i, k, block)``: block k of
        ``params[i]``, one block shape) stacked as the step's products take them (:func:`step_operands`, in the
        group's ``matmul_precision``), for matrices that change only when a refresh installs new ones (SOAP's
        eigenbases, Shampoo's roots). The stack is kept between steps, and at each step only the matrices written
        since (torch's version counters, which every in-place write bumps) or replaced are copied into it again:
        with the refreshes staggered, about one in ``precondition_frequency``. It costs the stacks' memory (the
        bases or roots again, in the operands' dtype); staged state (compact or offloaded: new tensors at every
        step) is stacked each time and not kept, and so is everything under ``torch.compile``, whose graph holds
        the stacking. Read only: the products never write it.

        A stack is kept per group, name and run, a run known by its first block (a bucket of one block shape is cut
        into several runs); a run that starts there with other blocks replaces it, and the stacks a group's step
        did not take are dropped at its end (:meth:`_drop_unused_stacks`), so what is kept is what the last step
        used."""
        precision = group["matmul_precision"]
        tensors = [states[i][f"{name}{k}"] for i, k, _ in ents]
        if self.state_dtype is not None or self.offload is not None or torch.compiler.is_compiling():
            return step_operands(tensors, precision)
        blocks = tuple((id(params[i]), k) for i, k, _ in ents)
        key = (id(group), name, precision, blocks[0])
        self._stacks_used.add(key)
        kept = self._operand_cache.get(key)
        if kept is None or kept[0] != blocks or kept[3].shape[1:] != tensors[0].shape:
            self._operand_cache.pop(key, None)  # the old stack's memory first
            stack = step_operands(tensors, precision)
        else:
            _, old, seen, stack = kept
            stale = [j for j, (a, b, v) in enumerate(zip(old, tensors, seen)) if a is not b or v != b._version]
            if stale:
                muon_elementwise.copy_matrices([stack[j] for j in stale], [tensors[j] for j in stale])
        self._operand_cache[key] = (blocks, tensors, [t._version for t in tensors], stack)
        return stack

    def _state_views(self, group: dict[str, Any], p: Tensor, st: dict[str, Any], name: str) -> list[Tensor]:
        """:func:`block_views` of the state tensor ``st[name]`` of ``p`` (a moment, written in place step after
        step), kept while that tensor is the state's: a step takes each block's view without making it again
        (hundreds of blocks a step; the host's time per view counts). Staged state (compact or offloaded: new
        tensors at every step) and steps under ``torch.compile`` make them anew each time."""
        t = st[name]
        kept = self._view_cache.get((id(p), name))
        if kept is not None and kept[0] is t:
            return kept[1]
        views = block_views(p, self._plan(group, p), t)
        if self.state_dtype is None and self.offload is None and not torch.compiler.is_compiling():
            self._view_cache[id(p), name] = (t, views)
        return views

    def _drop_unused_stacks(self, group: dict[str, Any]) -> None:
        """Drop the kept stacks (:meth:`_step_stack`) of ``group`` that its step just ended did not take."""
        for key in [k for k in self._operand_cache if k[0] == id(group) and k not in self._stacks_used]:
            del self._operand_cache[key]

    # ----------------------------------------------------------------------------------- refresh schedule
    def _refresh(self, gi: int, group: dict[str, Any], runs: list[Callable[[bool], Any]],
                 install: Callable[[Any], None]) -> None:
        """Run one refresh in batches. ``run(sync)`` computes one batch from a snapshot of its factors (with host
        syncs allowed when ``sync``) and returns its result; ``install(result)`` writes that into the state.
        Synchronous unless ``side_stream`` is set and the parameters are on CUDA: each batch is installed as soon as
        it is computed, so one batch's workspace and results are alive at a time. With the side stream, the previous
        refresh's results are installed and this one's batches launched on a side stream, their results held until
        the next refresh (the first refresh, with nothing in flight, also runs synchronously)."""
        device = group["params"][0].device
        if not (group["side_stream"] and device.type == "cuda"):
            for run in runs:
                install(run(True))
            return
        pending = self._pending.pop(gi, None)
        if pending is None:
            for run in runs:
                install(run(True))
        else:
            event, results = pending
            torch.cuda.current_stream(device).wait_event(event)
            for result in results:
                install(result)
        side = self._side_streams.get(device)
        if side is None:
            side = self._side_streams[device] = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            results = [run(False) for run in runs]
            event = torch.cuda.Event()
            event.record(side)
        self._pending[gi] = (event, results)

    def _refresh_later(self, *args: Any) -> None:
        """:meth:`_refresh` of a refresh that only follows the step's updates (nothing of the updates reads it):
        run by :meth:`_matrix_updates` after its ``then``."""
        self._later.append(functools.partial(self._refresh, *args))

    @staticmethod
    def _adopt(*tensors: Tensor) -> None:
        """Side-stream results read on the current stream: keep their memory until that stream is done."""
        for t in tensors:
            if t.is_cuda:
                t.record_stream(torch.cuda.current_stream(t.device))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As :meth:`MatrixOptimizer.load_state_dict`, and also checks the shape of every factor against this
        optimizer's blocks. Side-stream results in flight are dropped."""
        saved = [p for g in state_dict["param_groups"] for p in g["params"]]
        mine = [(g, p) for g in self.param_groups for p in g["params"]]
        for pid, (g, p) in zip(saved, mine):
            st = state_dict["state"].get(pid)
            if st and g[self.matrix_flag]:
                self._check_factors(g, p, st)
        super().load_state_dict(state_dict)
        self._pending.clear()
        self._operand_cache.clear()
        self._view_cache.clear()

    def _check_factors(self, group: dict[str, Any], p: Tensor, st: dict[str, Any]) -> None:
        """Raise ValueError unless the factors of the saved state ``st`` of ``p`` match its blocks."""
        for k, b in enumerate(self._block_plan(group, p)):
            m, n = b.key[:2]
            for side, d in (("left", m), ("right", n)):
                f = st.get(f"{side}{k}")
                if (f is None) == getattr(b, side) or (f is not None and tuple(f.shape) != (d, d)):
                    raise ValueError(f"state dict factors of a parameter of shape {tuple(p.shape)} do not match "
                                     f"its blocks (block {k}: {side} factor {None if f is None else tuple(f.shape)}"
                                     f", expected {(d, d) if getattr(b, side) else None}); it was saved with "
                                     f"another max_preconditioner_dim, one_sided_ratio or model")

    # ----------------------------------------------------------------------------------- the update
    first_step_moves = True  # whether a parameter's first step moves it (SOAP's only builds its factors)

    def _gradient_dtype(self, group: dict[str, Any]) -> torch.dtype:
        """The dtype in which ``group``'s step reads the matrices' gradients: a gradient given in it steps exactly
        as its float32 original (a sharded optimizer gathers the gradients in it). float32 here."""
        return torch.float32

    def _matrix_update(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                       skip: Tensor | None = None) -> None:
        skip = self._device_skip(group, params, skip)
        if skip is False:
            return
        updates = self._matrix_updates(group, params, grads, skip)
        moved = [i for i, u in enumerate(updates) if u is not None]
        if moved:
            self._apply(group, [params[i] for i in moved], [updates[i] for i in moved], skip)

    def _device_skip(self, group: dict[str, Any], params: list[Tensor], skip: Tensor | None) -> Tensor | None | bool:
        """How this step of ``params`` honours a deferred check's device flag ``skip``: the flag itself (the
        updates weight every write by ``1 - skip``, no host sync; a refresh that runs on the device keeps what it
        replaces where the flag is set), or, on a step whose refresh reads its results on the host
        (:meth:`_refresh_reads_host`) or is one refresh late (``side_stream``, whose results a later step
        installs), the flag read on the host now: None to step, False to write nothing
        (:meth:`~matrixopt.optim.nonfinite.NonFinitePolicy.on_host`; the step's own deferred check raises there).
        The same on every rank where the step counts are."""
        if skip is None:
            return skip
        late = group["side_stream"] and params and params[0].device.type == "cuda"
        for p in params:
            st = self.state[p]
            step = st.get("step", 0) + 1
            due = self._computes_bases(group, step, self._phase(group, p))
            if due and (late or self._refresh_reads_host(group, st, step)):
                return False if self.nonfinite.on_host(skip) else None
        return skip

    def _refresh_reads_host(self, group: dict[str, Any], st: dict[str, Any], step: int) -> bool:
        """Whether the refresh of the state ``st`` at its ``step``-th step reads results on the host (an eigh, or
        the Newton iteration's check): it can't then run under a device flag."""
        raise NotImplementedError

    def _computes_bases(self, group: dict[str, Any], step: int, phase: int = 0) -> bool:
        """Whether the ``step``-th step (counted from 1) of a parameter whose refresh phase is ``phase``
        (:meth:`_phase`) computes its roots or eigenbases."""
        raise NotImplementedError

    def _phase(self, group: dict[str, Any], p: Tensor) -> int:
        """The refresh phase of the matrix parameter ``p`` of ``group``: 0 unless the group staggers its refreshes;
        then the bins of :func:`~matrixopt.optim.layout.lpt` packing the group's parameters, by the cost of their
        refreshes (``d^3`` per factor), into ``precondition_frequency`` steps, so that each step refreshes about
        as much as any other. A function of the group's parameter list (shapes, order, block plans) only: the
        FSDP2 optimizers, whose groups hold every matrix, take the single-process phases; a layer-wise owner's
        optimizer, whose groups hold the matrices it owns, packs those."""
        if not group["stagger_refresh"]:
            return 0
        freq = group["precondition_frequency"]
        known = self._phases.get(id(p))
        if known is None or known[0] != freq:  # packed anew for a new frequency (a loaded state dict's)
            ps = group["params"]
            costs = [sum((b.r1 - b.r0) ** 3 * b.left + (b.c1 - b.c0) ** 3 * b.right for b in self._plan(group, q))
                     for q in ps]
            bins, _ = lpt(costs, freq)
            self._phases.update((id(q), (freq, b)) for q, b in zip(ps, bins))
            known = self._phases[id(p)]
        return known[1]

    def _advance(self, states: list[dict[str, Any]], skip: Tensor | None) -> None:
        """Count a step in each state (``step``: a Python int, read by the schedule and the bias correction);
        with a device flag ``skip``, registered to be taken back if the step turns out skipped."""
        for st in states:
            st["step"] = st.get("step", 0) + 1
        if skip is not None:
            self.nonfinite.undo_if_skipped(functools.partial(_take_back, states))

    def _matrix_updates(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                        skip: Tensor | None = None,
                        then: Callable[[list[Tensor | None]], None] | None = None) -> list[Tensor | None]:
        """Step the state of ``params`` on ``grads`` and return the update U of each parameter, float32 and shaped
        as it, or None where this step does not move it (not even by weight decay; see ``first_step_moves``). The
        matrix products run in the group's ``matmul_precision`` (:func:`cuda_matmul_precision`).

        A parameter serves as the key of its state and for its shape, device and matrix layout; its values are
        never read, so a sharded optimizer can pass its DTensor parameters with whole gradients. ``grads``: shaped
        as the parameters (whole), any float dtype. ``skip``: a deferred check's 0-d float32 device flag, on a step
        that computes no roots or eigenbases (:meth:`_device_skip`): nonzero makes every state write keep its old
        value (the moving averages weighted by ``1 - skip``, no NaN/Inf reaching a state write), and the caller
        applies U with the same weight.

        ``then(updates)``: called once the updates are issued, before a refresh that follows them (SOAP's,
        :meth:`_refresh_later`) runs; a sharded optimizer sends the updates to their ranks there, so that the
        exchange runs beside the refresh."""
        self._stacks_used.clear()
        self._later = []
        with cuda_matmul_precision(group["matmul_precision"]):
            updates = self._updates(group, params, grads, skip)
            if then is not None:
                then(updates)
            for refresh in self._later:
                refresh()
        self._later = []
        self._drop_unused_stacks(group)
        return updates

    def _updates(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                 skip: Tensor | None) -> list[Tensor | None]:
        """:meth:`_matrix_updates` without the precision scope: the subclass's math."""
        raise NotImplementedError

    # ----------------------------------------------------------------------------------- helpers
    @staticmethod
    def _apply(group: dict[str, Any], params: list[Tensor], updates: list[Tensor], skip: Tensor | None = None) -> None:
        """``W = (1 - lr wd) W - lr U`` over the list (U float32, cast to each parameter's dtype; not modified), the
        decay in the group's ``weight_decay_mode``, in one pass where the parameters are float32 on the GPU
        (:func:`~matrixopt.kernels.muon_elementwise.decay_update`). ``skip``: a 0-d float32 device flag; nonzero
        writes W as it was (U must be finite)."""
        lr = group["lr"]
        if isinstance(lr, Tensor):
            lr = lr.to(params[0].device)
        muon_elementwise.decay_update(params, updates, lr, group["weight_decay"], group["weight_decay_mode"], skip)


def _take_back(states: list[dict[str, Any]]) -> None:
    for st in states:
        st["step"] -= 1


# ----------------------------------------------------------------------------------------------- Shampoo
class Shampoo(KroneckerOptimizer):
    """Shampoo with Adam grafting (see the module docstring for the update).

    Args:
        params: parameters or param groups. Groups default to ``use_shampoo=True``; a group with
            ``use_shampoo=False`` is updated by AdamW. Use :func:`matrixopt.build_optimizer` to route a model.
        lr: learning rate (default 1e-3; with ``grafting="adam"`` an AdamW learning rate works).
        betas: (momentum of the gradient, second-moment decay of the Adam graft), each in [0, 1)
            (default (0.9, 0.999)).
        shampoo_beta: decay of the factors L and R in [0, 1]; 1 sums them (AdaGrad-style); None (default) uses
            ``betas[1]``.
        eps: Adam-graft epsilon (default 1e-8). weight_decay: weight decay (default 0.01).
        weight_decay_mode: "decoupled" (default), "independent" or "cautious" (:mod:`matrixopt.kernels.decay`), for
            the matrix and the AdamW groups.
        nesterov: Nesterov momentum (default True).
        precondition_frequency: roots recomputed every this many steps (default 10); stale roots in between.
        start_preconditioning_step: first step that uses the roots (default None: ``precondition_frequency``).
        inverse_root: r in :math:`L^{-1/r} G R^{-1/r}` (even int >= 2, default 4; one-sided blocks use r/2).
        damping: root damping relative to each factor's largest eigenvalue, in [0, 1) (default 1e-6).
        grafting: "adam" (default) or "none" (raw Shampoo steps; the learning rate is no longer AdamW's).
        max_preconditioner_dim: dims above this are cut into blocks (default 1024).
        one_sided_ratio: precondition only the short side of matrices longer than this ratio (default None).
        factor_dtype: storage of factors and roots, torch.float32 (default) or torch.bfloat16 (or "fp32", "bf16").
        root_config: :class:`matrixopt.linalg.roots.InverseRootConfig` (Newton steps and tolerance); groups hold it
            as ``root_max_iters`` and ``root_tolerance``.
        root_method: "newton" (default: the coupled Newton iteration, converged to ``root_config``'s tolerance at
            every refresh) or "eigenbasis" (a tracked eigenbasis, one power step per refresh; module docstring).
        side_stream: on CUDA, compute roots on a side stream, used one refresh later (default False).
        stagger_refresh: spread the refreshes after the first over the steps between two refreshes instead of
            refreshing every root on the same step (default False; module docstring). Not with ``side_stream``.
            Newton roots read their convergence on the host, so with ``deferred_nonfinite`` every step then reads
            the device flag once (eigenbasis roots run on the device).
        matmul_precision: "fp32" (default) or "tf32": the precision of the factor products and the preconditioning
            on CUDA, and of the eigenbasis roots' product (their power step keeps fp32 accuracy through three
            TF32 products); Newton roots stay fp32. "bf16": the factor products and
            the preconditioning from bfloat16 operands, the roots as under "tf32" (module docstring).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: defaults of the AdamW groups (lr and weight decay
            default to ``lr`` and ``weight_decay``).
        skip_nonfinite: skip (and count) the update of a parameter whose gradient is NaN/Inf instead of raising.
        deferred_nonfinite: check the gradients without a host sync: a step with a NaN/Inf gradient writes nothing
            (every state write and the parameter update weighted by the device flag) and the next ``step()`` or
            ``state_dict()`` raises. A step whose roots read their results on the host (the Newton iteration's
            check, the first eigenbasis's eigh) or run on a side stream reads the flag there; eigenbasis refreshes
            run on the device and are dropped on a skipped step. Not with ``skip_nonfinite``.
        state_dtype, offload: compact state and CPU offload, as in :class:`matrixopt.Muon` (the momentum and Adam
            moments compact; the factors and roots keep ``factor_dtype``; offload moves all of it, a matrix group's
            state to the device at once, since its refreshes and batches span the group).

    State per parameter: ``step`` (int), ``momentum_buffer`` and ``exp_avg_sq`` (float32, the parameter's shape;
    ``exp_avg_sq`` only with Adam grafting), and per block k ``left{k}``, ``right{k}`` (factors) and
    ``left_root{k}``, ``right_root{k}`` (their inverse roots), in ``factor_dtype``; bytes per parameter in the
    module docstring.
    """

    def __init__(self, params: Iterable[Any], lr: float | Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 shampoo_beta: float | None = None, eps: float = 1e-8, weight_decay: float = 0.01,
                 nesterov: bool = True, precondition_frequency: int = 10, start_preconditioning_step: int | None = None,
                 inverse_root: int = 4, damping: float = 1e-6, grafting: str = "adam",
                 max_preconditioner_dim: int = 1024, one_sided_ratio: float | None = None,
                 factor_dtype: torch.dtype = torch.float32, root_config: InverseRootConfig | None = None,
                 side_stream: bool = False, *, root_method: str = "newton", matmul_precision: str = "fp32",
                 stagger_refresh: bool = False, adamw_lr: float | None = None,
                 adamw_betas: tuple[float, float] = (0.9, 0.999), adamw_eps: float = 1e-8,
                 adamw_weight_decay: float | None = None, skip_nonfinite: bool = False,
                 deferred_nonfinite: bool = False, weight_decay_mode: str = "decoupled", state_dtype: Any = None,
                 offload: str | Offload | None = None) -> None:
        matrix_defaults = dict(
            lr=lr, betas=tuple(betas), shampoo_beta=shampoo_beta, eps=eps, weight_decay=weight_decay,
            weight_decay_mode=weight_decay_mode, nesterov=nesterov, precondition_frequency=precondition_frequency,
            start_preconditioning_step=(precondition_frequency if start_preconditioning_step is None
                                        else start_preconditioning_step),
            inverse_root=inverse_root, damping=damping, grafting=grafting,
            max_preconditioner_dim=max_preconditioner_dim, one_sided_ratio=one_sided_ratio,
            factor_dtype=resolve_factor_dtype(factor_dtype), side_stream=side_stream, root_method=root_method,
            matmul_precision=matmul_precision, stagger_refresh=stagger_refresh)
        if root_config is not None and not isinstance(root_config, InverseRootConfig):
            raise ValueError(f"Invalid root_config: {root_config!r} (must be an InverseRootConfig)")
        root_config = root_config or InverseRootConfig()  # stored as plain numbers: torch.load(weights_only=True)
        matrix_defaults.update(root_max_iters=root_config.max_iters, root_tolerance=root_config.tolerance)
        adamw_defaults = adamw_group_defaults(lr, weight_decay, weight_decay_mode, adamw_lr, adamw_betas, adamw_eps,
                                              adamw_weight_decay)
        super().__init__(params, matrix_defaults, adamw_defaults, skip_nonfinite=skip_nonfinite,
                         deferred_nonfinite=deferred_nonfinite, state_dtype=state_dtype, offload=offload)

    def _validate_matrix_group(self, group: dict[str, Any]) -> None:
        super()._validate_matrix_group(group)
        s = group["start_preconditioning_step"]
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"Invalid start_preconditioning_step: {s!r} (must be an int >= 1)")
        r = group["inverse_root"]
        if isinstance(r, bool) or not isinstance(r, int) or r < 2 or r % 2:
            raise ValueError(f"Invalid inverse_root: {r!r} (must be an even int >= 2: the update is "
                             f"L^(-1/r) G R^(-1/r), and one-sided blocks use L^(-2/r))")
        if group["grafting"] not in GRAFTINGS:
            raise ValueError(f"Unknown grafting {group['grafting']!r}; use one of {GRAFTINGS}")
        if group["root_method"] not in ROOT_METHODS:
            raise ValueError(f"Unknown root_method {group['root_method']!r}; use one of {ROOT_METHODS}")
        self._root_config(group)  # validates root_max_iters, root_tolerance

    _added_options = KroneckerOptimizer._added_options + ("root_method",)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # pickled before root_method existed
            if group[self.matrix_flag]:
                group.setdefault("root_method", "newton")

    @staticmethod
    def _root_config(group: dict[str, Any]) -> InverseRootConfig:
        return InverseRootConfig(max_iters=group["root_max_iters"], tolerance=group["root_tolerance"])

    def _init_state(self, group: dict[str, Any], st: dict[str, Any], p: Tensor) -> None:
        st["momentum_buffer"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if group["grafting"] == "adam":
            st["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        for side, k, _ in self._init_factors(group, st, p, "root"):
            if group["root_method"] == "eigenbasis":
                st[f"{side}_basis{k}"] = st[f"{side}_root{k}"].clone()  # the identity until the first eigh

    def _computes_bases(self, group: dict[str, Any], step: int, phase: int = 0) -> bool:
        start = group["start_preconditioning_step"]  # every root at once there, then by phase
        return step == start or (step > start and (step - start - phase) % group["precondition_frequency"] == 0)

    def _refresh_reads_host(self, group: dict[str, Any], st: dict[str, Any], step: int) -> bool:
        return group["root_method"] == "newton" or self._first_basis(group, st, step)

    @staticmethod
    def _first_basis(group: dict[str, Any], st: dict[str, Any], step: int) -> bool:
        """Whether an eigenbasis root at the state's ``step``-th step starts from eigh: the first root, or a state
        without bases (saved with the Newton roots)."""
        return step == group["start_preconditioning_step"] or not any("_basis" in k for k in st)

    def _updates(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                 skip: Tensor | None) -> list[Tensor]:
        graft = group["grafting"] == "adam"
        states = [self._state(group, p) for p in params]
        layout = self._layout(group, params)
        self._advance(states, skip)
        live = None if skip is None else 1 - skip
        g32 = [g if g.dtype == torch.float32 else g.float() for g in grads] if skip is None else sanitized(grads, skip)
        D, fallback = self._graft(group, states, g32, skip, live)
        gviews = [block_views(p, self._plan(group, p), g) for p, g in zip(params, g32)]
        self._update_factors(group, layout, states, gviews, live)

        start = group["start_preconditioning_step"]
        due = [i for i, (p, st) in enumerate(zip(params, states))
               if self._computes_bases(group, st["step"], self._phase(group, p))]
        if due:  # with skip only where the refresh runs on the device (_device_skip)
            gi = next(j for j, g in enumerate(self.param_groups) if g is group)
            items = [(self._plan(group, params[i]), states[i]) for i in due]
            install = functools.partial(self._install_eigen_roots, group, live=live) \
                if group["root_method"] == "eigenbasis" else functools.partial(self._install_roots, group)
            self._refresh(gi, group, self._root_runs(group, items), install)

        active = {i for i, st in enumerate(states) if st["step"] >= start}
        updates = [f if i not in active else torch.empty(p.shape, dtype=torch.float32, device=p.device)
                   for i, (p, f) in enumerate(zip(params, fallback))]
        if active:
            dviews = [block_views(p, self._plan(group, p), d) for p, d in zip(params, D)]
            fviews = [block_views(p, self._plan(group, p), f) for p, f in zip(params, fallback)]
            uviews = [block_views(p, self._plan(group, p), u) for p, u in zip(params, updates)]
            precision = group["matmul_precision"]

            def roots(side: str, ents: list[tuple[int, int, Block]]) -> Tensor:
                return self._step_stack(group, params, states, ents, f"{side}_root")

            for (_, _, left, right), ents in layout.runs(active):
                S = step_operands([dviews[i][k] for i, k, _ in ents], precision)  # (b, m, n)
                if left:
                    S = step_product(roots("left", ents), S, precision, inner=right)
                if right:
                    S = step_product(S, roots("right", ents), precision)
                Fs, Us = [fviews[i][k] for i, k, _ in ents], [uviews[i][k] for i, k, _ in ents]
                fused = muon_elementwise.fused_for(Fs, Us) if S.dtype == torch.float32 and S.stride(-1) == 1 \
                    else None
                if fused is not None:  # the graft and the select in two passes (graft_select_triton)
                    fused.graft_select_triton(S, Fs, Us, graft)
                    continue
                F = torch.stack(Fs)  # (b, m, n)
                if graft:
                    nS = torch.linalg.vector_norm(S, dim=(-2, -1), keepdim=True)
                    nF = torch.linalg.vector_norm(F, dim=(-2, -1), keepdim=True)
                    S = S * torch.where(nS > 0, nF / nS, 0.0)
                muon_elementwise.copy_matrices(Us, torch.where(finite_blocks(S), S, F))
        return updates

    @staticmethod
    def _graft(group: dict[str, Any], states: list[dict[str, Any]], g32: list[Tensor], skip: Tensor | None,
               live: Tensor | None) -> tuple[list[Tensor], list[Tensor]]:
        """The momentum ``B = beta1 B + (1 - beta1) G`` and, with Adam grafting, the graft's ``V = beta2 V +
        (1 - beta2) G^2``, in place; returns ``(D, A)``: the numerator ``D`` (Nesterov's ``lerp(G, B, beta1)``, or
        B) and the Adam update ``A = (D / bc1) / (sqrt(V / bc2) + eps)`` (D itself without grafting). On the GPU,
        float32 matrices with one step count, in one pass (:func:`matrixopt.kernels.muon_fused.adam_triton`: 28
        bytes per element against about 88 as foreach ops); a step skipped on the device (``skip``) leaves the
        moments as they were and gives zeros there."""
        beta1, nesterov = group["betas"][0], group["nesterov"]
        bufs = [st["momentum_buffer"] for st in states]
        steps = {st["step"] for st in states}
        if group["grafting"] == "adam":
            sqs = [st["exp_avg_sq"] for st in states]
            fused = muon_elementwise.fused_for(bufs, sqs, g32) if len(steps) == 1 else None
            if fused is not None:
                D = [torch.empty_like(b) for b in bufs] if nesterov else bufs
                A = fused.adam_triton(bufs, sqs, g32, steps.pop(), group["betas"], group["eps"], skip,
                                      nesterov=D if nesterov else None)
                return D, A
            adam_moments_(bufs, sqs, g32, group["betas"], live)
        else:
            ema_(bufs, g32, 1 - beta1, live)
        D = torch._foreach_lerp(g32, bufs, beta1) if nesterov else bufs
        if group["grafting"] != "adam":
            return D, D
        return D, adam_direction(D, [st["exp_avg_sq"] for st in states], [st["step"] for st in states],
                                 group["betas"], group["eps"])

    # ----------------------------------------------------------------------------------- roots
    def _root_runs(self, group: dict[str, Any], items: list[tuple[list[Block], dict[str, Any]]]
                   ) -> list[Callable[[bool], Any]]:
        """The roots of every factor of ``items`` (``(plan, state)`` pairs), as :meth:`_refresh` runs: one per batch
        of factors of one size and root order (and, for ``root_method="eigenbasis"``, of a first basis or not), of
        bounded workspace."""
        r = group["inverse_root"]
        eigen = group["root_method"] == "eigenbasis"
        buckets: dict[tuple[int, int, bool], list[tuple[dict[str, Any], int, str]]] = defaultdict(list)
        for plan, st in items:
            for k, b in enumerate(plan):
                for side in ("left", "right")[0 if b.left else 1:2 if b.right else 1]:
                    first = eigen and self._first_basis(group, st, st["step"])
                    buckets[(st[f"{side}{k}"].shape[0], r if b.left and b.right else r // 2, first)].append(
                        (st, k, side))
        compute = self._eigen_roots if eigen else self._roots
        return [functools.partial(compute, group, jobs, p, first)
                for (d, p, first), all_jobs in buckets.items() for jobs in capped_runs(all_jobs, d * d)]

    def _roots(self, group: dict[str, Any], jobs: list[tuple[dict[str, Any], int, str]], p: int, first: bool,
               sync: bool) -> tuple:
        """Inverse p-th roots of the factors ``jobs`` (``(state, k, side)``), from a snapshot, in IEEE fp32 whatever
        ``matmul_precision`` says (the Newton iteration fails in TF32; module docstring). Returns ``(destinations,
        snapshot, result, p)``: a :class:`~matrixopt.linalg.roots.RootResult` when ``sync``, else the unchecked Newton
        result ``(X, converged)`` (no host sync), finished at install."""
        A = torch.stack([st[f"{side}{k}"] for st, k, side in jobs]).float()  # (b, d, d) snapshot
        dsts = [st[f"{side}_root{k}"] for st, k, side in jobs]
        with cuda_matmul_precision("fp32"):
            if sync:
                return dsts, A, inverse_root(A, p, group["damping"], self._root_config(group)), p
            return dsts, A, newton_inverse_root(A, p, group["damping"], self._root_config(group), early_exit=False), p

    def _eigen_roots(self, group: dict[str, Any], jobs: list[tuple[dict[str, Any], int, str]], p: int,
                     first: bool, sync: bool) -> tuple:
        """``root_method="eigenbasis"``: the factors' eigenbases (float64 eigh when ``first``, else one power step
        from the stored bases) and the inverse p-th roots they give, from a snapshot: the power step (and the first
        basis' Rayleigh quotients) to float32 accuracy, the root's product in the group's ``matmul_precision``
        (module docstring).
        Returns ``(jobs, roots, bases, ok)``; no host sync unless ``first``."""
        A = torch.stack([st[f"{side}{k}"] for st, k, side in jobs]).float()  # (b, d, d) snapshot
        # A Q to float32 accuracy: one IEEE product, or under TF32 on CUDA three TF32 ones (module docstring)
        bmm = split_tf32_bmm if group["matmul_precision"] != "fp32" and A.is_cuda else torch.bmm
        if first:
            Q, ok = eigenbasis(A)
            d = rayleigh_quotients(A, Q, bmm)  # (b, d)
        else:  # the eigenvalue estimates the power step computed (refresh_eigenbasis)
            bases = [st.get(f"{side}_basis{k}") for st, k, side in jobs]
            if any(b is None for b in bases):  # a state without a basis (its roots were Newton's): the identity
                eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
                bases = [eye if b is None else b for b in bases]
            Q, _, ok, d = refresh_eigenbasis(A, torch.stack(bases), bmm=bmm)
        d = d.clamp_min(0)
        dmax = d.amax(dim=-1, keepdim=True)
        scale = torch.where(dmax > 0, (d + group["damping"] * dmax).pow(-1.0 / p), 1.0)  # 0 -> the identity
        roots = (Q * scale[:, None, :]) @ Q.mT
        return jobs, roots, Q, ok & finite_matrices(roots)

    def _install_roots(self, group: dict[str, Any], result: tuple) -> None:
        """Write one batch's roots (:meth:`_roots`); a failed root keeps the previous one."""
        dsts, A, res, p = result
        if not hasattr(res, "failed"):
            self._adopt(*res)
            res = fall_back(A, res[0], res[1], p, group["damping"])
        old = torch.stack(dsts).float()
        new = torch.where(res.failed[:, None, None], old, res.root)
        torch._foreach_copy_(dsts, list(new.to(dsts[0].dtype).unbind(0)))
        self.root_fallbacks += int(res.fell_back.sum())
        self._count_failures(res.failed)

    def _install_eigen_roots(self, group: dict[str, Any], result: tuple, live: Tensor | None = None) -> None:
        """Write one batch's roots and bases (:meth:`_eigen_roots`); a failed one keeps the previous ones, and so
        does every one where the device flag ``live`` is 0 (a skipped step). No host sync."""
        jobs, roots, Q, ok = result
        self._adopt(roots, Q, ok)
        ok = self._installable(ok, live)
        for name, new in (("root", roots), ("basis", Q)):
            for st, k, side in jobs:  # a state saved with Newton roots has no basis yet: the identity stands in
                if f"{side}_{name}{k}" not in st:
                    st[f"{side}_{name}{k}"] = torch.eye(new.shape[-1], dtype=st[f"{side}{k}"].dtype, device=new.device)
            dsts = [st[f"{side}_{name}{k}"] for st, k, side in jobs]
            kept = torch.where(ok[:, None, None], new, torch.stack(dsts).float())
            torch._foreach_copy_(dsts, list(kept.to(dsts[0].dtype).unbind(0)))
