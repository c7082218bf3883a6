"""The peers the benchmarks compare against: built from one place, recorded as missing with the reason, and
emerging_optimizers wired in when it is importable (a stand-in package here: the real one needs Python >= 3.12)."""

import json
import sys
import types

import pytest
import torch

from matrixopt.bench import peers
from matrixopt.bench.step import hidden_matrices, param_set
from tests.bench.test_bench import run_cli


@pytest.fixture
def no_emerging(monkeypatch):
    monkeypatch.setitem(sys.modules, "emerging_optimizers", None)  # import raises ImportError


@pytest.fixture
def fake_emerging(monkeypatch):
    """A stand-in ``emerging_optimizers`` with its Muon's signature and ``tsyrk_ex``; records what it was given."""
    built, grams = [], []

    class Muon(torch.optim.SGD):
        def __init__(self, params, lr=3e-4, momentum=0.95, weight_decay=0.01, *, num_ns_steps=5, use_syrk=False):
            params = list(params)
            built.append({"params": params, "lr": lr, "num_ns_steps": num_ns_steps, "use_syrk": use_syrk})
            super().__init__(params, lr=lr, momentum=momentum)

    def tsyrk_ex(a):
        assert a.ndim == 2 and a.dtype == torch.bfloat16
        grams.append(tuple(a.shape))
        return a @ a.T

    pkg = types.ModuleType("emerging_optimizers")
    ortho = types.ModuleType("emerging_optimizers.orthogonalized_optimizers")
    ortho.Muon = Muon
    kernels = types.ModuleType("emerging_optimizers.triton_kernels")
    kernels.tsyrk_ex = tsyrk_ex
    pkg.orthogonalized_optimizers, pkg.triton_kernels = ortho, kernels
    for name, mod in [("emerging_optimizers", pkg), ("emerging_optimizers.orthogonalized_optimizers", ortho),
                      ("emerging_optimizers.triton_kernels", kernels)]:
        monkeypatch.setitem(sys.modules, name, mod)
    return built, grams


def test_missing_emerging_optimizers_is_recorded_with_the_reason(no_emerging, tmp_path):
    ps = param_set("toy", torch.device("cpu"))
    got = peers.peer_muons(ps)
    assert callable(got["torch.optim.Muon"])
    assert "not installed" in got[peers.EMERGING] and "not installed" in got[peers.EMERGING_SYRK]
    assert "not installed" in peers.peer_gram(torch.device("cuda"))

    path = tmp_path / "train.json"
    assert run_cli(["train", "--device", "cpu", "--model", "tiny-cpu", "--steps", "1", "--reps", "1",
                    "--optimizers", "adamw", peers.EMERGING, "--json", str(path)]) == 0
    res = json.loads(path.read_text())["results"]
    assert res["adamw"]["status"] == "ok" and "not installed" in res[peers.EMERGING]["status"]


def test_peer_muons_step_the_hidden_matrices_beside_adamw(fake_emerging):
    built, _ = fake_emerging
    ps = param_set("toy", torch.device("cpu"))
    got = peers.peer_muons(ps, ns_steps=3)
    assert "CUDA" in got[peers.EMERGING_SYRK]  # its Triton SYRK is not offered on the CPU
    before = {n: p.detach().clone() for n, p in ps.named_parameters()}
    got[peers.EMERGING]().step()
    (b,) = built
    assert {id(p) for p in b["params"]} == {id(p) for p in hidden_matrices(ps)}
    assert (b["lr"], b["num_ns_steps"], b["use_syrk"]) == (peers.PEER_MUON_LR, 3, False)
    assert all(not torch.equal(before[n], p) for n, p in ps.named_parameters())  # Muon's and AdamW's all moved


def test_benches_time_emerging_optimizers_when_installed(fake_emerging, tmp_path):
    built, grams = fake_emerging
    path = tmp_path / "step.json"
    assert run_cli(["step", "--device", "cpu", "--model", "toy", "--reps", "2", "--json", str(path),
                    "--only", peers.EMERGING, peers.EMERGING_SYRK]) == 0
    res = json.loads(path.read_text())["results"]
    assert res[peers.EMERGING]["status"] == "ok" and res[peers.EMERGING]["ms"]["median"] > 0
    assert "CUDA" in res[peers.EMERGING_SYRK]["status"]

    path = tmp_path / "train.json"
    assert run_cli(["train", "--device", "cpu", "--model", "tiny-cpu", "--steps", "1", "--reps", "1",
                    "--optimizers", "adamw", peers.EMERGING, "--json", str(path)]) == 0
    res = json.loads(path.read_text())["results"]
    assert res[peers.EMERGING]["tokens_per_s"] > 0 and res[peers.EMERGING]["vs_adamw"] > 0
    assert len(built) >= 2


def test_peer_gram_batches_the_2d_kernel(fake_emerging):
    _, grams = fake_emerging
    assert "CUDA" in peers.peer_gram(torch.device("cpu"))
    gram = peers.peer_gram(torch.device("cuda"))  # the wrapper only; run here on CPU tensors by the stand-in
    X = torch.randn(3, 8, 20).to(torch.bfloat16)
    out = gram(X)
    assert grams == [(8, 20)] * 3
    torch.testing.assert_close(out, torch.bmm(X, X.mT))
