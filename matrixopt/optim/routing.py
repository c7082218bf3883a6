"""Automatic routing of a model's parameters: hidden matrices to the matrix optimizer, the rest to AdamW.

Rules, in order (each parameter's decision and the reason for it are printed by :func:`routing_summary`):

1. ``adamw`` / ``matrix`` name patterns (regular expressions, ``re.search`` on the parameter name) win.
2. Input embeddings (nn.Embedding, nn.EmbeddingBag, and what a Hugging Face model's ``get_input_embeddings()``
   returns) and the output head (what ``get_output_embeddings()`` returns, a linear layer whose name ends in one of
   ``HEAD_NAMES``, or a weight tied to an embedding) go to AdamW with weight decay. So does a mixture-of-experts
   router (a ``gate``/``router`` layer beside an ``experts`` module), whose rows are one logit per expert.
3. Parameters with fewer than 2 dims (norm weights, biases, scalars) go to AdamW without weight decay.
4. Known matrix layers go to the matrix optimizer: nn.Linear, nn.ConvNd (the kernel flattened to
   ``(out, in*k...)``), GPT-2's ``Conv1D`` (stored ``(in, out)``), and expert stacks: a 3-D parameter of a module
   named ``experts`` (or a class whose name ends in ``Experts``), as E matrices (:func:`mark_experts`).
5. Fused weights of Hugging Face models are split so that each part is orthogonalized on its own
   (:func:`mark_split`): GPT-2's ``c_attn`` (Q, K, V along the output columns of ``(d, 3d)``), ``qkv_proj`` (Q, K,
   V rows by the attention's head counts, GQA included), ``gate_up_proj`` (gate and up rows, also per expert).
   These rules apply to models whose ``config`` has a ``model_type`` (any ``transformers`` model) and to Conv1D;
   other models keep their fused weights whole unless ``splits`` says otherwise.
6. Anything else falls back: a 2-D parameter to the matrix optimizer, more dims to AdamW with weight decay.
   :func:`routing_summary` lists these as unrecognized, so a new layer type is visible.

Orientation: the polar factor of ``W^T`` is the transpose of the polar factor of ``W``, so a weight stored
``(in, out)`` (Conv1D) is orthogonalized correctly as stored, and the default update scale (``match_adamw``,
``0.2 sqrt(max(m, n))``) is the same either way. Scalings that are not symmetric in ``(m, n)`` (``original``,
``spectral``) and NorMuon's per-row second moment read the stored layout; :func:`build_optimizer` warns when a
non-square ``(in, out)`` weight meets one of them.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from matrixopt.optim.layout import _EXPERTS, _SPLIT, mark_experts, mark_split

HEAD_NAMES = ("lm_head", "head", "output", "classifier", "fc_out", "score", "qa_outputs")
ROUTER_NAMES = ("gate", "router")
_REASON = "_matrixopt_reason"
_IN_OUT = "_matrixopt_in_out"  # set on weights stored (in, out): Conv1D, transposed expert stacks


def _compile(patterns: Iterable[str], what: str) -> list[re.Pattern]:
    out = []
    for pat in patterns:
        try:
            out.append(re.compile(pat))
        except re.error as e:
            raise ValueError(f"{what} pattern {pat!r} is not a valid regular expression: {e}") from None
    return out


def _is_hf(model: nn.Module) -> bool:
    return isinstance(getattr(getattr(model, "config", None), "model_type", None), str)


def _is_conv1d(mod: nn.Module) -> bool:
    """GPT-2's ``transformers.pytorch_utils.Conv1D``: ``y = x @ W + b`` with W stored ``(nx, nf) = (in, out)``."""
    w = getattr(mod, "weight", None)
    return (type(mod).__name__ == "Conv1D" and isinstance(w, Tensor) and w.ndim == 2
            and tuple(w.shape) == (getattr(mod, "nx", None), getattr(mod, "nf", None)))


def _is_experts(mname: str, mod: nn.Module) -> bool:
    return mname.split(".")[-1] == "experts" or type(mod).__name__.endswith("Experts")


def _head_counts(attn: nn.Module, config: Any) -> tuple[int, int, int] | None:
    """``(n_head, n_kv_head, head_dim)`` of an attention module, from its attributes or the model config."""
    n_kv = getattr(attn, "num_key_value_heads", None) or getattr(config, "num_key_value_heads", None)
    n_head = getattr(attn, "num_heads", None) or getattr(config, "num_attention_heads", None)
    hd = getattr(attn, "head_dim", None) or getattr(config, "head_dim", None)
    if hd is None and n_head:
        hd = getattr(config, "hidden_size", 0) // n_head
    if not (n_head and hd):
        return None
    return int(n_head), int(n_kv or n_head), int(hd)


def _known_layouts(model: nn.Module) -> dict[int, tuple[str, str, Any]]:
    """``{id(param): (route, reason, split)}`` for the parameters rules 2, 4 and 5 recognize; ``split`` is None or
    ``(sizes, dim)`` for :func:`mark_split`."""
    hf = _is_hf(model)
    config = getattr(model, "config", None)
    known: dict[int, tuple[str, str, Any]] = {}
    modules = dict(model.named_modules())

    def special(mod: nn.Module | None, reason: str) -> None:
        for p in (mod.parameters(recurse=False) if isinstance(mod, nn.Module) else ()):
            if p.ndim >= 2:
                known.setdefault(id(p), ("adamw", reason, None))

    for getter, reason in (("get_input_embeddings", "embedding"), ("get_output_embeddings", "output head")):
        fn = getattr(model, getter, None)
        if callable(fn):
            try:
                special(fn(), reason)
            except (NotImplementedError, AttributeError):  # a model without one
                pass
    for mname, mod in modules.items():
        leaf = mname.split(".")[-1]
        parent = modules.get(mname.rsplit(".", 1)[0] if "." in mname else "")
        if isinstance(mod, nn.Embedding | nn.EmbeddingBag):
            special(mod, "embedding")
        elif leaf in HEAD_NAMES and isinstance(mod, nn.Linear):
            special(mod, "output head")
        elif leaf in ROUTER_NAMES and parent is not None and hasattr(parent, "experts"):
            special(mod, "MoE router")
        elif _is_conv1d(mod):
            w = mod.weight
            split = None
            if hf and leaf == "c_attn" and mod.nf in (2 * mod.nx, 3 * mod.nx):  # K|V (cross) or Q|K|V columns
                split = (mod.nf // mod.nx, 1)
            parts = "" if split is None else f", {'Q|K|V' if split[0] == 3 else 'K|V'}"
            known.setdefault(id(w), ("matrix", f"Conv1D (in, out){parts}", split))
            setattr(w, _IN_OUT, True)
        elif isinstance(mod, nn.Linear):
            split, what = None, "linear"
            out = mod.weight.shape[0]
            if hf and leaf == "qkv_proj":
                counts = _head_counts(parent, config)
                if counts is not None and (counts[0] + 2 * counts[1]) * counts[2] == out:
                    n_head, n_kv, hd = counts
                    split, what = ((n_head * hd, n_kv * hd, n_kv * hd), 0), "linear, Q|K|V"
            elif hf and leaf == "gate_up_proj" and out % 2 == 0:
                split, what = (2, 0), "linear, gate|up"
            known.setdefault(id(mod.weight), ("matrix", what, split))
        elif isinstance(mod, nn.modules.conv._ConvNd):
            known.setdefault(id(mod.weight), ("matrix", "conv kernel, flattened to (out, in*k)", None))
        elif _is_experts(mname, mod):
            transposed = bool(getattr(mod, "is_transposed", False))
            for pname, p in mod.named_parameters(recurse=False):
                if p.ndim != 3:
                    continue
                mark_experts(p)
                split, what = None, f"MoE experts, {p.shape[0]} matrices"
                if hf and pname == "gate_up_proj" and p.shape[2 if transposed else 1] % 2 == 0:
                    split, what = (2, 1 if transposed else 0), what + ", gate|up"
                if transposed:
                    setattr(p, _IN_OUT, True)
                    what += ", stored (in, out)"
                known.setdefault(id(p), ("matrix", what, split))
    return known


def _default(p: Tensor, mod: nn.Module | None, pname: str) -> tuple[str, str]:
    """Route and reason of a parameter no layout rule knows."""
    if p.ndim < 2:
        kind = "norm" if mod is not None and ("Norm" in type(mod).__name__) else (
            "bias" if pname.endswith("bias") else f"{p.ndim}-D")
        return "adamw_no_decay", kind
    if p.ndim == 2:
        return "matrix", "unrecognized 2-D: matrix"
    if getattr(p, _EXPERTS, False):
        return "matrix", f"experts (marked), {p.shape[0]} matrices"
    return "adamw", f"unrecognized {p.ndim}-D: adamw"


def route(model: nn.Module, *, adamw: Sequence[str] = (), matrix: Sequence[str] = (),
          splits: Mapping[str, int | Sequence[int]] | None = None,
          experts: Sequence[str] = ()) -> list[tuple[str, Tensor, str]]:
    """``[(name, param, route)]`` for every trainable parameter (tied ones once, under their first name), route in
    ``"matrix" | "adamw" | "adamw_no_decay"``. Marks split and expert parameters (see :mod:`matrixopt.optim.layout`)
    and records the reason for each decision on the parameter, which :func:`routing_summary` prints.

    ``splits`` pieces are taken along the output features (dim 1 of a Conv1D's ``(in, out)`` weight, dim 0 of any
    other). A pattern that matches no parameter is a warning naming it; an invalid pattern raises ValueError."""
    adamw_re, matrix_re = _compile(adamw, "adamw"), _compile(matrix, "matrix")
    split_re = list(zip(splits or {}, _compile(splits or {}, "splits"), (splits or {}).values()))
    experts_re = _compile(experts, "experts")
    owners = {}
    for mod in model.modules():
        for pname, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), (mod, pname))
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    for rx in experts_re:  # before the layouts, so that a split of a user's expert stack is per expert
        for name, p in model.named_parameters():
            if rx.search(name):
                mark_experts(p)  # raises, naming the shape, unless 3-D
    known = _known_layouts(model)
    used: set[str] = set()
    out = []
    for name, p in model.named_parameters():  # deduplicates tied parameters
        if not p.requires_grad:
            continue
        forced = [("adamw", rx) for rx in adamw_re if rx.search(name)] + \
                 [("matrix", rx) for rx in matrix_re if rx.search(name)]
        used.update(rx.pattern for _, rx in forced)
        kinds = {k for k, _ in forced}
        if len(kinds) > 1:
            raise ValueError(f"parameter `{name}` matches both an adamw and a matrix pattern; make them exclusive")
        mod, pname = owners.get(id(p), (None, name))
        r, reason, split = known.get(id(p), (*_default(p, mod, pname), None))
        for rx in experts_re:
            if rx.search(name):
                used.add(rx.pattern)
                r, reason = "matrix", f"experts by pattern, {p.shape[0]} matrices"
        if kinds == {"matrix"}:
            if p.ndim < 2:
                raise ValueError(f"pattern routes `{name}` (shape {tuple(p.shape)}) to the matrix optimizer, "
                                 "which needs 2 or more dims; route it to AdamW")
            r, reason = "matrix", "matrix pattern"
        elif kinds == {"adamw"}:
            r, reason = ("adamw" if p.ndim >= 2 else "adamw_no_decay"), "adamw pattern"
        user_split = [(pat, sizes) for pat, rx, sizes in split_re if rx.search(name)]
        used.update(pat for pat, _ in user_split)
        if user_split:
            split = (user_split[-1][1], 1 if getattr(p, _IN_OUT, False) else 0)
            reason += ", split pattern"
        if split is not None and r == "matrix":
            mark_split(p, split[0], dim=split[1])
        if len(aliases.get(id(p), ())) > 1:
            reason += f" (tied: {', '.join(aliases[id(p)][1:])})"
        setattr(p, _REASON, reason)
        out.append((name, p, r))
    patterns = [rx.pattern for rx in [*adamw_re, *matrix_re, *experts_re]] + [pat for pat, _, _ in split_re]
    unused = [pat for pat in patterns if pat not in used]
    if unused:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        warnings.warn(f"routing pattern(s) {unused} match no trainable parameter of {type(model).__name__}; "
                      f"check the names (e.g. {names[:4]})", stacklevel=3)
    return out


def param_groups(model: nn.Module, *, matrix_flag: str | None = "use_muon", adamw: Sequence[str] = (),
                 matrix: Sequence[str] = (), splits: Mapping[str, int | Sequence[int]] | None = None,
                 experts: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Param groups for a matrixopt optimizer: the matrix group (``{matrix_flag: True}``), AdamW with weight decay
    (embeddings, head, router) and AdamW without weight decay (1-D). Each group carries ``names``. With
    ``matrix_flag=None`` (plain AdamW) matrices join the weight-decayed group. Empty groups are left out.

    A model none of whose parameters qualifies for the matrix optimizer gives a warning naming it (every parameter
    then goes to AdamW); see :func:`route` for the rules and the arguments."""
    buckets: dict[str, list[tuple[str, Tensor]]] = {"matrix": [], "adamw": [], "adamw_no_decay": []}
    for name, p, r in route(model, adamw=adamw, matrix=matrix, splits=splits, experts=experts):
        buckets["adamw" if (r == "matrix" and matrix_flag is None) else r].append((name, p))
    if matrix_flag is not None and not buckets["matrix"]:
        warnings.warn(f"no parameter of {type(model).__name__} qualifies for the matrix optimizer (hidden weights "
                      "with 2 or more dims); every parameter goes to AdamW. Route some with matrix=[pattern] if "
                      "this is not what you want.", stacklevel=2)
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


def stored_in_out(groups: Sequence[Mapping[str, Any]], matrix_flag: str = "use_muon") -> list[str]:
    """Names of the non-square matrix-group weights stored ``(in, out)`` (Conv1D, transposed expert stacks): the
    ones whose update an asymmetric scaling or a per-row statistic would read the wrong way round."""
    out = []
    for g in groups:
        if not g.get(matrix_flag, False):
            continue
        names = g.get("names") or [f"params[{i}]" for i in range(len(g["params"]))]
        for name, p in zip(names, g["params"]):
            shape = p.shape[-2:]
            if getattr(p, _IN_OUT, False) and shape[0] != shape[1]:
                out.append(name)
    return out


def routing_summary(groups: Sequence[Mapping[str, Any]], matrix_flag: str | None = "use_muon") -> str:
    """A readable table of where each parameter went and why, with the split pieces of fused weights, followed by
    the parameters no rule recognized (routed by the fallback)."""
    lines, unknown = [], []
    for g in groups:
        kind = "matrix" if matrix_flag and g.get(matrix_flag, False) else "adamw"
        wd = g.get("weight_decay")
        tag = kind + ("" if wd is None else f" (wd={wd})")
        names = g.get("names") or [f"params[{i}]" for i in range(len(g["params"]))]
        n = sum(p.numel() for p in g["params"])
        lines.append(f"{tag}: {len(g['params'])} tensors, {n:,} parameters")
        for name, p in zip(names, g["params"]):
            reason = getattr(p, _REASON, "")
            split = getattr(p, _SPLIT, None) if kind == "matrix" else None
            if split is not None:
                reason += f" {list(split[1])} on dim {split[0]}"
            lines.append(f"    {name:<48} {str(tuple(p.shape)):<18} {reason}")
            if reason.startswith("unrecognized"):
                unknown.append(f"{name} {tuple(p.shape)} -> {kind}")
    if unknown:
        lines.append(f"unrecognized ({len(unknown)}, routed by the fallback: 2-D to the matrix optimizer, "
                     "more dims to AdamW):")
        lines += [f"    {u}" for u in unknown]
    return "\n".join(lines)
