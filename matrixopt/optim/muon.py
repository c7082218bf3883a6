r"""Muon (momentum orthogonalized by Newton–Schulz) and MOP (momentum orthogonalized by the exact polar factor).

For each matrix parameter W with gradient G (Keller Jordan, https://kellerjordan.github.io/posts/muon/):

.. math::
    B_t = \mu B_{t-1} + (1 - \mu) G_t, \qquad
    U_t = \mathrm{polar}\big(\mathrm{nesterov}\ ?\ (1-\mu) G_t + \mu B_t : B_t\big), \qquad
    W_t = (1 - \eta\lambda) W_{t-1} - \eta\, s(m, n)\, U_t

``polar`` is approximated by Newton–Schulz (Muon) or computed by an SVD (MOP). ``s(m, n)`` is the update scale
for an ``(m, n) = (out, in)`` matrix:

- ``"match_adamw"`` (default): ``0.2 * sqrt(max(m, n))``, so the update's RMS is about 0.2 like AdamW's
  (Moonlight, arXiv:2502.16982): one AdamW learning rate serves the matrix and the AdamW groups.
- ``"original"``: ``sqrt(max(1, m / n))`` (Keller Jordan's Muon).
- ``"spectral"``: ``sqrt(m / n)`` for ``(out, in)`` weights (spectral-norm scaling).

Groups with ``use_muon=False`` are updated by AdamW inside the same optimizer (their own lr, betas, eps and
weight decay), so one object works with LR schedulers, gradient clipping and training frameworks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from matrixopt.kernels import muon_elementwise
from matrixopt.linalg.ortho import DEFAULT_SCHEDULE, NewtonSchulzConfig, newton_schulz_short_side, polar
from matrixopt.optim.base import MatrixOptimizer, _check_finite, _pack, adamw_group_defaults, check_decay, check_lr
from matrixopt.optim.graphed import CapturedMuonStep
from matrixopt.optim.layout import (
    Bucket,
    bucket_keys,
    momentum_buckets,
    orthogonalized_momentum_step,
    orthogonalized_update,
    views_in_place,
)
from matrixopt.optim.offload import Offload, StagedStep

SCALINGS = ("match_adamw", "original", "spectral")


def update_scale(scaling: str, m: int, n: int) -> float:
    """Multiplier of the orthogonalized update of an ``(m, n) = (out, in)`` matrix."""
    if scaling == "match_adamw":
        return 0.2 * math.sqrt(max(m, n))
    if scaling == "original":
        return math.sqrt(max(1.0, m / n))
    if scaling == "spectral":
        return math.sqrt(m / n)
    raise ValueError(f"Unknown update scaling {scaling!r}; use one of {SCALINGS}")


def ns_config(group: dict[str, Any]) -> NewtonSchulzConfig:
    """The Newton–Schulz settings of a Muon param group (its ``ns_*`` keys), checked."""
    return NewtonSchulzConfig(steps=group["ns_steps"], coefficients=group["ns_coefficients"],
                              dtype=group["ns_dtype"], method=group["ns_method"])


def _fingerprint(tensors: list[Tensor]) -> tuple:
    """Where each tensor lies: address, strides and dtype (what a captured step's address tables depend on)."""
    return tuple((t.data_ptr(), t.stride(), t.dtype) for t in tensors)


class Muon(MatrixOptimizer):
    """Muon: SGD-momentum whose update is orthogonalized by Newton–Schulz.

    Args:
        params: parameters or param groups. Groups default to ``use_muon=True``; a group with
            ``use_muon=False`` is updated by AdamW. Use :func:`matrixopt.param_groups` to route a model.
        lr: learning rate (default 1e-3: with ``scaling="match_adamw"`` an AdamW learning rate works).
        momentum: in [0, 1) (default 0.95). nesterov: Nesterov momentum (default True).
        weight_decay: weight decay (default 0.01), in the form ``weight_decay_mode`` names: "decoupled" (default,
            ``W *= 1 - lr * weight_decay``), "independent" (``W *= 1 - weight_decay``) or "cautious" (decoupled,
            only where the update and the weight agree in sign; :mod:`matrixopt.kernels.decay`), for the matrix
            and the AdamW groups.
        ns_steps: Newton–Schulz iterations (default 5).
        ns_coefficients: "modded_nanogpt" (default: modded-nanogpt's 5-step table), "quintic" (Keller Jordan's
            (3.4445, -4.7750, 2.0315), torch.optim.Muon's default), "polar_express", "cans" or a list of (a, b, c)
            (:mod:`matrixopt.linalg.ortho`).
        ns_dtype: iteration dtype; None means bfloat16 on CUDA, float32 on CPU.
        ns_method: "auto" (default), "standard" or "gram": how Newton–Schulz is computed. "gram" iterates on
            each matrix's ``(s, s)`` Gram matrix (:func:`matrixopt.linalg.ortho.gram_newton_schulz`): the same
            iterates with up to 42% fewer FLOPs for wide or tall matrices, run in float16 where ``ns_dtype`` is
            bfloat16. "auto" takes it for matrices at least 1.5 times longer than wide (launched eagerly on CUDA,
            only for large stacks, whose FLOPs saved outweigh its extra launches: ``ortho.uses_gram``).
        scaling: "match_adamw" (default), "original" or "spectral".
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: defaults of the AdamW groups (lr and weight decay
            default to ``lr`` and ``weight_decay``).
        skip_nonfinite: skip (and count) the update of a parameter whose gradient is NaN/Inf instead of raising.
        deferred_nonfinite: check the gradients without a host sync: a step with a NaN/Inf gradient is skipped on
            the GPU (no parameter or state written) and ``NonFiniteGradientError`` is raised by the next
            ``step()``, ``state_dict()`` or ``raise_deferred_nonfinite()`` instead of by this one. The sync costs
            a training loop its lead over the GPU (the next forward then waits on the host); the trainer sets
            this. Matrices the fused kernels can't take (off CUDA, non-unit column stride) and AdamW parameters
            that are not float32 still check on the host. Not with ``skip_nonfinite``.
        cuda_graph: on CUDA, capture the matrix groups' step (fused momentum pass, Newton–Schulz, fused update) in
            one CUDA graph per set of parameters, after one eager step, and replay it: one launch instead of ~20
            kernels per bucket, for models whose step is bound by the host (on an H100: 3.7x faster on a toy GPT,
            4% on GPT-2-small, 3% slower on GPT-2-medium; docs/results/bench). Costs the graph's memory (each
            bucket's stacks). The learning rate may change; a change of another matrix-group setting captures
            anew. While the gradients, parameters and momentum stay at the same addresses (gradients zeroed or
            overwritten in place, or reallocated where they were), a step is one replay and little host work.
            Ignored off CUDA and without Triton (:mod:`matrixopt.optim.graphed`), and with ``state_dtype`` or
            ``offload``.
        state_dtype: how the momentum (and the AdamW groups' moments, and AdaMuon's second moment) is stored:
            None (default, float32), ``torch.bfloat16`` or ``"bf16"`` (2 bytes a value instead of 4), or ``"int8"``
            (the AdamW groups' moments in 1 byte and a float32 scale per 256 values, the momentum in bfloat16).
            Stochastically rounded, so the rounding error is carried in expectation; every step computes in
            float32 (:mod:`matrixopt.optim.state`, which has the table of bytes per parameter).
        offload: None (default) or ``"cpu"``: the optimizer state lives in CPU memory (pinned where CUDA is
            available); each step brings one chunk of it to the parameters' device at a time, overlapped with the
            previous chunk's update, and stores it back. With float32 state the parameters are bit for bit those of
            the step without offload. The step is all or nothing: an exception mid-step leaves parameters and
            state as they were (:mod:`matrixopt.optim.offload`). Host memory: twice the state plus the parameters.

    Parameters of matrix groups: 2-D ``(out, in)``; conv kernels ``(out, in, ...)`` (flattened); stacked experts
    ``(E, out, in)`` marked with :func:`matrixopt.mark_experts`; fused weights marked with
    :func:`matrixopt.mark_split`. Any float dtype; the momentum buffer is float32. Same-shape matrices are
    orthogonalized together in one batched call.
    """

    cuda_graph = False  # MOP and optimizers unpickled from before the option keep the eager step
    _added_options = ("ns_method", "weight_decay_mode")

    def __init__(self, params: Iterable[Any], lr: float | Tensor = 1e-3, momentum: float = 0.95,
                 nesterov: bool = True, weight_decay: float = 0.01, ns_steps: int = 5,
                 ns_coefficients: Any = DEFAULT_SCHEDULE, ns_dtype: torch.dtype | None = None,
                 scaling: str = "match_adamw", *, adamw_lr: float | None = None,
                 adamw_betas: tuple[float, float] = (0.9, 0.999), adamw_eps: float = 1e-8,
                 adamw_weight_decay: float | None = None, skip_nonfinite: bool = False,
                 deferred_nonfinite: bool = False, cuda_graph: bool = False, ns_method: str = "auto",
                 weight_decay_mode: str = "decoupled", state_dtype: Any = None,
                 offload: str | Offload | None = None) -> None:
        matrix_defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                               weight_decay_mode=weight_decay_mode, ns_steps=ns_steps,
                               ns_coefficients=ns_coefficients, ns_dtype=ns_dtype, ns_method=ns_method,
                               scaling=scaling)
        adamw_defaults = adamw_group_defaults(lr, weight_decay, weight_decay_mode, adamw_lr, adamw_betas,
                                              adamw_eps, adamw_weight_decay)
        self.cuda_graph = bool(cuda_graph)
        # the fused kernels (and the captured step) skip on the deferred check's flag; the momentum pass applies
        # clip_grad_norm_'s coefficient as it reads a gradient
        super().__init__(params, matrix_defaults, adamw_defaults, skip_nonfinite=skip_nonfinite,
                         deferred_nonfinite=deferred_nonfinite, clip_in_step=True, state_dtype=state_dtype,
                         offload=offload)

    def __getstate__(self) -> dict[str, Any]:
        return super().__getstate__() | {"cuda_graph": self.cuda_graph}  # captured graphs are not pickled

    def _validate_matrix_group(self, group: dict[str, Any]) -> None:
        check_lr(group["lr"])
        mu = group["momentum"]
        _check_finite("momentum", mu)
        if not 0.0 <= mu < 1.0:
            raise ValueError(f"Invalid momentum value: {mu} (must be in [0, 1))")
        check_decay(group)
        if group["scaling"] not in SCALINGS:
            raise ValueError(f"Unknown update scaling {group['scaling']!r}; use one of {SCALINGS}")
        self._validate_orthogonalizer(group)

    def _validate_orthogonalizer(self, group: dict[str, Any]) -> None:
        if not isinstance(group["ns_steps"], int) or group["ns_steps"] < 1:
            raise ValueError(f"Invalid ns_steps: {group['ns_steps']!r} (must be an int >= 1)")
        ns_config(group)

    def _orthogonalize(self, group: dict[str, Any], X: Tensor, parts: Tensor | None = None) -> Tensor:
        """``polar(X)`` approximated: ``(b, s, l)`` short side first -> same shape, in the iteration dtype.
        ``parts``: X's partial sums of squares from the momentum pass, or None (see ``newton_schulz_short_side``)."""
        return newton_schulz_short_side(X, ns_config(group), parts)

    def _stack_dtype(self, group: dict[str, Any], device: torch.device) -> torch.dtype:
        """The dtype updates are packed in for ``_orthogonalize``: Newton–Schulz's iteration dtype (``ns_dtype``,
        else bfloat16 on CUDA and float32 elsewhere)."""
        return ns_config(group).iteration_dtype(device)

    @staticmethod
    def _device_lr(group: dict[str, Any], device: torch.device) -> float | Tensor:
        """The group's learning rate: a float, or a tensor (a scheduler's) moved to ``device`` without a sync."""
        lr = group["lr"]
        return lr.to(device) if isinstance(lr, Tensor) else lr

    def _momentum_buffers(self, params: list[Tensor]) -> list[Tensor]:
        """Each parameter's float32 momentum, zeros on its first step."""
        bufs = []
        for p in params:
            st = self.state[p]
            if not st:
                st["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32,
                                                         memory_format=torch.preserve_format)
            bufs.append(st["momentum_buffer"])
        return bufs

    def _step_options(self, group: dict[str, Any], device: torch.device) -> dict[str, Any]:
        """The keyword arguments of :func:`~matrixopt.optim.layout.orthogonalized_momentum_step` that ``group``
        sets."""
        return dict(momentum=group["momentum"], nesterov=group["nesterov"],
                    fn=lambda X, parts: self._orthogonalize(group, X, parts), dtype=self._stack_dtype(group, device),
                    scale=lambda m, n: update_scale(group["scaling"], m, n), weight_decay=group["weight_decay"],
                    decay_mode=group["weight_decay_mode"], sign=self._pack_sign(group))

    def _matrix_update(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                       skip: Tensor | None = None) -> None:
        bufs = self._momentum_buffers(params)
        extras, adapt = self._adaptation(group, params)
        flat_extras = [t for ts in extras or () for t in ts]
        graph = self.cuda_graph and not self._staging  # staged state moves from step to step: no graphs
        fingerprint = _fingerprint([*params, *grads, *bufs, *flat_extras]) if graph and params[0].is_cuda else None
        if fingerprint is not None and self._replay_again(group, params, grads, fingerprint, skip, flat_extras):
            return
        keys = [self._staged_keys[p] for p in params] if self._staging else None  # the whole step's batches
        buckets, copies = momentum_buckets(params, grads, bufs, extras, keys)
        # whether every bucket suits the fused kernels, judged once per step (the graph and the skip both ask)
        fusable = not copies and all(muon_elementwise.fusable(bk.params, bk.grads, bk.bufs) for bk in buckets)
        if skip is not None and not (fusable and all(muon_elementwise.skips_on_device(bk.params) for bk in buckets)):
            if self.nonfinite.on_host(skip):  # these layouts can't skip on the device: check on the host now
                return
            skip = None
        lr = self._device_lr(group, params[0].device)
        step = self._step_options(group, params[0].device)
        grad_scale = self._step_grad_scale
        if not (graph and fusable and self._graph_step(group, params, grads, buckets, lr, skip, grad_scale,
                                                                 dict(step, adapt=adapt), fingerprint, flat_extras)):
            orthogonalized_momentum_step(buckets, copies, lr=lr, skip=skip, grad_scale=grad_scale, adapt=adapt,
                                         **step)

    def _state_chunks(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor]) -> list[list[int]]:
        """As the base class's, for a matrix group: parameters whose pieces share a Newton–Schulz batch (a bucket
        of :func:`~matrixopt.optim.layout.momentum_buckets`) stay in one chunk, and each chunk's update batches
        its pieces as the whole step does (the batches are kept in ``_staged_keys`` for it)."""
        if not group[self.matrix_flag]:
            return super()._state_chunks(group, params, grads)
        keys = bucket_keys(params, grads)
        self.__dict__.setdefault("_staged_keys", {}).update(zip(params, keys))
        parent = list(range(len(params)))

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        owner: dict[tuple, int] = {}
        for i, piece_keys in enumerate(keys):
            for key in piece_keys:
                j = owner.setdefault(key, i)
                parent[root(i)] = root(j)
        units: dict[int, list[int]] = {}
        for i in range(len(params)):
            units.setdefault(root(i), []).append(i)
        return _pack(list(units.values()), [p.numel() for p in params])

    streams_state = True
    """Whether the update reads a matrix's state in the momentum pass only, so that an offloaded chunk's state may
    move in sub-chunks (:meth:`_stream_units`) and a sharded optimizer's bucket stores its state back right after
    that pass: not where the update reads further state after Newton–Schulz (NorMuon's and AdaMuon's second
    moments)."""

    def _stream_units(self, group: dict[str, Any], params: list[Tensor]) -> list[list[int]] | None:
        """For an offloaded chunk of a matrix group (whole Newton–Schulz batches, as the step without offload
        batches them): indices of ``params`` in the sub-chunks whose momentum moves to the device one at a time,
        each up to ``CHUNK_NUMEL`` values (or one larger parameter), in order. None where the chunk moves whole:
        state not offloaded, an update that reads further state, or a parameter laid out so that its matrices are
        copies (a channels_last conv kernel)."""
        if self.offload is None or not self.streams_state or not group[self.matrix_flag]:
            return None
        if not all(views_in_place(p, p) for p in params):
            return None
        units = _pack([[i] for i in range(len(params))], [p.numel() for p in params])
        return units if len(units) > 1 else None

    def _streamed_update(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                         units: list[list[int]], staged: StagedStep) -> None:
        """The step of an offloaded matrix chunk whose momentum moves in sub-chunks (``units``, from
        :meth:`_stream_units`): each sub-chunk's state is staged, its momentum pass packs its matrices into the
        chunk's stacks (on the copy pipeline's stream on CUDA, overlapping the last chunk's Newton–Schulz), and
        it is stored back; then each stack's Newton–Schulz and update run as the whole step's. The device holds
        a few sub-chunks' state, not the chunk's; the batches, and so the results, are the step's without
        offload."""
        device = params[0].device
        keys = [self._staged_keys[p] for p in params]
        step = self._step_options(group, device)
        whole, _ = momentum_buckets(params, grads, grads, None, keys)  # the batches (gradients stand for momentum)
        stacks: dict[tuple, Tensor] = {}
        filled = {bk.key: 0 for bk in whole}
        parts: dict[tuple, list[Tensor | None]] = {bk.key: [] for bk in whole}

        def pack(unit: list[int]) -> None:  # one sub-chunk: staged, packed into the stacks, stored back
            ps, gs = [params[i] for i in unit], [grads[i] for i in unit]
            staged.stage(ps)
            sub, _ = momentum_buckets(ps, gs, self._momentum_buffers(ps), None, [keys[i] for i in unit])
            for bk in sub:
                n, start = bk.count, filled[bk.key]
                parts[bk.key].append(muon_elementwise.momentum_pack(
                    bk.grads, bk.bufs, stacks[bk.key][start:start + n], step["momentum"], step["nesterov"],
                    grad_scale=self._step_grad_scale, sign=step["sign"]))
                filled[bk.key] = start + n
            staged.unstage(ps)

        with staged.pack_stream(device):  # the stacks too: the stream that fills them allocates them
            stacks.update((bk.key, staged.stack((bk.count, bk.s, bk.l), step["dtype"], device)) for bk in whole)
            for unit in units:
                pack(unit)
        staged.packed(device, [*stacks.values(), *(t for ts in parts.values() for t in ts if t is not None)])
        lr = self._device_lr(group, device)
        for bk in whole:
            got = parts[bk.key]
            P = None if any(t is None for t in got) else torch.cat(got)
            orthogonalized_update(bk, stacks[bk.key], P, fn=step["fn"], scale=step["scale"], lr=lr,
                                  weight_decay=step["weight_decay"], decay_mode=step["decay_mode"])
        staged.chunk_done(device)

    def _adaptation(self, group: dict[str, Any],
                    params: list[Tensor]) -> tuple[list[list[Tensor]] | None, Callable[..., Tensor] | None]:
        """``(extras, adapt)`` for :func:`~matrixopt.optim.layout.orthogonalized_momentum_step`: per parameter the
        views of further state its buckets carry, and the map of each orthogonalized stack to the update; Muon
        has neither (NorMuon and AdaMuon do, :mod:`matrixopt.optim.adaptive`)."""
        return None, None

    def _pack_sign(self, group: dict[str, Any]) -> bool:
        """Whether Newton–Schulz orthogonalizes the update's sign rather than the update (AdaMuon's
        sign-stabilized form): the momentum pass then packs the sign."""
        return False

    _MAX_GRAPHS = 8  # captured steps kept per optimizer (one per set of parameters with gradients and settings)

    def _graph_key(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                   extras: list[Tensor]) -> tuple:
        """What a captured step is specific to: the parameters, the gradients' dtypes, the group's settings and
        where further state (NorMuon's, AdaMuon's second moments, which the graph's torch ops address) lies."""
        return (id(group), tuple(map(id, params)), tuple(g.dtype for g in grads), group["momentum"],
                group["nesterov"], group["weight_decay"], group["weight_decay_mode"], group["scaling"],
                ns_config(group), self._adaptation_key(group), tuple(t.data_ptr() for t in extras))

    def _adaptation_key(self, group: dict[str, Any]) -> tuple:
        """The group settings ``_adaptation`` reads (none for Muon)."""
        return ()

    def _capturable(self) -> bool:
        """Whether ``_orthogonalize`` can be captured in a CUDA graph: Muon's Newton–Schulz can; MOP's SVD and
        subclasses that orthogonalize through collectives cannot."""
        return type(self)._orthogonalize is Muon._orthogonalize

    def _graph_step(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor], buckets: list[Bucket],
                    lr: float | Tensor, skip: Tensor | None, grad_scale: Tensor | None, step: dict[str, Any],
                    fingerprint: tuple, extras: list[Tensor]) -> bool:
        """The step through a captured CUDA graph, for buckets the fused kernels take; False where it can't be
        (then the caller steps eagerly): off CUDA, without Triton, for subclasses that orthogonalize otherwise
        (MOP's SVD, collectives), and on the first step of a new set of parameters or settings, which runs eagerly
        so that every kernel is compiled, tuned and dispatched before capture."""
        device = params[0].device
        if (device.type != "cuda" or not self._capturable()
                or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing()
                or muon_elementwise.fused_kernels() is None or any(p.device != device for p in params)):
            return False
        key = self._graph_key(group, params, grads, extras)
        graphs = self.__dict__.setdefault("_graphs", {})
        captured = graphs.get(key)
        if captured is None:
            if len(graphs) < self._MAX_GRAPHS:
                graphs[key] = "warm"  # this eager step warms the kernels up; the next one captures
            return False
        if captured == "warm":
            captured = graphs[key] = CapturedMuonStep(buckets, **step)
        captured.replay(buckets, lr, skip, grad_scale)
        self.__dict__.setdefault("_last_replay", {})[id(group)] = (key, fingerprint, captured)
        return True

    def _replay_again(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor], fingerprint: tuple,
                      skip: Tensor | None, extras: list[Tensor]) -> bool:
        """The group's last captured step replayed again, when this step's parameters, gradients and momentum lie
        where that step's did (addresses, strides and dtypes: the graph's address tables still hold) and the
        settings are the same; False otherwise. The usual case in training (gradients come back at the same
        addresses step after step): it skips regrouping the matrices, which costs the host more than the replay."""
        last = self.__dict__.get("_last_replay", {}).get(id(group))
        if last is None or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            return False
        key, last_fingerprint, captured = last
        if fingerprint != last_fingerprint or key != self._graph_key(group, params, grads, extras):
            return False
        captured.replay(None, self._device_lr(group, params[0].device), skip, self._step_grad_scale)
        return True


class MOP(Muon):
    """Momentum Orthogonalized by Polar decomposition: Muon with the exact polar factor ``U V^T`` from a
    float64 SVD instead of Newton–Schulz. Slow; the quality reference for Muon's approximation. Takes Muon's
    arguments except the Newton–Schulz ones and ``deferred_nonfinite``: an SVD of a NaN matrix fails, so the
    gradients are checked on the host first."""

    def __init__(self, params: Iterable[Any], lr: float | Tensor = 1e-3, momentum: float = 0.95,
                 nesterov: bool = True, weight_decay: float = 0.01, scaling: str = "match_adamw", *,
                 adamw_lr: float | None = None, adamw_betas: tuple[float, float] = (0.9, 0.999),
                 adamw_eps: float = 1e-8, adamw_weight_decay: float | None = None,
                 skip_nonfinite: bool = False, weight_decay_mode: str = "decoupled", state_dtype: Any = None,
                 offload: str | Offload | None = None) -> None:
        matrix_defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                               weight_decay_mode=weight_decay_mode, scaling=scaling)
        adamw_defaults = adamw_group_defaults(lr, weight_decay, weight_decay_mode, adamw_lr, adamw_betas,
                                              adamw_eps, adamw_weight_decay)
        MatrixOptimizer.__init__(self, params, matrix_defaults, adamw_defaults, skip_nonfinite=skip_nonfinite,
                                 clip_in_step=True, state_dtype=state_dtype, offload=offload)

    def _validate_orthogonalizer(self, group: dict[str, Any]) -> None:
        pass

    def _stack_dtype(self, group: dict[str, Any], device: torch.device) -> torch.dtype:
        return torch.float32  # polar runs in float64 from whatever it gets: keep fp32's precision on the way

    def _orthogonalize(self, group: dict[str, Any], X: Tensor, parts: Tensor | None = None) -> Tensor:
        return polar(X)  # scale-invariant: no normalization, so no use for the sums of squares
