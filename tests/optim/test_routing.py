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
    with pytest.raises(ValueError, match="match no trainable parameter"):
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
