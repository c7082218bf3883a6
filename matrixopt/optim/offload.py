"""Optimizer state kept off the compute device (``offload="cpu"``) or compact (``state_dtype``), and the step that
moves it: :class:`StagedStep` runs an optimizer's usual float32 update chunk by chunk, with each chunk's state
brought to the parameters' device (as stored: compact state moves compact) and decoded to float32 there, then
encoded and stored back. Compact state on the device is written back in place chunk by chunk.

With ``offload="cpu"`` the state lives in CPU memory (pinned where CUDA is available, so copies are asynchronous).
It moves in *units*: a chunk (parameters whose matrices share Newton–Schulz batches, or a range of an element-wise
optimizer's parameter, up to :data:`CHUNK_NUMEL` values, or one larger matrix), or, for Muon's matrix chunks, which
hold whole Newton–Schulz batches of up to 128M values, sub-chunks of the batch's parameters of up to
:data:`CHUNK_NUMEL` values, which the momentum pass packs into the batch's stack one at a time
(``Muon._streamed_update``)::

    H2D stream    : state of unit i+1
    packing stream: momentum pass of unit i (Muon's sub-chunks; the AdamW groups' units, placed between Muon's
                    batches), overlapping the last batches' Newton–Schulz
    compute stream: update of unit i (decode, momentum, Newton–Schulz, apply, encode)
    D2H stream    : new state of unit i-1

so transfers overlap compute. The packing stream waits for the compute stream once per step, and the compute
stream waits for it before each batch's Newton–Schulz and at the end of the step. The host issues the step ahead
of the GPU, and each fetch allocates device memory when it is issued, so the host waits while more than
:data:`PENDING_STORES` units are still on their way back: the device holds the state of a few units, not the whole
state.

The step is all or nothing: new state is written into a second host buffer (a *shadow*) and swapped in only once
every chunk has succeeded, and the parameters have a copy on the host (a *backup*) from before their update, so an
exception (or KeyboardInterrupt) anywhere in the step restores the parameters and leaves the state of the step
before. The backups are refreshed right after each step on the D2H stream, overlapping the next forward and
backward, and checked against the parameters' version counters when the next step begins
(:meth:`Offload.backup`). Host memory: the state twice (live and shadow) plus one copy of the parameters.
Gradients are not copied. An optimizer built with offload checks at construction, before any state exists, that
the host has that much memory available (:meth:`Offload.check_fits`), and raises MemoryError otherwise; an
allocation that fails later, mid-step, raises MemoryError naming its size and leaves the step before.

The copies go through :class:`Offload`, whose ``device_copy`` can be replaced: a test on a CPU-only machine runs
the whole path with the "device" being the CPU and a copy standing in for the transfer.

A sharded optimizer (:class:`matrixopt.distributed.sharded.ShardedMuon`) runs the same step on the local shards of
its DTensor parameters and state (:class:`Shards`): each rank moves, encodes and backs up what it holds, and its
stored state stays DTensors laid out as before.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from matrixopt.optim import state as compact

CHUNK_NUMEL = 1 << 25
"""Parameter values per unit of staged state (128 MiB of float32 state per state tensor)."""
PENDING_STORES = 4
"""Units whose state may still be on its way to the host when the next fetch is issued. With CHUNK_NUMEL, the best
of the sizes tried on an H100 at 1.3B (docs/results/memory)."""
OFFLOAD_CHOICES = ("cpu",)
_MASK64 = (1 << 64) - 1


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
        self._versions: dict[Tensor, int] = {}  # per parameter: its version counter when its backup was refreshed
        self._refreshing: set[torch.device] = set()  # devices with backup refreshes the next update must follow
        self._streams: dict[torch.device, tuple[Any, Any]] = {}
        self._packers: dict[torch.device, Any] = {}  # per device: the stream sub-chunks' momentum passes run on
        self._stored: collections.deque = collections.deque()  # events: a staged unit's state stored to the host

    def __getstate__(self) -> dict[str, Any]:
        return {"pin_memory": self.pin_memory, "device_copy": self.device_copy, "host_bytes": 0, "shadows": {},
                "backups": {}, "_versions": {}, "_refreshing": set(), "_streams": {}, "_packers": {},
                "_stored": collections.deque()}

    # ----------------------------------------------------------------------------------- host memory
    def check_fits(self, nbytes: int, what: str) -> None:
        """MemoryError now, before any state exists, if the host's available memory (``MemAvailable``, Linux) is
        below ``nbytes``, the least the offloaded state will hold (``what`` says of what)."""
        available = available_host_bytes()
        if available is not None and nbytes > available and self.pin_memory and release_cached_pinned_memory():
            available = available_host_bytes()  # blocks PyTorch cached after an earlier run count as used
        if available is not None and nbytes > available:
            raise MemoryError(
                f"offload='cpu' needs at least {nbytes / 2**30:.2f} GiB of {'pinned ' if self.pin_memory else ''}CPU "
                f"memory ({what}), but {available / 2**30:.2f} GiB is available. Free host memory, use "
                f"state_dtype='bf16' or 'int8', or turn offload off.")

    def block_bytes(self, nbytes: int) -> int:
        """The host memory a tensor of ``nbytes`` takes: PyTorch's pinned (caching host) allocator rounds every
        block up to a power of two, so a 180 MB tensor takes 256 MB; unpinned memory takes what it asks."""
        if not self.pin_memory or nbytes <= 0:
            return nbytes
        return 1 << (nbytes - 1).bit_length()

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        """An uninitialized host tensor (pinned if ``pin_memory``); MemoryError naming the size if it can't be
        had."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        try:
            t = self._allocate(shape, dtype)
        except (RuntimeError, MemoryError) as e:
            kind = "pinned " if self.pin_memory else ""
            raise MemoryError(
                f"offload='cpu' could not allocate {_size(nbytes)} of {kind}CPU memory for optimizer state "
                f"(tensor {tuple(shape)} {dtype}; {self.host_bytes / 2**30:.2f} GiB already held: the state twice "
                f"and a copy of the parameters). Free host memory, use state_dtype='bf16' or 'int8', or turn "
                f"offload off. ({e})") from e
        self.host_bytes += self.block_bytes(nbytes)
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
        self._stored.clear()

    def mark_stored(self, device: torch.device) -> None:
        """Note that a unit's state has been issued to the host (CUDA: an event on the D2H stream), for
        :meth:`throttle`."""
        if self._overlapped(device):
            event = torch.cuda.Event()
            event.record(self._cuda_streams(device)[1])
            self._stored.append(event)

    def throttle(self, pending: int | None = None) -> None:
        """Wait on the host until at most ``pending`` units' stores are unfinished: the host issues the step far
        ahead of the GPU, and every fetch it issues allocates device memory at once."""
        pending = PENDING_STORES if pending is None else pending
        while len(self._stored) > pending:
            self._stored.popleft().synchronize()

    def packer(self, device: torch.device) -> Any:
        """The CUDA stream sub-chunks' momentum passes run on (:meth:`StagedStep.pack_stream`), or None."""
        if not self._overlapped(device):
            return None
        if device not in self._packers:
            self._packers[device] = torch.cuda.Stream(device)
        return self._packers[device]

    def backup(self, p: Tensor, values: Tensor) -> None:
        """Make parameter ``p``'s host backup hold ``values`` (the tensor holding ``p``'s values on this process:
        ``p`` itself, or a sharded parameter's local shard) as they are before the update. The copy
        :meth:`refresh_backups` started after the last step does, where the version counter of ``values`` has not
        moved since (then the compute stream only waits for that copy); otherwise ``values`` are copied now, on the
        compute stream, after that copy (which would otherwise land over it)."""
        if values.device in self._refreshing:
            self._refreshing.discard(values.device)
            if self._overlapped(values.device):  # the refresh reads p and writes its backup on the D2H stream:
                # before the update writes p, or a copy made now writes the backup
                torch.cuda.current_stream(values.device).wait_stream(self._cuda_streams(values.device)[1])
        b = self.backups.get(p)
        if (b is not None and b.shape == values.shape and b.dtype == values.dtype
                and self._versions.get(p) == values._version):
            return
        self._versions.pop(p, None)
        if b is None or b.shape != values.shape or b.dtype != values.dtype:
            b = self.backups[p] = self.empty(values.shape, values.dtype)
        b.copy_(values, non_blocking=b.is_pinned())

    def refresh_backups(self, params: dict[Tensor, Tensor]) -> None:
        """After a step: copy the updated ``params`` (parameter -> the tensor holding its values, as for
        :meth:`backup`) to their host backups for the next step's :meth:`backup`, on CUDA on the D2H stream, so
        that the copies overlap what runs until then (the next forward and backward) rather than the step. A
        parameter changed in place before the next step (its version counter moves) is copied again then. Code
        that writes a parameter's storage without moving its counter (through ``.data``, or a custom kernel)
        between steps leaves a stale backup, which only a step that fails would restore."""
        waited: set[torch.device] = set()
        for p, values in params.items():
            b = self.backups.get(p)
            if b is None or b.shape != values.shape or b.dtype != values.dtype:
                continue
            if self._overlapped(values.device):
                _, d2h = self._cuda_streams(values.device)
                if values.device not in waited:
                    d2h.wait_stream(torch.cuda.current_stream(values.device))
                    waited.add(values.device)
                with torch.cuda.stream(d2h):
                    b.copy_(values, non_blocking=True)
            else:
                b.copy_(values)
            self._versions[p] = values._version
            self._refreshing.add(values.device)

    def restore(self, p: Tensor, values: Tensor) -> None:
        """Parameter ``p`` back from its host backup into ``values`` (as for :meth:`backup`; after
        :meth:`synchronize`: a failed step's rollback)."""
        values.copy_(self.backups[p])
        self._versions.pop(p, None)

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


def _size(nbytes: int) -> str:
    """``nbytes`` for a message: in bytes, KiB, MiB or GiB, whichever reads best."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


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


def release_cached_pinned_memory() -> bool:
    """Return the pinned host blocks PyTorch's caching host allocator holds unused (say, an earlier offloaded
    optimizer's, freed in this process) to the system, where MemAvailable counts them again. Whether it could ask
    (CUDA initialized, and a PyTorch that has the call)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    release = (getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
               or getattr(torch._C, "_host_emptyCache", None))
    if release is None:
        return False
    release()
    return True


def check_offload(value: Any) -> Offload | None:
    """None, or an :class:`Offload` for ``"cpu"`` (or the given one); ValueError listing the choices otherwise."""
    if value is None or isinstance(value, Offload):
        return value
    if value in OFFLOAD_CHOICES:
        return Offload()
    raise ValueError(f"Invalid offload: {value!r}; use None (state on the parameters' device), 'cpu' (state in "
                     f"CPU memory, moved to the device per chunk) or a matrixopt.optim.offload.Offload")


class Shards:
    """How a staged step reaches the values of each tensor that this process holds: for plain tensors, the tensors
    themselves. Sharded optimizers give a subclass (:class:`matrixopt.distributed.sharded.DTensorShards`) whose
    tensors are DTensors: the step then moves, decodes and encodes their local shards and lays the stored state
    back out as DTensors, so ``self.state`` holds sharded state whether or not it is offloaded or compact."""

    def local(self, t: Tensor) -> Tensor:
        """The values of ``t`` this process holds, as a plain tensor."""
        return t

    def layout(self, t: Tensor) -> Any:
        """What :meth:`placed` needs to lay a local tensor out as ``t`` is (None: as it is)."""
        return None

    def placed(self, local: Tensor, layout: Any) -> Tensor:
        """``local`` laid out as the tensor :meth:`layout` described (``local`` itself for None)."""
        return local

    def offset(self, p: Tensor) -> int:
        """Where this process's values of parameter ``p`` start in the whole parameter (flattened): the stochastic
        rounding of a shard draws bits of its own (replicas of one shard the same bits)."""
        return 0


class StagedStep:
    """One optimizer step over state that is compact, offloaded or both (module docstring). ``state``: the
    optimizer's ``self.state``; ``formats``: per parameter, how its state is stored (``state_dtype`` of
    :mod:`matrixopt.optim.state`), in the optimizer's order of parameters; ``seed``: the step's stochastic
    rounding seed; ``shards``: how to reach the values this process holds of each parameter and state tensor
    (:class:`Shards`; default: plain tensors). Each parameter, or part, rounds with random bits of its own, keyed by
    the seed, its place in ``formats`` and its first value (in the whole parameter, for a shard), so the result
    does not depend on the order the units run in (offloaded or not, interleaved or not).

    Use: ``plan(units)`` (optional: each ``stage()`` then prefetches the unit after its own), ``stage(unit)``, the
    update, ``unstage(unit)``, ..., then ``commit()`` once every unit succeeded, or ``rollback()`` on an exception.
    A unit holds parameters, or *parts* of one (:meth:`part`: a flat range of an element-wise optimizer's
    parameter, with its gradient and state). A streamed Muon chunk stages its sub-chunks inside
    :meth:`pack_stream`, takes its stacks from :meth:`stack`, and calls :meth:`packed` and :meth:`chunk_done`."""

    def __init__(self, state: dict[Tensor, dict[str, Any]], formats: dict[Tensor, str | None],
                 offload: Offload | None, seed: int, shards: Shards | None = None) -> None:
        self.state, self.formats, self.offload, self.seed = state, formats, offload, seed
        self.shards = Shards() if shards is None else shards
        self._layouts: dict[Tensor, dict[str, Any]] = {}  # per parameter: each state entry's (Shards.layout)
        self._index = {p: i for i, p in enumerate(formats)}
        self.streaming = False  # whether element-wise units run on the packing stream (set by the optimizer)
        self._stored: dict[Tensor, dict[str, Any]] = {}  # per staged parameter or part: its state as stored
        self._fetched: dict[Tensor, dict[str, Any]] = {}  # prefetched device copies of stored state
        self._pending: dict[Tensor, dict[str, Any]] = {}  # offload: new state in the shadows, for commit()
        self._parts: dict[Tensor, tuple[Tensor, int, int]] = {}  # part view -> (parameter, start, stop)
        self._backed_up: dict[Tensor, Tensor] = {}  # parameters whose host backup this step relies on -> values
        self._before: dict[Tensor, dict[str, Any] | None] = {}  # see _part_before
        self._plan: list[list[Tensor]] = []  # the units stage() is called with, in order (see plan)
        self._next = 0  # index in _plan of the next unit to stage
        self._chunks_done: collections.deque = collections.deque()  # events: a streamed chunk's update done
        self._packing: set[torch.device] = set()  # devices whose packing stream has joined this step

    def plan(self, units: list[list[Tensor]]) -> None:
        """The units (lists of parameters or parts) :meth:`stage` will be called with, in order: each stage()
        then prefetches the next one."""
        self._plan, self._next = units, 0

    def part(self, p: Tensor, g: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor]:
        """Views of values ``start:stop`` of contiguous parameter ``p`` (flattened) and of its gradient ``g``, which
        a chunk updates as a parameter of its own, with the same range of ``p``'s state (``start`` a multiple of
        the int8 block). Element-wise updates only: the view's update must be the parameter's, restricted."""
        view = p.detach().view(-1)[start:stop]
        self._parts[view] = (p, start, stop)
        return view, g.reshape(-1)[start:stop]

    def _source(self, q: Tensor) -> tuple[Tensor, dict[str, Any], int | None, int | None]:
        """``(parameter, its stored state, start, stop)`` of parameter or part ``q`` (start, stop None: whole), the
        state's tensors as this process holds them (:meth:`_local`)."""
        p, start, stop = self._parts.get(q, (q, None, None))
        return p, self._local(p, self.state.get(p, {})), start, stop

    def _local(self, p: Tensor, stored: dict[str, Any]) -> dict[str, Any]:
        """Parameter ``p``'s ``stored`` state with its tensors as this process holds them (:meth:`Shards.local`),
        their layouts noted for :meth:`_placed`."""
        layouts = self._layouts.setdefault(p, {})
        local = {}
        for k, v in stored.items():
            if isinstance(v, Tensor):
                layouts[k] = self.shards.layout(v)
                v = self.shards.local(v)
            local[k] = v
        return local

    def _placed(self, p: Tensor, state: dict[str, Any]) -> dict[str, Any]:
        """Parameter ``p``'s ``state`` (local tensors) laid out as its entries are stored (:meth:`Shards.placed`)."""
        layouts = self._layouts.get(p, {})
        return {k: self.shards.placed(v, layouts.get(k)) if isinstance(v, Tensor) else v for k, v in state.items()}

    def _view(self, q: Tensor) -> dict[str, Any]:
        """The stored state of ``q``: a part's range of each parameter-sized tensor (and of int8 block scales),
        the parameter's other entries (step counts) as they are."""
        p, stored, start, stop = self._source(q)
        if start is None:
            return stored
        out = {}
        for k, v in stored.items():
            if isinstance(v, Tensor) and compact.is_scale(k, stored):
                out[k] = v[start // compact.BLOCK:-(-stop // compact.BLOCK)]
            elif isinstance(v, Tensor) and v.numel() == p.numel() and v.ndim > 0:
                out[k] = v.reshape(-1)[start:stop]
            else:
                out[k] = v
        return out

    def _part_before(self, q: Tensor) -> dict[str, Any]:
        """Part ``q``'s state as it stood before this step, for state kept on the device, which the earlier parts
        of its parameter have written in place: its own range, and its own copy of the parameter's other entries
        (step counts) as they were before the first part ran (empty if the parameter had no state then)."""
        p, stored, _, _ = self._source(q)
        if p not in self._before:
            self._before[p] = {k: v.clone() if isinstance(v, Tensor) else v for k, v in stored.items()
                               if not (isinstance(v, Tensor) and v.ndim > 0)} if stored else None
        before = self._before[p]
        if before is None:
            return {}
        return self._view(q) | {k: v.clone() if isinstance(v, Tensor) else v for k, v in before.items()}

    def prefetch(self, params: list[Tensor]) -> None:
        """Start copying the stored state of ``params`` (parameters or parts) to their device (offload only)."""
        if self.offload is None:
            return
        self.offload.throttle()
        for q in params:
            if q not in self._fetched and self._source(q)[1]:
                self._fetched[q] = {k: self.offload.fetch(v, q.device) if isinstance(v, Tensor) else v
                                    for k, v in self._view(q).items()}

    def stage(self, params: list[Tensor]) -> None:
        """Put float32 state of ``params`` (parameters or parts) on their device into ``state`` for the update;
        then start fetching the planned unit after them (:meth:`plan`)."""
        self.prefetch(params)
        for q in params:
            p, _, start, _ = self._source(q)
            self._stored[q] = self.state.get(p, {})
            raw = self._fetched.pop(q, None)
            if raw is None:
                raw = self._view(q) if start is None or self.offload is not None else self._part_before(q)
            if self.offload is not None:
                self.offload.ready([v for v in raw.values() if isinstance(v, Tensor)], q.device)
                if p not in self._backed_up:
                    values = self.shards.local(p.detach())
                    self.offload.backup(p, values)
                    self._backed_up[p] = values
            self.state[q] = self._placed(p, compact.decoded(raw))
        planned = self._plan[self._next] if self._next < len(self._plan) else None
        if planned is not None and len(planned) == len(params) and all(a is b for a, b in zip(planned, params)):
            self._next += 1
            if self._next < len(self._plan):
                self.prefetch(self._plan[self._next])

    def stack(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """An empty Newton–Schulz stack for a streamed chunk (on the current stream: inside :meth:`pack_stream`,
        which fills it), once the chunk two before this one has finished with its own: at most two chunks' stacks
        at a time."""
        while len(self._chunks_done) >= 2:
            self._chunks_done.popleft().synchronize()
        return torch.empty(shape, dtype=dtype, device=device)

    @contextlib.contextmanager
    def pack_stream(self, device: torch.device) -> Iterator[None]:
        """Run the body (a streamed chunk's staging and momentum passes) on the offload's packing stream, so that
        it overlaps the last chunks' Newton–Schulz (CUDA); as it is elsewhere. The packing stream waits for the
        compute stream once per step, at its first chunk: it reads the gradients (and the clip's coefficient),
        written before the step, and only its own allocations and fetches after that. Waiting at every chunk
        would hold each chunk's momentum passes, and so its stores and, through :meth:`Offload.throttle`, the
        host's next fetches, behind the last chunk's Newton–Schulz."""
        side = None if self.offload is None else self.offload.packer(device)
        if side is None:
            yield
            return
        if device not in self._packing:
            side.wait_stream(torch.cuda.current_stream(device))
            self._packing.add(device)
        with torch.cuda.stream(side):
            yield

    def packed(self, device: torch.device, tensors: list[Tensor]) -> None:
        """The compute stream waits for the momentum passes :meth:`pack_stream` ran; ``tensors`` made there are
        used on it."""
        side = None if self.offload is None else self.offload.packer(device)
        if side is not None:
            main = torch.cuda.current_stream(device)
            main.wait_stream(side)
            for t in tensors:
                t.record_stream(main)

    def chunk_done(self, device: torch.device) -> None:
        """A streamed chunk's update has been issued on the compute stream (see :meth:`stack`)."""
        if self.offload is not None and self.offload.packer(device) is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._chunks_done.append(event)

    def unstage(self, params: list[Tensor]) -> None:
        """Store the updated state of ``params`` (encoded; offload: into the shadows, swapped in by commit) and put
        the stored state back into ``state``. A part writes its range, and the last part of a parameter its other
        entries (the earlier parts read them as they stood before the step)."""
        for q in params:
            p, start, stop = self._parts.get(q, (q, None, None))
            work, stored = self.state[q], self._stored[q]  # still restorable by rollback() until stored back
            local = self._local(p, stored)
            new, generator, layouts = {}, self._generator(p, start), self._layouts[p]
            for k, v in work.items():
                if not isinstance(v, Tensor):
                    new[k] = v
                    continue
                layouts.setdefault(k, self.shards.layout(v))  # entries the update created
                new |= compact.encode(self.shards.local(v), k, self.formats.get(p), generator)
            whole = start is None or stop == p.numel()
            if self.offload is not None:
                shadow = self._pending.get(p)
                if shadow is None:
                    shadow = self._pending[p] = self.offload.shadow(p, self._full(p, new, start, stop))
                for k, v in new.items():
                    if isinstance(v, Tensor) and (whole or v.ndim > 0):
                        self.offload.store(v, self._range(p, shadow, k, start, stop))
                    elif whole:
                        shadow[k] = v
            else:  # compact state on the device: written in place (same tensors) where the layout holds
                full = self._full(p, new, start, stop)
                for k, v in new.items():
                    if not (whole or (isinstance(v, Tensor) and v.ndim > 0)):
                        continue
                    o, f = local.get(k), full[k]
                    if isinstance(o, Tensor) and isinstance(f, Tensor) and o.shape == f.shape and o.dtype == f.dtype:
                        dst = self._range(p, local, k, start, stop)
                        if dst is not v:
                            dst.copy_(v)
                    elif start is None:
                        stored[k] = self.shards.placed(v, layouts.get(k))
                    else:
                        stored[k] = torch.empty(f.shape, dtype=f.dtype, device=v.device)
                        self._range(p, stored, k, start, stop).copy_(v)
                self.state[p] = stored
            del self._stored[q]
            if start is None:
                self.state[q] = stored
            else:
                del self.state[q]
        if self.offload is not None and params:
            self.offload.mark_stored(params[0].device)

    def _generator(self, p: Tensor, start: int | None) -> torch.Generator | None:
        """The rounding's host generator for parameter ``p``'s values from ``start`` on (None: float32 state, which
        draws nothing), seeded from ``(seed, p's place, start)`` by a multiply-xorshift mix (SplitMix64's
        constants); ``start`` counts from the beginning of the whole parameter (:meth:`Shards.offset`)."""
        if self.formats.get(p) is None:
            return None
        h = self.seed & _MASK64
        for v in (self._index[p], self.shards.offset(p) + (start or 0)):
            h = (h ^ v) * 0xBF58476D1CE4E5B9 & _MASK64
            h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK64
        return torch.Generator().manual_seed(h >> 1)  # below 2**63

    def _full(self, p: Tensor, new: dict[str, Any], start: int | None, stop: int | None) -> dict[str, Any]:
        """``new`` (a part's entries when ``start`` is given) laid out for the whole parameter: meta tensors of
        the whole shapes, other values as they are."""
        if start is None:
            return new
        out = {}
        for k, v in new.items():
            if isinstance(v, Tensor) and compact.is_scale(k, new):
                out[k] = torch.empty((-(-p.numel() // compact.BLOCK),), dtype=v.dtype, device="meta")
            elif isinstance(v, Tensor) and v.ndim > 0:
                out[k] = torch.empty(p.shape, dtype=v.dtype, device="meta")
            else:
                out[k] = v
        return out

    @staticmethod
    def _range(p: Tensor, state: dict[str, Any], key: str, start: int | None, stop: int | None) -> Tensor:
        """``state[key]`` of parameter ``p``, or the part of it that values ``start:stop`` keep."""
        t = state[key]
        if start is None or t.ndim == 0:
            return t
        if compact.is_scale(key, state):
            return t[start // compact.BLOCK:-(-stop // compact.BLOCK)]
        return t.view(-1)[start:stop]

    def join(self) -> None:
        """The compute stream waits for the packing stream's work (the updates it ran), on every device."""
        for device in self._packing:
            torch.cuda.current_stream(device).wait_stream(self.offload.packer(device))

    def commit(self) -> None:
        """Make the new state current: every chunk's host copies finished, the shadows swapped in; then start
        refreshing the parameters' host backups for the next step (offload)."""
        self.join()
        if self.offload is not None:
            self.offload.synchronize()
            for p, new in self._pending.items():
                old = self.state.get(p)
                self.state[p] = self._placed(p, new)
                if old:
                    self.offload.shadows[p] = {k: self.shards.local(v) if isinstance(v, Tensor) else v
                                               for k, v in old.items()}
            self.offload.refresh_backups(self._backed_up)
        self._pending.clear()

    def rollback(self) -> None:
        """After an exception mid-step: the stored state back in place and, offloaded, the parameters restored
        from their host copies (the step before, all of it)."""
        self.join()
        for q in self._stored:
            if q in self._parts:
                self.state.pop(q, None)
            else:
                self.state[q] = self._stored[q]
        self._stored.clear()
        if self.offload is not None:
            self.offload.shadows.update(self._pending)  # partly written; the next step overwrites them
        self._pending.clear()
        self._fetched.clear()
        if self.offload is not None:
            self.offload.synchronize()
            for p, values in self._backed_up.items():
                self.offload.restore(p, values)
