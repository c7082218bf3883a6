"""Automatic routing of a model's parameters: hidden matrices to the matrix optimizer, the rest to AdamW.

Rules, in order:
1. ``adamw`` / ``matrix`` name patterns (regular expressions, ``re.search`` on the parameter name) win.
2. Parameters of embedding modules (nn.Embedding, nn.EmbeddingBag) and of the output head (a module whose name
   ends in one of ``HEAD_NAMES``, or any weight tied to an embedding) go to AdamW with weight decay.
3. Parameters with fewer than 2 dims (norm weights, biases, scalars) go to AdamW without weight decay.
4. Every other parameter (hidden 2-D weights, conv kernels, stacked experts) goes to the matrix optimizer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from matrixopt.optim.layout import mark_experts, mark_split

HEAD_NAMES = ("lm_head", "head", "output", "classifier", "fc_out")


def _compile(patterns: Iterable[str], what: str) -> list[re.Pattern]:
    out = []
    for pat in patterns:
        try:
            out.append(re.compile(pat))
        except re.error as e:
            raise ValueError(f"{what} pattern {pat!r} is not a valid regular expression: {e}") from None
    return out


def route(model: nn.Module, *, adamw: Sequence[str] = (), matrix: Sequence[str] = (),
          splits: Mapping[str, int | Sequence[int]] | None = None,
          experts: Sequence[str] = ()) -> list[tuple[str, Tensor, str]]:
    """``[(name, param, route)]`` for every trainable parameter (shared ones once), route in
    ``"matrix" | "adamw" | "adamw_no_decay"``. Marks split and expert parameters (see :mod:`matrixopt.optim.layout`).
    A pattern that matches no parameter raises ValueError."""
    adamw_re, matrix_re = _compile(adamw, "adamw"), _compile(matrix, "matrix")
    split_re = {pat: (rx, sizes) for pat, (rx, sizes) in
                zip(splits or {}, zip(_compile(splits or {}, "splits"), (splits or {}).values()))}
    experts_re = _compile(experts, "experts")
    special: dict[int, str] = {}
    for mname, mod in model.named_modules():
        is_embed = isinstance(mod, nn.Embedding | nn.EmbeddingBag)
        is_head = mname.split(".")[-1] in HEAD_NAMES and isinstance(mod, nn.Linear)
        if is_embed or is_head:
            for p in mod.parameters(recurse=False):
                if p.ndim >= 2:
                    special[id(p)] = "adamw"
    used: set[str] = set()
    out = []
    for name, p in model.named_parameters():  # deduplicates tied parameters
        if not p.requires_grad:
            continue
        forced = [("adamw", rx) for rx in adamw_re if rx.search(name)] + \
                 [("matrix", rx) for rx in matrix_re if rx.search(name)]
        for _, rx in forced:
            used.add(rx.pattern)
        kinds = {k for k, _ in forced}
        if len(kinds) > 1:
            raise ValueError(f"parameter `{name}` matches both an adamw and a matrix pattern; make them exclusive")
        if kinds == {"matrix"}:
            if p.ndim < 2:
                raise ValueError(f"pattern routes `{name}` (shape {tuple(p.shape)}) to the matrix optimizer, "
                                 "which needs 2 or more dims; route it to AdamW")
            r = "matrix"
        elif kinds == {"adamw"}:
            r = "adamw" if p.ndim >= 2 else "adamw_no_decay"
        elif id(p) in special:
            r = special[id(p)]
        else:
            r = "matrix" if p.ndim >= 2 else "adamw_no_decay"
        for rx in experts_re:
            if rx.search(name):
                used.add(rx.pattern)
                mark_experts(p)
        for pat, (rx, sizes) in split_re.items():
            if rx.search(name):
                used.add(pat)
                mark_split(p, sizes, dim=0)
        out.append((name, p, r))
    unused = [rx.pattern for rx in [*adamw_re, *matrix_re, *experts_re]] + list(split_re)
    unused = [pat for pat in unused if pat not in used]
    if unused:
        raise ValueError(f"routing pattern(s) {unused} match no trainable parameter of the model; "
                         f"check the names (e.g. {[n for n, _ in model.named_parameters()][:4]})")
    return out


def param_groups(model: nn.Module, *, matrix_flag: str | None = "use_muon", adamw: Sequence[str] = (),
                 matrix: Sequence[str] = (), splits: Mapping[str, int | Sequence[int]] | None = None,
                 experts: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Param groups for a matrixopt optimizer: the matrix group (``{matrix_flag: True}``), AdamW with weight decay
    (embeddings, head) and AdamW without weight decay (1-D). Each group carries ``names``. With
    ``matrix_flag=None`` (plain AdamW) matrices join the weight-decayed group. Empty groups are left out."""
    buckets: dict[str, list[tuple[str, Tensor]]] = {"matrix": [], "adamw": [], "adamw_no_decay": []}
    for name, p, r in route(model, adamw=adamw, matrix=matrix, splits=splits, experts=experts):
        buckets["adamw" if (r == "matrix" and matrix_flag is None) else r].append((name, p))
    groups = []
    for r, items in buckets.items():
        if not items:
            continue
        g: dict[str, Any] = {"params": [p for _, p in items], "names": [n for n, _ in items]}
        if matrix_flag is not None:
            g[matrix_flag] = r == "matrix"
        if r == "adamw_no_decay":
            g["weight_decay"] = 0.0
        groups.append(g)
    return groups


def routing_summary(groups: Sequence[Mapping[str, Any]], matrix_flag: str | None = "use_muon") -> str:
    """A readable table of where each parameter went."""
    lines = []
    for g in groups:
        kind = "matrix" if matrix_flag and g.get(matrix_flag, False) else "adamw"
        wd = g.get("weight_decay")
        tag = kind + ("" if wd is None else f" (wd={wd})")
        names = g.get("names") or [f"params[{i}]" for i in range(len(g["params"]))]
        n = sum(p.numel() for p in g["params"])
        lines.append(f"{tag}: {len(g['params'])} tensors, {n:,} parameters")
        lines += [f"    {name:<48} {tuple(p.shape)}" for name, p in zip(names, g["params"])]
    return "\n".join(lines)
