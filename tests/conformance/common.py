"""Shared pieces of the conformance suite: the optimizer names it runs over, a tiny model with every routing
kind, deterministic gradients, and exact comparisons of parameters and optimizer state.

Every test parametrizes over ``NAMES`` (``sorted(matrixopt.OPTIMIZERS)`` at collection time), so an optimizer
added to the registry runs the whole suite without a change here. ``HPARAMS`` holds the few per-optimizer
settings that keep a test tiny (e.g. precondition every step so the preconditioner is exercised at all).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import matrixopt
from matrixopt.optim.base import MatrixOptimizer

NAMES = sorted(matrixopt.OPTIMIZERS)
LR = 1e-2
HPARAMS: dict[str, dict[str, Any]] = {  # name -> build_optimizer kwargs: precondition from the first step
    "shampoo": {"precondition_frequency": 1},
    "soap": {"precondition_frequency": 1},
}


def is_plain_torch(name: str) -> bool:
    """Registry entries with ``matrix_flag=None`` are plain torch optimizers (today only "adamw")."""
    return getattr(matrixopt.OPTIMIZERS[name], "matrix_flag", "use_muon") is None


def matrixopt_names(reason: str) -> list:
    """``NAMES`` for a matrixopt-specific check: plain torch entries are skipped as not applicable by design."""
    return [pytest.param(n, marks=pytest.mark.skip(reason=f"not applicable by design: {n!r} is plain "
                                                          f"torch.optim.AdamW, which {reason}"))
            if is_plain_torch(n) else n for n in NAMES]


class TinyNet(nn.Module):
    """Every routing kind in a few hundred weights: an embedding, hidden matrices of two shapes (fc2 and fc3
    share one, so they take the batched path together), a LayerNorm, biases and an output head."""

    def __init__(self, vocab: int = 11, d: int = 8, h: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, h, bias=False)
        self.fc3 = nn.Linear(h, h, bias=False)
        self.norm = nn.LayerNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.embed(idx)  # (B, T, d)
        x = F.gelu(self.fc1(x))  # (B, T, h)
        x = x + self.fc3(F.gelu(self.fc2(x)))
        return self.head(self.norm(x))  # (B, T, vocab)


def tiny_net(seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu", **kw: Any) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet(**kw).to(device=device, dtype=dtype)


def batch(seed: int = 0, vocab: int = 11, device: str = "cpu") -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (4, 5), generator=g)  # (B, T)
    y = torch.randint(0, vocab, (4, 5), generator=g)
    return x.to(device), y.to(device)


def loss_fn(model: nn.Module, xy: tuple[Tensor, Tensor]) -> Tensor:
    x, y = xy
    logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def build(name: str, model: nn.Module, **hparams: Any) -> torch.optim.Optimizer:
    """``build_optimizer`` with the suite's defaults; ``hparams`` override them."""
    return matrixopt.build_optimizer(model, name, **({"lr": LR} | HPARAMS.get(name, {}) | hparams))


def set_grads(params: list[Tensor] | nn.Module, seed: int, scale: float = 1.0) -> None:
    """Deterministic synthetic gradients (faster and more exact than a backward pass)."""
    params = list(params.parameters()) if isinstance(params, nn.Module) else list(params)
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g, dtype=torch.float64) * scale).to(p.dtype).to(p.device)


def train(opt: torch.optim.Optimizer, model: nn.Module, steps: int, seed: int = 0) -> None:
    for s in range(steps):
        set_grads(model, seed + s)
        opt.step()
        opt.zero_grad()


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Deep copies of every parameter and of the optimizer's state (per parameter, by position)."""
    return {"params": [p.detach().clone() for p in model.parameters()],
            "state": copy.deepcopy(opt.state_dict()["state"])}


def assert_identical(a: Any, b: Any, where: str = "") -> None:
    """Bit-identical nested containers of tensors (NaN equal to NaN, dtypes equal)."""
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor), f"{where}: tensor vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} vs " \
                                                           f"{b.dtype}{tuple(b.shape)}"
        assert torch.equal(a.cpu(), b.cpu()) or torch.equal(a.isnan().cpu(), b.isnan().cpu()) and torch.equal(
            a.nan_to_num().cpu(), b.nan_to_num().cpu()), f"{where}: values differ"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def state_tensors(opt: torch.optim.Optimizer) -> list[tuple[str, Tensor]]:
    return [(k, v) for st in opt.state.values() for k, v in st.items() if isinstance(v, Tensor)]


def is_matrixopt(opt: torch.optim.Optimizer) -> bool:
    return isinstance(opt, MatrixOptimizer)


def child_env() -> dict[str, str]:
    """The environment for a child Python process: this checkout's matrixopt first on its path, whatever is
    installed."""
    root = str(Path(__file__).resolve().parents[2])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
