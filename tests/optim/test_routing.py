"""Automatic routing of a model's parameters."""

import pytest
import torch
from torch import nn

import matrixopt


class TinyGPT(nn.Module):
    def __init__(self, vocab=50, d=16, tied=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(8, d)
        self.h = nn.ModuleList(nn.ModuleDict(dict(
            ln_1=nn.LayerNorm(d), c_attn=nn.Linear(d, 3 * d), c_proj=nn.Linear(d, d),
            ln_2=nn.LayerNorm(d), c_fc=nn.Linear(d, 4 * d), mlp_proj=nn.Linear(4 * d, d))) for _ in range(2))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight


def routes(groups):
    out = {}
    for g in groups:
        kind = "matrix" if g.get("use_muon") else ("adamw" if g.get("weight_decay", None) != 0.0 else "no_decay")
        for n in g["names"]:
            out[n] = kind
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_gpt_routing(tied):
    model = TinyGPT(tied=tied)
    r = routes(matrixopt.param_groups(model))
    assert r["wte.weight"] == "adamw" and r["wpe.weight"] == "adamw"
    assert ("lm_head.weight" in r) != tied  # a tied head is the embedding: listed once
    if not tied:
        assert r["lm_head.weight"] == "adamw"
    for i in range(2):
        for name in ("c_attn", "c_proj", "c_fc", "mlp_proj"):
            assert r[f"h.{i}.{name}.weight"] == "matrix"
            assert r[f"h.{i}.{name}.bias"] == "no_decay"
        assert r[f"h.{i}.ln_1.weight"] == "no_decay"
    assert r["ln_f.weight"] == "no_decay"
    n_model = len({id(p) for p in model.parameters()})
    assert len(r) == n_model


def test_overrides_and_splits():
    model = TinyGPT()
    groups = matrixopt.param_groups(model, adamw=[r"h\.1\.c_fc"], matrix=[r"^wpe\."],
                                    splits={r"c_attn\.weight$": 3})
    r = routes(groups)
    assert r["h.1.c_fc.weight"] == "adamw" and r["h.0.c_fc.weight"] == "matrix"
    assert r["wpe.weight"] == "matrix"
    assert model.h[0].c_attn.weight._matrixopt_split == (0, (16, 16, 16))
    text = matrixopt.routing_summary(groups)
    assert "h.0.c_attn.weight" in text and "matrix" in text


def test_bad_patterns():
    with pytest.warns(UserWarning, match=r"\['nothing_like_this'\] match no trainable parameter of TinyGPT"):
        matrixopt.param_groups(TinyGPT(), adamw=["nothing_like_this"])
    with pytest.raises(ValueError, match="needs 2 or more dims"):
        matrixopt.param_groups(TinyGPT(), matrix=[r"ln_f\.weight"])
    with pytest.raises(ValueError, match="regular expression"):
        matrixopt.param_groups(TinyGPT(), adamw=["("])


def test_build_optimizer_registry_and_conv():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    opt = matrixopt.build_optimizer(model, "muon", lr=1e-2)
    x = torch.randn(2, 3, 9, 9)
    model(x).square().mean().backward()
    w0 = model[0].weight.detach().clone()
    opt.step()
    assert not torch.equal(w0, model[0].weight)
    assert set(matrixopt.OPTIMIZERS) >= {"adamw", "muon", "mop"}
    with pytest.raises(ValueError, match="unknown optimizer"):
        matrixopt.build_optimizer(model, "lion")
    adam = matrixopt.build_optimizer(TinyGPT(), "adamw", lr=1e-3)
    assert isinstance(adam, torch.optim.AdamW)
    assert sorted(g["weight_decay"] for g in adam.param_groups) == [0.0, 0.01]


class Conv1D(nn.Module):
    """GPT-2's layer: y = x @ W + b, W stored (in, out)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return x @ self.weight + self.bias


@pytest.mark.parametrize("nx, nf", [(16, 16), (16, 64), (64, 16)])
def test_conv1d_update_is_the_transposed_linear_update(nx, nf):
    """The polar factor of W^T is polar(W)^T, and the default update scale is symmetric in (m, n): a weight
    stored (in, out) takes the transpose of the update of the same weight stored (out, in)."""
    torch.manual_seed(0)
    conv, lin = Conv1D(nf, nx), nn.Linear(nx, nf)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.T)
        lin.bias.copy_(conv.bias)
    x = torch.randn(8, nx)
    r = routes(matrixopt.param_groups(conv))
    assert r == {"weight": "matrix", "bias": "no_decay"}
    opts = [matrixopt.build_optimizer(m, "muon", lr=0.05) for m in (conv, lin)]
    for _ in range(3):
        for m, opt in zip((conv, lin), opts):
            opt.zero_grad()
            m(x).sin().sum().backward()
            opt.step()
    torch.testing.assert_close(conv.weight, lin.weight.T, rtol=1e-5, atol=1e-6)


def test_conv1d_asymmetric_scaling_warns():
    model = nn.Sequential(Conv1D(64, 16))
    with pytest.warns(UserWarning, match=r"stored \(in, out\)"):
        matrixopt.build_optimizer(model, "muon", scaling="original")


def test_fallback_is_listed_and_no_matrix_warns():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.randn(8, 8))     # a 2-D parameter of no known layer
            self.cube = nn.Parameter(torch.randn(2, 3, 4))   # 3-D, not an expert stack
            self.norm = nn.LayerNorm(8)

    groups = matrixopt.param_groups(Odd())
    r = routes(groups)
    assert r == {"table": "matrix", "cube": "adamw", "norm.weight": "no_decay", "norm.bias": "no_decay"}
    text = matrixopt.routing_summary(groups)
    assert "unrecognized (2" in text and "table (8, 8) -> matrix" in text and "cube (2, 3, 4) -> adamw" in text
    with pytest.warns(UserWarning, match="no parameter of Sequential qualifies for the matrix optimizer"):
        groups = matrixopt.param_groups(nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4)))
    assert not any(g["use_muon"] for g in groups)


def test_expert_pattern_and_router():
    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(8, 4, bias=False)
            self.w = nn.Parameter(torch.randn(4, 16, 8))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = MoE()

    model = Block()
    assert routes(matrixopt.param_groups(model))["moe.w"] == "adamw"  # an unknown 3-D parameter
    matrixopt.mark_experts(model.moe.w)
    assert routes(matrixopt.param_groups(model))["moe.w"] == "matrix"  # marked by hand
    model = Block()
    r = routes(matrixopt.param_groups(model, experts=[r"moe\.w$"], splits={r"moe\.w$": 2}))
    assert r == {"moe.gate.weight": "matrix", "moe.w": "matrix"}  # no `experts` module here: the gate is a linear
    assert model.moe.w._matrixopt_experts and model.moe.w._matrixopt_split == (0, (8, 8))
