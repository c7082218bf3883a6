r"""SOAP: Adam in the eigenbasis of Shampoo's factors (Vyas et al., arXiv:2409.11321).

For each matrix block G (``(m, n)``; blocks as in :mod:`matrixopt.optim.shampoo`) at step t, with
:math:`Q_L, Q_R` the eigenbases of the factors L, R:

.. math::
    G' = Q_L^\top G Q_R, \qquad M'_t = \beta_1 M'_{t-1} + (1 - \beta_1) G', \qquad
    V'_t = \beta_2 V'_{t-1} + (1 - \beta_2) G'^2

    U = Q_L \frac{M'_t / (1 - \beta_1^t)}{\sqrt{V'_t / (1 - \beta_2^t)} + \epsilon} Q_R^\top, \qquad
    W_t = (1 - \eta\lambda) W_{t-1} - \eta U

and then, after the update, :math:`L \leftarrow \beta_L L + (1 - \beta_L) G G^\top`,
:math:`R \leftarrow \beta_L R + (1 - \beta_L) G^\top G`. The moments live in the rotated coordinates.

The first call of ``step()`` for a parameter only builds the factors from G and takes their eigenvectors by
float64 ``eigh``; it does not move the parameter (as in the authors' code): in the eigenbasis of its own
gradient, G' is diagonal up to round-off, and Adam would blow that round-off up to steps of size ~lr. Adam's
step count t starts at the next call. Every ``precondition_frequency`` Adam steps, one QR power-iteration step
refreshes them
(:func:`matrixopt.linalg.roots.refresh_eigenbasis`): the second moment V' is permuted with the basis columns
(sorted by estimated eigenvalue), and the first moment M' is rotated exactly into the new basis,
:math:`M' \leftarrow (Q_L^{\text{new}\top} Q_L)\, M'\, (Q_R^\top Q_R^{\text{new}})`.

``factor_update="kl"`` uses KL-Shampoo's factor updates (Lin et al., arXiv:2509.03378), in which each factor is
estimated with the other one whitened out:

.. math::
    L \leftarrow \beta_L L + \frac{1 - \beta_L}{n} G R^{-1} G^\top, \qquad
    R \leftarrow \beta_L R + \frac{1 - \beta_L}{m} G^\top L^{-1} G .

As in the paper's KL-SOAP, :math:`R^{-1}` is taken in the current eigenbasis,
:math:`Q_R \operatorname{diag}(d_R)^{-1} Q_R^\top`, where the eigenvalue estimates d (state ``left_eig{k}``,
``right_eig{k}``) follow the same EMA every step, :math:`d_L \leftarrow \beta_L d_L + \frac{1-\beta_L}{n}
\sum_j G'^2_{ij} / d_{R,j}`, and are reset to :math:`\operatorname{diag}(Q^\top L Q)` at each refresh. ``damping``
(relative to the largest estimate) keeps the inverse bounded. Step 1 uses the plain update with the other factor
taken as the identity.

A one-sided block (``one_sided_ratio``) has a basis on its short side only. ``side_stream=True`` on CUDA runs
each QR refresh on a side stream and installs it at the next refresh (the eigh at step 1 is synchronous); on CPU
it is accepted and synchronous. ``stagger_refresh=True`` spreads the QR refreshes over the steps between two refreshes,
each parameter from its own phase (as Shampoo's roots, :mod:`matrixopt.optim.shampoo`). Eigenbases that cannot
be computed (non-finite factors) keep the previous basis and are counted in ``root_failures``.

Matrix products on CUDA (``matmul_precision``, as in :mod:`matrixopt.optim.shampoo`): ``"fp32"`` (default, IEEE)
or ``"tf32"`` for all of SOAP's products: the factor updates, the rotations :math:`Q_L^\top G Q_R` and
:math:`Q_L N Q_R^\top`, and the refresh's power step :math:`A Q` and moment rotation. TF32 keeps what the method
relies on: the bases are orthogonal to fp32 accuracy whatever the product's precision (the QR is a float64
CholeskyQR with a correction step, and the eigh at step 1 is float64), so a rotation by them is off by about
3e-4 relative, and a basis slightly farther from the exact eigenvectors is still a basis Adam runs in.
``"bf16"`` runs the step's products (the factor updates and both rotations) from bfloat16 operands summed in
float32, on any device (:func:`~matrixopt.optim.shampoo.step_product`), and the refresh as under ``"tf32"``: each
product off by about 2e-3 relative, what ``factor_dtype=torch.bfloat16`` already costs the rotations. On a
prose GPT trained for 1144 steps on one H100 the final loss moved by less than the seed's spread (SOAP 4.057 with
bf16 products, 4.067 with TF32; Shampoo 4.209 and 4.206; ``docs/results/prose``), and an FSDP2 owner's step
over half of the 1.3B's matrices took 94 against 103 ms on 2 H100s (``docs/results/distributed``; Shampoo gained
nothing there).

Memory per matrix parameter of a block ``(m, n)`` with both factors, besides the parameter and its gradient:
state ``8 + 8 (m^2 + n^2) / (m n)`` bytes in float32 (two moments, two factors, two eigenbases: 24 bytes for a
square block, as Shampoo); ``factor_dtype=torch.bfloat16`` makes it 16 (the factors and bases in bfloat16: a basis
rounded to bfloat16 is orthogonal to about 2e-3 RMS and a rotation by it off by about 2e-3 relative, measured at
n = 1024, against 3e-4 for TF32 products); ``factor_update="kl"`` adds ``4 (m + n) / (m n)``. A step's workspace
is the update, a float32 tensor of the parameter's shape (4 bytes), plus a few stacked batches
of at most :data:`~matrixopt.optim.layout.BUCKET_NUMEL` values. A synchronous refresh computes and installs one
batch at a time; with ``side_stream`` every factor's new basis is held from one refresh to the next
(``4 (m^2 + n^2) / (m n)`` bytes, 8 for a square block).
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from matrixopt.kernels.muon_elementwise import copy_matrices
from matrixopt.linalg.roots import eigenbasis, rayleigh_quotients, refresh_eigenbasis
from matrixopt.optim.adam import adam_step, ema_
from matrixopt.optim.base import adamw_group_defaults
from matrixopt.optim.layout import capped_runs
from matrixopt.optim.nonfinite import sanitized
from matrixopt.optim.offload import Offload
from matrixopt.optim.shampoo import (
    Block,
    KroneckerOptimizer,
    accumulate,
    block_views,
    resolve_factor_dtype,
    step_operands,
    step_product,
)

FACTOR_UPDATES = ("shampoo", "kl")


def gradient_dtype(matmul_precision: str, factor_update: str = "shampoo") -> torch.dtype:
    """The dtype in which SOAP's step reads a matrix's gradient: bfloat16 where its products take bfloat16
    operands (``matmul_precision="bf16"``) and the factors are Shampoo's, for the gradient then enters only as the
    operand of those products, rounded to bfloat16 as it is stacked; float32 otherwise (KL's factors and eigenvalue
    estimates read it in float32 at the first step). A gradient given in it steps exactly as its float32 original
    (FSDP2's owners gather the gradients in it)."""
    return torch.bfloat16 if matmul_precision == "bf16" and factor_update == "shampoo" else torch.float32


def _inverse(d: Tensor, damping: float) -> Tensor:
    """``1 / (d + damping * max(d))`` per row of ``(b, d)`` estimates; 0 where that is 0 (no information)."""
    den = d.clamp_min(0) + damping * d.amax(dim=-1, keepdim=True).clamp_min(0)
    return torch.where(den > 0, 1.0 / den, 0.0)


class SOAP(KroneckerOptimizer):
    """SOAP: Adam in the eigenbasis of Shampoo's factors, refreshed every ``precondition_frequency`` steps.

    Args:
        params: parameters or param groups. Groups default to ``use_soap=True``; a group with ``use_soap=False``
            is updated by AdamW. Use :func:`matrixopt.build_optimizer` to route a model.
        lr: learning rate (default 3e-3, the paper's). betas: Adam's (beta1, beta2), each in [0, 1)
            (default (0.95, 0.95), the paper's).
        shampoo_beta: decay of the factors in [0, 1] (1 sums them); None (default) uses ``betas[1]``.
        eps: Adam epsilon (default 1e-8). weight_decay: weight decay (default 0.01).
        weight_decay_mode: as in :class:`matrixopt.Shampoo`.
        precondition_frequency: eigenbases refreshed every this many steps (default 10).
        factor_update: "shampoo" (default) or "kl" (KL-Shampoo factor updates, see the module docstring).
        damping: relative damping of the eigenvalue estimates of ``factor_update="kl"`` (default 1e-6).
        max_preconditioner_dim: dims above this are cut into blocks (default 1024).
        one_sided_ratio: rotate only the short side of matrices longer than this ratio (default None).
        factor_dtype: storage of factors and eigenbases, torch.float32 (default) or torch.bfloat16 (or "fp32",
            "bf16"; what it costs is in the module docstring).
        side_stream: on CUDA, refresh eigenbases on a side stream, used one refresh later (default False).
        stagger_refresh: spread the QR refreshes over the steps between two refreshes instead of refreshing every
            eigenbasis on the same step (default False; module docstring). Not with ``side_stream``.
        matmul_precision: "fp32" (default), "tf32" (every matrix product on CUDA in TF32) or "bf16" (the step's
            factor products and rotations from bfloat16 operands, the refresh as under "tf32"; module docstring).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay, skip_nonfinite, deferred_nonfinite, state_dtype,
            offload: as in :class:`matrixopt.Shampoo` (a parameter's first step, whose eigh reads the host, reads
            a deferred check's flag there; the QR refreshes run on the device and are dropped on a skipped step,
            except with ``side_stream`` on CUDA, whose refresh steps read the flag on the host).

    State per parameter: ``step`` (int), ``exp_avg`` and ``exp_avg_sq`` (float32, the parameter's shape, each
    block in its eigen-coordinates), and per block k ``left{k}``, ``right{k}`` (factors), ``left_basis{k}``,
    ``right_basis{k}`` (eigenbases), in ``factor_dtype``, and with ``factor_update="kl"`` ``left_eig{k}``,
    ``right_eig{k}`` (float32 eigenvalue estimates); bytes per parameter in the module docstring.
    """

    matrix_state_tensors = 2  # exp_avg and exp_avg_sq

    matrix_flag = "use_soap"

    def __init__(self, params: Iterable[Any], lr: float | Tensor = 3e-3, betas: tuple[float, float] = (0.95, 0.95),
                 shampoo_beta: float | None = None, eps: float = 1e-8, weight_decay: float = 0.01,
                 precondition_frequency: int = 10, factor_update: str = "shampoo", damping: float = 1e-6,
                 max_preconditioner_dim: int = 1024, one_sided_ratio: float | None = None,
                 factor_dtype: torch.dtype = torch.float32, side_stream: bool = False, *,
                 matmul_precision: str = "fp32", stagger_refresh: bool = False, adamw_lr: float | None = None,
                 adamw_betas: tuple[float, float] = (0.9, 0.999), adamw_eps: float = 1e-8,
                 adamw_weight_decay: float | None = None,
                 skip_nonfinite: bool = False, deferred_nonfinite: bool = False,
                 weight_decay_mode: str = "decoupled", state_dtype: Any = None,
                 offload: str | Offload | None = None) -> None:
        matrix_defaults = dict(
            lr=lr, betas=tuple(betas), shampoo_beta=shampoo_beta, eps=eps, weight_decay=weight_decay,
            weight_decay_mode=weight_decay_mode, precondition_frequency=precondition_frequency,
            factor_update=factor_update, damping=damping,
            max_preconditioner_dim=max_preconditioner_dim, one_sided_ratio=one_sided_ratio,
            factor_dtype=resolve_factor_dtype(factor_dtype), side_stream=side_stream,
            matmul_precision=matmul_precision, stagger_refresh=stagger_refresh)
        adamw_defaults = adamw_group_defaults(lr, weight_decay, weight_decay_mode, adamw_lr, adamw_betas, adamw_eps,
                                              adamw_weight_decay)
        super().__init__(params, matrix_defaults, adamw_defaults, skip_nonfinite=skip_nonfinite,
                         deferred_nonfinite=deferred_nonfinite, state_dtype=state_dtype, offload=offload)

    def _validate_matrix_group(self, group: dict[str, Any]) -> None:
        super()._validate_matrix_group(group)
        if group["factor_update"] not in FACTOR_UPDATES:
            raise ValueError(f"Unknown factor_update {group['factor_update']!r}; use one of {FACTOR_UPDATES}")

    def _init_state(self, group: dict[str, Any], st: dict[str, Any], p: Tensor) -> None:
        st["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        st["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        for side, k, d in self._init_factors(group, st, p, "basis"):
            if group["factor_update"] == "kl":
                st[f"{side}_eig{k}"] = torch.zeros(d, dtype=torch.float32, device=p.device)

    @staticmethod
    def _sides(b: Block) -> tuple[str, ...]:
        return ("left", "right")[0 if b.left else 1:2 if b.right else 1]

    first_step_moves = False  # the first step builds the factors and their eigenbases only

    def _computes_bases(self, group: dict[str, Any], step: int, phase: int = 0) -> bool:
        # the first step's eigh, then every precondition_frequency Adam steps, from the parameter's phase on
        return step == 1 or (step > 1 and (step - 1 - phase) % group["precondition_frequency"] == 0)

    def _refresh_reads_host(self, group: dict[str, Any], st: dict[str, Any], step: int) -> bool:
        return step == 1  # the eigh; the QR refreshes run on the device

    def _gradient_dtype(self, group: dict[str, Any]) -> torch.dtype:
        return gradient_dtype(group["matmul_precision"], group["factor_update"])

    def _updates(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                 skip: Tensor | None) -> list[Tensor | None]:
        kl = group["factor_update"] == "kl"
        states = [self._state(group, p) for p in params]
        self._advance(states, skip)
        live = None if skip is None else 1 - skip
        out: list[Tensor | None] = [None] * len(params)
        first = [i for i, st in enumerate(states) if st["step"] == 1]
        rest = [i for i in range(len(params)) if states[i]["step"] > 1]
        if first:  # factors from this gradient and their eigenbases; no update (see the module docstring)
            params1, grads1 = [params[i] for i in first], [grads[i].float() for i in first]
            plans1, states1 = [self._plan(group, p) for p in params1], [states[i] for i in first]
            gviews1 = [block_views(p, plan, g) for p, plan, g in zip(params1, plans1, grads1)]
            layout1 = self._layout(group, params1)
            if kl:
                for key, ents in layout1.runs():
                    G = torch.stack([gviews1[i][k] for i, k, _ in ents])
                    self._kl_factors(group, states1, ents, key, G, None, None)
            else:
                self._update_factors(group, layout1, states1, gviews1)
            self._first_bases(group, list(zip(params1, plans1, states1)))
            params, grads, states = [params[i] for i in rest], [grads[i] for i in rest], [states[i] for i in rest]
            if not params:
                return out
        layout = self._layout(group, params)
        plans = [self._plan(group, p) for p in params]
        steps = [st["step"] - 1 for st in states]  # Adam steps: the first call only initializes
        # a skipped step reads its gradients as they are where every use of them is masked (a non-finite factor
        # block is dropped, Adam keeps its moments), as zeros where KL's eigenvalue estimates would read them
        read = (torch.float32, self._gradient_dtype(group))  # a bf16 gradient is stacked as it is
        gs = [g if g.dtype in read else g.float() for g in grads] if skip is None or not kl else \
            sanitized(grads, skip)
        gviews = [block_views(p, plan, g) for p, plan, g in zip(params, plans, gs)]

        # Adam in the eigenbasis, run by run (batches: Layout.runs): project, the factors, Adam on the projected
        # stack in place (the moments' blocks read and written where they lie), project back into the update
        updates = [torch.empty(p.shape, dtype=torch.float32, device=p.device) for p in params]
        uviews = [block_views(p, plan, t) for p, plan, t in zip(params, plans, updates)]
        mviews = [self._state_views(group, p, st, "exp_avg") for p, st in zip(params, states)]
        vviews = [self._state_views(group, p, st, "exp_avg_sq") for p, st in zip(params, states)]
        beta, precision = self._shampoo_beta(group), group["matmul_precision"]
        for key, ents in layout.runs():
            G = step_operands([gviews[i][k] for i, k, _ in ents], precision)  # (b, m, n)
            bases = self._bases(group, params, states, ents, key)
            X = self._rotate(bases, G, True, precision)  # G' = Q_L^T G Q_R
            if kl:  # KL's factors read this step's projection
                self._kl_factors(group, states, ents, key, G, X, bases, live)
            else:  # this run's factors, from the stack at hand: the projections read the bases, not the factors
                self._accumulate_factors(states, ents, G, key, beta, precision, live)
            del G
            adam_step([mviews[i][k] for i, k, _ in ents], [vviews[i][k] for i, k, _ in ents], X,
                      [steps[i] for i, _, _ in ents], group["betas"], group["eps"], skip, into_grads=True)
            U = self._rotate(bases, X, False, precision)  # Q_L N Q_R^T
            copy_matrices([uviews[i][k] for i, k, _ in ents], U)
            del X, U, bases
        due = [i for i, (p, st) in enumerate(zip(params, states))
               if self._computes_bases(group, st["step"], self._phase(group, p))]
        if due:  # with skip only where the refresh runs on the device (_device_skip)
            gi = next(j for j, g in enumerate(self.param_groups) if g is group)
            items = [(params[i], plans[i], states[i]) for i in due]
            self._refresh_later(gi, group, [functools.partial(self._new_bases, group, jobs)
                                            for jobs in self._factor_runs(group, items)],
                                functools.partial(self._install_bases, group, live=live))
        for i, u in zip(rest, updates):
            out[i] = u
        return out

    # ----------------------------------------------------------------------------------- rotations
    def _bases(self, group: dict[str, Any], params: list[Tensor], states: list[dict[str, Any]],
               ents: list[tuple[int, int, Block]],
               key: tuple[int, int, bool, bool]) -> tuple[Tensor | None, Tensor | None]:
        """``(Q_L, Q_R)`` of a run of blocks sharing ``key``, stacked ``(b, d, d)`` as the products in the group's
        ``matmul_precision`` take them (None for a side without a basis), for both rotations of a step, and kept
        until a refresh writes one of them (:meth:`~matrixopt.optim.shampoo.KroneckerOptimizer._step_stack`)."""
        _, _, left, right = key
        return tuple(self._step_stack(group, params, states, ents, f"{side}_basis") if has else None
                     for side, has in (("left", left), ("right", right)))

    @staticmethod
    def _rotate(bases: tuple[Tensor | None, Tensor | None], X: Tensor, to_eigen: bool, precision: str) -> Tensor:
        """``Q_L^T X Q_R`` (``to_eigen``) or ``Q_L X Q_R^T`` for a stack ``(b, m, n)`` and its :meth:`_bases`, in
        ``precision`` (:func:`~matrixopt.optim.shampoo.step_product`); float32."""
        QL, QR = bases
        if QL is not None:
            X = step_product(QL.mT if to_eigen else QL, X, precision, inner=QR is not None)
        if QR is not None:
            X = step_product(X, QR if to_eigen else QR.mT, precision)
        return X

    # ----------------------------------------------------------------------------------- factors (KL)
    def _kl_factors(self, group: dict[str, Any], states: list[dict[str, Any]], ents: list[tuple[int, int, Block]],
                    key: tuple[int, int, bool, bool], G: Tensor, P: Tensor | None,
                    bases: tuple[Tensor | None, Tensor | None] | None, live: Tensor | None = None) -> None:
        """KL-Shampoo factor updates (module docstring) of one run of blocks sharing ``key``: ``G`` the gradient
        stack ``(b, m, n)``, ``P`` this step's projection ``Q_L^T G Q_R`` and ``bases`` the run's :meth:`_bases`,
        both None at the first call (then the other factor is taken as the identity). ``live``: as in
        :func:`~matrixopt.optim.shampoo.accumulate` (the eigenvalue estimates too)."""
        beta = self._shampoo_beta(group)
        init = P is None
        m, n, left, right = key
        ones_m, ones_n = G.new_ones(len(ents), m), G.new_ones(len(ents), n)
        inv_l = ones_m if init or not left else _inverse(
            torch.stack([states[i][f"left_eig{k}"] for i, k, _ in ents]), group["damping"])  # (b, m)
        inv_r = ones_n if init or not right else _inverse(
            torch.stack([states[i][f"right_eig{k}"] for i, k, _ in ents]), group["damping"])  # (b, n)
        precision = group["matmul_precision"]
        if left:  # L += (1 - beta)/n G R^-1 G^T, R^-1 = Q_R diag(inv_r) Q_R^T
            H = G.float() if init or not right else step_product(G, bases[1], precision)
            H = H * inv_r.sqrt()[:, None, :]
            accumulate([states[i][f"left{k}"] for i, k, _ in ents], step_product(H, H.mT, precision) / n, beta, live)
        if right:  # R += (1 - beta)/m G^T L^-1 G
            H = G.float() if init or not left else step_product(bases[0].mT, G, precision)
            H = H * inv_l.sqrt()[:, :, None]
            accumulate([states[i][f"right{k}"] for i, k, _ in ents], step_product(H.mT, H, precision) / m, beta, live)
        if not init:  # eigenvalue estimates, from this step's G' = Q_L^T G Q_R
            P2 = P.square()  # (b, m, n)
            if left:
                d = [states[i][f"left_eig{k}"] for i, k, _ in ents]
                ema_(d, list(((P2 * inv_r[:, None, :]).sum(-1) / n).unbind(0)), 1 - beta, live)
            if right:
                d = [states[i][f"right_eig{k}"] for i, k, _ in ents]
                ema_(d, list(((P2 * inv_l[:, :, None]).sum(-2) / m).unbind(0)), 1 - beta, live)

    # ----------------------------------------------------------------------------------- eigenbases
    def _factor_jobs(self, group: dict[str, Any], items: list[tuple[Tensor, list[Block], dict[str, Any]]]
                     ) -> dict[int, list[tuple]]:
        """``{d: [(state, k, side, exp_avg blocks, exp_avg_sq blocks)]}``: every factor of ``items``
        (``(param, plan, state)``; the moments' :func:`~matrixopt.optim.shampoo.block_views`, block k the job's),
        bucketed by size, each size's jobs ordered by side and moment block shape (a parameter's blocks in order)."""
        jobs: dict[int, list[tuple]] = defaultdict(list)
        for p, plan, st in items:
            mviews, vviews = (self._state_views(group, p, st, name) for name in ("exp_avg", "exp_avg_sq"))
            for k, b in enumerate(plan):
                for side in self._sides(b):
                    jobs[st[f"{side}{k}"].shape[0]].append((st, k, side, mviews, vviews))
        for same in jobs.values():  # each side's blocks of one shape together: the install rotates them in a batch
            same.sort(key=lambda job: (job[2], tuple(job[3][job[1]].shape)))
        return jobs

    def _factor_runs(self, group: dict[str, Any], items: list[tuple[Tensor, list[Block], dict[str, Any]]]
                     ) -> list[list[tuple]]:
        """:meth:`_factor_jobs` of each size in batches of bounded workspace
        (:func:`~matrixopt.optim.layout.capped_runs`)."""
        return [run for d, jobs in self._factor_jobs(group, items).items() for run in capped_runs(jobs, d * d)]

    @staticmethod
    def _stack(jobs: list[tuple], name: str) -> Tensor:
        return torch.stack([st[f"{side}{name}{k}"] for st, k, side, *_ in jobs]).float()

    @staticmethod
    def _write(jobs: list[tuple], name: str, X: Tensor) -> None:
        dsts = [st[f"{side}{name}{k}"] for st, k, side, *_ in jobs]
        torch._foreach_copy_(dsts, list(X.to(dsts[0].dtype).unbind(0)))

    def _first_bases(self, group: dict[str, Any], items: list[tuple[Tensor, list[Block], dict[str, Any]]]) -> None:
        for jobs in self._factor_runs(group, items):
            F = self._stack(jobs, "")
            Q, ok = eigenbasis(F)
            self._write(jobs, "_basis", Q)
            if group["factor_update"] == "kl":
                self._write(jobs, "_eig", rayleigh_quotients(F, Q))
            self._count_failures(~ok)

    def _new_bases(self, group: dict[str, Any], jobs: list[tuple], sync: bool) -> tuple:
        """One :meth:`_refresh` run: a QR power step from a snapshot of the factors ``jobs`` (and, for
        ``factor_update="kl"``, the new eigenvalue estimates). Returns ``(jobs, Q_new, order, ok, estimates or
        None)``; no host sync either way."""
        F, Q = self._stack(jobs, ""), self._stack(jobs, "_basis")
        Q_new, order, ok, _ = refresh_eigenbasis(F, Q)
        return jobs, Q_new, order, ok, rayleigh_quotients(F, Q_new) if group["factor_update"] == "kl" else None

    def _install_bases(self, group: dict[str, Any], result: tuple, live: Tensor | None = None) -> None:
        """Write one batch's new bases; rotate the first moment into them and permute the second moment with their
        columns. The old bases are the state's: only an install changes them. Where the device flag ``live`` is 0
        (a skipped step) every basis, moment and estimate is kept as it was, bit for bit. No host sync."""
        jobs, Q_new, order, ok, eig = result
        self._adopt(*(t for t in (Q_new, order, ok, eig) if t is not None))
        old = self._stack(jobs, "_basis")
        ok = self._installable(ok, live)
        if live is not None:
            Q_new = torch.where(ok[:, None, None], Q_new, old)
            order = torch.where(ok[:, None], order, torch.arange(order.shape[1], device=order.device))
            if eig is not None:
                eig = torch.where(ok[:, None], eig, self._stack(jobs, "_eig"))
        R = Q_new.mT @ old  # (b, d, d): old eigen-coordinates -> new
        # one batch per side and moment block shape (consecutive: _factor_jobs), a block with both factors rotated
        # by its left batch and by its right batch (the two rotations commute)
        start = 0
        for (side, (rows, cols)), same in itertools.groupby((job[2], tuple(job[3][job[1]].shape)) for job in jobs):
            at = slice(start, start + len(list(same)))
            start = at.stop
            r, o = R[at], order[at]
            ms, vs = [job[3][job[1]] for job in jobs[at]], [job[4][job[1]] for job in jobs[at]]
            M, V = torch.stack(ms), torch.stack(vs)  # (b', rows, cols)
            if side == "left":
                rotated, V = r @ M, V.gather(1, o[:, :, None].expand(-1, -1, cols))
            else:
                rotated, V = M @ r.mT, V.gather(2, o[:, None, :].expand(-1, rows, -1))
            if live is not None:
                rotated = torch.where(ok[at, None, None], rotated, M)
            for slot, X in ((3, rotated), (4, V)):
                copy_matrices([job[slot][job[1]] for job in jobs[at]], X)
        self._write(jobs, "_basis", Q_new)
        if eig is not None:
            self._write(jobs, "_eig", eig)
