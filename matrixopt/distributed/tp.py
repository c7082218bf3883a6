r"""Tensor-parallel Newton–Schulz: orthogonalize a matrix whose rows or columns are split over a TP group.

Under tensor parallelism no rank holds the whole weight. Four modes (NVIDIA's Emerging-Optimizers design):

- ``duplicated``: all-gather the shards, every rank runs the full iteration and keeps its slice. One
  collective; P-fold redundant compute.
- ``distributed``: each rank keeps its shard. The shards are laid out so that the sharded dim is the
  contracted one, ``X = [X_1 | ... | X_P]`` (columns split), because then the Gram matrix is a sum of local
  products and the rest of the step is local::

      A   = sum_p X_p X_p^T            (r, r)   all-reduce over the TP group
      X_p <- a X_p + (b A + c A^2) X_p          local

  A weight sharded along its rows is transposed first, which can make ``r`` its long side (a warning says so).
  The Gram all-reduce can be chunked by row blocks (``chunks``): the all-reduce of each finished block is launched
  while the next block is computed, so communication hides behind compute. Measured, that rarely paid (smaller
  products run slower), so by default the Gram matrix is one product and one all-reduce.
- ``blockwise``: each shard is orthogonalized on its own. No communication, but the update depends on the TP
  size (it is the polar factor of each block, not of the matrix).
- ``auto``: duplicated or distributed per shape, from the shared cost model (:mod:`matrixopt.distributed.cost`)
  with a :class:`CostModel` measured once per group and device (link latency and bandwidth, matmul rate) and
  cached; the choice is logged once per shape.

Weights come as local shards plus ``partition_dim`` and a process group (Megatron style,
:func:`tp_newton_schulz`) or as DTensors with ``Shard(0)``/``Shard(1)`` on a TP mesh dim
(:func:`tp_newton_schulz_dtensor`). Collectives live in :mod:`matrixopt.distributed.comm`; the math
functions below take and return local tensors only.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Replicate, Shard

from matrixopt.device import time_ms
from matrixopt.distributed import comm
from matrixopt.distributed.cost import TP_GRAM_CHUNKS, Link, tp_ns_times
from matrixopt.linalg.ortho import NewtonSchulzConfig, newton_schulz_flops, newton_schulz_with

logger = logging.getLogger(__name__)

MODES = ("duplicated", "distributed", "blockwise", "auto")

# ----------------------------------------------------------------------------------------------------------
# math: pure functions on local tensors


def row_blocks(rows: int, chunks: int) -> list[tuple[int, int]]:
    """``[(r0, r1)]`` cutting ``rows`` into ``min(chunks, rows)`` near-equal consecutive blocks."""
    k = max(1, min(chunks, rows))
    edges = [rows * i // k for i in range(k + 1)]
    return list(zip(edges[:-1], edges[1:]))


def gram_rows(X: Tensor, r0: int, r1: int) -> Tensor:
    """Rows ``r0:r1`` of the Gram matrix: ``X[:, r0:r1] @ X^T``. X: ``(b, r, c)`` -> ``(b, r1 - r0, r)``."""
    return torch.bmm(X[:, r0:r1], X.mT)


def ns_apply(X: Tensor, A: Tensor, a: float, b: float, c: float) -> Tensor:
    """The rest of a Newton–Schulz step once the Gram matrix is known: ``a X + (b A + c A^2) X``.

    X: ``(batch, r, c)`` (a column block of the matrix suffices), A: ``(batch, r, r)``; same dtype."""
    B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A @ A, (batch, r, r)
    return torch.baddbmm(X, B, X, beta=a, alpha=1.0)  # (batch, r, c)


# ----------------------------------------------------------------------------------------------------------
# cost model


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """What ``auto`` mode needs to know about the machine. Measured by :func:`measure_cost_model`; pass one to
    force a choice (tests) or to skip the start-up measurement."""

    latency: float
    """Seconds of fixed cost per collective call."""
    bandwidth: float
    """Bus bandwidth in bytes/s: a ring all-reduce of B bytes over P ranks moves 2 (P-1)/P B per rank."""
    flops: float
    """Matmul rate in FLOP/s in the iteration dtype."""

    def __post_init__(self) -> None:
        for name in ("latency", "bandwidth", "flops"):
            v = getattr(self, name)
            if not (v >= 0 and v < float("inf")):
                raise ValueError(f"CostModel.{name} must be finite and >= 0, got {v}")
        if self.bandwidth == 0 or self.flops == 0:
            raise ValueError(f"CostModel bandwidth and flops must be > 0, got {self.bandwidth}, {self.flops}")


def mode_costs(rows: int, cols: int, parts: int, *, batch: int = 1, steps: int = 5, itemsize: int = 2,
               chunks: int = TP_GRAM_CHUNKS, cost: CostModel) -> dict[str, float]:
    """Estimated seconds of ``duplicated`` and ``distributed`` for ``batch`` matrices of ``(rows, cols)`` whose
    columns (the contracted dim) are split over ``parts`` ranks: the shared model's
    :func:`matrixopt.distributed.cost.tp_ns_times` with one matmul rate for every product and ``cost``'s link,
    its per-call latency (a one-element all-reduce, a tree of ``2 ceil(log2 P)`` message steps) spread over the
    steps. FLOPs: the standard form's counts of :mod:`matrixopt.linalg.ortho`."""
    alpha = cost.latency / (2 * math.ceil(math.log2(parts))) if parts > 1 else cost.latency
    times = tp_ns_times(rows, cols, parts, batch=batch, steps=steps, itemsize=itemsize, chunks=chunks,
                        link=Link(latency=alpha, bandwidth=cost.bandwidth),
                        ns=lambda s, l, b: newton_schulz_flops(s, l, steps, "standard", b) / cost.flops,
                        gemm=lambda flops: flops / cost.flops)
    return {mode: times[mode] for mode in ("duplicated", "distributed")}


_MEASURED: dict[tuple, CostModel] = {}


def _seconds(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds per call of ``fn`` after one warm-up call (``fn`` runs ``reps + 1`` times on every rank)."""
    return time_ms(fn, device, reps=reps, warmup=1)["median"] / 1e3


def measure_cost_model(group: ProcessGroup | None, device: torch.device) -> CostModel:
    """Time a matmul, a one-element all-reduce (latency) and a large all-reduce (bandwidth) on ``group``, once
    per (group ranks, device type); later calls return the cached model. Collective: every rank of the group
    must call it. Ranks agree on the slowest measurement, so they all make the same ``auto`` choices."""
    key = (comm.group_ranks(group), device.type)
    if key in _MEASURED:
        return _MEASURED[key]
    cuda = device.type == "cuda"
    n, nbytes, reps = (4096, 64 << 20, 10) if cuda else (256, 1 << 20, 5)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    mm = _seconds(lambda: a @ a, device, reps)
    tiny = torch.zeros(1, device=device)
    lat = _seconds(lambda: comm.all_reduce_sum(tiny, group), device, reps)
    big = torch.zeros(nbytes // 4, device=device)
    t_big = _seconds(lambda: comm.all_reduce_sum(big, group), device, reps)
    times = comm.all_reduce_max(torch.tensor([mm, lat, t_big], dtype=torch.float64, device=device), group)
    mm, lat, t_big = times.tolist()
    parts = comm.world_size(group)
    bw = 2 * (parts - 1) / parts * nbytes / max(t_big - lat, 1e-9)
    model = CostModel(latency=lat, bandwidth=bw, flops=2.0 * n**3 / mm)
    logger.info("tp cost model for %d ranks on %s: latency %.1f us, bandwidth %.2f GB/s, matmul %.1f TFLOP/s",
                parts, device.type, lat * 1e6, bw / 1e9, model.flops / 1e12)
    _MEASURED[key] = model
    return model


_LOGGED: set[tuple] = set()


def choose_mode(rows: int, cols: int, parts: int, *, batch: int, steps: int, itemsize: int, chunks: int,
                cost: CostModel) -> str:
    """``duplicated`` or ``distributed``, whichever :func:`mode_costs` says is faster. Logs each new choice."""
    costs = mode_costs(rows, cols, parts, batch=batch, steps=steps, itemsize=itemsize, chunks=chunks, cost=cost)
    mode = min(costs, key=costs.get)
    key = (rows, cols, parts, batch, steps, itemsize, chunks, cost)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("tp auto: %s for %d x (%d, %d) with the contracted dim over %d ranks (duplicated %.3g ms, "
                    "distributed %.3g ms)", mode, batch, rows, cols, parts, costs["duplicated"] * 1e3,
                    costs["distributed"] * 1e3)
    return mode


# ----------------------------------------------------------------------------------------------------------
# the modes on local shards


def gram_all_reduce(X: Tensor, group: ProcessGroup | None, chunks: int) -> Tensor:
    """``sum over ranks of X_p X_p^T`` for ``X``: ``(b, r, c_p)``; returns ``(b, r, r)``.

    Row block k of the Gram matrix is computed, its all-reduce launched asynchronously, and block k + 1 computed
    while it is in flight; ``chunks=1`` is the plain compute-then-communicate version."""
    blocks, handles = [], []
    for r0, r1 in row_blocks(X.size(-2), chunks):
        block = gram_rows(X, r0, r1)  # (b, r1 - r0, r)
        handles.append(comm.all_reduce_sum_async(block, group))
        blocks.append(block)
    for h in handles:
        h.wait()
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-2)


def distributed_newton_schulz(X: Tensor, group: ProcessGroup | None, config: NewtonSchulzConfig,
                              chunks: int = TP_GRAM_CHUNKS) -> Tensor:
    """Newton–Schulz of the matrix ``[X_1 | ... | X_P]`` whose column block ``X_p`` (``(b, r, c_p)``, any float
    dtype, ``c_p`` may be 0) this rank holds. Returns this rank's column block of the result, ``(b, r, c_p)``
    in ``config``'s iteration dtype. Normalizes by the global max-abs, then the global Frobenius norm, like
    :func:`matrixopt.linalg.ortho.newton_schulz`; always the standard form (``config.method`` is not used)."""
    X = X.float()
    # global max-abs first, as newton_schulz does, so the float32 sum of squares can neither overflow nor underflow
    peak = X.abs().amax(dim=(-2, -1)) if X.numel() else X.new_zeros(X.size(0))  # (b,)
    X = X / comm.all_reduce_max(peak, group).clamp_min(torch.finfo(torch.float32).tiny)[:, None, None]
    sq = comm.all_reduce_sum(X.square().sum(dim=(-2, -1)), group)  # (b,)
    X = (X / sq.sqrt().clamp_min(1e-30)[:, None, None]).to(config.iteration_dtype(X.device))
    for a, b, c in config.schedule:
        X = ns_apply(X, gram_all_reduce(X, group, chunks), a, b, c)
    return X


def tp_newton_schulz(local: Tensor, partition_dim: int, group: ProcessGroup | None = None, *,
                     config: NewtonSchulzConfig | None = None, mode: str = "auto", chunks: int = TP_GRAM_CHUNKS,
                     sizes: Sequence[int] | None = None, cost_model: CostModel | None = None) -> Tensor:
    """Newton–Schulz of a matrix split over ``group`` along ``partition_dim``; returns this rank's shard of the
    result (same shape and dtype as ``local``).

    local: ``(m_p, n)`` for ``partition_dim=0`` or ``(m, n_p)`` for ``partition_dim=1``, or a batch ``(b, ...)``
    of such shards (``partition_dim`` counts within each matrix). Shards are in group-rank order and may be
    uneven. sizes: every rank's size along ``partition_dim``; None all-gathers them (one tiny collective).
    mode: one of ``MODES``. chunks: Gram row blocks whose all-reduce overlaps compute (distributed mode; default
    :data:`~matrixopt.distributed.cost.TP_GRAM_CHUNKS`, one).
    cost_model: for ``auto``; None measures one (collective, once per group). config: the iteration (None: the
    defaults of :class:`~matrixopt.linalg.ortho.NewtonSchulzConfig`); its ``method`` applies to the modes that
    iterate on whole matrices, blockwise and duplicated. Every rank of the group must call this with the same
    arguments except ``local``."""
    if mode not in MODES:
        raise ValueError(f"Unknown TP Newton–Schulz mode {mode!r}; use one of {MODES}")
    if partition_dim not in (0, 1):
        raise ValueError(f"partition_dim is the sharded dim of each matrix, 0 (rows) or 1 (columns); got "
                         f"{partition_dim}")
    if local.ndim not in (2, 3):
        raise ValueError(f"tp_newton_schulz takes a (m, n) or (b, m, n) shard, got shape {tuple(local.shape)}")
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    config = config or NewtonSchulzConfig()
    parts = comm.world_size(group)
    if mode == "blockwise" or parts == 1:
        return newton_schulz_with(local, config) if local.numel() else local.clone()
    X = local.unsqueeze(0) if local.ndim == 2 else local  # (b, m, n)
    X = X.mT if partition_dim == 0 else X  # (b, r, c_p): the sharded dim is the contracted (last) one
    if sizes is None:
        sizes = comm.all_gather_sizes(X.size(-1), group, X.device)
    sizes = list(sizes)
    me = comm.rank(group)
    if len(sizes) != parts or sizes[me] != X.size(-1):
        raise ValueError(f"sizes {sizes} must list the {parts} ranks' shard sizes along partition_dim "
                         f"{partition_dim}, and this rank (group rank {me}) holds {X.size(-1)}")
    rows, cols = X.size(-2), sum(sizes)
    if mode == "auto":
        cost = cost_model or measure_cost_model(group, X.device)
        mode = choose_mode(rows, cols, parts, batch=X.size(0), steps=config.steps,
                           itemsize=config.iteration_dtype(X.device).itemsize, chunks=chunks, cost=cost)
    if mode == "duplicated":
        full = comm.all_gather_last_dim(X, sizes, group)  # (b, r, c)
        start = sum(sizes[:me])
        Y = newton_schulz_with(full, config)[..., start:start + sizes[me]]
    else:
        if rows > cols:
            warnings.warn(f"distributed TP Newton–Schulz contracts the sharded dim, so this ({rows}, {cols}) "
                          f"matrix (sharded along dim {partition_dim} of the weight) iterates on its long side: a "
                          f"{rows}x{rows} Gram instead of {cols}x{cols}. mode='duplicated' or 'auto' may be "
                          f"faster.", stacklevel=2)
        Y = distributed_newton_schulz(X, group, config, chunks)
    Y = Y.mT if partition_dim == 0 else Y
    Y = Y.to(local.dtype).contiguous()
    return Y.squeeze(0) if local.ndim == 2 else Y


# ----------------------------------------------------------------------------------------------------------
# DTensor entry point


def tp_shard_spec(X: DTensor, mesh_dim: int | str | None = None) -> tuple[int, ProcessGroup, list[int]]:
    """``(partition_dim, group, sizes)`` of a DTensor ``(m, n)`` or ``(b, m, n)`` sharded on one TP mesh dim.

    mesh_dim: the TP mesh dim (index or name); None means the only mesh dim that shards the matrix. Every other
    mesh dim must replicate it."""
    mesh = X.device_mesh
    names = mesh.mesh_dim_names or ()
    if isinstance(mesh_dim, str):
        if mesh_dim not in names:
            raise ValueError(f"mesh has no dim named {mesh_dim!r}; its dims are {names}")
        mesh_dim = names.index(mesh_dim)
    sharded = [i for i, pl in enumerate(X.placements) if not isinstance(pl, Replicate)]
    if mesh_dim is None:
        if len(sharded) != 1:
            raise ValueError(f"cannot tell the TP mesh dim of a DTensor with placements {X.placements}; pass "
                             f"mesh_dim")
        mesh_dim = sharded[0]
    others = [i for i in sharded if i != mesh_dim]
    pl = X.placements[mesh_dim]
    if others or type(pl) is not Shard or pl.dim < X.ndim - 2:
        raise ValueError(f"TP Newton–Schulz needs a DTensor sharded along a matrix dim (Shard({X.ndim - 2}) or "
                         f"Shard({X.ndim - 1})) on mesh dim {mesh_dim} and replicated elsewhere; got placements "
                         f"{X.placements}")
    partition_dim = pl.dim - (X.ndim - 2)
    sizes = comm.chunk_sizes(X.shape[pl.dim], mesh.size(mesh_dim))
    return partition_dim, mesh.get_group(mesh_dim), sizes


def tp_newton_schulz_dtensor(X: DTensor, *, mesh_dim: int | str | None = None, **kwargs) -> DTensor:
    """:func:`tp_newton_schulz` for a DTensor ``(m, n)`` or ``(b, m, n)`` with ``Shard`` along a matrix dim on
    the TP mesh dim; returns a DTensor with the same placements. kwargs: as :func:`tp_newton_schulz`."""
    partition_dim, group, sizes = tp_shard_spec(X, mesh_dim)
    Y = tp_newton_schulz(X.to_local(), partition_dim, group, sizes=sizes, **kwargs)
    return DTensor.from_local(Y, X.device_mesh, X.placements, shape=X.shape, stride=X.stride(), run_check=False)
