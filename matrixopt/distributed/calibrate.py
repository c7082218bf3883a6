"""Measure a device profile for the cost model (``matrixopt plan --calibrate --out profile.json``).

On each point the call is timed with :func:`matrixopt.device.time_ms` (CUDA events; replayed from a CUDA graph on
the GPU, as the trainer's Muon step runs), median of ``reps``, right after :data:`HEAT_S` seconds of the same call
on the GPU: a GPU at its power limit lowers its clock within a tenth of a second of large products, and training
holds it there (on an H200, 1.3B-sized bf16 products ran at about 765 TFLOP/s in a burst of ten and 645 after a
second of them), so the tables are the rates a step sustains, not a burst's:

- ``gemm``: ``(b, s, s) @ (b, s, 4 s)`` in the iteration dtype (bf16 on CUDA, fp32 on the CPU), the shape of
  Newton–Schulz's ``B X``; ``b`` grows with ``s`` shrinking so small shapes are measured as the stacks Muon runs;
- ``syrk``: the Gram product ``X X^T`` of a ``(b, s, 4 s)`` stack through :func:`matrixopt.kernels.ns_step.gram`
  (Triton SYRK or cuBLAS, whichever the dispatcher picks for a step replayed from a CUDA graph, as Muon's is),
  rate on the dense FLOPs;
- ``sym_mul``: the product of two symmetric ``(4 b, s, s)`` stacks through
  :func:`matrixopt.kernels.ns_step.sym_mul` (the square products of both Newton–Schulz forms; the SYRK's
  two-operand form where it is faster), rate on the dense FLOPs, the same FLOPs per width as ``gemm``;
- ``fp32_gemm``: the same products as ``gemm`` in float32 (IEEE), ``tf32_gemm`` on TF32 tensor cores (as
  Shampoo's and SOAP's ``matmul_precision="tf32"`` runs them; the CPU has none, so there the two agree);
- ``qr``: :func:`~matrixopt.linalg.roots.cholesky_qr` of a batch of ``QR_BATCH`` ``(n, n)`` float32 matrices,
  as SOAP's eigenbasis refresh runs it (eagerly), per matrix;
- ``elementwise``: ``c = a + b`` on fp32 vectors (3 passes of 4 bytes per element);
- ``fused_adamw``: ``torch.optim.AdamW(fused=True).step()`` on fp32 parameters (split into tensors of at most
  :data:`ADAMW_TENSOR` elements, as a model's are), counted at ``ADAMW_BYTES`` per element, timed eagerly as
  it runs in training (its learning rate is a float, so it is not captured in a graph);
- ``host_launch``: seconds of host time per kernel of Muon's eager step (the trainer's deferred check): for each
  parameter set of :data:`CUDA_HOST_SETS` (GPT-2-small's and the 1.3B's matrices, QKV fused; one tiny set on the
  CPU, whose "kernels" run on the host), the median time ``step()`` takes to return, the queue drained before
  each, over the kernels :func:`~matrixopt.distributed.cost.muon_launches` counts on those matrices; the
  geometric mean over the sets;
- ``peak_flops`` (the data sheet's, for MFU) is copied from ``base``;
- ``links``: with a process group of several ranks, a one-element all-reduce (latency) and a large one
  (bandwidth, from the ring formula) on ``intra``; the group is assumed to lie inside one node. ``inter`` and,
  without a group, ``intra`` are kept from ``base`` (the nominal profile by default) and ``notes`` say so.

The output has the format of the shipped profiles (:class:`~matrixopt.distributed.cost.DeviceProfile`), with
``"source": "measured"`` and the environment it was measured in.
"""

from __future__ import annotations

import platform
import statistics

import torch
import torch.distributed as dist

from matrixopt.device import describe, host_ms, host_pace, time_ms
from matrixopt.distributed import comm
from matrixopt.distributed.cost import (
    ADAMW_BYTES,
    DeviceProfile,
    Shapes,
    link_from_all_reduce,
    muon_launches,
    nominal_profile,
    qr_flops,
    shipped_profile,
)
from matrixopt.kernels.ns_step import for_cuda_graphs, gram, sym_mul
from matrixopt.linalg.roots import cholesky_qr
from matrixopt.optim.muon import Muon
from matrixopt.optim.shampoo import cuda_matmul_precision

# (s, b): Newton–Schulz-shaped stacks; the CPU list stays small so calibrating in a test takes seconds.
CUDA_SHAPES = ((256, 64), (512, 32), (768, 24), (1024, 16), (2048, 8), (4096, 4), (8192, 1))
CPU_SHAPES = ((32, 4), (64, 4), (128, 2))
CUDA_QR = (256, 512, 1024, 2048)
CPU_QR = (32, 64, 128)
QR_BATCH = 16  # refreshes factor batches of matrices: the per-matrix time of one batch
CUDA_ELEMENTS = tuple(2**k for k in range(14, 30, 2))
CPU_ELEMENTS = (2**12, 2**16, 2**20)
HEAT_S = 0.5  # seconds of each call before it is timed (CUDA only)
ADAMW_TENSOR = 2**22  # a model's tensors are millions of elements: the fused step's chunking as it meets them


def _gpt_matrices(layers: int, d: int) -> tuple[Shapes, ...]:
    """A GPT's hidden matrices as Muon steps them, QKV fused: ``(3d, d)``, ``(d, d)``, ``(4d, d)``, ``(d, 4d)``."""
    return tuple(Shapes(m, n, layers) for m, n in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d)))


CUDA_HOST_SETS = (_gpt_matrices(12, 768), _gpt_matrices(24, 2048))  # GPT-2-small's, the 1.3B's
CPU_HOST_SETS = (_gpt_matrices(2, 8),)
HOST_STEPS = 10


def _rate_points(sizes_and_ms: list[tuple[float, float]]) -> list[list[float]]:
    """``[[size, size per second]]`` sorted by size, one point per size (the faster where sizes repeat)."""
    best: dict[float, float] = {}
    for size, ms in sizes_and_ms:
        best[size] = max(best.get(size, 0.0), size / (ms / 1e3))
    return [[s, best[s]] for s in sorted(best)]


def measure(device: torch.device, *, reps: int = 10, base: DeviceProfile | None = None,
            group: dist.ProcessGroup | None = None, heat_s: float | None = None) -> DeviceProfile:
    """A measured profile of ``device`` (and of ``group``'s links, where it has several ranks). Collective when a
    process group is initialized: every rank must call it. ``heat_s``: seconds each call runs before it is timed
    (default :data:`HEAT_S` on CUDA, none elsewhere); the collectives are never heated."""
    base = base or shipped_profile("h100")
    cuda = device.type == "cuda"
    heat_s = (HEAT_S if cuda else 0.0) if heat_s is None else heat_s
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes, elements = (CUDA_SHAPES, CUDA_ELEMENTS) if cuda else (CPU_SHAPES, CPU_ELEMENTS)
    gen = torch.Generator(device).manual_seed(0)

    def timed(fn, graph: bool = cuda, heat: bool = True) -> float:
        return time_ms(fn, device, reps=reps, warmup=2, graph=graph, heat_s=heat_s if heat else 0.0)["median"]

    gemm, syrk, sym, fp32, tf32 = [], [], [], [], []
    for s, b in shapes:
        for dt, precision, out in ((dtype, "fp32", gemm), (torch.float32, "fp32", fp32),
                                   (torch.float32, "tf32", tf32)):
            A = torch.randn(b, s, s, device=device, dtype=dt, generator=gen)
            X = torch.randn(b, s, 4 * s, device=device, dtype=dt, generator=gen)
            with cuda_matmul_precision(precision):  # float32 products in IEEE or on TF32 tensor cores
                out.append((2.0 * b * s * s * 4 * s, timed(lambda A=A, X=X: torch.bmm(A, X))))
        X = torch.randn(b, s, 4 * s, device=device, dtype=dtype, generator=gen)
        S = torch.randn(4 * b, s, s, device=device, dtype=dtype, generator=gen)
        S = S + S.mT  # symmetric to the bit, as the products of Newton–Schulz are
        # the dispatcher decides each shape for a replayed step in the warm-up (during the capture it could not)
        with for_cuda_graphs():
            syrk.append((2.0 * b * s * s * 4 * s, timed(lambda X=X: gram(X))))
            sym.append((2.0 * 4 * b * s**3, timed(lambda S=S: sym_mul(S, S, 1.0, 0.5))))
    qr = []
    for n in (CUDA_QR if cuda else CPU_QR):
        A = torch.randn(QR_BATCH, n, n, device=device, generator=gen)
        qr.append((qr_flops(n), timed(lambda A=A: cholesky_qr(A), graph=False) / QR_BATCH))
    elementwise = []
    for n in elements:
        # two inputs: c = a + a reads a once, and would count its 4 bytes per element twice
        a, b, c = torch.ones(n, device=device), torch.ones(n, device=device), torch.empty(n, device=device)
        elementwise.append((12.0 * n, timed(lambda a=a, b=b, c=c: torch.add(a, b, out=c))))

    fused_adamw = [(ADAMW_BYTES * n, timed(_fused_adamw_step(n, device), graph=False)) for n in elements]
    host_launch = statistics.geometric_mean(
        _host_per_launch(groups, device) for groups in (CUDA_HOST_SETS if cuda else CPU_HOST_SETS))

    links, notes = dict(base.links), []
    world = comm.world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world > 1:
        tiny = torch.zeros(1, device=device)
        big = torch.zeros((64 << 20 if cuda else 1 << 20) // 4, device=device)
        # collectives run eagerly, and are not heated: each rank would run its own number of heating calls, and
        # the ranks' collectives would pair up wrongly
        lat = timed(lambda: comm.all_reduce_sum(tiny, group), graph=False, heat=False) / 1e3
        t_big = timed(lambda: comm.all_reduce_sum(big, group), graph=False, heat=False) / 1e3
        worst = comm.all_reduce_max(torch.tensor([lat, t_big], dtype=torch.float64, device=device), group)
        lat, t_big = worst.tolist()
        links["intra"] = link_from_all_reduce(world, lat, t_big, big.numel() * 4)
        notes.append(f"intra link measured by all-reduce over {world} ranks; inter link from {base.name}")
    else:
        notes.append(f"links not measured (one rank): kept from {base.name}")
    memory = (torch.cuda.get_device_properties(device).total_memory if cuda else base.memory_bytes)
    env = {"device": describe(device), "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "dtype": str(dtype), "reps": reps, "world_size": world,
           "heat_s": heat_s, "host": host_pace(device)}
    return DeviceProfile(
        name=f"{describe(device)} (measured)", device=describe(device), source="measured", peak_flops=base.peak_flops,
        memory_bytes=float(memory), gpus_per_node=base.gpus_per_node,
        gemm=_rate_points(gemm), syrk=_rate_points(syrk), sym_mul=_rate_points(sym), fp32_gemm=_rate_points(fp32),
        tf32_gemm=_rate_points(tf32),
        qr=_rate_points(qr),
        elementwise=_rate_points(elementwise), fused_adamw=_rate_points(fused_adamw), links=links,
        host_launch=host_launch, notes="; ".join(notes), env=env)


def _host_per_launch(groups: tuple[Shapes, ...], device: torch.device) -> float:
    """Seconds of host time per kernel :func:`muon_launches` counts, for Muon's eager step on ``groups`` (random
    gradients, the trainer's deferred check): the median over :data:`HOST_STEPS` steps of the time ``step()``
    takes to return, the device's queue drained before each."""
    gen = torch.Generator(device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(g.m, g.n, device=device, generator=gen) * 0.02)
              for g in groups for _ in range(g.count)]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen) * 1e-3
    opt = Muon(params, lr=0.0, deferred_nonfinite=True)
    # three steps first: state, kernel choices, compilation
    return host_ms(opt.step, device, reps=HOST_STEPS, warmup=3)["median"] / 1e3 / muon_launches(groups)


def _fused_adamw_step(n: int, device: torch.device):
    """``step`` of a fused torch AdamW over ``n`` fp32 parameters with gradients, its state already made."""
    params = [torch.zeros(min(ADAMW_TENSOR, n - i), device=device, requires_grad=True)
              for i in range(0, n, ADAMW_TENSOR)]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    opt.step()  # the moments exist from here on
    return opt.step


NOMINAL: dict[str, dict] = {
    "h100": dict(name="h100-sxm-nominal", device="NVIDIA H100 SXM5 80GB", matmul_flops=989e12, fp32_flops=67e12,
                 hbm_bytes_per_s=3.35e12, memory_bytes=80e9, nvlink_bytes_per_s=450e9, network="ib-400g",
                 notes="data sheet: 989 TFLOP/s dense bf16, 67 TFLOP/s fp32, 3.35 TB/s HBM3, 80 GB, NVLink 4 at "
                       "450 GB/s per direction, one 400 Gb/s InfiniBand NIC per GPU, 8 GPUs per node"),
    "h200": dict(name="h200-sxm-nominal", device="NVIDIA H200 SXM 141GB", matmul_flops=989e12, fp32_flops=67e12,
                 hbm_bytes_per_s=4.8e12, memory_bytes=141e9, nvlink_bytes_per_s=450e9, network="ib-400g",
                 notes="data sheet: 989 TFLOP/s dense bf16, 67 TFLOP/s fp32, 4.8 TB/s HBM3e, 141 GB, NVLink 4 at "
                       "450 GB/s per direction, one 400 Gb/s InfiniBand NIC per GPU, 8 GPUs per node"),
}
"""Data-sheet figures of the shipped nominal profiles (``matrixopt/distributed/profiles/<name>.json`` is
``nominal(name)``): replace one with ``matrixopt plan --calibrate`` on the device."""


def nominal(name: str) -> DeviceProfile:
    """The nominal profile ``name`` (a key of :data:`NOMINAL`) built by
    :func:`~matrixopt.distributed.cost.nominal_profile`."""
    return nominal_profile(**NOMINAL[name])
