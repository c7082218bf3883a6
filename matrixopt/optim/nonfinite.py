"""What matrixopt's optimizers do about NaN/Inf gradients, and the gradient clip that shares their pass.

One policy, :class:`NonFinitePolicy`, serves the single-process optimizers
(:class:`matrixopt.optim.base.MatrixOptimizer`), the layer-wise wrapper (flags agreed over ranks) and sharded Muon:

- eager (default): one pass flags each gradient (:func:`nonfinite_flags`), one host sync reads the flags, and a
  NaN/Inf gradient raises :class:`NonFiniteGradientError` before anything is written;
- ``skip_nonfinite=True``: the update of each parameter whose gradient is NaN/Inf is dropped and counted instead;
- ``deferred_nonfinite=True``: no host sync. The flags travel to the host in the background (:class:`HostMirror`),
  the updates skip on a device flag, and the next call raises.

Every error is built by :func:`raise_nonfinite`. The clip computes each gradient's norm once
(:func:`grad_norms`): the norms give the total norm and so the coefficient (:func:`clip_coefficient`), and their
non-finite entries serve as the step's check.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from matrixopt.kernels import muon_elementwise


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds NaN or Inf. Raised before any parameter or state is touched (with
    ``deferred_nonfinite=True``: at the next call after the step, which left everything as it was)."""


def raise_nonfinite(labels: list[str], *, deferred: bool = False, ranks: bool = False) -> NoReturn:
    """Raise :class:`NonFiniteGradientError` for the gradients named by ``labels`` (the first five are shown).
    ``deferred``: found by the last step, which was skipped; ``ranks``: the check was agreed over ranks."""
    where = f"{', '.join(labels[:5])}{' ...' if len(labels) > 5 else ''}"
    nothing = f"no parameter or state was updated{' on any rank' if ranks else ''}"
    if deferred:
        raise NonFiniteGradientError(
            f"non-finite (NaN/Inf) gradient at the last step in {where}, which was skipped: {nothing} "
            "(deferred_nonfinite=True reports it at the next call). Lower the learning rate, clip gradients or use "
            "loss scaling.")
    raise NonFiniteGradientError(
        f"non-finite (NaN/Inf) gradient in {where}; {nothing}. Lower the learning rate, clip gradients or use loss "
        "scaling, or pass skip_nonfinite=True to skip such updates.")


def label(name: str, p: Tensor) -> str:
    """How errors name a parameter: its name and shape."""
    return f"`{name}` (shape {tuple(p.shape)})"


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


def sanitized(grads: list[Tensor], skip: Tensor) -> list[Tensor]:
    """float32 copies of ``grads`` that are all zeros where the 0-d device flag ``skip`` is set (nonzero): what an
    update that skips by weighting its writes with ``1 - skip`` reads, so that no NaN/Inf reaches its arithmetic.
    One pass per gradient, no host sync."""
    bad = skip > 0
    return [g.masked_fill(bad, 0) if g.dtype == torch.float32 else g.float().masked_fill_(bad, 0) for g in grads]


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


# ----------------------------------------------------------------------------------------------- clipping
def check_clip(max_norm: float, norm_type: float) -> tuple[float, float]:
    """``(max_norm, norm_type)`` as floats; ValueError unless max_norm is finite and >= 0 and norm_type > 0."""
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not math.isfinite(max_norm) or max_norm < 0:
        raise ValueError(f"clip_grad_norm_ needs a finite max_norm >= 0, got {max_norm}")
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_ needs norm_type > 0 (2.0: Euclidean, inf: largest entry), got {norm_type}")
    return max_norm, norm_type


def grad_norms(grads: list[Tensor], norm_type: float, device: torch.device, sharded: Tensor | None = None,
               group: dist.ProcessGroup | None = None) -> tuple[Tensor, Tensor]:
    """The total ``norm_type`` norm of ``grads`` as ``torch.nn.utils.clip_grad_norm_`` computes it (the norm of the
    per-gradient norms; foreach, no host sync), and which gradients are not finite. Returns ``(total, flags)`` on
    ``device``: ``total`` 0-d float32; ``flags`` ``(len(grads),)`` float32, 1 where a gradient's norm is not finite
    (a NaN/Inf, or a float32 overflow: entries beyond ~1e19). Totals of disjoint gradients (ranks, shards) combine
    as their max for ``norm_type`` inf, else as ``(sum total**norm_type) ** (1 / norm_type)``.

    ``sharded``: an optional ``(len(grads),)`` bool mask on ``device`` of the gradients that are disjoint shards
    over ``group`` (expert stacks under expert parallelism): their part is combined over the group's ranks (a
    collective), the others counted once. The total is then the same on every rank, and a non-finite one flags
    every gradient, so that every rank skips the step together."""
    if not grads:
        return torch.zeros((), device=device), torch.zeros(0, device=device)
    norms = torch.stack(torch._foreach_norm(grads, norm_type)).float().to(device)  # (n,)
    flags = (~torch.isfinite(norms)).float()
    if sharded is None:
        total = norms.amax() if norm_type == math.inf else torch.linalg.vector_norm(norms, norm_type)
        return total, flags
    if norm_type == math.inf:
        part = torch.where(sharded, norms, 0.0).amax()
        dist.all_reduce(part, op=dist.ReduceOp.MAX, group=group)
        total = torch.maximum(torch.where(sharded, 0.0, norms).amax(), part)
    else:
        powers = norms.pow(norm_type)
        part = torch.where(sharded, powers, 0.0).sum()
        dist.all_reduce(part, group=group)
        total = (torch.where(sharded, 0.0, powers).sum() + part).pow(1.0 / norm_type)
    return total, torch.maximum(flags, (~torch.isfinite(total)).float())


def clip_coefficient(total: Tensor, max_norm: float) -> Tensor:
    """What gradients of total norm ``total`` (0-d) are multiplied by to clip them to ``max_norm``:
    ``min(1, max_norm / (total + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def current_grads(optimizer: Optimizer) -> list[Tensor]:
    """The gradients an optimizer's parameters hold now, in ``param_groups`` order."""
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def scale_grads(optimizer: Optimizer, coef: Tensor) -> None:
    """Multiply ``optimizer``'s current gradients by ``coef`` (0-d): inside its next step for an optimizer that
    can (:meth:`matrixopt.optim.base.MatrixOptimizer.scale_grads_`), else in place now."""
    scale = getattr(optimizer, "scale_grads_", None)
    if scale is not None:
        scale(coef)
    else:
        multiply(current_grads(optimizer), coef)


def multiply(grads: list[Tensor], coef: Tensor) -> None:
    """``grads *= coef`` in place, one foreach call (``coef``: a 0-d tensor, moved to the gradients' device)."""
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))


# ----------------------------------------------------------------------------------------------- the policy
@dataclass
class Pending:
    """What one call leaves for a later one: non-finite flags, one per gradient in ``param_groups`` order (nonzero
    where it held NaN/Inf), and for a clip its coefficient.

    - A deferred check, from a step to the next call: ``flags`` is a host copy that ``event`` completes (None for
      CPU flags); ``labels()`` names the gradients.
    - A deferred clip, from ``clip_grad_norm_`` to the next step: the step multiplies the gradients by ``coef`` (0-d
      float32 on their device) as it reads them and takes ``flags`` (on the device, or None) as its check;
      ``grads`` are the ``(id, version)`` of the gradients both were computed from."""

    flags: Tensor | None
    event: torch.cuda.Event | None = None
    labels: Callable[[], list[str]] | None = None
    coef: Tensor | None = None
    grads: list[tuple[int, int]] | None = None


def _versions(grads: list[Tensor]) -> list[tuple[int, int]]:
    return [(id(g), g._version) for g in grads]


def plain_on(grads: list[Tensor], device: torch.device) -> bool:
    """Whether every gradient is a plain tensor (no DTensor) on ``device``: what a device flag or a held clip
    coefficient can be applied to."""
    return all(type(g) is Tensor and g.device == device for g in grads)


class NonFinitePolicy:
    """One optimizer's non-finite gradient policy (see the module docstring) and what it keeps between calls.

    Args:
        skip: drop (and count in ``skipped``) the update of each parameter whose gradient is NaN/Inf.
        deferred: check without a host sync wherever the gradients are plain tensors on one device. Only for
            optimizers whose updates take a ``skip`` device flag (and read it on the host, :meth:`on_host`, where a
            layout can't skip on the device). Not with ``skip``.
        clip_in_step: the optimizer's updates multiply the gradients by a held clip coefficient as they read them
            (:meth:`scale`); otherwise the clip scales the gradients at once.
        ranks: the flags are agreed over ranks (errors then say that no rank was updated).

    A wrapper that checks an optimizer's gradients itself, agreed over ranks (the layer-wise optimizer), sets
    ``wrapped`` on that optimizer's policy, and ``agreed`` during each deferred step: the 0-d float32 device flag,
    nonzero when some rank's gradient held NaN/Inf, that the step then skips on (the wrapper reports the error).
    """

    def __init__(self, *, skip: bool = False, deferred: bool = False, clip_in_step: bool = False,
                 ranks: bool = False) -> None:
        if skip and deferred:
            raise ValueError("skip_nonfinite skips single parameters, which needs the flags on the host before the "
                             "step; it can't be combined with deferred_nonfinite")
        self.skip, self.deferred, self.clip_in_step, self.ranks = bool(skip), bool(deferred), clip_in_step, ranks
        self.skipped = 0  # parameter updates skipped for non-finite gradients
        self.wrapped = False
        self._start()

    def _start(self) -> None:
        self.agreed: Tensor | None = None
        self._check: Pending | None = None  # the last step's deferred check
        self._undo: list[Callable[[], None]] = []  # what to put back if the last step turns out skipped
        self._clip: Pending | None = None  # the clip held for the next step
        self._host = HostMirror()  # where deferred flags are copied

    def __getstate__(self) -> dict:
        """The options and the counter; a check or clip in flight (an event, pinned memory) is not pickled."""
        return {k: self.__dict__[k] for k in ("skip", "deferred", "clip_in_step", "ranks", "skipped", "wrapped")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._start()

    # ----------------------------------------------------------------------------------- the step's check
    def screen(self, grads: list[Tensor], flags: Callable[[], Tensor], labels: Callable[[], list[str]],
               local: list[Tensor] | None = None) -> tuple[Tensor | None, list[bool] | None]:
        """A step's verdict on its ``grads``: ``(skip, keep)``. ``skip`` is None or the 0-d float32 device flag the
        updates skip on (nonzero: write nothing): a deferred check's, or a wrapper's agreed one. ``keep`` is None
        (update every parameter) or, per gradient, whether to update its parameter. ``flags()`` gives the
        gradients' non-finite flags on the device (agreed over ranks where the gradients are shards),
        ``labels()`` their names; each is called only if needed. ``local``: what the updates apply a device flag
        to, where that is not ``grads`` themselves (sharded optimizers: each DTensor gradient's local shard); a
        deferred check needs them plain tensors on one device. Raises NonFiniteGradientError (the eager check)."""
        self._undo = []
        if not grads:
            return None, None
        if self.wrapped:
            if self.agreed is None:  # the wrapper checked on the host
                return None, None
            if plain_on(grads, self.agreed.device):
                return self.agreed, None
            return None, [not self.on_host(self.agreed)] * len(grads)
        local = grads if local is None else local
        if self.deferred and plain_on(local, local[0].device):
            return self.defer(flags(), labels), None
        return None, self.check(flags(), labels)

    def check(self, flags: Tensor, labels: Callable[[], list[str]]) -> list[bool] | None:
        """The eager check: ``flags`` read on the host (one sync). None when every gradient is finite; otherwise
        raise or, with ``skip``, count the bad ones and return which to keep."""
        finite = (flags == 0).tolist()
        if all(finite):
            return None
        if not self.skip:
            raise_nonfinite([name for name, ok in zip(labels(), finite) if not ok], ranks=self.ranks)
        self.skipped += finite.count(False)
        return finite

    def defer(self, flags: Tensor, labels: Callable[[], list[str]]) -> Tensor:
        """The deferred check: ``flags`` (``(n,)`` on the device, n >= 1) start on their way to the host, read by
        the next :meth:`raise_pending`. Returns the 0-d float32 device flag the updates skip on."""
        host, event = self._host.send(flags)
        self._check = Pending(host, event, labels)
        return flags.amax()

    def raise_pending(self) -> None:
        """Raise the last step's deferred check if it found a NaN/Inf gradient (that step wrote nothing). Waits for
        that check only (a few kernels at the start of the step), not for the whole step. Reports once."""
        pending, self._check = self._check, None
        if pending is None:
            return
        if pending.event is not None:
            pending.event.synchronize()
        finite = (pending.flags == 0).tolist()
        if not all(finite):
            self.unwind()
            raise_nonfinite([name for name, ok in zip(pending.labels(), finite) if not ok], deferred=True,
                            ranks=self.ranks)

    def undo_if_skipped(self, undo: Callable[[], None]) -> None:
        """Register ``undo``, which puts back what the running step advanced on the host (step counts kept as
        Python ints), for the case that the step's device flag turns out set: :meth:`unwind` runs it then."""
        self._undo.append(undo)

    def unwind(self) -> None:
        """The last step was skipped on the device: put back what its updates advanced on the host (the
        callbacks of :meth:`undo_if_skipped`, last first). A wrapper that reports its agreed check itself calls
        this on the optimizers it wraps."""
        undo, self._undo = self._undo, []
        for fn in reversed(undo):
            fn()

    def on_host(self, skip: Tensor) -> bool:
        """For an update that can't skip on the device, mid-step: whether it must write nothing, read on the host
        now. A wrapper's agreed flag is read (the wrapper reports the error); the step's own deferred check raises
        here (nothing of this step has been written but what skipped on the device)."""
        if self.wrapped:
            return bool(skip.item())
        self.raise_pending()
        return False

    # ----------------------------------------------------------------------------------- clipping
    def scale(self, grads: list[Tensor], coef: Tensor, flags: Tensor | None = None, held: bool | None = None) -> None:
        """Multiply ``grads`` (the optimizer's, in ``param_groups`` order) by ``coef`` (0-d): held for the next
        step where its updates apply it as they read the gradients (``clip_in_step``, and ``held``: by default
        plain tensors on one device), else in place now. ``flags``: the gradients' non-finite flags, which a held
        clip hands to the step as its check."""
        self._clip = None
        if held is None:
            held = bool(grads) and plain_on(grads, grads[0].device)
        if self.clip_in_step and grads and held:
            self._clip = Pending(flags, coef=coef.to(grads[0].device), grads=_versions(grads))
        else:
            multiply(grads, coef)

    def take_clip(self, grads: list[Tensor]) -> Pending | None:
        """The clip held for this step, checked against the gradients it was computed from."""
        pending, self._clip = self._clip, None
        if pending is not None and pending.grads != _versions(grads):
            raise RuntimeError("the gradients changed between clip_grad_norm_() and step(); clip right before "
                               "step(), after the last backward (zero_grad() drops a clip that is not wanted)")
        return pending

    def drop_clip(self) -> None:
        self._clip = None
