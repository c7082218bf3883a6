"""Optimizer state kept off the compute device (``offload="cpu"``) or compact (``state_dtype``), and the step that
moves it: :class:`StagedStep` runs an optimizer's usual float32 update chunk by chunk, with each chunk's state
brought to the parameters' device (as stored: compact state moves compact) and decoded to float32 there, then
encoded and stored back. Compact state on the device is written back in place chunk by chunk.

With ``offload="cpu"`` the state lives in CPU memory (pinned where CUDA is available, so copies are asynchronous).
Per chunk (a set of parameters whose matrices share Newton–Schulz batches, up to :data:`CHUNK_NUMEL` values)::

    H2D stream    : state of chunk i+1
    compute stream: update of chunk i (decode, momentum, Newton–Schulz, apply, encode)
    D2H stream    : new state of chunk i-1

so transfers overlap the next chunk's compute. The step is all or nothing: new state is written into a second host
buffer (a *shadow*) and swapped in only once every chunk has succeeded, and each chunk's parameters are copied to
the host before they are updated, so an exception (or KeyboardInterrupt) anywhere in the step restores the
parameters and leaves the state of the step before. Host memory: the state twice (live and shadow) plus one copy of
the parameters. Gradients are not copied. An optimizer built with offload checks at construction, before any state
exists, that the host has that much memory available (:meth:`Offload.check_fits`), and raises MemoryError
otherwise; an allocation that fails later, mid-step, raises MemoryError naming its size and leaves the step
before.

The copies go through :class:`Offload`, whose ``device_copy`` can be replaced: a test on a CPU-only machine runs
the whole path with the "device" being the CPU and a copy standing in for the transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from matrixopt.optim import state as compact

CHUNK_NUMEL = 1 << 24  # parameter values per chunk (64 MiB of float32 state per state tensor)
OFFLOAD_CHOICES = ("cpu",)


class Offload:
    """Where offloaded state lives (CPU memory) and how it moves to and from the compute device.

    Args:
        pin_memory: allocate the host state in pinned memory (default: where CUDA is available).
        device_copy: ``device_copy(host_tensor, device) -> Tensor``, a new tensor on ``device`` with the same
            values (default: an asynchronous copy on a side stream on CUDA, a plain copy elsewhere). Tests replace
            it to run the offload path on a machine without a GPU.
    """

    def __init__(self, pin_memory: bool | None = None,
                 device_copy: Callable[[Tensor, torch.device], Tensor] | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.device_copy = device_copy
        self.host_bytes = 0  # held by this offload: state, shadows and parameter backups
        self.shadows: dict[Tensor, dict[str, Any]] = {}  # per parameter: the other host buffer of its state
        self.backups: dict[Tensor, Tensor] = {}  # per parameter: its host copy for rolling back a failed step
        self._streams: dict[torch.device, tuple[Any, Any]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"pin_memory": self.pin_memory, "device_copy": self.device_copy, "host_bytes": 0, "shadows": {},
                "backups": {}, "_streams": {}}

    # ----------------------------------------------------------------------------------- host memory
    def check_fits(self, nbytes: int, what: str) -> None:
        """MemoryError now, before any state exists, if the host's available memory (``MemAvailable``, Linux) is
        below ``nbytes``, the least the offloaded state will hold (``what`` says of what)."""
        available = available_host_bytes()
        if available is not None and nbytes > available:
            raise MemoryError(
                f"offload='cpu' needs at least {nbytes / 2**30:.2f} GiB of {'pinned ' if self.pin_memory else ''}CPU "
                f"memory ({what}), but {available / 2**30:.2f} GiB is available. Free host memory, use "
                f"state_dtype='bf16' or 'int8', or turn offload off.")

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        """An uninitialized host tensor (pinned if ``pin_memory``); MemoryError naming the size if it can't be
        had."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        try:
            t = self._allocate(shape, dtype)
        except (RuntimeError, MemoryError) as e:
            kind = "pinned " if self.pin_memory else ""
            raise MemoryError(
                f"offload='cpu' could not allocate {nbytes / 2**20:.1f} MiB of {kind}CPU memory for optimizer state "
                f"(tensor {tuple(shape)} {dtype}; {self.host_bytes / 2**30:.2f} GiB already held: the state twice "
                f"and a copy of the parameters). Free host memory, use state_dtype='bf16' or 'int8', or turn "
                f"offload off. ({e})") from e
        self.host_bytes += nbytes
        return t

    def _allocate(self, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory)

    def to_host(self, t: Tensor) -> Tensor:
        """A host copy of ``t`` in this offload's memory (synchronous: for loading state)."""
        if not isinstance(t, Tensor):
            return t
        out = self.empty(t.shape, t.dtype)
        out.copy_(t)
        return out

    # ----------------------------------------------------------------------------------- copies
    def _cuda_streams(self, device: torch.device) -> tuple[Any, Any]:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))  # (H2D, D2H)
        return self._streams[device]

    def _overlapped(self, device: torch.device) -> bool:
        return (device.type == "cuda" and self.device_copy is None and not torch.compiler.is_compiling()
                and not torch.cuda.is_current_stream_capturing())

    def fetch(self, host: Tensor, device: torch.device) -> Tensor:
        """``host`` copied to ``device`` (a new tensor; on CUDA issued on the H2D stream, see :meth:`ready`)."""
        if self.device_copy is not None:
            return self.device_copy(host, device)
        if self._overlapped(device):
            h2d, _ = self._cuda_streams(device)
            with torch.cuda.stream(h2d):  # from host memory into a new tensor: nothing on the main stream to wait for
                return host.to(device, non_blocking=True)
        return host.to(device, copy=True)

    def ready(self, tensors: list[Tensor], device: torch.device) -> None:
        """Make the compute stream wait for :meth:`fetch`'s copies of ``tensors`` before it uses them."""
        if self._overlapped(device):
            h2d, _ = self._cuda_streams(device)
            main = torch.cuda.current_stream(device)
            main.wait_stream(h2d)
            for t in tensors:
                t.record_stream(main)

    def store(self, src: Tensor, dst: Tensor) -> None:
        """Copy ``src`` (on the device) into the host tensor ``dst``: on CUDA on the D2H stream, after the compute
        stream's work so far (see :meth:`synchronize`)."""
        if self._overlapped(src.device):
            _, d2h = self._cuda_streams(src.device)
            d2h.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(d2h):
                dst.copy_(src, non_blocking=True)
            src.record_stream(d2h)
        else:
            dst.copy_(src)

    def synchronize(self) -> None:
        """Wait for every copy to the host issued so far."""
        for _, d2h in self._streams.values():
            d2h.synchronize()

    def backup(self, p: Tensor) -> None:
        """Copy parameter ``p`` to its host backup (on the compute stream, before its update)."""
        b = self.backups.get(p)
        if b is None or b.shape != p.shape or b.dtype != p.dtype:
            b = self.backups[p] = self.empty(p.shape, p.dtype)
        b.copy_(p, non_blocking=b.is_pinned())

    def shadow(self, p: Tensor, new: dict[str, Any]) -> dict[str, Any]:
        """Host tensors laid out as ``new``'s (keys, shapes, dtypes) for parameter ``p``, reused from step to step."""
        old = self.shadows.pop(p, {})
        out = {}
        for k, v in new.items():
            if not isinstance(v, Tensor):
                out[k] = v
                continue
            o = old.get(k)
            out[k] = o if isinstance(o, Tensor) and o.shape == v.shape and o.dtype == v.dtype else self.empty(
                v.shape, v.dtype)
        return out


def available_host_bytes() -> int | None:
    """The host memory available to new allocations (``MemAvailable`` of ``/proc/meminfo``), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_offload(value: Any) -> Offload | None:
    """None, or an :class:`Offload` for ``"cpu"`` (or the given one); ValueError listing the choices otherwise."""
    if value is None or isinstance(value, Offload):
        return value
    if value in OFFLOAD_CHOICES:
        return Offload()
    raise ValueError(f"Invalid offload: {value!r}; use None (state on the parameters' device), 'cpu' (state in "
                     f"CPU memory, moved to the device per chunk) or a matrixopt.optim.offload.Offload")


class StagedStep:
    """One optimizer step over state that is compact, offloaded or both (module docstring). ``state``: the
    optimizer's ``self.state``; ``generator(device)``: the stochastic rounding's generator for ``device``.

    Use: ``prefetch(next chunk)`` (optional), ``stage(chunk)``, the update, ``unstage(chunk)``, ..., then ``commit()``
    once every chunk succeeded, or ``rollback()`` on an exception."""

    def __init__(self, state: dict[Tensor, dict[str, Any]], state_dtype: str | None, offload: Offload | None,
                 generator: Callable[[torch.device], torch.Generator]) -> None:
        self.state, self.state_dtype, self.offload, self.generator = state, state_dtype, offload, generator
        self._stored: dict[Tensor, dict[str, Any]] = {}  # per staged parameter: its state as stored
        self._fetched: dict[Tensor, dict[str, Any]] = {}  # prefetched device copies of stored state
        self._pending: dict[Tensor, dict[str, Any]] = {}  # offload: new state in the shadows, for commit()
        self._backed_up: list[Tensor] = []

    def prefetch(self, params: list[Tensor]) -> None:
        """Start copying the stored state of ``params`` to their device (offload only)."""
        if self.offload is None:
            return
        for p in params:
            if p not in self._fetched and p in self.state:
                self._fetched[p] = {k: self.offload.fetch(v, p.device) if isinstance(v, Tensor) else v
                                    for k, v in self.state[p].items()}

    def stage(self, params: list[Tensor]) -> None:
        """Put float32 state of ``params`` on their device into ``state`` for the update to use."""
        self.prefetch(params)
        for p in params:
            stored = self.state.get(p, {})
            self._stored[p] = stored
            raw = self._fetched.pop(p, stored)
            if self.offload is not None:
                self.offload.ready([v for v in raw.values() if isinstance(v, Tensor)], p.device)
                self.offload.backup(p)
                self._backed_up.append(p)
            self.state[p] = compact.decoded(raw)

    def unstage(self, params: list[Tensor]) -> None:
        """Store the updated state of ``params`` (encoded; offload: into the shadows, swapped in by commit) and put
        the stored state back into ``state``."""
        for p in params:
            work, stored = self.state[p], self._stored[p]  # still restorable by rollback() until stored back
            new = {}
            for k, v in work.items():
                new |= compact.encode(v, k, self.state_dtype, self.generator(p.device)) if isinstance(v, Tensor) \
                    else {k: v}
            if self.offload is not None:
                shadow = self.offload.shadow(p, new)
                for k, v in new.items():
                    if isinstance(v, Tensor):
                        self.offload.store(v, shadow[k])
                self._pending[p] = shadow
            else:  # compact state on the device: written in place (same tensors) where the layout holds
                for k, v in new.items():
                    o = stored.get(k)
                    if isinstance(o, Tensor) and isinstance(v, Tensor) and o.shape == v.shape and o.dtype == v.dtype:
                        if o is not v:
                            o.copy_(v)
                    else:
                        stored[k] = v
            self.state[p] = stored
            del self._stored[p]

    def commit(self) -> None:
        """Make the new state current: every chunk's host copies finished, the shadows swapped in."""
        if self.offload is not None:
            self.offload.synchronize()
            for p, new in self._pending.items():
                old = self.state.get(p)
                self.state[p] = new
                if old:
                    self.offload.shadows[p] = old
        self._pending.clear()

    def rollback(self) -> None:
        """After an exception mid-step: the stored state back in place and, offloaded, the parameters restored
        from their host copies (the step before, all of it)."""
        for p, stored in self._stored.items():
            self.state[p] = stored
        self._stored.clear()
        if self.offload is not None:
            self.offload.shadows.update(self._pending)  # partly written; the next step overwrites them
        self._pending.clear()
        self._fetched.clear()
        if self.offload is not None:
            self.offload.synchronize()
            for p in self._backed_up:
                p.copy_(self.offload.backups[p])
