"""Optimizers by name: ``build_optimizer(model, "muon", lr=...)`` routes the model and builds one optimizer.

``OPTIMIZERS`` maps a name to a factory ``factory(groups, **hparams)``, where ``groups`` come from
:func:`matrixopt.param_groups` with the factory's ``matrix_flag`` attribute (None for plain AdamW). Add your own
with :func:`register_optimizer`.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from matrixopt.optim.adaptive import AdaMuon, NorMuon
from matrixopt.optim.muon import MOP, Muon
from matrixopt.optim.routing import param_groups, routing_summary, stored_in_out
from matrixopt.optim.shampoo import Shampoo
from matrixopt.optim.soap import SOAP

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {}


def register_optimizer(name: str, factory: Callable[..., torch.optim.Optimizer]) -> None:
    """Register ``factory(groups, **hparams)`` under ``name``. A class that subclasses
    ``matrixopt.optim.base.MatrixOptimizer`` works as is (its ``matrix_flag`` selects the routing)."""
    if name in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is already registered")
    OPTIMIZERS[name] = factory


def adamw(groups: list[dict[str, Any]], **hparams: Any) -> torch.optim.AdamW:
    """torch.optim.AdamW over the routed groups (no weight decay on 1-D parameters); fused when every parameter
    is on CUDA, unless ``fused``/``foreach`` is given."""
    params = [p for g in groups for p in g["params"]]
    if "fused" not in hparams and "foreach" not in hparams and params and all(p.is_cuda for p in params):
        hparams["fused"] = True
    return torch.optim.AdamW(groups, **hparams)


adamw.matrix_flag = None  # type: ignore[attr-defined]

register_optimizer("adamw", adamw)
register_optimizer("muon", Muon)
register_optimizer("mop", MOP)
register_optimizer("normuon", NorMuon)
register_optimizer("adamuon", AdaMuon)
register_optimizer("shampoo", Shampoo)
register_optimizer("soap", SOAP)


def accepted(name: str, **hparams: Any) -> dict[str, Any]:
    """The subset of ``hparams`` that the optimizer registered as ``name`` takes (by its signature), e.g.
    ``accepted(name, deferred_nonfinite=True)`` for the options that only some optimizers have."""
    params = inspect.signature(OPTIMIZERS[name]).parameters
    return {k: v for k, v in hparams.items() if k in params}


def build_optimizer(model: nn.Module, name: str, *, adamw: Sequence[str] = (), matrix: Sequence[str] = (),
                    splits: Mapping[str, int | Sequence[int]] | None = None, experts: Sequence[str] = (),
                    verbose: bool = False, **hparams: Any) -> torch.optim.Optimizer:
    """Route ``model``'s parameters and build the optimizer registered as ``name``.

    adamw / matrix: regex patterns forcing parameters to AdamW / the matrix optimizer. splits: ``{pattern:
    sizes}`` marks fused weights (e.g. ``{r"attn\\.c_attn\\.weight$": 3}`` for Q, K, V). experts: patterns of
    ``(E, out, in)`` expert stacks. verbose: print where each parameter went. hparams go to the optimizer."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; registered: {sorted(OPTIMIZERS)}")
    factory = OPTIMIZERS[name]
    flag = getattr(factory, "matrix_flag", "use_muon")
    groups = param_groups(model, matrix_flag=flag, adamw=adamw, matrix=matrix, splits=splits, experts=experts)
    if verbose:
        print(routing_summary(groups, flag))
    in_out = stored_in_out(groups, flag) if flag is not None else []
    if in_out and (hparams.get("scaling", "match_adamw") != "match_adamw" or name == "normuon"):
        warnings.warn(f"{in_out[:3]} are stored (in, out) (e.g. GPT-2's Conv1D): {name} with scaling="
                      f"{hparams.get('scaling', 'match_adamw')!r} scales or normalizes their update by the stored "
                      "layout, not by (out, in); the default scaling='match_adamw' with muon is symmetric",
                      stacklevel=2)
    if flag is None:
        for g in groups:
            g.pop("names", None)
    return factory(groups, **hparams)
