"""Shared machinery of matrixopt's optimizers: one object per model, a matrix algorithm for the groups that
carry the optimizer's flag (``use_muon=True`` for Muon), AdamW inside for every other group.

Subclasses implement ``_matrix_update(group, params, grads)``; this class owns group defaults and validation,
the non-finite gradient policy, the AdamW update, and a ``state_dict`` that keeps float32 state for low-precision
parameters and refuses state from another optimizer or model.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from matrixopt.kernels import muon_elementwise


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds NaN or Inf. Raised before any parameter or state is touched (with
    ``deferred_nonfinite=True``: at the next call after the step, which left everything as it was)."""


@dataclass
class _PendingCheck:
    """A step's non-finite flags on their way to the host: a pinned copy that ``event`` completes."""

    flags: Tensor  # (n,) float32 on the host (pinned when copied from a GPU), 1 where the gradient held NaN/Inf
    event: torch.cuda.Event | None  # completes the copy from the GPU; None for CPU gradients
    work: list[tuple[dict[str, Any], list[Tensor]]]  # the step's (group, params with gradients), for the message


@dataclass
class _PendingClip:
    """``clip_grad_norm_``'s coefficient, deferred into the next step, and the gradients it was computed from."""

    coef: Tensor  # 0-d float32, on the gradients' device
    flags: Tensor | None  # (n,) float32: 1 where a gradient's norm is not finite (NaN/Inf, or a float32 overflow)
    grads: list[tuple[int, int]]  # (id, version counter) of each gradient, in param_groups order


class HostMirror:
    """A pinned host buffer that small device tensors (non-finite flags) are copied into without a host sync,
    reused from step to step (pinned allocations are slow). Read the copy after its event completes, and before
    the next :meth:`send` overwrites it."""

    def __init__(self) -> None:
        self._buffer: Tensor | None = None

    def send(self, t: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
        """``(host copy, event completing it)``; a CPU tensor is its own copy, with no event."""
        if not t.is_cuda:
            return t, None
        if self._buffer is None or self._buffer.shape != t.shape or self._buffer.dtype != t.dtype:
            self._buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host = self._buffer.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event


def nonfinite_flags(grads: list[Tensor], device: torch.device) -> Tensor:
    """``(len(grads),)`` float32 on ``device``: 1 where a gradient holds a NaN or Inf, else 0. One pass per (device,
    dtype) present (:func:`matrixopt.kernels.muon_elementwise.nonfinite_flags`) and no host sync, so a caller can
    reduce the flags across ranks before reading them."""
    by_kind: dict[tuple, list[int]] = defaultdict(list)
    for i, g in enumerate(grads):
        by_kind[(g.device, g.dtype)].append(i)
    flags: list[Tensor | None] = [None] * len(grads)
    for idx in by_kind.values():
        bad = muon_elementwise.nonfinite_flags([grads[i] for i in idx]).to(device)
        if len(by_kind) == 1:  # one kind, already in order: no reassembly
            return bad
        for j, i in enumerate(idx):  # views, not an index list (which would go to the GPU with a host sync)
            flags[i] = bad[j]
    return torch.stack(flags) if flags else torch.zeros(0, device=device)


def current_grads(optimizer: Optimizer) -> list[Tensor]:
    """The gradients an optimizer's parameters hold now, in ``param_groups`` order."""
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def scale_grads(optimizer: Optimizer, coef: Tensor) -> None:
    """Multiply ``optimizer``'s current gradients by ``coef`` (0-d): inside its next step for a
    :class:`MatrixOptimizer` that can (:meth:`MatrixOptimizer.scale_grads_`), else in place now."""
    if isinstance(optimizer, MatrixOptimizer):
        optimizer.scale_grads_(coef)
    else:
        _multiply(current_grads(optimizer), coef)


def _multiply(grads: list[Tensor], coef: Tensor) -> None:
    """``grads *= coef`` in place, one foreach call (``coef``: a 0-d tensor, moved to the gradients' device)."""
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))


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


def check_adamw_group(group: dict[str, Any]) -> None:
    check_lr(group["lr"])
    check_betas(group["betas"])
    _check_finite("epsilon", group["eps"])
    if group["eps"] < 0:
        raise ValueError(f"Invalid epsilon value: {group['eps']} (must be >= 0)")
    _check_finite("weight_decay", group["weight_decay"])
    if group["weight_decay"] < 0:
        raise ValueError(f"Invalid weight_decay value: {group['weight_decay']} (must be >= 0)")


def param_label(group: dict[str, Any], i: int, p: Tensor) -> str:
    """A readable name for the i-th parameter of a group: its model name when routing supplied one."""
    names = group.get("names")
    name = names[i] if names is not None else f"params[{i}]"
    return f"`{name}` (shape {tuple(p.shape)})"


class MatrixOptimizer(Optimizer):
    """Base class. ``matrix_flag`` is the group key that selects the matrix algorithm (default True);
    ``matrix_defaults`` and ``adamw_defaults`` fill in missing group keys of each kind."""

    matrix_flag = "use_muon"
    # whether _matrix_update honours ``skip`` (a device flag) without a host sync; only such optimizers defer the
    # non-finite check (``deferred_nonfinite``), others check on the host
    _skips_on_device = False
    # whether the step applies clip_grad_norm_'s coefficient as it reads the gradients (Muon's fused momentum pass
    # and the AdamW path); others have their gradients scaled by clip_grad_norm_ itself
    _defers_grad_scale = False
    deferred_nonfinite = False  # optimizers unpickled from before the option check on the host

    def __init__(self, params: Iterable[Any], matrix_defaults: dict[str, Any], adamw_defaults: dict[str, Any],
                 *, skip_nonfinite: bool = False, deferred_nonfinite: bool = False) -> None:
        check_adamw_group(adamw_defaults)
        self._matrix_defaults = dict(matrix_defaults)
        self._adamw_defaults = dict(adamw_defaults)
        self.skip_nonfinite = bool(skip_nonfinite)
        self.deferred_nonfinite = bool(deferred_nonfinite)
        if self.skip_nonfinite and self.deferred_nonfinite:
            raise ValueError("skip_nonfinite skips single parameters, which needs the flags on the host before the "
                             "step; it can't be combined with deferred_nonfinite")
        self._deferred_check: _PendingCheck | None = None
        self._flags_host = HostMirror()  # where the deferred check's flags are copied
        self.skipped_updates = 0  # parameter updates skipped for non-finite gradients
        # False when a wrapper has already checked every gradient (the layer-wise optimizer, agreed across ranks):
        # the step then skips its own check and its host sync
        self.check_nonfinite = True
        # set by a wrapper that agreed on finiteness on the device (the layer-wise optimizer, deferred): the 0-d
        # float32 flag this step's writes skip on, nonzero when some rank's gradient held NaN/Inf. The wrapper
        # reports the error; the step only writes nothing.
        self.external_skip: Tensor | None = None
        self._pending_clip: _PendingClip | None = None  # clip_grad_norm_'s coefficient for the next step
        self._step_grad_scale: Tensor | None = None  # the coefficient the running step applies (see step())
        super().__init__(params, dict(matrix_defaults))

    def __getstate__(self) -> dict[str, Any]:
        """torch.optim.Optimizer pickles only defaults, state and param_groups; keep our attributes too."""
        return super().__getstate__() | {k: self.__dict__[k] for k in
                                         ("_matrix_defaults", "_adamw_defaults", "skip_nonfinite",
                                          "skipped_updates", "deferred_nonfinite")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_deferred_check", None)  # a pending check (an event, pinned memory) is not pickled
        self.__dict__.setdefault("_flags_host", HostMirror())
        self.__dict__.setdefault("external_skip", None)
        self.__dict__.setdefault("_pending_clip", None)
        self.__dict__.setdefault("_step_grad_scale", None)

    # ----------------------------------------------------------------------------------- param groups
    def _validate_matrix_group(self, group: dict[str, Any]) -> None:
        """Subclasses check their own hyperparameters and shapes; raise ValueError naming the value."""
        raise NotImplementedError

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
        else:
            check_adamw_group(group)
            for i, p in enumerate(group["params"]):
                if p.is_complex() or p.is_sparse:
                    raise ValueError(f"matrixopt's AdamW handles real dense parameters; {param_label(group, i, p)}"
                                     " is complex or sparse")
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

    def _finite_mask(self, grads: list[Tensor]) -> list[bool]:
        """Whether each gradient is free of NaN/Inf: one max-abs pass per (device, dtype), one host sync."""
        if not grads:
            return []
        return (nonfinite_flags(grads, grads[0].device) == 0).tolist()

    @staticmethod
    def _nonfinite_labels(work: list[tuple[dict[str, Any], list[Tensor]]], finite: list[bool]) -> str:
        """The labels of the parameters whose gradient is not finite (the first five)."""
        bad = []
        k = 0
        for g, params in work:
            for p in params:
                if not finite[k]:
                    idx = next(i for i, q in enumerate(g["params"]) if q is p)
                    bad.append(param_label(g, idx, p))
                k += 1
        return f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}"

    def raise_deferred_nonfinite(self) -> None:
        """With ``deferred_nonfinite=True``: raise ``NonFiniteGradientError`` if the last step found a NaN/Inf
        gradient (that step was skipped on the GPU: no parameter or state was written). ``step()`` and
        ``state_dict()`` call it first; call it yourself to learn of a bad step before the next one. Waits for
        the last step's check only (a few kernels at its start), not for the whole step."""
        pending, self._deferred_check = self._deferred_check, None
        if pending is None:
            return
        if pending.event is not None:
            pending.event.synchronize()
        finite = (pending.flags == 0).tolist()
        if not all(finite):
            raise NonFiniteGradientError(
                f"non-finite (NaN/Inf) gradient in {self._nonfinite_labels(pending.work, finite)} at the last "
                "step, which was skipped: no parameter or state was updated (deferred_nonfinite=True reports it "
                "at the next call). Lower the learning rate, use gradient clipping or loss scaling.")

    def _skip_on_host(self) -> bool:
        """For an update that can't skip on the device, mid-step: whether it must write nothing, read on the host.
        The step's own deferred check raises here (nothing of this step is written but what the device skips); a
        wrapper's agreed flag (``external_skip``) is read, and the wrapper reports the error itself."""
        if self.external_skip is not None:
            return bool(self.external_skip.item())
        self.raise_deferred_nonfinite()
        return False

    def _defer_check(self, work: list[tuple[dict[str, Any], list[Tensor], list[Tensor]]],
                     flat: list[Tensor], flags: Tensor | None = None) -> Tensor:
        """The deferred check: this step's flags (``flags``, else computed) start on their way to the host (read
        by the next :meth:`raise_deferred_nonfinite`); returns the 0-d float32 device flag the updates skip on."""
        if flags is None:
            flags = nonfinite_flags(flat, flat[0].device)
        host, event = self._flags_host.send(flags)
        self._deferred_check = _PendingCheck(host, event, [(g, params) for g, params, _ in work])
        return flags.amax()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the gradients of this optimizer's parameters to a total ``norm_type`` norm of ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)`` does, and return that total norm (a 0-d
        float32 tensor, before clipping). Call it after backward, right before :meth:`step`.

        Where the optimizer can (Muon: its fused momentum pass and the AdamW path), the gradients are not scaled
        here: the next :meth:`step` applies the coefficient as it reads them, which saves a read and a write of
        every gradient, and uses the per-gradient norms as its non-finite check, which saves another read (a
        gradient whose float32 norm overflows, entries beyond ~1e19, then counts as non-finite). The gradients
        must not change in between (``zero_grad()`` drops the coefficient; other changes make ``step()`` raise).
        Other optimizers, and gradients on several devices, are scaled here."""
        max_norm, norm_type = float(max_norm), float(norm_type)
        if not math.isfinite(max_norm) or max_norm < 0:
            raise ValueError(f"clip_grad_norm_ needs a finite max_norm >= 0, got {max_norm}")
        self._pending_clip = None
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        grads = [p.grad for p in params]  # in param_groups order, as step() gathers them
        if not grads:
            return torch.zeros(())
        if len({g.device for g in grads}) > 1 or any(g.is_sparse for g in grads):
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        norms = torch.stack(torch._foreach_norm(grads, norm_type)).float()
        total = norms.max() if norm_type == math.inf else torch.linalg.vector_norm(norms, norm_type)
        self.scale_grads_(torch.clamp(max_norm / (total + 1e-6), max=1.0), (~torch.isfinite(norms)).float())
        return total

    @torch.no_grad()
    def scale_grads_(self, coef: Tensor, nonfinite: Tensor | None = None) -> None:
        """Multiply the current gradients by ``coef`` (a 0-d float32 tensor on their device): inside the next
        :meth:`step` where the optimizer can (see :meth:`clip_grad_norm_`), else in place now. ``nonfinite``:
        optional ``(n,)`` flags, one per gradient in ``param_groups`` order, 1 where it is not finite, which the
        step then takes as its non-finite check. A wrapper that clips over several optimizers (the layer-wise
        optimizer) calls this with the global coefficient."""
        self._pending_clip = None
        grads = current_grads(self)
        if self._defers_grad_scale and grads and len({g.device for g in grads}) == 1:
            self._pending_clip = _PendingClip(coef.to(grads[0].device), nonfinite,
                                              [(id(g), g._version) for g in grads])
        else:
            _multiply(grads, coef)

    def _take_pending_clip(self, flat: list[Tensor]) -> _PendingClip | None:
        """The coefficient clip_grad_norm_ left for this step, checked against the gradients it was computed
        from."""
        pending, self._pending_clip = self._pending_clip, None
        if pending is not None and pending.grads != [(id(g), g._version) for g in flat]:
            raise RuntimeError("the gradients changed between clip_grad_norm_() and step(); clip right before "
                               "step(), after the last backward (zero_grad() drops a clip that is not wanted)")
        return pending

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._pending_clip = None
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One optimizer step over every group. A NaN/Inf gradient raises ``NonFiniteGradientError`` before
        anything is written (or, with ``skip_nonfinite=True``, that parameter's update is skipped and counted in
        ``skipped_updates``).

        With ``deferred_nonfinite=True`` there is no host sync: a step with a NaN/Inf gradient is skipped
        on the GPU (nothing written) and the error is raised by the next ``step()``, ``state_dict()`` or
        :meth:`raise_deferred_nonfinite`. Optimizers whose matrix update can't skip on the GPU (MOP, sharded Muon)
        check on the host as without the option, and so do Muon's updates off the fused kernels."""
        self.raise_deferred_nonfinite()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(g, *self._gather(g)) for g in self.param_groups]
        flat = [gr for _, _, grads in work for gr in grads]
        clip = self._take_pending_clip(flat)
        check = getattr(self, "check_nonfinite", True)
        skip = None
        external = self.external_skip
        if external is not None:
            check = False
            if self._skips_on_device and all(type(g) is Tensor and g.device == external.device for g in flat):
                skip = external
            elif bool(external.item()):  # these updates can't skip on the device: read the flag now
                return loss
        elif (check and self.deferred_nonfinite and self._skips_on_device and flat
                and all(type(g) is Tensor and g.device == flat[0].device for g in flat)):
            skip = self._defer_check(work, flat, None if clip is None else clip.flags)
            check = False
        if not check:
            finite = [True] * len(flat)
        elif clip is not None and clip.flags is not None:
            finite = (clip.flags == 0).tolist()
        else:
            finite = self._finite_mask(flat)
        if not all(finite):
            if not self.skip_nonfinite:
                raise NonFiniteGradientError(
                    f"non-finite (NaN/Inf) gradient in {self._nonfinite_labels([w[:2] for w in work], finite)}; "
                    "no parameter or state was updated. Lower the learning rate, use gradient clipping or loss "
                    "scaling, or pass skip_nonfinite=True to skip such updates.")
            k = 0
            kept = []
            for g, params, grads in work:
                keep = finite[k:k + len(params)]
                k += len(params)
                self.skipped_updates += keep.count(False)
                kept.append((g, [p for p, f in zip(params, keep) if f], [x for x, f in zip(grads, keep) if f]))
            work = kept
        work = [w for w in work if w[1]]
        self._step_grad_scale = None if clip is None else clip.coef  # read by the updates as they read gradients
        try:
            self._update(work, skip)
        finally:
            self._step_grad_scale = None
        return loss

    def _update(self, work: list[tuple[dict[str, Any], list[Tensor], list[Tensor]]], skip: Tensor | None) -> None:
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
            if group[self.matrix_flag]:
                if skip is None:
                    self._matrix_update(group, params, grads)
                else:  # only where _skips_on_device
                    self._matrix_update(group, params, grads, skip)
            else:
                self._adamw_update(group, params, grads, skip)
        if side is not None:
            main.wait_stream(side)

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
        """The matrix algorithm's update of one group. ``skip`` (only where ``_skips_on_device``): a 0-d float32
        device flag, nonzero when the step must write nothing."""
        raise NotImplementedError

    # ----------------------------------------------------------------------------------- AdamW
    def _adamw_update(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                      skip: Tensor | None = None) -> None:
        """Decoupled-weight-decay Adam. Float32 state for every parameter dtype; PyTorch's fused kernel when the
        parameters are float32 (outside torch.compile, whose functionalization can't trace it), a foreach path
        otherwise. ``skip``: a 0-d float32 device flag, nonzero to write nothing (the fused kernel's
        ``found_inf``; the foreach path checks it on the host)."""
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
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        fused_ok = not torch.compiler.is_compiling()  # traced graphs can't functionalize _fused_adamw_
        fused = fused_ok and all(p.dtype == torch.float32 and g.dtype == torch.float32 for p, g in zip(params, grads))
        if skip is not None and not fused:  # the foreach path can't skip on the device: check on the host now
            if self._skip_on_host():
                return
            skip = None
        torch._foreach_add_(steps, 1.0)
        if skip is not None:
            torch._foreach_sub_(steps, [skip] * len(steps))
        scale = self._step_grad_scale  # clip_grad_norm_'s deferred coefficient, or None
        if fused:
            if isinstance(lr, Tensor):
                lr = lr.to(params[0].device)
            # the fused kernel divides the gradients by grad_scale as it reads them
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=wd, eps=eps, amsgrad=False, maximize=False,
                                grad_scale=None if scale is None else scale.reciprocal(), found_inf=skip)
            return
        # foreach path (low-precision parameters): float32 math on 0-d step tensors (no host sync)
        g32 = [g.float() for g in grads]
        if scale is not None:
            g32 = torch._foreach_mul(g32, scale)
        torch._foreach_lerp_(exp_avgs, g32, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, g32, g32, 1 - beta2)
        for p, m, v, t in zip(params, exp_avgs, exp_avg_sqs, steps):
            denom = (v.sqrt() / (1 - beta2**t).sqrt()).add_(eps)
            p32 = p.float().mul_(1 - lr * wd)
            p32.sub_(m / denom * (lr / (1 - beta1**t)))
            p.copy_(p32)

    # ----------------------------------------------------------------------------------- state_dict
    def state_dict(self) -> dict[str, Any]:
        """PyTorch's structure ``{"state": {index: {...}}, "param_groups": [...]}`` plus ``"optimizer"``: the
        class name, checked on load. Raises a deferred non-finite error first (:meth:`raise_deferred_nonfinite`)."""
        self.raise_deferred_nonfinite()
        sd = super().state_dict()
        sd["optimizer"] = type(self).__name__
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from ``state_dict()`` of the same optimizer class over the same parameters. A state
        dict from another optimizer class, another grouping or other parameter shapes raises ValueError. State
        tensors keep the float32 dtype they were saved with (PyTorch would cast them to the parameter dtype)."""
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
            # an option added after the state dict was saved keeps this optimizer's value
            missing = [k for k in g if k not in sg and k not in ("params", "names") and k not in self._added_options]
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
        for pid, st in state_dict["state"].items():
            p = id_map[pid]
            self.state[p] = {k: (v.to(device=p.device, copy=True) if isinstance(v, Tensor) else v)
                             for k, v in st.items()}

    _shaped_state_keys = ("exp_avg", "exp_avg_sq", "momentum_buffer")
    # group options newer than some saved state dicts: loading one without them keeps this optimizer's values
    _added_options: tuple[str, ...] = ()
