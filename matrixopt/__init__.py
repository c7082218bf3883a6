"""matrixopt: matrix-aware optimizers (Muon, NorMuon, AdaMuon, MOP, Shampoo, SOAP) for PyTorch.

Public API:
    newton_schulz(G, steps=5, coefficients="modded_nanogpt", *, dtype=None, method="auto")
                                                                      approximate polar factor, (m, n) or (b, m, n)
    NewtonSchulzConfig(steps=, coefficients=, dtype=, method=)        the same settings as one checked value
    SCHEDULES                                                         the named coefficient schedules
    polar(G)                                                          exact polar factor via float64 SVD
    Muon, MOP                                                         torch.optim.Optimizer subclasses
    NorMuon, AdaMuon                                                  Muon with a second moment on its update
    opt.clip_grad_norm_(max_norm, norm_type=2.0)                      clipping as torch's, applied inside Muon's step
    Shampoo, SOAP                                                     Kronecker-factored preconditioning (same routing)
    build_optimizer(model, name, **hparams)                           route a model and build by name
    param_groups(model, ...), routing_summary(groups)                 the routing itself
    mark_split(param, sizes, dim=0), mark_experts(param)              matrix layouts of fused / stacked weights
    OPTIMIZERS, register_optimizer(name, factory)                     the registry
    QKClip(threshold, attentions, *, process_group=None)              QK-clip (MuonClip): .step(max_logits) after a step
    SplitQK(q_weight=, k_weight=, n_head=, ...)                       an attention with separate W_q, W_k
    FusedQKV(weight=, n_head=, n_kv_head=, row_order=, ...)           an attention with one fused W_qkv
    QKClipStats                                                       what one QKClip.step did (clipped, max_logit, ...)
    Offload(pin_memory=None, device_copy=None)                        where offloaded optimizer state lives
    frozen_heap()                                                     a training loop without long garbage collections

Every matrix optimizer takes ``state_dtype`` (None, ``torch.bfloat16``/"bf16", "int8": compact, stochastically
rounded state) and ``offload`` (None, "cpu", or an :class:`Offload`: state in CPU memory, streamed for the step).
"""

from matrixopt.device import frozen_heap
from matrixopt.distributed.qk_clip import FusedQKV, QKClip, QKClipStats, SplitQK
from matrixopt.linalg.ortho import SCHEDULES, NewtonSchulzConfig, newton_schulz, polar
from matrixopt.optim.adaptive import AdaMuon, NorMuon
from matrixopt.optim.layout import mark_experts, mark_split
from matrixopt.optim.muon import MOP, Muon
from matrixopt.optim.nonfinite import NonFiniteGradientError
from matrixopt.optim.offload import Offload
from matrixopt.optim.registry import OPTIMIZERS, build_optimizer, register_optimizer
from matrixopt.optim.routing import param_groups, routing_summary
from matrixopt.optim.shampoo import Shampoo
from matrixopt.optim.soap import SOAP

__all__ = [
    "MOP",
    "AdaMuon",
    "NorMuon",
    "OPTIMIZERS",
    "SCHEDULES",
    "SOAP",
    "FusedQKV",
    "Muon",
    "NewtonSchulzConfig",
    "NonFiniteGradientError",
    "Offload",
    "QKClip",
    "QKClipStats",
    "Shampoo",
    "SplitQK",
    "build_optimizer",
    "frozen_heap",
    "mark_experts",
    "mark_split",
    "newton_schulz",
    "param_groups",
    "polar",
    "register_optimizer",
    "routing_summary",
]

__version__ = "0.1.0"
