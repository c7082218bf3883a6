r"""NorMuon and AdaMuon: Muon's orthogonalized update, normalized by a second moment kept on it.

For a matrix parameter :math:`W \in \mathbb{R}^{m \times n}` (``(out, in)``) with gradient :math:`G_t`, both keep
Muon's momentum and orthogonalization (:mod:`matrixopt.optim.muon`):

.. math::
    B_t = \mu B_{t-1} + (1 - \mu) G_t, \qquad U_t = (1 - \mu) G_t + \mu B_t \text{ (Nesterov) or } B_t,
    \qquad O_t = \mathrm{NS}(U_t)

**NorMuon** (Li et al., "NorMuon: Making Muon more efficient and scalable", arXiv:2510.05491) keeps one second
moment per neuron (row of W, an output feature):

.. math::
    v_t = \beta_2 v_{t-1} + (1 - \beta_2)\, \mathrm{mean}_{\mathrm{cols}}(O_t \odot O_t) \in \mathbb{R}^m,
    \qquad \hat O_t = \mathrm{diag}(\sqrt{v_t} + \epsilon)^{-1} O_t

**AdaMuon** (Si et al., "AdaMuon: Adaptive Muon Optimizer", arXiv:2507.11005) orthogonalizes the momentum's
sign (its sign-stabilized form, ``sign_stabilize=True``) and keeps an element-wise second moment:

.. math::
    O_t = \mathrm{NS}(\mathrm{sign}(U_t)), \qquad V_t = \beta_2 V_{t-1} + (1 - \beta_2)\, O_t \odot O_t,
    \qquad \hat O_t = O_t \oslash (\sqrt{V_t} + \epsilon)

Both then align the update's size with an orthogonal matrix's (Frobenius norm :math:`\sqrt{\min(m, n)}`) and
apply Muon's update scaling :math:`s(m, n)` and weight decay:

.. math::
    W_t = W_{t-1} - \eta\lambda W_{t-1} - \eta\, s(m, n) \sqrt{\min(m, n)}\, \hat O_t / \|\hat O_t\|_F

With the default ``scaling="match_adamw"``, :math:`s = 0.2\sqrt{\max(m, n)}`, this is both papers' RMS-aligned
step :math:`0.2\,\eta \sqrt{mn}\, \hat O_t / \|\hat O_t\|_F` (update RMS 0.2, as AdamW's), so AdamW's learning
rate transfers. There is no bias correction: the normalization by the Frobenius norm removes any common scale
of :math:`v_t`, and the papers have none. Orthogonalizing a sign matrix makes AdaMuon's Newton–Schulz input
scale-free (every entry ±1 or 0).

The second moments are float32 state, ``row_second_moment`` (NorMuon: one value per row of each matrix piece,
:func:`matrixopt.optim.layout.row_state`) and ``exp_avg_sq`` (AdaMuon: the parameter's shape). Same-shape
matrices are still orthogonalized as one batch; the normalization is batched too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from matrixopt.kernels.muon_elementwise import matrix_count, row_sums_of_squares, second_moment_normalize
from matrixopt.linalg.ortho import DEFAULT_SCHEDULE
from matrixopt.optim.base import _check_finite
from matrixopt.optim.layout import Bucket, matrix_pieces, row_pieces, row_state
from matrixopt.optim.muon import Muon
from matrixopt.optim.offload import Offload


class _SecondMomentMuon(Muon):
    """Muon with a second moment on the orthogonalized update (module docstring); subclasses say where it lives
    (``_second_moment``, ``_views``) and how it steps and applies it (``_moments``)."""

    _state_key: str
    streams_state = False  # the update reads the second moment after Newton–Schulz: a chunk's state moves whole

    def __init__(self, params: Iterable[Any], lr: float | Tensor = 1e-3, momentum: float = 0.95,
                 beta2: float = 0.95, eps: float = 1e-8, nesterov: bool = True, weight_decay: float = 0.01,
                 ns_steps: int = 5, ns_coefficients: Any = DEFAULT_SCHEDULE, ns_dtype: torch.dtype | None = None,
                 scaling: str = "match_adamw", *, weight_decay_mode: str = "decoupled", ns_method: str = "auto",
                 adamw_lr: float | None = None, adamw_betas: tuple[float, float] = (0.9, 0.999),
                 adamw_eps: float = 1e-8, adamw_weight_decay: float | None = None, skip_nonfinite: bool = False,
                 deferred_nonfinite: bool = False, cuda_graph: bool = False, state_dtype: Any = None,
                 offload: str | Offload | None = None, **options: Any) -> None:
        self._extra_defaults = dict(beta2=beta2, eps=eps) | self._options(dict(options))
        super().__init__(params, lr, momentum, nesterov, weight_decay, ns_steps, ns_coefficients, ns_dtype, scaling,
                         adamw_lr=adamw_lr, adamw_betas=adamw_betas, adamw_eps=adamw_eps,
                         adamw_weight_decay=adamw_weight_decay, skip_nonfinite=skip_nonfinite,
                         deferred_nonfinite=deferred_nonfinite, cuda_graph=cuda_graph, ns_method=ns_method,
                         weight_decay_mode=weight_decay_mode, state_dtype=state_dtype, offload=offload)

    def _options(self, given: dict[str, Any]) -> dict[str, Any]:
        """The subclass's own matrix-group options, from the constructor's keyword arguments ``given``, with their
        defaults; an argument no option takes raises TypeError."""
        if given:
            raise TypeError(f"{type(self).__name__} got unexpected keyword arguments: {', '.join(given)}")
        return {}

    def __getstate__(self) -> dict[str, Any]:
        return super().__getstate__() | {"_extra_defaults": self._extra_defaults}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = dict(param_group)
        if group.get(self.matrix_flag, True):
            for k, v in self.__dict__.get("_extra_defaults", {}).items():
                group.setdefault(k, v)
        super().add_param_group(group)

    def _validate_matrix_group(self, group: dict[str, Any]) -> None:
        super()._validate_matrix_group(group)
        _check_finite("beta2", group["beta2"])
        if not 0.0 <= group["beta2"] < 1.0:
            raise ValueError(f"Invalid beta2: {group['beta2']} (the second moment's decay; must be in [0, 1))")
        _check_finite("eps", group["eps"])
        if not group["eps"] > 0:
            raise ValueError(f"Invalid eps: {group['eps']} (added to the second moment's square root; must be > 0)")

    def _second_moment(self, p: Tensor) -> tuple[Tensor, list[Tensor]]:
        """A new zero second moment for parameter ``p`` and its views per matrix piece."""
        raise NotImplementedError

    def _moments(self, group: dict[str, Any], O: Tensor, state: list[Tensor],
                 skip: Tensor | None) -> tuple[Tensor | None, Tensor | None, Tensor]:
        """The second-moment step on ``O (k, r, c)``, k matrices (or row blocks of them) laid out rows first (a row
        is a neuron, an output feature), with ``state`` their k second-moment views as the matrices lie. Updates
        the state in place unless ``skip`` (a 0-d device flag) is nonzero, and may write ``out`` over O. Returns
        ``(out, row_factor, row_sq)``: the normalized update is ``row_factor[:, :, None] * out`` (``out`` None: O
        itself; ``row_factor`` None: 1), and ``row_sq (k, r)`` float32 holds its squared norm per row, from which
        the RMS alignment follows (summed over ranks when the rows are sharded)."""
        raise NotImplementedError

    def _normalize(self, group: dict[str, Any], bk: Bucket, O: Tensor,
                   skip: Tensor | None) -> tuple[Tensor, Tensor]:
        """The update from the bucket's orthogonalized stack ``O (b, s, l)`` (the iteration's dtype), as
        ``(update (b, s, l), row_scale (b, l))`` for the update kernel: the second moments' normalization and the
        RMS alignment to an orthogonal ``(s, l)`` matrix's Frobenius norm sqrt(s) (module docstring), the scale
        per row of each matrix as it lies. Runs eagerly inside torch.compile (``torch.compiler.disable`` on the
        subclasses': their per-matrix layout logic does not trace with symbolic shapes)."""
        raise NotImplementedError

    def _adaptation(self, group: dict[str, Any],
                    params: list[Tensor]) -> tuple[list[list[Tensor]], Callable[..., tuple[Tensor, Tensor]]]:
        extras = []
        for p in params:
            st = self.state[p]
            if self._state_key not in st:
                st[self._state_key] = self._second_moment(p)
            extras.append(self._views(p, st[self._state_key]))
        return extras, lambda bk, Y, skip: self._normalize(group, bk, Y, skip)

    def _views(self, p: Tensor, v: Tensor) -> list[Tensor]:
        raise NotImplementedError

    def _adaptation_key(self, group: dict[str, Any]) -> tuple:
        return tuple(group[k] for k in self._extra_defaults)


class NorMuon(_SecondMomentMuon):
    """NorMuon: Muon whose orthogonalized update is normalized per neuron (row) by a running second moment
    (module docstring; Li et al., arXiv:2510.05491).

    Args:
        params, lr, momentum, nesterov, weight_decay, weight_decay_mode, ns_steps, ns_coefficients, ns_dtype,
            ns_method, scaling, adamw_*, skip_nonfinite, deferred_nonfinite, cuda_graph, state_dtype, offload: as in
            :class:`matrixopt.Muon`
            (``scaling="match_adamw"`` makes the update RMS 0.2, so an AdamW learning rate works).
        beta2: decay of the per-row second moment, in [0, 1) (default 0.95, the paper's).
        eps: added to its square root (default 1e-8).

    State per matrix parameter: ``momentum_buffer`` (float32, the parameter's shape) and ``row_second_moment``
    (float32, one value per row of each matrix: ``(out,)`` for an ``(out, in)`` weight, ``(E, out)`` for stacked
    experts). ``cuda_graph=True`` captures the step as Muon's, the second moments included.
    """

    _state_key = "row_second_moment"

    def _second_moment(self, p: Tensor) -> Tensor:
        return row_state(p)

    def _views(self, p: Tensor, v: Tensor) -> list[Tensor]:
        return row_pieces(p, v)

    @torch.compiler.disable
    def _normalize(self, group: dict[str, Any], bk: Bucket, O: Tensor,
                   skip: Tensor | None) -> tuple[Tensor, Tensor]:
        b, s, l = O.shape
        sumsq_all = row_sums_of_squares(O, bk.params)  # (b, l): per row of each W_i as it lies, one read of O
        counts = [matrix_count(p) for p in bk.params]  # the stack's slots, view by view
        sums = sumsq_all.split(counts)
        tall = [bk.tall(j) for j in range(len(counts))]
        scales: dict[int, Tensor] = {}  # view -> its (E, l) block of the kernel's row scale
        for is_tall in sorted(set(tall)):  # one batch per orientation: a tall matrix's rows are the stack's columns
            views = [j for j, t in enumerate(tall) if t == is_tall]
            r, c = (l, s) if is_tall else (s, l)
            # slices, not an index tensor: capturable in a CUDA graph
            sumsq = sumsq_all[:, :r] if len(views) == len(counts) else torch.cat([sums[j][:, :r] for j in views])
            inv, row_sq = self._row_step(group, sumsq, c, [bk.extra[j] for j in views], skip)
            norm = row_sq.sum(-1, keepdim=True).sqrt_()  # (k, 1): the normalized update's Frobenius norm
            scale = inv * torch.where(norm > 0, s**0.5 / norm, 0.0)  # (k, r)
            padded = torch.nn.functional.pad(scale, (0, l - r))  # (k, l): the kernel's
            scales.update(zip(views, padded.split([counts[j] for j in views])))
        return O, torch.cat([scales[j] for j in range(len(counts))])  # (b, l); O itself is not rewritten

    def _moments(self, group: dict[str, Any], O: Tensor, state: list[Tensor],
                 skip: Tensor | None) -> tuple[None, Tensor, Tensor]:
        sumsq = row_sums_of_squares(O, [O], transpose=False)[:, :O.shape[1]]
        return None, *self._row_step(group, sumsq, O.shape[2], state, skip)

    def _row_step(self, group: dict[str, Any], sumsq: Tensor, cols: int, state: list[Tensor],
                  skip: Tensor | None) -> tuple[Tensor, Tensor]:
        """The per-row second moments stepped from ``sumsq (k, r)``, the sums of squares of the rows (``cols``
        long) of k matrices, with ``state`` their ``(r,)`` views, or ``(E, r)`` for a stack of E: returns
        ``(inv, row_sq)``, the normalization diag(sqrt(v) + eps)^-1 and the normalized rows' sums of squares, both
        ``(k, r)``. All of it comes from the sums (||D O_r||^2 = d_r^2 ||O_r||^2 for a diagonal D), and the update
        kernel applies the scale per row as it writes W: O itself is never rewritten."""
        rows = [v.reshape(-1, v.shape[-1]) for v in state]  # (E, r) views of the state, (1, r) for a matrix
        old = torch.cat(rows)  # (k, r)
        new = old.lerp(sumsq / cols, 1 - group["beta2"])
        if skip is not None:  # a skipped step's O is not even finite: keep the moments, without a host sync
            new = torch.where(skip != 0, old, new)
        torch._foreach_copy_(rows, list(new.split([v.shape[0] for v in rows])))
        inv = new.sqrt_().add_(group["eps"]).reciprocal_()
        return inv, inv.square() * sumsq


class AdaMuon(_SecondMomentMuon):
    """AdaMuon: Muon on the momentum's sign, its orthogonalized update normalized element-wise by a running second
    moment (module docstring; Si et al., arXiv:2507.11005).

    Args:
        params, lr, momentum, nesterov, weight_decay, weight_decay_mode, ns_steps, ns_coefficients, ns_dtype,
            ns_method, scaling, adamw_*, skip_nonfinite, deferred_nonfinite, cuda_graph, state_dtype, offload: as in
            :class:`matrixopt.Muon`
            (``scaling="match_adamw"`` makes the update RMS 0.2, so an AdamW learning rate works).
        beta2: decay of the element-wise second moment, in [0, 1) (default 0.95).
        eps: added to its square root (default 1e-8).
        sign_stabilize: orthogonalize ``sign(U)`` rather than ``U`` (default True, the paper's); param groups may
            set it too.

    State per matrix parameter: ``momentum_buffer`` and ``exp_avg_sq`` (float32, the parameter's shape).
    ``cuda_graph=True`` captures the step as Muon's, the second moments included.
    """

    matrix_state_tensors = 2  # momentum and the element-wise second moment

    _state_key = "exp_avg_sq"

    def _options(self, given: dict[str, Any]) -> dict[str, Any]:
        sign_stabilize = given.pop("sign_stabilize", True)
        return super()._options(given) | {"sign_stabilize": sign_stabilize}

    def _validate_matrix_group(self, group: dict[str, Any]) -> None:
        super()._validate_matrix_group(group)
        if not isinstance(group["sign_stabilize"], bool):
            raise ValueError(f"Invalid sign_stabilize: {group['sign_stabilize']!r} (must be True or False)")

    def _second_moment(self, p: Tensor) -> Tensor:
        return torch.zeros(p.shape, dtype=torch.float32, device=p.device)

    def _views(self, p: Tensor, v: Tensor) -> list[Tensor]:
        return matrix_pieces(p, v)

    def _pack_sign(self, group: dict[str, Any]) -> bool:
        return group["sign_stabilize"]  # sign(U) from the momentum pass, its sums of squares with it

    @torch.compiler.disable
    def _normalize(self, group: dict[str, Any], bk: Bucket, O: Tensor,
                   skip: Tensor | None) -> tuple[Tensor, Tensor]:
        # Element-wise moments need no rows-first layout: one pass over the stack as it lies (each state read as
        # its matrix lies, transposed in the kernel for tall ones), the update written over O
        b, s, l = O.shape
        row_sq = second_moment_normalize(O, bk.extra, group["beta2"], group["eps"], skip=skip)
        norm = row_sq.sum(-1).sqrt_()  # (b,)
        return O, torch.where(norm > 0, s**0.5 / norm, 0.0)[:, None].expand(b, l).contiguous()

    def _moments(self, group: dict[str, Any], O: Tensor, state: list[Tensor],
                 skip: Tensor | None) -> tuple[Tensor, None, Tensor]:
        row_sq = second_moment_normalize(O, state, group["beta2"], group["eps"], transpose=False, skip=skip)
        return O, None, row_sq[:, :O.shape[1]]
