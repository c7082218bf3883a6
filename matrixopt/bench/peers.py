"""The peers the benchmarks compare against, built in one place for ``step``, ``train`` and ``ns``.

- ``torch.optim.Muon`` on the hidden matrices, stepped together with AdamW on the rest (torch's Muon takes 2-D
  parameters only);
- NVIDIA's ``emerging_optimizers`` (https://github.com/NVIDIA-NeMo/Emerging-Optimizers) where it is installed:
  its ``Muon`` as it ships (Newton–Schulz through cuBLAS in bf16, one matrix at a time) and with ``use_syrk=True``
  (its Triton SYRK for ``X X^T``, CUDA only), each beside the same AdamW; and its Triton Gram kernel ``tsyrk_ex``
  for the Gram row of ``bench ns``. It needs Python >= 3.12; where it is missing the rows say why instead.

Each Muon peer runs 5 quintic Newton–Schulz steps (the package defaults), at the learning rate torch's Muon
documents (0.02); step time does not depend on it. ``emerging_optimizers``' Triton SYRK autotunes 486 configs on
each new shape (17–44 s per shape on an H100), so its first step, and the Gram row's first call, take that long.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from matrixopt.optim.layout import _EXPERTS

PEER_MUON_LR = 0.02
EMERGING = "emerging_optimizers Muon"
EMERGING_SYRK = "emerging_optimizers Muon, SYRK"
TORCH_MUON = "torch.optim.Muon"
PEER_NAMES = (TORCH_MUON, EMERGING, EMERGING_SYRK)
"""The keys of :func:`peer_muons`."""


class Stepper:
    """Steps several optimizers as one (a peer's Muon plus its separate AdamW)."""

    def __init__(self, *opts: torch.optim.Optimizer):
        self.opts = opts

    def step(self) -> None:
        for o in self.opts:
            o.step()


def split_hidden(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(hidden matrices, the rest) of a GPT: the 2-D parameters of the blocks (``.h.`` in the name) but a MoE
    router go to Muon; embeddings, head, router, norms and biases to AdamW (Muon's authors keep the embedding and the
    head on AdamW). An expert stack (``(E, out, in)``, marked with :func:`matrixopt.mark_experts`) enters as E 2-D
    copies with their gradients, made once and kept on the model: the peers take 2-D leaf tensors and loop over
    them, doing the stack's work on copies."""
    hidden, stacks = [], set()
    for name, p in model.named_parameters():
        if ".h." not in f".{name}" or name.endswith("router.weight"):
            continue
        if getattr(p, _EXPERTS, False):
            stacks.add(id(p))
            hidden += _per_expert(model, name, p)
        elif p.ndim == 2:
            hidden.append(p)
    ids = {id(p) for p in hidden} | stacks
    return hidden, [p for p in model.parameters() if id(p) not in ids]


def _per_expert(model: nn.Module, name: str, stack: nn.Parameter) -> list[nn.Parameter]:
    """E leaf copies of ``stack``'s matrices, with copies of its gradient's, cached on ``model``."""
    cache = model.__dict__.setdefault("_per_expert", {})
    if name not in cache:
        copies = [nn.Parameter(w.detach().clone()) for w in stack.unbind(0)]
        if stack.grad is not None:
            for c, g in zip(copies, stack.grad.unbind(0)):
                c.grad = g.clone()
        cache[name] = copies
    return cache[name]


def emerging_optimizers() -> Any:
    """The ``emerging_optimizers`` package, or a string saying why it can't be used."""
    try:
        import emerging_optimizers
        from emerging_optimizers.orthogonalized_optimizers import Muon  # noqa: F401
    except ImportError as e:
        return f"not installed ({e}; pip install emerging-optimizers, Python >= 3.12)"
    return emerging_optimizers


def peer_muons(model: nn.Module, *, ns_steps: int = 5, adamw_lr: float = 1e-3,
               weight_decay: float = 0.1) -> dict[str, Callable[[], Stepper] | str]:
    """name -> factory of the peer's stepper over ``model``'s parameters (Muon on the hidden matrices, fused AdamW
    on a GPU, foreach elsewhere, on the rest), or a string saying why the peer is missing."""
    hidden, rest = split_hidden(model)
    fused = next(model.parameters()).is_cuda

    def adamw() -> torch.optim.AdamW:
        return torch.optim.AdamW(rest, lr=adamw_lr, weight_decay=weight_decay, fused=fused,
                                 foreach=None if fused else True)

    out: dict[str, Callable[[], Stepper] | str] = {
        TORCH_MUON: lambda: Stepper(torch.optim.Muon(hidden, lr=PEER_MUON_LR, ns_steps=ns_steps), adamw()),
    }
    eo = emerging_optimizers()
    if isinstance(eo, str):
        out[EMERGING] = out[EMERGING_SYRK] = eo
        return out
    from emerging_optimizers.orthogonalized_optimizers import Muon as EOMuon

    out[EMERGING] = lambda: Stepper(EOMuon(hidden, lr=PEER_MUON_LR, num_ns_steps=ns_steps), adamw())
    if fused:
        out[EMERGING_SYRK] = lambda: Stepper(EOMuon(hidden, lr=PEER_MUON_LR, num_ns_steps=ns_steps, use_syrk=True),
                                             adamw())
    else:
        out[EMERGING_SYRK] = "its Triton SYRK needs a CUDA GPU"
    return out


def peer_gram(device: torch.device) -> Callable[[Tensor], Tensor] | str:
    """``emerging_optimizers``' Triton ``tsyrk_ex`` as a batched Gram matrix (``(b, m, k)`` bf16 -> ``(b, m, m)``;
    it takes one 2-D matrix per call, so a batch is a loop, as its Muon runs it), or a string saying why not."""
    eo = emerging_optimizers()
    if isinstance(eo, str):
        return eo
    if device.type != "cuda":
        return "its Triton SYRK needs a CUDA GPU"
    try:
        from emerging_optimizers.triton_kernels import tsyrk_ex
    except ImportError as e:
        return f"emerging_optimizers.triton_kernels unavailable ({e})"

    def gram(X: Tensor) -> Tensor:
        return torch.stack([tsyrk_ex(x) for x in X])

    return gram
