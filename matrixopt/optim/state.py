r"""Compact optimizer state: the momentum and Adam's moments stored in bfloat16 or 8 bits, stepped in float32.

Each step decodes a parameter's state to float32, runs the usual update on it, and encodes the result back::

    m32 = decode(m);   m32 <- beta m32 + (1 - beta) g;   m = encode(m32)

**Stochastic rounding, not error feedback.** Rounding to nearest loses every increment smaller than half a unit in
the last place (ulp): with ``beta2 = 0.999`` the change ``(1 - beta2)(g^2 - v)`` of a bf16 second moment is mostly
below it, so the moment freezes. Two remedies keep the rounding error: *error feedback* stores the residual
``m32 - m`` in a compensation buffer and adds it back next step (exact in the mean, but the buffer costs as much
memory as the compact state saves: bf16 state plus a bf16 residual is fp32's 4 bytes); *stochastic rounding*
rounds up with probability equal to the fraction of the ulp the value lies past the lower neighbour, so the stored
value is unbiased, ``E[encode(x)] = x``, and the error of one rounding is below one ulp. It needs no memory, and
increments below an ulp survive in expectation. We use stochastic rounding (Zamirai et al., arXiv:2010.06192;
Gupta et al., arXiv:1502.02551), with random bits keyed by the step, the parameter and its range (a host generator
seeded from them; on the GPU one Triton pass draws its bits from Philox keyed by that generator's draw), so a run,
and a resumed run, is reproducible, and the bits do not depend on the order a step updates its parameters in.

Formats (``state_dtype``):

- ``"bf16"``: each value rounded stochastically to bfloat16 (8 significand bits).
- ``"int8"``: the AdamW groups' moments in 8 bits, the matrix groups' state in bfloat16 (:func:`group_format`).
  Blocks of :data:`BLOCK` consecutive values (the tensor flattened) share one float32 scale. ``exp_avg``
  (signed) stores ``q = round(x / absmax * 127)`` as int8 with ``absmax`` the block's largest magnitude; the second
  moment ``exp_avg_sq`` (nonnegative, spanning many decades) is quantized in the square-root domain,
  ``q = round(sqrt(v) / max sqrt(v) * 255)`` as uint8, which halves its dynamic range in decades and matches how
  Adam uses it (``sqrt(v)`` divides the update). Rounding is stochastic here too, except that a positive value below
  one level is stored as one level, not as zero: ``sqrt(v)`` is floored at 1/255 of its block's largest, a
  per-block epsilon, so an entry below the block's resolution takes a smaller step rather than dividing by zero.
  The scale tensor is kept under ``<key>_scale``, shape ``(ceil(numel / BLOCK),)``.

Memory of optimizer state per parameter, in bytes (a bf16 parameter and its gradient add 4 more):

=================================  ===========  ==========  ==========================
state_dtype                        Muon, MOP    AdamW       AdaMuon (matrix groups)
=================================  ===========  ==========  ==========================
None (float32)                     4            8           8
"bf16"                             2            4           4
"int8"                             2            2.031       4
=================================  ===========  ==========  ==========================

(int8: one byte plus a 4-byte scale per 256 values, for AdamW's moments. NorMuon as Muon plus 4 bytes per row;
the AdamW step count is one float32 per tensor.) Which keys are compact: :data:`COMPACT_KEYS`; every other state
tensor stays float32.

Checkpoints hold the compact tensors and scales as they are, so compact state round-trips exactly; a state dict of
one format loads into an optimizer of another, decoded to float32 (exact) and, for a compact optimizer, encoded
(which rounds, stochastically).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from matrixopt.kernels.muon_elementwise import generator_on, stochastic_round_bf16

BLOCK = 256  # values per int8 block (one float32 scale each)
STATE_DTYPES = ("float32", "bf16", "int8")
_ALIASES = {None: None, "float32": None, "fp32": None, torch.float32: None,
            "bf16": "bf16", "bfloat16": "bf16", torch.bfloat16: "bf16", "int8": "int8", torch.int8: "int8"}
COMPACT_KEYS = {"momentum_buffer": True, "exp_avg": True, "exp_avg_sq": False}
"""State keys stored compactly, and whether they are signed (False: nonnegative, the square-root domain)."""


def value_bytes(state_dtype: str | None) -> float:
    """Bytes one state value takes stored as ``state_dtype`` (None: float32), its share of a block scale included."""
    return {None: 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / BLOCK}[state_dtype]


def group_format(state_dtype: str | None, matrix: bool) -> str | None:
    """How a parameter group's state is stored under the optimizer's ``state_dtype``: as given, except that
    ``"int8"`` quantizes the AdamW groups' moments only and stores a matrix group's state (Muon's momentum, SOAP's
    and AdaMuon's moments) in bfloat16. With the momentum in 8 bits as well, the prose benchmark ended 0.024 and
    0.028 above float32 state at two seeds (docs/results/memory)."""
    return "bf16" if state_dtype == "int8" and matrix else state_dtype


def check_state_dtype(value: Any) -> str | None:
    """``None`` for float32 state, ``"bf16"`` or ``"int8"``; ValueError listing the choices otherwise."""
    try:
        return _ALIASES[value]
    except (KeyError, TypeError):
        raise ValueError(f"Invalid state_dtype: {value!r}; use None or 'float32' (float32 state), torch.bfloat16 or "
                         f"'bf16', or 'int8' (block-quantized)") from None


def _blocks(x: Tensor) -> Tensor:
    """``x`` flattened and zero-padded to ``(ceil(numel / BLOCK), BLOCK)``."""
    flat = x.reshape(-1)
    pad = (-flat.numel()) % BLOCK
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, BLOCK)


def _stochastic_round(x: Tensor, generator: torch.Generator | None) -> Tensor:
    """``floor(x + u)``, u uniform in [0, 1): unbiased rounding to an integer."""
    u = torch.rand(x.shape, dtype=x.dtype, device=x.device, generator=generator_on(generator, x.device))
    return x.add_(u).floor_()


def quantize_blockwise(x: Tensor, signed: bool, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """``(q, scale)``: ``x`` (float32) quantized per block of :data:`BLOCK` values, stochastically rounded. Signed:
    ``q`` int8 in [-127, 127], ``x ~ q * scale / 127``. Not signed (``x >= 0``): ``q`` uint8, ``sqrt(x) ~ q * scale /
    255``. ``q`` has ``x``'s shape; ``scale`` is ``(ceil(numel / BLOCK),)`` float32 (a block's max magnitude, of
    ``sqrt(x)`` when not signed)."""
    b = _blocks(x.float())  # (nb, BLOCK)
    if not signed:
        b = b.clamp(min=0).sqrt()
    levels = 127.0 if signed else 255.0
    scale = b.abs().amax(dim=1)  # (nb,)
    inv = torch.where(scale > 0, levels / scale, 0.0)
    q = _stochastic_round(b * inv[:, None], generator).clamp_(-levels if signed else 1.0, levels)
    if not signed:  # a positive value below one level keeps one level (above): never a zero denominator
        q = torch.where(b > 0, q, 0.0)
    q = q.to(torch.int8 if signed else torch.uint8).view(-1)[:x.numel()].view(x.shape)
    return q, scale


def dequantize_blockwise(q: Tensor, scale: Tensor) -> Tensor:
    """The float32 values :func:`quantize_blockwise` encoded (signed for int8 ``q``, squared back for uint8)."""
    signed = q.dtype == torch.int8
    b = _blocks(q.float()) * (scale / (127.0 if signed else 255.0))[:, None]
    if not signed:
        b = b.square()
    return b.view(-1)[:q.numel()].view(q.shape)


def decode(state: dict[str, Any], key: str) -> Tensor:
    """The float32 value of ``state[key]`` as stored (float32, bfloat16, or int8/uint8 with ``<key>_scale``),
    on the stored tensor's device; a new tensor unless it was float32."""
    v = state[key]
    if v.dtype in (torch.int8, torch.uint8):
        return dequantize_blockwise(v, state[key + "_scale"])
    return v.float()


def encode(x: Tensor, key: str, state_dtype: str | None, generator: torch.Generator | None) -> dict[str, Tensor]:
    """The entries that store float32 ``x`` as ``state[key]`` in ``state_dtype`` (float32 itself for None or for a
    key not in :data:`COMPACT_KEYS`)."""
    if state_dtype is None or key not in COMPACT_KEYS:
        return {key: x}
    if state_dtype == "bf16":
        return {key: stochastic_round_bf16(x, generator)}
    q, scale = quantize_blockwise(x, COMPACT_KEYS[key], generator)
    return {key: q, key + "_scale": scale}


def is_scale(key: str, state: dict[str, Any]) -> bool:
    """Whether ``state[key]`` is the block scale of another entry."""
    return key.endswith("_scale") and key[:-len("_scale")] in COMPACT_KEYS and key[:-len("_scale")] in state


def in_format(state: dict[str, Any], key: str, state_dtype: str | None) -> bool:
    """Whether ``state[key]`` is already stored as ``state_dtype`` asks (then it is kept bit for bit)."""
    dtype = state[key].dtype
    if state_dtype is None or key not in COMPACT_KEYS:
        return dtype == torch.float32
    if state_dtype == "bf16":
        return dtype == torch.bfloat16
    return dtype == (torch.int8 if COMPACT_KEYS[key] else torch.uint8) and key + "_scale" in state


def decoded(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every compact entry decoded to float32 and the scales dropped."""
    out = {}
    for k, v in state.items():
        if is_scale(k, state):
            continue
        out[k] = decode(state, k) if isinstance(v, Tensor) and k in COMPACT_KEYS else v
    return out


def converted(state: dict[str, Any], state_dtype: str | None, generator: torch.Generator | None) -> dict[str, Any]:
    """``state`` stored as ``state_dtype`` asks: entries already in that format kept as they are, others decoded
    to float32 and, for a compact ``state_dtype``, encoded (rounded)."""
    out = {}
    for k, v in state.items():
        if is_scale(k, state):
            continue
        if not isinstance(v, Tensor) or k not in COMPACT_KEYS:
            out[k] = v
        elif in_format(state, k, state_dtype):
            out[k] = v
            if k + "_scale" in state and state_dtype == "int8":
                out[k + "_scale"] = state[k + "_scale"]
        else:
            out |= encode(decode(state, k), k, state_dtype, generator)
    return out
