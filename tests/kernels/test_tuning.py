"""The per-shape tuner: it times each candidate once per key, keeps the fastest, and passes over candidates that
do not fit the GPU. Timing is faked (``do_bench`` replaced) so this runs on the CPU."""

import pytest
import torch

triton = pytest.importorskip("triton")

from matrixopt.kernels import _tuning  # noqa: E402


def _fake_bench(monkeypatch, times):
    def do_bench(fn, warmup, rep, return_mode):
        return times[fn()]

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)


def _too_big(name):
    raise triton.runtime.errors.OutOfResources(262144, 232448, "shared memory")


def test_fastest_candidate_wins_and_is_cached(monkeypatch):
    _fake_bench(monkeypatch, {"a": 2.0, "b": 1.0, "c": 3.0})
    calls = []
    launch = lambda c: calls.append(c) or c  # noqa: E731
    key = ("test", "fastest")
    assert _tuning.pick(key, lambda: ["a", "b", "c"], launch, torch.device("cuda")) == "b"
    assert _tuning.pick(key, lambda: ["a", "b", "c"], launch, torch.device("cuda")) == "b"
    assert calls == ["a", "b", "c"]  # timed once


def test_candidates_that_do_not_fit_are_passed_over(monkeypatch):
    _fake_bench(monkeypatch, {"a": 2.0, "c": 3.0})
    launch = lambda c: _too_big(c) if c == "b" else c  # noqa: E731
    assert _tuning.pick(("test", "oor"), lambda: ["a", "b", "c"], launch, torch.device("cuda")) == "a"
    with pytest.raises(RuntimeError, match="no kernel config fits"):
        _tuning.pick(("test", "all-oor"), lambda: ["b", "b"], launch, torch.device("cuda"))
