r"""The cost model: how long an optimizer step, a collective and a layout's step take, and how much memory a rank
needs, from a device profile. One model serves the layer-wise balancer (:mod:`.balance`), ``--tp-mode auto``
(:mod:`.tp`) and the planner (``matrixopt plan``).

**Device profile** (:class:`DeviceProfile`, a JSON file; format below): achieved rates by problem size, measured
by ``matrixopt plan --calibrate`` or filled from nominal figures (``"source": "nominal"``):

- ``gemm``: bf16 batched matrix products, ``[[flops of one call, achieved FLOP/s], ...]`` in ascending FLOPs;
- ``syrk``: the Gram product ``X X^T`` as our kernels compute it, the rate counted on the dense FLOPs ``2 m^2 k``
  (a SYRK computing one triangle may exceed ``gemm``'s);
- ``sym_mul`` (optional): the product of two symmetric ``(s, s)`` matrices as Newton–Schulz computes its square
  products (the SYRK's two-operand form where it is faster), rate on the dense FLOPs ``2 s^3``; a profile without
  it prices those products at the ``gemm`` rate;
- ``fp32_gemm``: float32 products (Shampoo's inverse roots, SOAP's eigenbases);
- ``tf32_gemm`` (optional): the same float32 products on TF32 tensor cores (Shampoo's and SOAP's
  ``matmul_precision="tf32"``); a profile without it prices them at half the ``gemm`` rate (the data sheet's
  ratio);
- ``qr``: the QR factorization of one ``(n, n)`` float32 matrix (SOAP's eigenbasis refresh), its rate counted on
  ``8/3 n^3`` FLOPs (those of a Householder factorization forming Q, whatever the algorithm measured);
- ``elementwise``: ``[[bytes moved by one pass, achieved bytes/s], ...]`` (momentum, AdamW, packing);
- ``fused_adamw`` (optional): the same for ``torch.optim.AdamW(fused=True)``'s step, counted at
  :data:`ADAMW_BYTES` per parameter (four inputs and three outputs per element, torch's launches); a profile
  without it (the nominal ones) prices that step at the ``elementwise`` rate;
- ``links``: ``{"intra": {"latency": s, "bandwidth": bytes/s}, "inter": {...}}``: inside a node (NVLink) and
  between nodes (the network), per GPU and direction;
- ``host_launch`` (optional): seconds the host takes to issue one kernel of an eager optimizer step, the Python
  around it included (:func:`muon_host_time`; ``--calibrate`` measures it on Muon's eager step); a profile
  without it (written before the field) takes :data:`HOST_LAUNCH`;
- ``peak_flops`` (the data sheet's, for MFU), ``memory_bytes`` per GPU, ``gpus_per_node``, ``name``,
  ``device``, ``source``, ``notes`` and ``env``.

A call's time is its size over the rate interpolated (linearly in log size) between the two nearest points; below
the first point it takes the first point's time (launch-bound), above the last it runs at the last point's rate.

A product table measured on the calibration's stacks (:data:`CALIBRATION_STACKS`: ``(b, s, s) @ (b, s, 4 s)``, one
batch ``b`` per width ``s``, so its sizes are ``8 b s^3``) is also a table of rates by matrix width: a product of
a stack of width ``s`` runs no faster than the calibration's stack of that width (interpolated in log width,
clamped to the grid's ends), whatever its batch. A larger batch adds tiles, not reuse per tile: a stack of 320
matrices of 384 x 1024 has the FLOPs of the 768-wide calibration stack but the inner dimension of a 384-wide one.
Tables not on that grid (the nominal rooflines) give rates by size alone.

**Collectives** (:func:`collective_time`): the α–β model, α the latency of one message step, β the per-GPU
bandwidth of the slowest link the group crosses (a group inside one node uses ``intra``, one spanning nodes
``inter``); ``P`` ranks, ``n`` bytes:

=================  ==============================================================  =========================
collective         seconds                                                         ``n`` is
=================  ==============================================================  =========================
all-gather         :math:`(P-1)\alpha + \frac{P-1}{P} n \beta`  (ring)              the gathered result
reduce-scatter     :math:`(P-1)\alpha + \frac{P-1}{P} n \beta`  (ring)              the full input
all-reduce         min of ring :math:`2(P-1)\alpha + 2\frac{P-1}{P} n\beta` and     the buffer
                   tree :math:`2\lceil\log_2 P\rceil\alpha + 2 n\beta`
broadcast          :math:`\lceil\log_2 P\rceil\alpha + n\beta`  (pipelined tree)    the buffer
all-to-all         :math:`(P-1)\alpha + \frac{P-1}{P} n \beta`  (pairwise)          what one rank sends
=================  ==============================================================  =========================

**Optimizer steps** on lists of same-shape matrix groups (our optimizers batch same-shape matrices into one
stack): Muon (:func:`batched_newton_schulz_time` plus its elementwise passes), AdamW (torch's fused step, at the
``fused_adamw`` rate where the profile has one), Shampoo and SOAP (their factor products every step, their roots or
eigenbases every ``precondition_frequency`` steps, amortized, and the per-block stacking and copies of
:func:`block_pass_bytes`). A matrix
optimizer's AdamW groups run on a side stream beside its matrix groups
(:meth:`matrixopt.optim.base.MatrixOptimizer._update`): their pass is hidden behind the matrix groups' products,
not behind their elementwise passes, which contend for the same memory bandwidth. A step that is not handed the
clip's per-gradient norms (no ``clip_grad_norm_`` through the optimizer) first reads every gradient once for its
non-finite check (:data:`CHECK_BYTES`).
:func:`matrix_step_flops` gives the FLOPs of one step on one matrix, which the balancer packs on.

**The host.** A step launched eagerly (a layer-wise or FSDP2 owner's Muon step, one process's step without
``cuda_graph``) runs no faster than its host issues its kernels: its time is ``max(device, host)``, the host's
being its kernel launches (:func:`muon_launches`, counted from how the step launches them, a TP-sharded stack's
by :func:`tp_newton_schulz_launches`) times the profile's ``host_launch``. A step replayed from a CUDA graph (one
launch) costs the host nothing the model counts.

**Tensor-parallel Newton–Schulz** (:func:`tp_ns_times`): the three modes of :mod:`.tp` and what they overlap;
``distributed`` always runs the standard form with plain ``bmm`` products, so at the ``gemm`` rate.

**Memory** (:class:`Memory`): parameters, gradients, optimizer state, buffers and activations per rank, in bytes;
the per-parameter byte counts are the constants below.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from matrixopt.linalg.ortho import gram_phases, newton_schulz_flops, uses_gram
from matrixopt.optim.layout import BUCKET_NUMEL
from matrixopt.optim.shampoo import MATMUL_PRECISIONS, ROOT_METHODS

FORMAT = "matrixopt-profile/1"
SOURCES = ("nominal", "measured")
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")

# Bytes each step moves per parameter in its elementwise passes (fp32 state and weights):
# Muon (matrixopt.kernels.muon_elementwise): the momentum pass reads the gradient and the momentum and writes the
# momentum and the update into the 16-bit Newton-Schulz stack (4 + 4 + 4 + 2); the normalization reads and
# writes the stack (2 + 2); the update pass reads the 16-bit result and reads and writes the weight (2 + 4 + 4)
MUON_BYTES = 28
ADAMW_BYTES = 28  # read grad, weight, m, v; write weight, m, v
# Shampoo: the graft in one pass (reads the gradient, the momentum and the second moment, writes both moments, the
# Nesterov numerator and the Adam update: 28), then the update applied in one pass (reads the weight and the update,
# writes the weight: UPDATE_BYTES, matrixopt.kernels.muon_elementwise.decay_update). SOAP: AdamW's passes in the
# eigenbasis plus the projected gradient written and read (36), then the update applied alike.
UPDATE_BYTES = 12
SHAMPOO_BYTES = 28 + UPDATE_BYTES
SOAP_BYTES = 36 + UPDATE_BYTES
CHECK_BYTES = 4  # the non-finite check reads each fp32 gradient once (nonfinite.nonfinite_flags)
# Sharded Muon's owner (matrixopt.distributed.sharded, FSDP2), per 16-bit element of the whole matrices it gathers,
# besides Newton-Schulz and MUON_BYTES: the received rows concatenated into matrices (comm.gather_to_owners: read
# and write, 4), the Frobenius norm read in a pass of its own (a gathered stack comes without the momentum pass's
# partial sums: 2) and the result copied into the all-to-all's send buffer by destination
# (comm.scatter_from_owners: 4); the pieces of a split weight (Q, K and V) are also multiplied by their own update
# scales (read and write, SHARDED_SPLIT_BYTES), where an unsplit matrix's scale is applied by the update kernel
SHARDED_OWNER_BYTES = 10
SHARDED_SPLIT_BYTES = 4


def block_pass_bytes(optimizer: str, m: int, n: int) -> float:
    """Bytes SOAP's or Shampoo's step moves per ``(m, n)`` preconditioner block besides :data:`SOAP_BYTES` /
    :data:`SHAMPOO_BYTES` and its products, in fp32 (``matrixopt.optim.soap``, ``matrixopt.optim.shampoo``): the
    blocks stacked for the batched products (each read where it lies and written into the stack), each side's
    ``(d, d)`` bases or roots stacked the same way, the factors' one-pass update (``L += G G^T`` reads the factor
    and the product and writes the factor), and the result copied back into the update's blocks. SOAP stacks the
    gradient and its bases once per step (both rotations share them). Shampoo stacks the gradient for its factors
    and the Nesterov numerator and the roots for the preconditioning, then grafts and selects in two passes
    (``matrixopt.kernels.muon_fused.graft_select_triton``: the sums of squares of the preconditioned stack and the
    fallback's blocks, then the scaled stack or the fallback written into the update)."""
    mn, sides = m * n, m * m + n * n
    if optimizer == "soap":  # gradient stack 8 m n, bases 8 (m^2 + n^2), factors 12 (m^2 + n^2), copy back 8 m n
        return 16 * mn + 20 * sides
    if optimizer == "shampoo":  # stacks of the gradient and the numerator 16 m n, roots 8 (m^2 + n^2), factors
        # 12 (m^2 + n^2), the graft's sums 8 m n, its select 12 m n
        return 36 * mn + 20 * sides
    raise ValueError(f"no block passes for optimizer {optimizer!r}; use shampoo or soap")

# Optimizer state bytes per parameter of a matrix (the per-factor state of Shampoo and SOAP is counted apart):
STATE_BYTES = {"adamw": 8, "muon": 4, "shampoo": 8, "soap": 8}  # Shampoo: momentum and the Adam graft's moment

# Shampoo's inverse 4th roots run a coupled Newton iteration (matrixopt.linalg.roots): about 20 steps at a
# condition number of 1e6, each X T and T^4 M, four (n, n) products. SOAP refreshes an eigenbasis with one power
# step (one product) and a QR (the profile's ``qr``). Both blocks are capped at 1024 (max_preconditioner_dim).
ROOT_STEPS = 20
ROOT_PRODUCTS = 4
MAX_PRECONDITIONER_DIM = 1024
NS_STEPS = 5

# Kernels of Muon's eager step per Newton–Schulz stack besides its products (matrixopt.optim.layout.
# orthogonalized_momentum_step): the fused momentum pass that packs the stack, the Frobenius normalization and
# the fused update pass
MUON_STACK_LAUNCHES = 3
HOST_LAUNCH = 190e-6
"""Seconds of host time per kernel of an eager Muon step, where a profile has no ``host_launch``: the H100's,
from ``docs/results/moe/scale_moe-2b_ep2_16k_eager_2xh100.json`` (DDP with expert parallelism 2, the Muon step
eager: 46.9 ms of host time on the slower rank for the 248 launches :func:`muon_launches` counts on its
matrices; the 4.1 ms of host the same step took replayed from a CUDA graph are not taken out). It holds the
Python of the ``ns_step`` dispatch and the Triton launchers, not the GPU's own launch latency."""

CALIBRATION_STACKS = ((256, 64), (512, 32), (768, 24), (1024, 16), (2048, 8), (4096, 4), (8192, 1))
"""``(s, b)``: the stacks ``matrixopt plan --calibrate`` times each product table on, on CUDA
(:data:`matrixopt.distributed.calibrate.CUDA_SHAPES`): ``(b, s, s) @ (b, s, 4 s)``, ``8 b s^3`` FLOPs per call."""


# ----------------------------------------------------------------------------------------------------------
# device profile


@dataclass(frozen=True, kw_only=True)
class Link:
    """One link class in the α–β model."""

    latency: float
    """α: seconds per message step."""
    bandwidth: float
    """1/β: bytes/s per GPU and direction."""

    def __post_init__(self) -> None:
        if not (0 <= self.latency < math.inf):
            raise ValueError(f"link latency must be finite and >= 0 seconds, got {self.latency!r}")
        if not (0 < self.bandwidth < math.inf):
            raise ValueError(f"link bandwidth must be finite and > 0 bytes/s, got {self.bandwidth!r}")


NETWORKS: dict[str, Link] = {
    "ib-400g": Link(latency=8e-6, bandwidth=400e9 / 8),  # one 400 Gb/s InfiniBand NDR NIC per GPU
    "ib-200g": Link(latency=8e-6, bandwidth=200e9 / 8),  # HDR
    "ib-800g": Link(latency=8e-6, bandwidth=800e9 / 8),  # XDR
    "roce-400g": Link(latency=12e-6, bandwidth=400e9 / 8),
    "eth-100g": Link(latency=25e-6, bandwidth=100e9 / 8),
}
"""Nominal inter-node links by name (``--network``): the NIC's line rate per GPU, and a latency assumed for one
NCCL message step across the fabric."""

Table = tuple[tuple[float, float], ...]
_TABLES = ("gemm", "syrk", "fp32_gemm", "qr", "elementwise")
# -> the table used where one is absent (tf32_gemm: at half its rate, DeviceProfile.seconds)
_OPTIONAL_TABLES = {"fused_adamw": "elementwise", "sym_mul": "gemm", "tf32_gemm": "gemm"}


def _check_table(name: str, table: Any) -> Table:
    try:
        points = tuple((float(x), float(r)) for x, r in table)
    except (TypeError, ValueError):
        raise ValueError(f"profile {name!r} must be a list of [size, rate] pairs, got {table!r:.80}") from None
    if not points:
        raise ValueError(f"profile {name!r} has no points")
    sizes = [x for x, _ in points]
    if sizes != sorted(sizes) or len(set(sizes)) != len(sizes):
        raise ValueError(f"profile {name!r} sizes must be strictly ascending, got {sizes}")
    if not all(0 < x < math.inf and 0 < r < math.inf for x, r in points):
        raise ValueError(f"profile {name!r} sizes and rates must be finite and > 0")
    return points


def _rate_at(points: Table, x: float) -> float:
    """The rate at ``x`` inside the table's span, interpolated linearly in log ``x``."""
    xs = [p for p, _ in points]
    i = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    (x0, r0), (x1, r1) = points[i - 1], points[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return r0 + t * (r1 - r0)


def _interpolate(points: Table, size: float) -> float:
    """Seconds of one call of ``size`` by the table's rates (module docstring)."""
    if size <= points[0][0]:
        return points[0][0] / points[0][1]  # launch-bound floor
    if size >= points[-1][0]:
        return size / points[-1][1]
    return size / _rate_at(points, size)


def width_rates(points: Table) -> Table | None:
    """``((s, rate), ...)`` for a product table measured on :data:`CALIBRATION_STACKS` (its sizes are their
    ``8 b s^3``, to a part in a million), else None."""
    grid = [8.0 * b * s**3 for s, b in CALIBRATION_STACKS]
    if len(points) != len(grid) or any(abs(x / g - 1) > 1e-6 for (x, _), g in zip(points, grid)):
        return None
    return tuple((float(s), r) for (s, _), (_, r) in zip(CALIBRATION_STACKS, points))


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """A device's achieved rates and links; see the module docstring for the JSON format. Checks itself."""

    name: str
    device: str
    source: str
    """"nominal" (from data sheets and stated assumptions) or "measured" (``matrixopt plan --calibrate``)."""
    peak_flops: float
    """The data sheet's dense bf16 matmul FLOP/s, which model FLOPs utilization (MFU) is quoted against."""
    memory_bytes: float
    gpus_per_node: int
    gemm: Table
    syrk: Table
    fp32_gemm: Table
    qr: Table
    elementwise: Table
    links: dict[str, Link]
    fused_adamw: Table | None = None
    sym_mul: Table | None = None
    tf32_gemm: Table | None = None
    host_launch: float = HOST_LAUNCH
    """Seconds of host time per kernel of an eager optimizer step (:func:`muon_host_time`)."""
    notes: str = ""
    env: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"profile source must be one of {SOURCES}, got {self.source!r}")
        if not (0 < self.peak_flops < math.inf):
            raise ValueError(f"profile peak_flops must be finite and > 0, got {self.peak_flops!r}")
        if not self.memory_bytes > 0:
            raise ValueError(f"profile memory_bytes must be > 0, got {self.memory_bytes!r}")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"profile gpus_per_node must be an int >= 1, got {self.gpus_per_node!r}")
        for name in _TABLES:
            object.__setattr__(self, name, _check_table(name, getattr(self, name)))
        for name in _OPTIONAL_TABLES:
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _check_table(name, getattr(self, name)))
        if (isinstance(self.host_launch, bool) or not isinstance(self.host_launch, (int, float))
                or not 0 <= self.host_launch < 1):
            raise ValueError(f"profile host_launch must be seconds per launch in [0, 1), got {self.host_launch!r}")
        missing = {"intra", "inter"} - set(self.links)
        if missing:
            raise ValueError(f"profile links need 'intra' and 'inter', missing {sorted(missing)}")

    # -- rates ------------------------------------------------------------------------------------------
    def seconds(self, table: str, size: float, width: int | None = None) -> float:
        """Seconds of one call of ``size`` (FLOPs, or bytes for ``elementwise``) from the named table. ``width``:
        the matrices' short side, for a product; where the table is on the calibration's grid
        (:func:`width_rates`), the call runs no faster than the table's rate at that width (module docstring)."""
        points: Table = getattr(self, table)
        if points is None:  # an optional table not measured: the rate of what it refines
            if table == "tf32_gemm":  # TF32 tensor cores: half the bf16 rate on the data sheets
                return 2 * self.seconds("gemm", size, width)
            points = getattr(self, _OPTIONAL_TABLES[table])
        if size <= 0:
            return 0.0
        by_size = _interpolate(points, size)
        widths = width_rates(points) if width is not None else None
        if widths is None:
            return by_size
        w = min(max(float(width), widths[0][0]), widths[-1][0])  # clamped to the grid's widths
        return max(by_size, size / _rate_at(widths, w))

    def host_seconds(self, launches: float) -> float:
        """Seconds the host takes to issue ``launches`` kernels of an eager step (``host_launch`` each)."""
        return launches * self.host_launch

    def link(self, group_size: int, stride: int = 1, gpus_per_node: int | None = None) -> Link:
        """The link a group of ``group_size`` ranks ``stride`` apart crosses: ``intra`` if it fits in a node."""
        per_node = gpus_per_node or self.gpus_per_node
        return self.links["intra"] if (group_size - 1) * stride < per_node else self.links["inter"]

    def with_network(self, network: Link) -> DeviceProfile:
        """This profile with another inter-node link."""
        return DeviceProfile(**{**self._fields(), "links": {**self.links, "inter": network}})

    # -- JSON -------------------------------------------------------------------------------------------
    def _fields(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    def to_dict(self) -> dict[str, Any]:
        d = self._fields()
        d["links"] = {k: asdict(v) for k, v in self.links.items()}
        for name in _TABLES:
            d[name] = [list(p) for p in d[name]]
        for name in _OPTIONAL_TABLES:
            if d[name] is None:
                del d[name]
            else:
                d[name] = [list(p) for p in d[name]]
        return {"format": FORMAT, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "profile") -> DeviceProfile:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"{where} is not a device profile: expected \"format\": \"{FORMAT}\", got {got!r}")
        fields = dict(d)
        fields.pop("format")
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{where} has unknown keys {sorted(unknown)}")
        try:
            fields["links"] = {k: Link(**v) for k, v in fields.get("links", {}).items()}
            return cls(**fields)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> DeviceProfile:
        """Read a profile JSON; ValueError naming the file and what is wrong with it."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise ValueError(f"cannot read device profile {path}: {e.strerror or e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"device profile {path} is not valid JSON ({e}); rerun matrixopt plan --calibrate "
                             f"--out {path} or pass a shipped profile") from None
        return cls.from_dict(data, where=f"device profile {path}")

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON, one ``[size, rate]`` point per line."""
        text = json.dumps(self.to_dict(), indent=1)
        text = re.sub(r"\[\s+([-0-9.e+]+),\s+([-0-9.e+]+)\s+\]", r"[\1, \2]", text)
        Path(path).write_text(text + "\n")


PROFILES_DIR = Path(__file__).parent / "profiles"


def shipped_profile(name: str = "h100") -> DeviceProfile:
    """A profile shipped with the package (``h100``, ``h200``; see ``matrixopt/distributed/profiles/``)."""
    path = PROFILES_DIR / f"{name}.json"
    if not path.is_file():
        names = sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
        raise ValueError(f"no shipped profile {name!r}; shipped: {', '.join(names)} (or pass a JSON path)")
    return DeviceProfile.load(path)


MATMUL_EFFICIENCY = 0.8  # assumed achievable fraction of a data sheet's peak matmul rate (nominal profiles)


def roofline_table(peak: float, launch: float, sizes: Sequence[float]) -> Table:
    """``[[size, rate]]`` of calls that take ``launch + size / peak`` seconds: a nominal table for a device whose
    only figures are a peak rate and a launch overhead."""
    return tuple((float(s), s / (launch + s / peak)) for s in sizes)


def nominal_profile(*, name: str, device: str, matmul_flops: float, fp32_flops: float, hbm_bytes_per_s: float,
                    memory_bytes: float, nvlink_bytes_per_s: float, network: str, gpus_per_node: int = 8,
                    matmul_efficiency: float = MATMUL_EFFICIENCY, hbm_efficiency: float = 0.85, launch: float = 4e-6,
                    nvlink_latency: float = 3e-6, notes: str = "") -> DeviceProfile:
    """A profile from data-sheet figures: peak dense matmul FLOP/s (bf16; ``fp32_flops`` for float32), HBM and
    NVLink bandwidth (bytes/s per direction), memory, and a network from :data:`NETWORKS`. The achievable
    fractions (``matmul_efficiency``, ``hbm_efficiency``), the launch overhead of one call and NVLink's latency
    are assumptions, recorded in ``notes``; calibrate to replace them. A QR of ``(n, n)`` is assumed to take one
    launch per column (an unblocked panel factorization) besides its FLOPs at the fp32 rate."""
    flops = [2.0 ** k for k in range(24, 44)]  # 16 MFLOP .. 8.8 TFLOP per call
    nbytes = [2.0 ** k for k in range(12, 36)]  # 4 KB .. 34 GB per pass
    sides = [2 ** k for k in range(6, 14)]  # QR of 64 .. 8192
    qr = tuple((qr_flops(n), qr_flops(n) / (n * launch + qr_flops(n) / (matmul_efficiency * fp32_flops)))
               for n in sides)
    assumed = (f"assumed: {matmul_efficiency:g} of the peak matmul rate and {hbm_efficiency:g} of HBM bandwidth "
               f"achievable, {launch * 1e6:g} us per call (a QR: one call per column), NVLink latency "
               f"{nvlink_latency * 1e6:g} us, inter-node "
               f"link {network!r} at its line rate")
    return DeviceProfile(
        name=name, device=device, source="nominal", peak_flops=matmul_flops, memory_bytes=memory_bytes,
        gpus_per_node=gpus_per_node,
        gemm=roofline_table(matmul_efficiency * matmul_flops, launch, flops),
        syrk=roofline_table(matmul_efficiency * matmul_flops, launch, flops),
        fp32_gemm=roofline_table(matmul_efficiency * fp32_flops, launch, flops), qr=qr,
        elementwise=roofline_table(hbm_efficiency * hbm_bytes_per_s, launch, nbytes),
        links={"intra": Link(latency=nvlink_latency, bandwidth=nvlink_bytes_per_s), "inter": NETWORKS[network]},
        notes="; ".join(x for x in (notes, assumed) if x))


# ----------------------------------------------------------------------------------------------------------
# collectives


def collective_time(kind: str, nbytes: float, parts: int, link: Link) -> float:
    """Seconds of one collective over ``parts`` ranks on ``link`` (table in the module docstring); 0 for one
    rank or no bytes."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; use one of {COLLECTIVES}")
    if parts < 1:
        raise ValueError(f"a collective needs >= 1 rank, got {parts}")
    if parts == 1 or nbytes <= 0:
        return 0.0
    a, b, frac = link.latency, 1.0 / link.bandwidth, (parts - 1) / parts
    steps = math.ceil(math.log2(parts))
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (parts - 1) * a + frac * nbytes * b
    if kind == "all_reduce":
        return min(2 * (parts - 1) * a + 2 * frac * nbytes * b, 2 * steps * a + 2 * nbytes * b)
    return steps * a + nbytes * b  # broadcast


def link_from_all_reduce(parts: int, small_s: float, large_s: float, large_bytes: float) -> Link:
    """The link that makes :func:`collective_time` give the two measured all-reduces over ``parts >= 2`` ranks: a
    one-element one (``small_s``: the tree's ``2 ceil(log2 P)`` latencies) and one of ``large_bytes`` (``large_s``:
    the ring)."""
    if parts < 2:
        raise ValueError(f"a link is measured over >= 2 ranks, got {parts}")
    latency = small_s / (2 * math.ceil(math.log2(parts)))
    moving = max(large_s - 2 * (parts - 1) * latency, 1e-12)
    return Link(latency=latency, bandwidth=2 * (parts - 1) / parts * large_bytes / moving)


# ----------------------------------------------------------------------------------------------------------
# optimizer steps


def matrix_step_flops(optimizer: str, m: int, n: int, steps: int = NS_STEPS) -> float:
    """FLOPs of one step of ``optimizer`` on one ``(m, n)`` matrix, dense counts (2 per multiply-add); what the
    layer-wise balancer packs on.

    - muon: Newton–Schulz as Muon computes it (:func:`matrixopt.linalg.ortho.newton_schulz_flops`);
    - mop: an SVD, about ``14 l s^2`` (Golub & Van Loan, Table 8.6.1: R-SVD, U and V wanted);
    - shampoo: factor updates and preconditioning ``4 m n (m + n)`` plus roots ``~10 (m^3 + n^3)``;
    - soap: Shampoo's plus projecting into and out of the eigenbasis, ``4 m n (m + n)``.
    """
    s, l = min(m, n), max(m, n)
    if optimizer == "muon":
        return newton_schulz_flops(m, n, steps)
    if optimizer == "mop":
        return 14 * l * s * s
    shampoo = 4 * m * n * (m + n) + 10 * (m**3 + n**3)
    if optimizer == "shampoo":
        return shampoo
    if optimizer == "soap":
        return shampoo + 4 * m * n * (m + n)
    raise ValueError(f"no FLOP count for optimizer {optimizer!r}; use muon, mop, shampoo or soap")


def newton_schulz_time(profile: DeviceProfile, batch: int, m: int, n: int, steps: int = NS_STEPS,
                       method: str = "auto", *, eager: bool = False) -> float:
    """Seconds of ``steps`` Newton–Schulz iterations on a ``(batch, m, n)`` bf16 stack, product by product as
    :func:`matrixopt.linalg.ortho.newton_schulz` runs them, each product at most at the rate of its width
    ``min(m, n)`` (module docstring). Replayed from a CUDA graph ``auto`` takes the Gram form by aspect alone;
    launched eagerly (``eager``: a layer-wise or FSDP2 owner's step, TP Newton–Schulz) only for stacks of enough
    work (:func:`~matrixopt.linalg.ortho.uses_gram`), as the dispatcher does. The FLOPs add up to
    :func:`~matrixopt.linalg.ortho.newton_schulz_flops`."""
    if batch == 0:
        return 0.0
    s, l = min(m, n), max(m, n)
    gram = profile.seconds("syrk", 2.0 * batch * s * s * l, s)  # X X^T
    square = profile.seconds("sym_mul", 2.0 * batch * s**3, s)  # (s, s) @ (s, s), both symmetric
    apply = profile.seconds("gemm", 2.0 * batch * s * s * l, s)  # (s, s) @ (s, l)
    if not uses_gram(method, batch, s, l, eager_cuda=eager):
        return steps * (gram + square + apply)
    return sum(gram + (4 * k - 3) * square + apply for k in gram_phases(steps))


def batched_newton_schulz_time(profile: DeviceProfile, count: int, m: int, n: int, steps: int = NS_STEPS,
                                method: str = "auto", *, eager: bool = False) -> float:
    """:func:`newton_schulz_time` of ``count`` ``(m, n)`` matrices as the optimizers batch them: stacks of at most
    :data:`~matrixopt.optim.layout.BUCKET_NUMEL` values (a larger matrix alone), each its own iteration."""
    per = max(1, BUCKET_NUMEL // max(1, m * n))
    full, rest = divmod(count, per)
    return (full * newton_schulz_time(profile, per, m, n, steps, method, eager=eager)
            + newton_schulz_time(profile, rest, m, n, steps, method, eager=eager))


def newton_schulz_launches(batch: int, m: int, n: int, steps: int = NS_STEPS, method: str = "auto") -> int:
    """Kernels one eager Newton–Schulz call on a ``(batch, m, n)`` stack launches for its products, as
    :func:`matrixopt.linalg.ortho.newton_schulz_short_side` runs it on CUDA (``auto`` takes the Gram form eagerly
    only for large stacks, :func:`~matrixopt.linalg.ortho.uses_gram`): the standard form three per step (the
    Gram product, ``b A + c A^2`` and ``a X + B X``); the Gram form per phase of ``k`` steps the Gram matrix, four
    per step but the last (``Z``, ``R (a I + Z)``, the new ``R`` and ``Q``) and the last step's ``Z`` and ``Q Y``
    (and ``Q Z`` after the phase's first step)."""
    if batch == 0:
        return 0
    s, l = min(m, n), max(m, n)
    if not uses_gram(method, batch, s, l, eager_cuda=True):
        return 3 * steps
    return sum(1 + 4 * (k - 1) + (2 if k == 1 else 3) for k in gram_phases(steps))


TP_GATHER_LAUNCHES = 5
"""Kernels a rank launches around ``duplicated`` TP Newton–Schulz's iteration (:func:`matrixopt.distributed.tp.
tp_newton_schulz`): the padded buffer and its fill, the all-gather, the concatenation and its own columns of the
result copied out."""
TP_NORMALIZE_LAUNCHES = 13
"""Kernels a rank launches around ``distributed`` TP Newton–Schulz's steps (:func:`matrixopt.distributed.tp.
distributed_newton_schulz`) on a bf16 stack: the float32 copy, the max-abs (two), its all-reduce, its clamp and the
scaling, the squares, their sum and its all-reduce, the square root, its clamp, the normalization and the cast into
the iteration dtype."""
TP_STEP_LAUNCHES = 4
"""Kernels per step of ``distributed`` TP Newton–Schulz: the Gram rows, their all-reduce, ``b A + c A^2`` and
``a X + B X``."""


def tp_newton_schulz_launches(mode: str, batch: int, rows: int, cols: int, parts: int, steps: int = NS_STEPS,
                              method: str = "auto") -> int:
    """Kernels (collectives included) one rank launches for TP Newton–Schulz of a ``(batch, rows, cols)`` stack
    whose ``cols`` (the contracted dim) are split over ``parts`` ranks, in ``mode``: ``duplicated`` iterates on
    the gathered matrices (:func:`newton_schulz_launches` of the whole stack, :data:`TP_GATHER_LAUNCHES`),
    ``distributed`` runs the standard form's steps over the shards (:data:`TP_STEP_LAUNCHES` each,
    :data:`TP_NORMALIZE_LAUNCHES`), ``blockwise`` iterates on its own shard alone."""
    if batch == 0:
        return 0
    if mode == "duplicated":
        return newton_schulz_launches(batch, rows, cols, steps, method) + TP_GATHER_LAUNCHES
    if mode == "distributed":
        return TP_NORMALIZE_LAUNCHES + TP_STEP_LAUNCHES * steps
    if mode == "blockwise":
        return newton_schulz_launches(batch, rows, -(-cols // parts), steps, method)
    raise ValueError(f"unknown TP Newton–Schulz mode {mode!r}; use duplicated, distributed or blockwise")


def muon_launches(groups: Sequence[Shapes], steps: int = NS_STEPS, method: str = "auto", *,
                  tp_mode: str | None = None, parts: int = 1) -> int:
    """Kernels Muon's eager step launches on ``groups``: per stack of at most
    :data:`~matrixopt.optim.layout.BUCKET_NUMEL` values (as :func:`batched_newton_schulz_time` splits them) its
    Newton–Schulz products and :data:`MUON_STACK_LAUNCHES`. ``tp_mode``: the groups are TP-sharded over ``parts``
    ranks along their ``n`` (the contracted dim), each stack one :func:`tp_newton_schulz_launches` call on this
    rank's shards."""
    total = 0
    for g in groups:
        per = max(1, BUCKET_NUMEL // max(1, g.m * g.n // parts))
        for b in [per] * (g.count // per) + ([g.count % per] if g.count % per else []):
            ns = (newton_schulz_launches(b, g.m, g.n, steps, method) if tp_mode is None
                  else tp_newton_schulz_launches(tp_mode, b, g.m, g.n, parts, steps, method))
            total += ns + MUON_STACK_LAUNCHES
    return total


def muon_host_time(profile: DeviceProfile, groups: Sequence[Shapes], steps: int = NS_STEPS,
                   method: str = "auto") -> float:
    """Seconds the host takes to issue Muon's eager step on ``groups`` (:func:`muon_launches` times the profile's
    ``host_launch``); the step takes at least this long (module docstring)."""
    return profile.host_seconds(muon_launches(groups, steps, method))


@dataclass(frozen=True)
class Shapes:
    """``count`` matrices of shape ``(m, n)``, stepped as one stack."""

    m: int
    n: int
    count: int

    @property
    def numel(self) -> int:
        return self.m * self.n * self.count


def _blocks(dim: int) -> list[int]:
    k = -(-dim // MAX_PRECONDITIONER_DIM)
    return [dim // k + (i < dim % k) for i in range(k)]


def matrix_step_time(profile: DeviceProfile, optimizer: str, groups: Sequence[Shapes], *,
                     ns_steps: int = NS_STEPS, precondition_frequency: int = 10, adamw_numel: int = 0,
                     check: bool = False, root_method: str = "newton", matmul_precision: str = "fp32",
                     eager: bool = False) -> float:
    """Seconds of one step of ``optimizer`` ("muon", "shampoo", "soap" or "adamw") on the matrices ``groups`` of
    one rank, each group one stack, plus the step's elementwise passes (one fused pass over all of them).
    Shampoo's roots and SOAP's eigenbases are refreshed every ``precondition_frequency`` steps; their cost is
    amortized over the period. Shampoo's ``root_method``: "newton" (the coupled iteration's products) or
    "eigenbasis" (SOAP's refresh of a basis, whose power step also gives the eigenvalue estimates, and a product
    forming the root).
    ``matmul_precision="tf32"``: the factor products, the preconditioning or projections and SOAP's power step at
    the TF32 rate (the profile's ``tf32_gemm``, else half the bf16 ``gemm`` rate); Shampoo's roots stay fp32 (the
    optimizers' own rule). ``"bf16"``: the step's products (factors, preconditioning, projections)
    at the bf16 ``gemm`` rate, the refresh's as under ``"tf32"``.

    ``adamw_numel``: elements of the matrix optimizer's AdamW groups (vectors, tables), stepped on a side stream
    beside the matrix groups, so their pass counts only where it outlasts the matrix products:
    ``passes + max(products, adamw)`` (module docstring). ``check``: the step runs its own non-finite check, one
    read of every gradient (:data:`CHECK_BYTES`), as it does when not handed the clip's norms. ``eager``: Muon's
    step launched eagerly, not replayed from a CUDA graph (:func:`newton_schulz_time`)."""
    numel = sum(g.numel for g in groups)
    checked = profile.seconds("elementwise", CHECK_BYTES * (numel + adamw_numel)) if check else 0.0
    side = profile.seconds("elementwise", ADAMW_BYTES * adamw_numel)
    if optimizer == "adamw":  # torch's fused AdamW on every parameter
        return profile.seconds("fused_adamw", ADAMW_BYTES * (numel + adamw_numel)) + checked
    if optimizer == "muon":
        t = sum(batched_newton_schulz_time(profile, g.count, g.m, g.n, ns_steps, eager=eager) for g in groups)
        return checked + max(t, side) + profile.seconds("elementwise", MUON_BYTES * numel)
    if optimizer not in ("shampoo", "soap"):
        raise ValueError(f"no step-time model for optimizer {optimizer!r}; use muon, adamw, shampoo or soap")
    if precondition_frequency < 1:
        raise ValueError(f"precondition_frequency must be >= 1, got {precondition_frequency}")
    every, refresh, block_bytes = _preconditioner_products(profile, optimizer, groups, root_method, matmul_precision)
    per_param = SHAMPOO_BYTES if optimizer == "shampoo" else SOAP_BYTES
    products = every + refresh / precondition_frequency
    return checked + max(products, side) + profile.seconds("elementwise", per_param * numel + block_bytes)


def refresh_time(profile: DeviceProfile, optimizer: str, groups: Sequence[Shapes], *, precondition_frequency: int = 10,
                 root_method: str = "newton", matmul_precision: str = "fp32") -> float:
    """Seconds per step of Shampoo's or SOAP's refresh on ``groups`` amortized over ``precondition_frequency``
    steps: the part of :func:`matrix_step_time` the roots or eigenbases take."""
    if precondition_frequency < 1:
        raise ValueError(f"precondition_frequency must be >= 1, got {precondition_frequency}")
    return _preconditioner_products(profile, optimizer, groups, root_method, matmul_precision)[1] / \
        precondition_frequency


def _preconditioner_products(profile: DeviceProfile, optimizer: str, groups: Sequence[Shapes], root_method: str,
                             matmul_precision: str) -> tuple[float, float, float]:
    """``(seconds of every step's products, seconds of one whole refresh, bytes of the per-block passes)`` of
    Shampoo or SOAP on ``groups`` (:func:`matrix_step_time`)."""
    check_root_method(root_method)
    check_matmul_precision(matmul_precision)
    newton = optimizer == "shampoo" and root_method == "newton"

    def product(flops: float, width: int, fp32: bool = False, step: bool = False) -> float:
        if fp32 or matmul_precision == "fp32":
            return profile.seconds("fp32_gemm", flops, width)
        if step and matmul_precision == "bf16":
            return profile.seconds("gemm", flops, width)
        return profile.seconds("tf32_gemm", flops, width)

    every, refresh, block_bytes = 0.0, 0.0, 0.0
    for g in groups:
        for mb in _blocks(g.m):
            for nb in _blocks(g.n):
                block_bytes += g.count * block_pass_bytes(optimizer, mb, nb)
                pair = 2.0 * g.count * mb * nb * (mb + nb)  # L += G G^T and R += G^T G, or one product by each
                passes = 2 if optimizer == "shampoo" else 3  # factors, preconditioning (, projection back)
                every += passes * product(pair, min(mb, nb), step=True)
                for k in (mb, nb):
                    cube = 2.0 * g.count * k**3
                    if newton:
                        refresh += ROOT_STEPS * ROOT_PRODUCTS * product(cube, k, fp32=True)
                    else:  # the power step's product and the QR; Shampoo's roots: the root's product too.
                        # Shampoo keeps the power step at fp32 accuracy: under TF32 three TF32 products
                        # (matrixopt.linalg.roots.split_tf32_bmm)
                        refresh += g.count * profile.seconds("qr", qr_flops(k))
                        if optimizer == "shampoo":
                            accurate = product(cube, k) if matmul_precision == "fp32" else 3 * product(cube, k)
                            refresh += accurate + product(cube, k)
                        else:
                            refresh += product(cube, k)
    return every, refresh, block_bytes


def qr_flops(n: int) -> float:
    """FLOPs of the QR factorization of an ``(n, n)`` matrix with Q formed: ``8/3 n^3`` (Golub & Van Loan, 5.2)."""
    return 8.0 / 3.0 * n**3


def preconditioner_state_bytes(optimizer: str, m: int, n: int, root_method: str = "newton",
                               matmul_precision: str = "fp32") -> int:
    """Optimizer state of one ``(m, n)`` matrix in bytes (fp32): Muon's momentum, AdamW's two moments, or
    Shampoo's and SOAP's per-element state plus, per factor of each block, the ``(k, k)`` factor and root, or
    factor and eigenbasis (Shampoo with ``root_method="eigenbasis"``: its basis too), all fp32, and the stack of
    its root or basis the step keeps for its products (:meth:`matrixopt.optim.shampoo.KroneckerOptimizer.
    _step_stack`) in their operand dtype: bf16 under ``matmul_precision="bf16"``, else fp32."""
    base = STATE_BYTES[optimizer] * m * n
    if optimizer not in ("shampoo", "soap"):
        return base
    kept = 2 if check_matmul_precision(matmul_precision) == "bf16" else 4
    per_factor = 4 * (3 if optimizer == "shampoo" and check_root_method(root_method) == "eigenbasis" else 2) + kept
    return base + sum(per_factor * (mb * mb + nb * nb) for mb in _blocks(m) for nb in _blocks(n))


def check_root_method(root_method: str) -> str:
    """``root_method`` if Shampoo takes it, else ValueError."""
    if root_method not in ROOT_METHODS:
        raise ValueError(f"Unknown root_method {root_method!r}; use one of {ROOT_METHODS}")
    return root_method


def check_matmul_precision(precision: str) -> str:
    """``precision`` if Shampoo and SOAP take it as ``matmul_precision``, else ValueError."""
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"Invalid matmul_precision: {precision!r} (use one of {MATMUL_PRECISIONS})")
    return precision


# ----------------------------------------------------------------------------------------------------------
# tensor-parallel Newton–Schulz


TP_GRAM_CHUNKS = 1
"""Row blocks of the Gram matrix whose all-reduces the TP ``distributed`` mode launches one by one behind the next
block's product, by default. Measured with ``matrixopt bench tp`` (``docs/results/distributed/tp_ns_*.json``, the
``overlap`` tables): over the 12 cases on 2 and 4 H200s and 2 H100s, 4 blocks saved at most 3% and cost up to
21% (the smaller products run slower than the whole one), so the Gram matrix is one product and one all-reduce."""


def tp_ns_times(rows: int, cols: int, parts: int, *, batch: int = 1, steps: int = NS_STEPS, itemsize: int = 2,
                chunks: int = TP_GRAM_CHUNKS, link: Link, ns: Callable[[int, int, int], float],
                gemm: Callable[[float], float]) -> dict[str, float]:
    """Seconds of the three TP Newton–Schulz modes of :mod:`matrixopt.distributed.tp` for ``batch`` matrices of
    ``(rows, cols)`` whose columns (the contracted dim) are split over ``parts`` ranks on ``link``.

    ns(s, l, batch): seconds of a whole local Newton–Schulz on ``(batch, s, l)``; gemm(flops): seconds of one
    product.

    - duplicated: all-gather of the matrix, then the whole iteration on every rank;
    - distributed: two one-element all-reduces (max-abs and norm), then per step the local Gram product, its
      all-reduce of ``rows^2`` elements and the local rest (``A A`` and ``B X``), always in the standard form and
      every product a plain ``torch.bmm``/``baddbmm`` (:func:`matrixopt.distributed.tp.gram_rows` computes both
      triangles of the Gram matrix), so all three at the ``gemm`` rate. With ``chunks > 1`` the Gram all-reduce
      runs in row blocks behind the Gram compute, so only the longer of the two counts;
    - blockwise: the local shard alone, no communication.
    """
    local_cols = -(-cols // parts)
    gather = collective_time("all_gather", batch * rows * cols * itemsize, parts, link)
    duplicated = gather + ns(min(rows, cols), max(rows, cols), batch)
    g = gemm(2.0 * batch * rows * rows * local_cols)
    rest = gemm(2.0 * batch * rows**3) + gemm(2.0 * batch * rows * rows * local_cols)
    reduce = collective_time("all_reduce", batch * rows * rows * itemsize, parts, link)
    per_step = rest + (max(g, reduce) if chunks > 1 else g + reduce)
    norms = 2 * collective_time("all_reduce", 4 * batch, parts, link)
    distributed = norms + steps * per_step
    blockwise = ns(min(rows, local_cols), max(rows, local_cols), batch)
    return {"duplicated": duplicated, "distributed": distributed, "blockwise": blockwise}


# ----------------------------------------------------------------------------------------------------------
# memory


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds, by kind, at the larger of its two peaks (:attr:`total`): backward's start, every
    activation of the micro-batch live beside the gradients held through the forward (``grads``), and the optimizer
    step, the activations freed, with the step's gradients (``step_grads``) and its workspace (``buffers``)."""

    params: float
    grads: float
    """Gradients held while the activations are: what earlier micro-batches or steps leave allocated and what
    backward makes before it frees the first activations."""
    optimizer_state: float
    buffers: float
    """The optimizer step's workspace (Newton–Schulz stacks), allocated after backward."""
    activations: float
    step_grads: float
    """Gradients the optimizer step reads."""

    @property
    def total(self) -> float:
        held = self.params + self.optimizer_state
        return held + max(self.grads + self.activations, self.step_grads + self.buffers)

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}
