"""The device a run uses and how long things take on it: picking the device, naming it, peak memory, timers
(``time_ms`` for benchmarks, ``StreamTimer`` for laps inside a training loop), and keeping Python's garbage
collector from stalling the host in a loop (``frozen_heap``). Imports only torch."""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

_frozen_depth = 0  # frozen_heap blocks entered and not yet left


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Python's garbage collector told to pass over every object alive on entry (after one collection:
    ``gc.freeze``) until the block ends (``gc.unfreeze``). A full collection walks every tracked object: with a
    large model, its optimizer and FSDP2's DTensors, one stalled the host for about 200 ms inside a timed window on
    2 H100s (``bench scale``'s ``gc`` record), which the other ranks then wait for at the next collective. Objects
    made inside the block are collected as usual; those alive on entry that become unreachable inside are freed by
    reference counting at once, or, if they sit in a reference cycle, after the block. Blocks nest: an inner block
    also freezes what the outer one made, and only the outermost block's end unfreezes."""
    global _frozen_depth
    if _frozen_depth == 0:
        gc.collect()
    gc.freeze()
    _frozen_depth += 1
    try:
        yield
    finally:
        _frozen_depth -= 1
        if _frozen_depth == 0:
            gc.unfreeze()


def resolve_device(name: str) -> torch.device:
    """``"auto"`` is CUDA when available, else the CPU; any other name is passed to ``torch.device``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA GPU here; use --device cpu")
    return device


def describe(device: torch.device) -> str:
    """The device in words: the GPU's name, or the CPU's architecture and thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def peak_mem_mb(device: torch.device) -> float:
    """Peak CUDA memory allocated by tensors, or on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def allocator_calls(device: torch.device) -> dict[str, int]:
    """The caching allocator's calls to the driver so far on ``device``: ``cudaMalloc`` and ``cudaFree`` (each
    may synchronise the device and stall the host) and retries after a failed allocation (each frees the whole
    cache); zeros off CUDA. Differences between two readings count a stretch of work."""
    if device.type != "cuda":
        return {"device_allocs": 0, "device_frees": 0, "alloc_retries": 0}
    stats = torch.cuda.memory_stats(device)
    return {"device_allocs": stats.get("num_device_alloc", 0), "device_frees": stats.get("num_device_free", 0),
            "alloc_retries": stats.get("num_alloc_retries", 0)}


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def captured(fn: Callable[[], object], device: torch.device, calls: int) -> Callable[[], None]:
    """``calls`` back-to-back calls of ``fn`` captured in one CUDA graph; returns its replay. ``fn`` runs once
    first, on a side stream outside capture (a kernel's first launch loads it, and fails there if it does not fit
    the GPU)."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        fn()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def time_ms(fn: Callable[[], Any], device: torch.device, *, reps: int = 10, inner: int = 1,
            warmup: int = 2, graph: bool = False, heat_s: float = 0.0) -> dict[str, float]:
    """Milliseconds per call of ``fn``: ``reps`` blocks of ``inner`` back-to-back calls (CUDA events on the GPU,
    ``perf_counter`` plus a sync elsewhere), after ``warmup`` calls. Returns median, p20, p80 and min.

    ``graph=True`` (CUDA only) captures each block of ``inner`` calls in a CUDA graph and times its replays: the
    GPU time without the host's launch overhead, which dominates kernels of a few tens of microseconds.

    ``heat_s``: seconds of back-to-back blocks run just before the timed ones, so that a GPU held at its power
    limit is timed at the clock it sustains under load, as in training, rather than the boost clock of a short
    burst (an H200 runs large bf16 products about 15% slower after a tenth of a second of them)."""
    for _ in range(warmup):
        fn()
    sync(device)
    calls, per_block = fn, inner
    if graph and device.type == "cuda":
        calls, inner = captured(fn, device, inner), 1  # one replay runs per_block calls
        calls()
        sync(device)
    until, queued = time.perf_counter() + heat_s, []
    while time.perf_counter() < until:  # the GPU kept busy, with at most two blocks queued ahead of it
        for _ in range(inner):
            calls()
        if device.type == "cuda":
            queued.append(torch.cuda.Event())
            queued[-1].record()
            if len(queued) > 2:
                queued.pop(0).synchronize()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                calls()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / per_block)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                calls()
            sync(device)
            times.append((time.perf_counter() - t0) * 1e3 / per_block)
    return ms_summary(times)


def host_ms(fn: Callable[[], Any], device: torch.device, *, reps: int = 10, warmup: int = 0) -> dict[str, float]:
    """Milliseconds until each of ``reps`` calls of ``fn`` returns, the device's queue drained before each (after
    ``warmup`` calls): the host's time to issue it, which the GPU's work runs beside; where it exceeds the call's
    GPU time, the call is bound by its host. Returns :func:`ms_summary`'s record."""
    for _ in range(warmup):
        fn()
    laps = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        laps.append((time.perf_counter() - t0) * 1e3)
    sync(device)
    return ms_summary(laps)


def host_pace(device: torch.device, *, calls: int = 200, rounds: int = 5) -> dict[str, Any]:
    """The host this process runs on and its pace: the CPU's model name, its logical cores, and ``op_us``, the
    microseconds the host takes to issue one tiny op on ``device`` (``torch.add`` of one element, out of place
    into a kept tensor; median over ``rounds`` of ``calls`` calls, the queue drained before each round). Eager
    optimizer steps and FSDP2's forward issue hundreds of kernels each, and the lent machines' hosts differ in pace
    for the same GPU, so benchmark records keep it beside the device's name."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    a, out = torch.zeros(1, device=device), torch.empty(1, device=device)
    laps = []
    for _ in range(rounds + 1):  # the first round warms the op's dispatch up
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            torch.add(a, 1.0, out=out)
        laps.append((time.perf_counter() - t0) / calls * 1e6)
    sync(device)
    return {"cpu": cpu, "cpus": os.cpu_count(), "op_us": statistics.median(laps[1:])}


def ms_summary(times: list[float]) -> dict[str, float]:
    """Median, p20, p80 and min of per-call milliseconds (:func:`time_ms`'s record)."""
    q = statistics.quantiles(times, n=5, method="inclusive") if len(times) > 1 else [times[0]] * 4
    return {"median": statistics.median(times), "p20": q[0], "p80": q[3], "min": min(times)}


class StreamTimer:
    """Seconds spent between ``start()`` and ``stop()``, plus ``offset``. On CUDA, events on the current stream:
    no device-wide sync, so communication left running on other streams (e.g. the layer-wise parameter
    broadcasts) keeps overlapping what follows; laps are read when asked for. Elsewhere ``perf_counter``."""

    def __init__(self, device: torch.device, offset: float = 0.0) -> None:
        self.cuda, self.offset = device.type == "cuda", offset
        self.laps: list[float] = []
        self._pending: list[tuple[Any, Any]] = []
        self._t0: Any = None

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._t0 = self._now()

    def stop(self) -> None:
        end = self._now()
        if self.cuda:
            self._pending.append((self._t0, end))
        else:
            self.laps.append(end - self._t0)

    def resolve(self) -> list[float]:
        """Every finished lap in seconds (waits for the recorded events)."""
        for start, end in self._pending:
            end.synchronize()
            self.laps.append(start.elapsed_time(end) / 1e3)
        self._pending.clear()
        return self.laps

    def total(self) -> float:
        return self.offset + sum(self.resolve())
