"""Shared machinery of matrixopt's optimizers: one object per model, a matrix algorithm for the groups that
carry the optimizer's flag (``use_muon=True`` for Muon), AdamW inside for every other group.

Subclasses implement ``_matrix_update(group, params, grads)``; this class owns group defaults and validation,
the step's use of the non-finite gradient policy and of the clip (:mod:`matrixopt.optim.nonfinite`), the AdamW
update, and a ``state_dict`` that keeps float32 state for low-precision parameters and refuses state from another
optimizer or model. With ``state_dtype`` (compact state, :mod:`matrixopt.optim.state`) or ``offload`` (state in CPU
memory, :mod:`matrixopt.optim.offload`) the same updates run chunk by chunk on float32 state staged for them.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterable
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from matrixopt.kernels.decay import check_weight_decay_mode, decay_
from matrixopt.optim import state as compact
from matrixopt.optim.adam import adam_direction, adam_moments_
from matrixopt.optim.nonfinite import (
    NonFinitePolicy,
    check_clip,
    clip_coefficient,
    current_grads,
    grad_norms,
    label,
    nonfinite_flags,
    plain_on,
)
from matrixopt.optim.offload import CHUNK_NUMEL, Offload, Shards, StagedStep, check_offload


def _check_finite(name: str, value: Any) -> None:
    v = value.item() if isinstance(value, Tensor) else value
    if not math.isfinite(v):
        raise ValueError(f"Invalid {name}: {v!r} (must be finite)")


def check_lr(value: Any) -> None:
    if isinstance(value, Tensor) and value.numel() != 1:
        raise ValueError(f"Tensor lr must have one element, got shape {tuple(value.shape)}")
    _check_finite("learning rate", value)
    if value < 0:
        raise ValueError(f"Invalid learning rate: {float(value)} (must be >= 0)")


def check_betas(betas: Any) -> None:
    if len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (need two values, (beta1, beta2))")
    for i, b in enumerate(betas):
        _check_finite(f"beta parameter at index {i}", b)
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b} (must be in [0, 1))")


def check_decay(group: dict[str, Any]) -> None:
    """The group's ``weight_decay`` (finite, >= 0) and ``weight_decay_mode``."""
    _check_finite("weight_decay", group["weight_decay"])
    if group["weight_decay"] < 0:
        raise ValueError(f"Invalid weight_decay value: {group['weight_decay']} (must be >= 0)")
    check_weight_decay_mode(group.get("weight_decay_mode", "decoupled"))


def check_adamw_group(group: dict[str, Any]) -> None:
    check_lr(group["lr"])
    check_betas(group["betas"])
    _check_finite("epsilon", group["eps"])
    if group["eps"] < 0:
        raise ValueError(f"Invalid epsilon value: {group['eps']} (must be >= 0)")
    check_decay(group)


def adamw_group_defaults(lr: Any, weight_decay: float, weight_decay_mode: str, adamw_lr: float | None,
                         adamw_betas: tuple[float, float], adamw_eps: float,
                         adamw_weight_decay: float | None) -> dict[str, Any]:
    """The defaults of a matrix optimizer's AdamW groups: its own lr, weight decay and decay mode unless the
    ``adamw_*`` arguments set them."""
    return dict(lr=lr if adamw_lr is None else adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
                weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay,
                weight_decay_mode=weight_decay_mode)


def param_label(group: dict[str, Any], i: int, p: Tensor) -> str:
    """A readable name for the i-th parameter of a group: its model name when routing supplied one."""
    names = group.get("names")
    return label(names[i] if names is not None else f"params[{i}]", p)


class MatrixOptimizer(Optimizer):
    """Base class. ``matrix_flag`` is the group key that selects the matrix algorithm (default True);
    ``matrix_defaults`` and ``adamw_defaults`` fill in missing group keys of each kind."""

    matrix_flag = "use_muon"

    def __init__(self, params: Iterable[Any], matrix_defaults: dict[str, Any], adamw_defaults: dict[str, Any],
                 *, skip_nonfinite: bool = False, deferred_nonfinite: bool = False,
                 clip_in_step: bool = False, state_dtype: Any = None, offload: str | Offload | None = None) -> None:
        """``deferred_nonfinite``: only for subclasses whose ``_matrix_update`` takes ``skip``. ``clip_in_step``:
        declared by subclasses whose ``_matrix_update`` multiplies the gradients by ``self._step_grad_scale`` as it
        reads them (see :meth:`clip_grad_norm_`). ``state_dtype`` (None, ``torch.bfloat16``/"bf16", "int8") and
        ``offload`` (None, "cpu"): how the momentum and Adam moments are stored (:mod:`matrixopt.optim.state`,
        :mod:`matrixopt.optim.offload`)."""
        self.state_dtype = compact.check_state_dtype(state_dtype)
        self.offload = check_offload(offload)
        check_adamw_group(adamw_defaults)
        self._matrix_defaults = dict(matrix_defaults)
        self._adamw_defaults = dict(adamw_defaults)
        self.nonfinite = NonFinitePolicy(skip=skip_nonfinite, deferred=deferred_nonfinite, clip_in_step=clip_in_step)
        self._step_grad_scale: Tensor | None = None  # the clip coefficient the running step applies (see step())
        self._rounding_step = 0  # steps taken with compact state: the stochastic rounding's seed
        super().__init__(params, dict(matrix_defaults))
        if self.offload is not None:
            self.offload.check_fits(*self._offload_host_bytes())

    matrix_state_tensors: int = 1
    """Parameter-shaped state tensors per parameter of a matrix group (Muon's momentum: 1; SOAP's moments: 2)."""
    shards = Shards()
    """How a staged step (compact or offloaded state) reaches the values this process holds of each parameter and
    state tensor: plain tensors here; optimizers that step DTensors' local shards give their own."""

    def _offload_host_bytes(self) -> tuple[int, str]:
        """``(bytes, what)``: the least host memory the offloaded state holds once every parameter has stepped: the
        parameter-shaped state twice (live and the step's shadow) and a copy of the parameters, each tensor as the
        offload allocates it (:meth:`~matrixopt.optim.offload.Offload.block_bytes`), for the values this process
        holds (a sharded parameter's local shard). Smaller state (rows, factors, step counts) is left out."""
        block = self.offload.block_bytes
        state = params = 0
        for group in self.param_groups:
            tensors = self.matrix_state_tensors if group[self.matrix_flag] else 2  # AdamW: exp_avg, exp_avg_sq
            each = compact.value_bytes(self._state_format(group))
            for p in map(self.shards.local, group["params"]):
                state += tensors * block(int(p.numel() * each))
                params += block(p.numel() * p.element_size())
        return 2 * state + params, (f"the optimizer state twice, {2 * state / 2**30:.2f} GiB, and a copy of the "
                                    f"parameters, {params / 2**30:.2f} GiB")

    def _state_format(self, group: dict[str, Any]) -> str | None:
        """How ``group``'s state is stored (:func:`matrixopt.optim.state.group_format`)."""
        return compact.group_format(self.state_dtype, bool(group[self.matrix_flag]))

    @property
    def skip_nonfinite(self) -> bool:
        return self.nonfinite.skip

    @property
    def deferred_nonfinite(self) -> bool:
        return self.nonfinite.deferred

    @property
    def skipped_updates(self) -> int:
        """Parameter updates skipped for non-finite gradients (``skip_nonfinite=True``)."""
        return self.nonfinite.skipped

    @skipped_updates.setter
    def skipped_updates(self, value: int) -> None:
        self.nonfinite.skipped = value

    @property
    def rounding_step(self) -> int:
        """Steps taken with compact state: the counter the stochastic rounding's seed comes from, which
        ``state_dict()`` saves so that a resumed run rounds with the bits of the uninterrupted one."""
        return self._rounding_step

    @rounding_step.setter
    def rounding_step(self, value: int) -> None:
        self._rounding_step = int(value)

    def __getstate__(self) -> dict[str, Any]:
        """torch.optim.Optimizer pickles only defaults, state and param_groups; keep our attributes too."""
        return super().__getstate__() | {k: self.__dict__[k] for k in ("_matrix_defaults", "_adamw_defaults",
                                                                       "nonfinite", "state_dtype", "offload",
                                                                       "_rounding_step")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Optimizer.load_state_dict calls this with state and param_groups only: keep the policy this object has
        if "nonfinite" not in state and "nonfinite" not in self.__dict__:  # pickled before the policy existed
            state["nonfinite"] = NonFinitePolicy(skip=state.pop("skip_nonfinite", False),
                                                 deferred=state.pop("deferred_nonfinite", False))
            state["nonfinite"].skipped = state.pop("skipped_updates", 0)
        super().__setstate__(state)
        self.__dict__.setdefault("_step_grad_scale", None)
        for k, v in (("state_dtype", None), ("offload", None), ("_rounding_step", 0)):  # pickled before these
            self.__dict__.setdefault(k, v)
        for group in self.param_groups:  # pickled before weight_decay_mode existed
            group.setdefault("weight_decay_mode", "decoupled")

    # ----------------------------------------------------------------------------------- param groups
    def _validate_matrix_group(self, group: dict[str, Any]) -> None:
        """Subclasses check their own hyperparameters; raise ValueError naming the value."""
        raise NotImplementedError

    def _validate_adamw_group(self, group: dict[str, Any]) -> None:
        """An AdamW group's hyperparameters and parameters (real and dense); ValueError naming what is wrong."""
        check_adamw_group(group)
        for i, p in enumerate(group["params"]):
            if p.is_complex() or p.is_sparse:
                raise ValueError(f"matrixopt's AdamW handles real dense parameters; {param_label(group, i, p)}"
                                 " is complex or sparse")

    def _check_matrices(self, group: dict[str, Any]) -> None:
        """Every parameter of a matrix group is a real dense floating-point matrix (2-D or more)."""
        for i, p in enumerate(group["params"]):
            kind = "complex" if p.is_complex() else "sparse" if p.is_sparse else (
                None if p.is_floating_point() else f"of dtype {p.dtype}")
            if kind is not None:
                raise ValueError(f"{type(self).__name__} handles real dense floating-point matrices; "
                                 f"{param_label(group, i, p)} is {kind}. Put it in an AdamW group "
                                 f"({self.matrix_flag}=False) or convert it.")
            if p.ndim < 2:
                raise ValueError(f"{type(self).__name__} handles matrix parameters (2-D or more); "
                                 f"{param_label(group, i, p)} is {p.ndim}-D. Put it in an AdamW group "
                                 f"({self.matrix_flag}=False), as matrixopt.param_groups(model) does.")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = dict(param_group)
        params = group["params"]
        group["params"] = [params] if isinstance(params, Tensor) else list(params)
        if len(group["params"]) == 0:
            raise ValueError("optimizer got an empty parameter group; drop it or add parameters to it")
        is_matrix = bool(group.setdefault(self.matrix_flag, True))
        for k, v in (self._matrix_defaults if is_matrix else self._adamw_defaults).items():
            group.setdefault(k, v)
        for i, p in enumerate(group["params"]):
            if not isinstance(p, Tensor):
                raise TypeError(f"optimizer params must be Tensors, got {type(p).__name__} at index {i}")
            if not p.is_leaf:
                raise ValueError(f"can't optimize a non-leaf Tensor: {param_label(group, i, p)}")
        if group.get("names") is not None and len(group["names"]) != len(group["params"]):
            raise ValueError("param group 'names' must have one entry per parameter")
        if is_matrix:
            self._validate_matrix_group(group)
            self._check_matrices(group)
        else:
            self._validate_adamw_group(group)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in seen for p in group["params"]) or len({id(p) for p in group["params"]}) < len(
                group["params"]):
            raise ValueError("some parameters appear in more than one parameter group")
        self.param_groups.append(group)

    # ----------------------------------------------------------------------------------- step
    def _gather(self, group: dict[str, Any]) -> tuple[list[Tensor], list[Tensor]]:
        params, grads = [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise ValueError("matrixopt optimizers do not support sparse gradients")
            params.append(p)
            grads.append(p.grad)
        return params, grads

    def _local_grads(self, grads: list[Tensor]) -> list[Tensor] | None:
        """What the updates apply a deferred check's device flag to, where that is not the gradients themselves
        (None): sharded optimizers give each gradient's local shard."""
        return None

    def _nonfinite_flags(self, grads: list[Tensor]) -> Tensor:
        """``(len(grads),)`` float32 on the device, 1 where a gradient holds NaN/Inf: one pass per (device, dtype)
        and no host sync. Subclasses whose gradients are shards agree on them over ranks here."""
        return nonfinite_flags(grads, grads[0].device)

    @staticmethod
    def _labels(groups: list[tuple[dict[str, Any], list[Tensor]]]) -> list[str]:
        """The labels of the parameters with gradients (per group, those parameters), in the order of the step's
        flags."""
        index = [{id(q): i for i, q in enumerate(g["params"])} for g, _ in groups]
        return [param_label(g, idx[id(p)], p) for (g, params), idx in zip(groups, index) for p in params]

    def raise_deferred_nonfinite(self) -> None:
        """With ``deferred_nonfinite=True``: raise ``NonFiniteGradientError`` if the last step found a NaN/Inf
        gradient (that step was skipped on the GPU: no parameter or state was written). ``step()`` and
        ``state_dict()`` call it first; call it yourself to learn of a bad step before the next one. Waits for
        the last step's check only (a few kernels at its start), not for the whole step."""
        self.nonfinite.raise_pending()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, sharded: Iterable[Tensor] = (),
                        group: Any = None) -> Tensor:
        """Clip the gradients of this optimizer's parameters to a total ``norm_type`` norm of ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)`` does, and return that total norm (a 0-d
        float32 tensor, before clipping). Call it after backward, right before :meth:`step`.

        Where the optimizer can (Muon: its fused momentum pass and the AdamW path), the gradients are not scaled
        here: the next :meth:`step` applies the coefficient as it reads them, which saves a read and a write of
        every gradient, and uses the per-gradient norms as its non-finite check, which saves another read (a
        gradient whose float32 norm overflows, entries beyond ~1e19, then counts as non-finite). The gradients
        must not change in between (``zero_grad()`` drops the coefficient; other changes make ``step()`` raise).
        Other optimizers, and gradients on several devices, are scaled here.

        ``sharded``: parameters whose gradients are disjoint shards spread over the process group ``group`` (this
        rank's expert stacks under expert parallelism); the global norm counts the others once and sums the
        shards' part over the group (a collective: every rank of the group calls this), and a non-finite total
        skips the step on every rank (:func:`~matrixopt.optim.nonfinite.grad_norms`). Gradients on one device."""
        max_norm, norm_type = check_clip(max_norm, norm_type)
        self.nonfinite.drop_clip()
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        grads = [p.grad for p in params]  # in param_groups order, as step() gathers them
        shards = {id(p) for p in sharded}
        if not grads:
            return torch.zeros(())
        one_device = len({g.device for g in grads}) == 1 and not any(g.is_sparse for g in grads)
        if shards and not one_device:
            raise ValueError("clip_grad_norm_ with sharded gradients needs every gradient dense and on one device")
        if not one_device:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        mask = self._shard_mask(params, shards, grads[0].device) if shards else None
        total, flags = grad_norms(grads, norm_type, grads[0].device, mask, group)
        self.scale_grads_(clip_coefficient(total, max_norm), flags)
        return total

    def _shard_mask(self, params: list[Tensor], shards: set[int], device: torch.device) -> Tensor:
        """``(len(params),)`` bool on ``device``, True for the sharded ones: built once per parameter list (a
        host-to-device copy every step would wait for the GPU)."""
        key = (tuple(map(id, params)), frozenset(shards), device)
        cached = self.__dict__.get("_shard_masks")
        if cached is None or cached[0] != key:
            self.__dict__["_shard_masks"] = cached = (key, torch.tensor([id(p) in shards for p in params],
                                                                        dtype=torch.bool, device=device))
        return cached[1]

    @torch.no_grad()
    def scale_grads_(self, coef: Tensor, nonfinite: Tensor | None = None) -> None:
        """Multiply the current gradients by ``coef`` (a 0-d float32 tensor on their device): inside the next
        :meth:`step` where the optimizer can (see :meth:`clip_grad_norm_`), else in place now. ``nonfinite``:
        optional ``(n,)`` flags, one per gradient in ``param_groups`` order, 1 where it is not finite, which the
        step then takes as its non-finite check. A wrapper that clips over several optimizers (the layer-wise
        optimizer) calls this with the global coefficient."""
        grads = current_grads(self)
        self.nonfinite.scale(grads, coef, nonfinite, held=self._holds_clip(grads, coef, nonfinite))

    def _holds_clip(self, grads: list[Tensor], coef: Tensor, flags: Tensor | None) -> bool | None:
        """Whether this optimizer's updates can apply the clip coefficient ``coef`` (and take ``flags`` as their
        check) to ``grads``, its current gradients, as they read them; None: the policy's rule, plain tensors on
        one device (:meth:`~matrixopt.optim.nonfinite.NonFinitePolicy.scale`)."""
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.nonfinite.drop_clip()
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One optimizer step over every group. A NaN/Inf gradient raises ``NonFiniteGradientError`` before
        anything is written (or, with ``skip_nonfinite=True``, that parameter's update is skipped and counted in
        ``skipped_updates``).

        With ``deferred_nonfinite=True`` there is no host sync: a step with a NaN/Inf gradient is skipped
        on the GPU (nothing written) and the error is raised by the next ``step()``, ``state_dict()`` or
        :meth:`raise_deferred_nonfinite`. Muon's updates off the fused kernels check on the host, and so does
        sharded Muon for DTensor gradients."""
        self.raise_deferred_nonfinite()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(g, *self._gather(g)) for g in self.param_groups]
        flat = [gr for _, _, grads in work for gr in grads]
        clip = self.nonfinite.take_clip(flat)
        clip_flags = None if clip is None else clip.flags  # the clip's norms, where given, are this step's check
        # the labels are held until the next step reads a deferred check: they must not keep the gradients alive
        skip, keep = self.nonfinite.screen(
            flat, lambda: self._nonfinite_flags(flat) if clip_flags is None else clip_flags,
            functools.partial(self._labels, [(g, params) for g, params, _ in work]), self._local_grads(flat))
        if keep is not None:
            kept, k = [], 0
            for g, params, grads in work:
                mask = keep[k:k + len(params)]
                k += len(params)
                kept.append((g, [p for p, f in zip(params, mask) if f], [x for x, f in zip(grads, mask) if f]))
            work = kept
        work = [w for w in work if w[1]]
        self._step_grad_scale = None if clip is None else clip.coef  # read by the updates as they read gradients
        try:
            self._update(work, skip)
        finally:
            self._step_grad_scale = None
        return loss

    def _update(self, work: list[tuple[dict[str, Any], list[Tensor], list[Tensor]]], skip: Tensor | None) -> None:
        if self.state_dtype is not None or self.offload is not None:
            self._staged_update(work, skip)
            return
        side = self._adamw_stream(work)
        if side is not None:
            # AdamW (bound by memory bandwidth) on a side stream, beside the matrix groups' GEMMs
            main = torch.cuda.current_stream(side.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for group, params, grads in work:
                    if not group[self.matrix_flag]:
                        self._adamw_update(group, params, grads, skip)
            work = [w for w in work if w[0][self.matrix_flag]]
        # matrix groups first: after the check's host sync the GPU is idle, and their long kernels (Newton–Schulz)
        # then run while the host issues the rest
        for group, params, grads in sorted(work, key=lambda w: not w[0][self.matrix_flag]):
            self._group_update(group, params, grads, skip)
        if side is not None:
            main.wait_stream(side)

    def _group_update(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                      skip: Tensor | None) -> None:
        """One group's update: AdamW's, or the matrix algorithm's (given ``skip`` only where there is one: only
        optimizers that take ``deferred_nonfinite`` defer, or are wrapped by a deferred check)."""
        if not group[self.matrix_flag]:
            self._adamw_update(group, params, grads, skip)
        elif skip is None:
            self._matrix_update(group, params, grads)
        else:
            self._matrix_update(group, params, grads, skip)

    def _staged_update(self, work: list[tuple[dict[str, Any], list[Tensor], list[Tensor]]],
                       skip: Tensor | None) -> None:
        """The step over compact or offloaded state: chunk by chunk (:meth:`_state_chunks`), each chunk's state
        decoded to float32 on the parameters' device, updated by the usual update and stored back
        (:class:`matrixopt.optim.offload.StagedStep`; the next chunk's state is fetched while this one computes).
        A plain parameter of an AdamW group larger than a chunk moves in ranges. Offloaded, the step is all or
        nothing: on an exception the parameters and state are the step's before."""
        for group, _, _ in work:
            for i, p in enumerate(group["params"]):
                if type(self.shards.local(p).data) is not Tensor:
                    raise NotImplementedError(
                        f"{type(self).__name__} takes state_dtype and offload for plain tensors; "
                        f"{param_label(group, i, p)} is a {type(p.data).__name__} (sharded parameters: FSDP2, "
                        f"tensor parallelism). Turn them off, or use the sharded optimizer "
                        f"(matrixopt.distributed.ShardedMuon and its variants).")
        if skip is not None:  # a deferred check, read on the host now: the state is moved and encoded anyway
            if self.nonfinite.on_host(skip):
                return
            skip = None
        formats = {p: self._state_format(group) for group, params, _ in work for p in params}
        # the rounding's seed, new each step: reproducible, and resumable from a checkpoint
        staged = StagedStep(self.state, formats, self.offload, 0x5EED * 1_000_003 + self._rounding_step,
                            self.shards)
        chunks = []  # (group, params, grads, units: None, or sub-chunks whose state moves one at a time)
        for group, params, grads in sorted(work, key=lambda w: not w[0][self.matrix_flag]):
            for idx in self._state_chunks(group, params, grads):
                p, g = params[idx[0]], grads[idx[0]]
                if (group[self.matrix_flag] or len(idx) > 1 or p.numel() <= CHUNK_NUMEL or not p.is_contiguous()
                        or type(p.data) is not Tensor):  # a shard (DTensor) moves whole
                    ps = [params[i] for i in idx]
                    chunks.append((group, ps, [grads[i] for i in idx], self._stream_units(group, ps)))
                    continue
                # a large element-wise (AdamW) parameter moves in ranges of whole int8 blocks
                size = max(compact.BLOCK, CHUNK_NUMEL // compact.BLOCK * compact.BLOCK)
                for start in range(0, p.numel(), size):
                    view, grad = staged.part(p, g, start, min(start + size, p.numel()))
                    chunks.append((group, [view], [grad], None))
        chunks = self._interleaved(chunks, staged)
        plan = []  # the units staged one after another: each one's state is fetched while the one before computes
        for _, params, _, unit_lists in chunks:
            plan.extend([[params[i] for i in u] for u in unit_lists] if unit_lists else [params])
        staged.plan(plan)
        self._staging = True
        try:
            for group, params, grads, unit_lists in chunks:
                if unit_lists is None:
                    with staged.pack_stream(params[0].device) if staged.streaming and not group[self.matrix_flag] \
                            else contextlib.nullcontext():
                        staged.stage(params)
                        self._group_update(group, params, grads, None)
                        staged.unstage(params)
                else:
                    self._streamed_update(group, params, grads, unit_lists, staged)
            staged.commit()
        except BaseException:
            staged.rollback()
            raise
        finally:
            self._staging = False
        self._rounding_step += 1

    def _interleaved(self, chunks: list[tuple], staged: StagedStep) -> list[tuple]:
        """The staged step's chunks ``(group, params, grads, units)`` in the order they run. Where matrix chunks
        stream their state (``units`` given) the AdamW groups' chunks go between them, spread evenly, and run on
        the packing stream (:meth:`StagedStep.pack_stream`): their transfers, and the host's work on them, then
        overlap Newton–Schulz instead of following it. A chunk of many small parameters (norms' weights, biases:
        little to move, but host work per parameter) is split into as many pieces as there are streamed chunks;
        an element-wise update gives each parameter the same result in any grouping. Elsewhere the order is as
        given: the matrix groups', then the AdamW groups'."""
        streamed = sum(units is not None for *_, units in chunks)
        staged.streaming = bool(streamed) and self.offload is not None
        if not staged.streaming:
            return chunks
        elementwise = []
        for group, ps, gs, units in chunks:
            if units is None and not group[self.matrix_flag]:
                n = -(-len(ps) // streamed)
                elementwise.extend((group, ps[i:i + n], gs[i:i + n], None) for i in range(0, len(ps), n))
        out, seen = [], 0
        for c in chunks:
            if c[3] is None and not c[0][self.matrix_flag]:
                continue
            out.append(c)
            if c[3] is not None:
                seen += 1
                out.extend(elementwise[len(elementwise) * (seen - 1) // streamed:len(elementwise) * seen // streamed])
        return out

    def _stream_units(self, group: dict[str, Any], params: list[Tensor]) -> list[list[int]] | None:
        """None: a staged chunk's state moves whole (Muon's offloaded matrix chunks move in sub-chunks)."""
        return None

    def _streamed_update(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                         units: list[list[int]], staged: StagedStep) -> None:
        raise NotImplementedError  # only where _stream_units gives sub-chunks

    def _state_chunks(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor]) -> list[list[int]]:
        """Indices of ``params`` in the chunks a staged step updates one at a time, each up to ``CHUNK_NUMEL``
        values (or one larger parameter). Subclasses keep together parameters whose updates are computed
        together (Muon's Newton–Schulz batches), so that a chunked step computes what the whole step would."""
        return _pack([[i] for i in range(len(params))], [p.numel() for p in params])

    overlap_adamw = True  # set False on an instance to run AdamW after the matrix groups on one stream

    def _adamw_stream(self, work: list[tuple[dict[str, Any], list[Tensor], list[Tensor]]]) -> Any:
        """The side stream AdamW runs on (one per optimizer and device), or None: off CUDA, during capture or
        compilation, with ``overlap_adamw`` False, or unless both kinds of group have work on one device."""
        params = [p for _, ps, _ in work for p in ps]
        if (not self.overlap_adamw or not params or params[0].device.type != "cuda"
                or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing()
                or any(p.device != params[0].device for p in params)
                or len({bool(g[self.matrix_flag]) for g, _, _ in work}) < 2):
            return None
        streams = self.__dict__.setdefault("_side_streams", {})
        device = params[0].device
        if device not in streams:
            streams[device] = torch.cuda.Stream(device)
        return streams[device]

    def _matrix_update(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                       skip: Tensor | None = None) -> None:
        """The matrix algorithm's update of one group. ``skip`` (only for optimizers that take
        ``deferred_nonfinite``): a 0-d float32 device flag, nonzero when the step must write nothing; an update
        that can't skip on the device reads it with ``self.nonfinite.on_host(skip)``."""
        raise NotImplementedError

    # ----------------------------------------------------------------------------------- AdamW
    def _elementwise_operands(self, params: list[Tensor], *lists: list[Tensor]) -> tuple[list[Tensor], ...]:
        """The tensors an element-wise update computes on: ``params`` and the ``lists`` of tensors shaped as them
        (gradients, state), as they are. Sharded optimizers give local shards instead."""
        return (params, *lists)

    def _adamw_update(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                      skip: Tensor | None = None) -> None:
        """Adam with weight decay in the group's mode. Float32 state for every parameter dtype; PyTorch's fused
        kernel when the parameters are float32 (outside torch.compile, whose functionalization can't trace it),
        every decay mode, a foreach path otherwise. ``skip``: a 0-d float32 device flag, nonzero to write nothing
        (the fused kernel's ``found_inf`` on plain tensors; the foreach path and DTensor operands check it on the
        host)."""
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            st = self.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            exp_avgs.append(st["exp_avg"])
            exp_avg_sqs.append(st["exp_avg_sq"])
            steps.append(st["step"])
        params, grads, exp_avgs, exp_avg_sqs = self._elementwise_operands(params, grads, exp_avgs, exp_avg_sqs)
        beta1, beta2 = group["betas"]
        lr, wd, eps, decay_mode = group["lr"], group["weight_decay"], group["eps"], group["weight_decay_mode"]
        fused_ok = not torch.compiler.is_compiling()  # traced graphs can't functionalize _fused_adamw_
        fused = fused_ok and all(p.dtype == torch.float32 and g.dtype == torch.float32 for p, g in zip(params, grads))
        if skip is not None and not (fused and plain_on(grads, skip.device)):
            # the foreach path can't skip on the device, nor can the fused kernel on DTensors: check on the host now
            if self.nonfinite.on_host(skip):
                return
            skip = None
        torch._foreach_add_(steps, 1.0)
        if skip is not None:
            torch._foreach_sub_(steps, [skip] * len(steps))
        scale = self._step_grad_scale  # clip_grad_norm_'s deferred coefficient, or None
        if fused:
            if isinstance(lr, Tensor):
                lr = lr.to(params[0].device)
            # The fused kernel decays the decoupled way; the other modes decay around it with its own decay off
            # (decoupled and independent decay before the update, as the kernel does; cautious after, from the
            # weights before the step and the step taken, which is -lr times the update direction)
            kernel_wd = wd if decay_mode == "decoupled" else 0.0
            live = 1.0 if skip is None else 1 - skip  # a skipped step decays nothing either
            before = torch._foreach_mul(params, 1.0) if decay_mode == "cautious" and wd else None
            if decay_mode == "independent" and wd:
                torch._foreach_mul_(params, 1 - wd * live)
            # the fused kernel divides the gradients by grad_scale as it reads them
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=kernel_wd, eps=eps, amsgrad=False, maximize=False,
                                grad_scale=None if scale is None else scale.reciprocal(), found_inf=skip)
            for p, w in zip(params, before or ()):
                agree = (w - p).mul_(w) >= 0  # the direction (W_before - W_after) / lr agrees with W in sign
                p.sub_(w.mul_(agree).mul_(lr * wd * live))
            return
        # foreach path (low-precision parameters, other decay modes): float32 math on 0-d step tensors (no host sync)
        g32 = [g.float() for g in grads]
        if scale is not None:
            g32 = torch._foreach_mul(g32, scale)
        adam_moments_(exp_avgs, exp_avg_sqs, g32, group["betas"])
        directions = adam_direction(exp_avgs, exp_avg_sqs, steps, group["betas"], eps, lr)
        p32 = [p.float() for p in params]
        decay_(p32, lr, wd, decay_mode, directions)
        for p, q, d in zip(params, p32, directions):
            p.copy_(q.sub_(d))

    # ----------------------------------------------------------------------------------- state_dict
    def state_dict(self) -> dict[str, Any]:
        """PyTorch's structure ``{"state": {index: {...}}, "param_groups": [...]}`` plus ``"optimizer"``: the
        class name, checked on load. Raises a deferred non-finite error first (:meth:`raise_deferred_nonfinite`)."""
        self.raise_deferred_nonfinite()
        sd = super().state_dict()
        sd["optimizer"] = type(self).__name__
        if self.state_dtype is not None:
            sd["rounding_step"] = self._rounding_step
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from ``state_dict()`` of the same optimizer class over the same parameters. A state
        dict from another optimizer class, another grouping or other parameter shapes raises ValueError. State
        tensors keep the float32 dtype they were saved with (PyTorch would cast them to the parameter dtype).

        State saved in another ``state_dtype`` is converted: decoded to float32 (exact), and encoded for a compact
        optimizer (which rounds, stochastically); state already in this optimizer's format is kept bit for bit.
        Offloaded or not when saved, the state goes where this optimizer keeps it."""
        saved_name = state_dict.get("optimizer")
        if saved_name is not None and saved_name != type(self).__name__:
            raise ValueError(f"this state dict was saved by {saved_name}, not {type(self).__name__}; build the "
                             f"same optimizer it came from to load it")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(saved_groups)} param groups, this optimizer has "
                             f"{len(self.param_groups)}: it comes from a different model or routing")
        for gi, (sg, g) in enumerate(zip(saved_groups, self.param_groups)):
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(f"param group {gi}: state dict has {len(sg['params'])} parameters, optimizer "
                                 f"has {len(g['params'])}: it comes from a different model")
            if bool(sg.get(self.matrix_flag, True)) != bool(g[self.matrix_flag]):
                raise ValueError(f"param group {gi}: {self.matrix_flag} differs between state dict and optimizer")
            # an option added after the state dict was saved keeps this optimizer's value; names (ours and torch's
            # param_names) are labels, kept from this optimizer when the state dict has none
            missing = [k for k in g if k not in sg and k not in ("params", "names", "param_names")
                       and k not in self._added_options]
            if missing:
                raise ValueError(f"param group {gi} of the state dict lacks {missing}: it was saved by a "
                                 f"different optimizer")
        saved_groups = [{**{k: v for k, v in g.items() if k != "params"}, **sg}
                        for sg, g in zip(saved_groups, self.param_groups)]
        state_dict = {**state_dict, "param_groups": saved_groups}
        id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                          chain.from_iterable(g["params"] for g in self.param_groups)))
        for pid, st in state_dict["state"].items():
            p = id_map.get(pid)
            if p is None:
                raise ValueError(f"state dict has state for parameter index {pid}, which no group holds")
            for k, v in st.items():
                if isinstance(v, Tensor) and v.ndim > 0 and v.shape != p.shape and k in self._shaped_state_keys:
                    raise ValueError(f"state '{k}' has shape {tuple(v.shape)} but the parameter has shape "
                                     f"{tuple(p.shape)}: the state dict comes from a different model")
        super().load_state_dict(state_dict)
        generator = torch.Generator().manual_seed(0x5EED)
        formats = {p: self._state_format(g) for g in self.param_groups for p in g["params"]}
        for pid, st in state_dict["state"].items():
            p = id_map[pid]
            layouts = {k: self.shards.layout(v) for k, v in st.items() if isinstance(v, Tensor)}
            # converted and moved as this process holds them (a DTensor's local shard), then laid out as saved
            st = {k: (self.shards.local(v).to(device=p.device, copy=True) if isinstance(v, Tensor) else v)
                  for k, v in st.items()}
            if any(isinstance(v, Tensor) and not compact.in_format(st, k, formats[p])
                   for k, v in st.items() if not compact.is_scale(k, st)):
                st = compact.converted(st, formats[p], generator)
            if self.offload is not None:
                st = {k: self.offload.to_host(v) for k, v in st.items()}
            self.state[p] = {k: self.shards.placed(v, layouts.get(k)) if isinstance(v, Tensor) else v
                             for k, v in st.items()}
        self._rounding_step = int(state_dict.get("rounding_step", self._rounding_step))

    _shaped_state_keys = ("exp_avg", "exp_avg_sq", "momentum_buffer")
    _staging = False  # True while a staged step runs (compact or offloaded state: no captured graphs)
    # group options newer than some saved state dicts: loading one without them keeps this optimizer's values
    _added_options: tuple[str, ...] = ("weight_decay_mode",)


def _pack(units: list[list[int]], sizes: list[int]) -> list[list[int]]:
    """``units`` (lists of indices that stay together) packed in order into chunks of up to ``CHUNK_NUMEL``
    values, ``sizes`` per index."""
    chunks: list[list[int]] = []
    total = 0
    for unit in units:
        n = sum(sizes[i] for i in unit)
        if chunks and total + n <= CHUNK_NUMEL:
            chunks[-1].extend(unit)
            total += n
        else:
            chunks.append(list(unit))
            total = n
    return [sorted(c) for c in chunks]
