"""The per-shape tuner: it times each candidate once per key, keeps the fastest, and passes over candidates that
do not fit the GPU. Timing is faked (the graph-replay timer replaced) so this runs on the CPU."""

import threading

import pytest
import torch

triton = pytest.importorskip("triton")

from matrixopt.kernels import _tuning  # noqa: E402


def _fake_bench(monkeypatch, times):
    monkeypatch.setattr(_tuning, "time_replayed", lambda launch, device: times[launch()])


def _too_big(name):
    raise triton.runtime.errors.OutOfResources(262144, 232448, "shared memory")


def test_fastest_candidate_wins_and_is_cached(monkeypatch):
    _fake_bench(monkeypatch, {"a": 2.0, "b": 1.0, "c": 3.0})
    calls = []
    launch = lambda c: calls.append((c, _tuning.compiling())) or c  # noqa: E731
    key = ("test", "fastest")
    assert _tuning.pick(key, lambda: ["a", "b", "c"], launch, torch.device("cuda")) == "b"
    assert _tuning.pick(key, lambda: ["a", "b", "c"], launch, torch.device("cuda")) == "b"
    assert sorted(c for c, comp in calls[:3] if comp) == ["a", "b", "c"]  # compiled first, on the workers
    assert [c for c, comp in calls if not comp] == ["a", "b", "c"]  # then timed once each


def test_candidates_that_do_not_fit_are_passed_over(monkeypatch):
    _fake_bench(monkeypatch, {"a": 2.0, "c": 3.0})
    launch = lambda c: _too_big(c) if c == "b" else c  # noqa: E731
    assert _tuning.pick(("test", "oor"), lambda: ["a", "b", "c"], launch, torch.device("cuda")) == "a"
    with pytest.raises(RuntimeError, match="no kernel config fits"):
        _tuning.pick(("test", "all-oor"), lambda: ["b", "b"], launch, torch.device("cuda"))


class _FakeKernel:
    """Records launches and compiles; each compile waits at a barrier for the others, so the compiles must
    overlap (one after another they would time out there)."""

    def __init__(self, barrier):
        self.barrier, self.launched, self.compiled, self.loaded = barrier, [], [], []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launched.append((grid, args, kw))

    def warmup(self, *args, grid, **kw):
        self.barrier.wait()
        self.compiled.append((grid, args, kw))
        return self

    def _init_handles(self):  # Triton's CompiledKernel: launcher built and binary loaded
        self.loaded.append(threading.get_ident())


def test_launch_kernel_compiles_concurrently_ahead_and_launches_otherwise():
    kernel = _FakeKernel(threading.Barrier(3, timeout=10))
    launch = lambda c: _tuning.launch_kernel(kernel, (c,), "x", BLOCK=c)  # noqa: E731
    with _tuning.compile_ahead(torch.device("cpu")):
        assert _tuning.compiling()
        for c in (64, 128, 256):
            launch(c)
        with _tuning.compile_ahead(torch.device("cpu")):  # nested: joins the outer block
            pass
        assert _tuning.compiling()
    assert sorted(g for g, _, _ in kernel.compiled) == [(64,), (128,), (256,)] and not kernel.launched
    assert len(kernel.loaded) == 3 and not _tuning.compiling()
    launch(64)
    assert kernel.launched == [((64,), ("x",), {"BLOCK": 64})]


def test_pick_under_compile_ahead_compiles_every_candidate_and_chooses_none(monkeypatch):
    _fake_bench(monkeypatch, {})  # timing would fail: nothing may be timed
    launched = []
    with _tuning.compile_ahead(torch.device("cuda")):
        first = _tuning.pick(("test", "ahead"), lambda: ["a", "b"], launched.append, torch.device("cuda"))
    assert first == "a" and launched == ["a", "b"] and ("test", "ahead") not in _tuning.chosen()


def test_a_failing_compile_is_left_for_the_timing(monkeypatch):
    _fake_bench(monkeypatch, {"a": 2.0, "c": 3.0})
    launch = lambda c: _too_big(c) if c == "b" else c  # noqa: E731  (fails compiling and timing alike)
    assert _tuning.pick(("test", "compile-fails"), lambda: ["b", "a", "c"], launch, torch.device("cuda")) == "a"


def test_pick_during_capture_takes_the_first_candidate_and_keeps_nothing(monkeypatch):
    _fake_bench(monkeypatch, {})  # timing would fail: nothing may be timed during a capture
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    key = ("test", "capturing")
    assert _tuning.pick(key, lambda: ["a", "b"], lambda c: c, torch.device("cuda")) == "a"
    assert key not in _tuning.chosen()
