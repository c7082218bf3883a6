"""The dispatching Newton–Schulz step: the Triton path against float64, and the fallbacks."""

import importlib
import os
import sys

import pytest
import torch

import matrixopt.kernels.ns_step as ns
from matrixopt.linalg.ortho import QUINTIC, newton_schulz, polar

# One bf16 step rounds A, B and X to bf16 (unit round-off 2^-8) and compounds them through two products;
# observed ~5e-3 for both the Triton path and cuBLAS-style bf16 torch. Twice the bf16 operand band of METHOD.md.
STEP_BF16_TOL = 2e-2


interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors through Triton's interpreter; on a GPU see test_gpu.py")


def normalized(shape, dtype):
    X = torch.randn(shape, dtype=torch.float64)
    return (X / X.norm(dim=(-2, -1), keepdim=True)).to(dtype)


@interpreted
@pytest.mark.parametrize("shape", [(3, 19, 45), (2, 33, 33)])
def test_triton_step_matches_float64(shape):
    pytest.importorskip("triton")
    X = normalized(shape, torch.bfloat16)
    a, b, c = QUINTIC[1]
    with ns.ns_backend("triton"):
        out = ns.ns_step(X, a, b, c)
    ref = ns.ns_step_reference(X.double(), a, b, c)
    assert out.shape == X.shape and out.dtype == torch.bfloat16
    assert ((out.double() - ref).norm() / ref.norm()).item() < STEP_BF16_TOL


@interpreted
def test_newton_schulz_through_triton_reaches_the_quintic_band():
    pytest.importorskip("triton")
    G = torch.randn(2, 24, 40, dtype=torch.float64)
    with ns.ns_backend("triton"):
        out = newton_schulz(G, dtype=torch.bfloat16)
    U = polar(G)
    s = torch.linalg.svdvals(out.double())
    assert out.dtype == G.dtype and out.shape == G.shape
    # quintic leaves singular values in about [0.7, 1.2]; bf16 adds a few percent
    assert s.min() > 0.6 and s.max() < 1.3
    assert ((out - U).norm() / U.norm()).item() < 0.3


def test_cpu_tensors_use_the_reference(monkeypatch):
    def boom(*args):
        raise AssertionError("Triton path taken on the CPU")

    monkeypatch.setattr(ns, "ns_step_triton", boom)
    X = normalized((2, 8, 12), torch.bfloat16)
    torch.testing.assert_close(ns.ns_step(X, *QUINTIC[0]), ns.ns_step_reference(X, *QUINTIC[0]), rtol=0, atol=0)


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA, to drive the dispatcher's auto path without a GPU."""

    @property
    def is_cuda(self):
        return True


@pytest.mark.parametrize("faster", ["triton", "torch"])
def test_auto_measures_once_per_shape_and_follows_the_measurement(monkeypatch, faster):
    calls = []

    def fake_measure(X, a, b, c, graphed):
        calls.append((tuple(X.shape), graphed))
        return {"triton_ms": 1.0, "torch_ms": 2.0, "backend": faster}

    monkeypatch.setattr(ns, "_measure", fake_measure)
    monkeypatch.setattr(ns, "_decisions", {})
    monkeypatch.setattr(ns, "triton_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    X = torch.randn(2, 8, 12).bfloat16().as_subclass(FakeCuda)
    assert [ns._choose(X, 1.0, 1.0, 1.0) for _ in range(3)] == [faster] * 3
    assert calls == [((2, 8, 12), False)]
    assert list(ns.dispatch_table()) == ["2x8x12 bfloat16 cpu"]
    with ns.for_cuda_graphs():  # decided apart, by GPU time, for steps replayed from a CUDA graph
        assert ns._choose(X, 1.0, 1.0, 1.0) == faster
        assert ns._choose(X, 1.0, 1.0, 1.0) == faster
    assert calls == [((2, 8, 12), False), ((2, 8, 12), True)]
    assert list(ns.dispatch_table()) == ["2x8x12 bfloat16 cpu", "2x8x12 bfloat16 cpu (graphed)"]
    assert ns._choose(X.float().as_subclass(FakeCuda), 1.0, 1.0, 1.0) == "torch"  # fp32: no Triton path


def test_auto_without_triton_falls_back(monkeypatch):
    monkeypatch.setattr(ns, "_decisions", {})
    monkeypatch.setattr(ns, "triton_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    X = torch.randn(2, 8, 12).bfloat16().as_subclass(FakeCuda)
    assert ns._choose(X, 1.0, 1.0, 1.0) == "torch"
    assert ns._decisions == {}  # nothing measured


def test_module_imports_and_runs_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    for name in ("matrixopt.kernels.syrk", "matrixopt.kernels.ns_update"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    fresh = importlib.reload(ns)
    try:
        assert not fresh.triton_available()
        X = normalized((2, 6, 10), torch.float32)
        torch.testing.assert_close(fresh.ns_step(X, *QUINTIC[0]), fresh.ns_step_reference(X, *QUINTIC[0]))
        with pytest.raises(ImportError, match="pip install triton"):
            fresh.ns_step_triton(X, *QUINTIC[0])
    finally:
        monkeypatch.undo()
        importlib.reload(ns)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown Newton–Schulz backend 'cuda'"):
        with ns.ns_backend("cuda"):
            pass
