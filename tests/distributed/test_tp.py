"""Tensor-parallel Newton–Schulz against the single-process ``newton_schulz``, on CPU with gloo at 2 and 4 ranks."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from _mp import run
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from matrixopt.distributed import comm, tp
from matrixopt.distributed.cost import TP_GATHER_LAUNCHES, TP_NORMALIZE_LAUNCHES, TP_STEP_LAUNCHES
from matrixopt.distributed.tp import CostModel, choose_mode, mode_costs, tp_newton_schulz, tp_newton_schulz_dtensor
from matrixopt.linalg import ortho
from matrixopt.linalg.ortho import NewtonSchulzConfig, newton_schulz

# fp32 Newton–Schulz of the same matrix, iterated on the other side or with the Gram matrix summed in another
# order, differs by round-off amplified over 5 Newton–Schulz steps: measured <= 4e-6 on these shapes, so 5e-5 leaves
# margin while a wrong shard, transpose or norm (errors of order 1e-1) fails.
ATOL = 5e-5

# (rows, cols) of the weights: wide, tall, square-ish and uneven (7 and 5 split over 2 or 4 ranks unevenly;
# 3 rows over 4 ranks leaves one rank empty), plus a batch.
SHAPES = [(6, 10), (10, 6), (7, 5), (3, 9), (2, 5, 7)]

LATENCY_BOUND = CostModel(latency=1.0, bandwidth=1e12, flops=1e12)  # every collective is very expensive
COMPUTE_BOUND = CostModel(latency=0.0, bandwidth=1e15, flops=1e3)  # free network, slow matmuls


def _shard(G: torch.Tensor, partition_dim: int, world: int) -> list[torch.Tensor]:
    d = G.ndim - 2 + partition_dim
    return list(G.split(comm.chunk_sizes(G.shape[d], world), dim=d))


def _close(Y: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert Y.shape == ref.shape, (what, Y.shape, ref.shape)
    if Y.numel():
        err = (Y - ref).abs().max().item()
        assert err < ATOL, f"{what}: max error {err}"


# ----------------------------------------------------------------------------------------------------------
# workers


def _equals_unsharded(rank: int, world: int) -> None:
    gen = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        G = torch.randn(*shape, generator=gen)
        ref = newton_schulz(G)
        for pd in (0, 1):
            mine, want = _shard(G, pd, world)[rank], _shard(ref, pd, world)[rank]
            for mode, chunks in (("duplicated", 1), ("distributed", 1), ("distributed", 3)):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the long-side warning has its own test
                    Y = tp_newton_schulz(mine, pd, None, mode=mode, chunks=chunks)  # sizes all-gathered
                _close(Y, want, f"{mode} chunks={chunks} {shape} dim {pd}")
            blocks = tp_newton_schulz(mine, pd, None, mode="blockwise")
            _close(blocks, newton_schulz(mine) if mine.numel() else mine, f"blockwise {shape} dim {pd}")
            if rank == 0 and shape == (6, 10):  # blockwise is per block: not the polar factor of the matrix
                assert (blocks - want).abs().max() > 1e-2


def _dtensor_api(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    G = torch.randn(9, 6, generator=torch.Generator().manual_seed(1))
    ref = newton_schulz(G)
    for pd in (0, 1):
        X = distribute_tensor(G, mesh, [Shard(pd)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Y = tp_newton_schulz_dtensor(X, mesh_dim="tp", mode="distributed")
        assert Y.placements == X.placements
        _close(Y.to_local(), _shard(ref, pd, world)[rank], f"dtensor dim {pd}")


def _overlap_and_warning(rank: int, world: int) -> None:
    G = torch.randn(12, 8, generator=torch.Generator().manual_seed(2))
    launched = []
    real = comm.all_reduce_sum_async

    def counting(t, group):
        launched.append(tuple(t.shape))
        return real(t, group)

    comm.all_reduce_sum_async = counting
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tp_newton_schulz(_shard(G, 0, world)[rank], 0, None, mode="distributed", chunks=3,
                             config=NewtonSchulzConfig(steps=2))
    finally:
        comm.all_reduce_sum_async = real
    # sharded along rows -> transposed to (8, 12): an 8 x 8 Gram in row blocks of 2, 3, 3 rows, per step
    assert launched == [(1, 2, 8), (1, 3, 8), (1, 3, 8)] * 2, launched
    launched.clear()
    comm.all_reduce_sum_async = counting
    try:  # by default the whole Gram matrix in one all-reduce per step
        tp_newton_schulz(_shard(G, 0, world)[rank], 0, None, mode="distributed", config=NewtonSchulzConfig(steps=2))
    finally:
        comm.all_reduce_sum_async = real
    assert launched == [(1, 8, 8)] * 2, launched
    assert not caught  # contracting the long side: no warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tp_newton_schulz(_shard(G, 1, world)[rank], 1, None, mode="distributed")
    assert any("long side" in str(w.message) for w in caught), [str(w.message) for w in caught]


def _auto(rank: int, world: int) -> None:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    tp.logger.addHandler(handler)
    tp.logger.setLevel(logging.INFO)
    G = torch.randn(6, 10, generator=torch.Generator().manual_seed(3))
    ref = _shard(newton_schulz(G), 1, world)[rank]
    for cost, expect in ((LATENCY_BOUND, "duplicated"), (COMPUTE_BOUND, "distributed")):
        records.clear()
        Y = tp_newton_schulz(_shard(G, 1, world)[rank], 1, None, mode="auto", cost_model=cost)
        _close(Y, ref, f"auto -> {expect}")
        assert any(f"tp auto: {expect}" in r for r in records), records
    measured = tp.measure_cost_model(None, torch.device("cpu"))
    assert measured is tp.measure_cost_model(None, torch.device("cpu"))  # measured once, then cached
    assert measured.latency > 0 and measured.bandwidth > 0 and measured.flops > 0
    Y = tp_newton_schulz(_shard(G, 1, world)[rank], 1, None, mode="auto")
    _close(Y, ref, "auto with the measured model")


class _Kernels(TorchDispatchMode):
    """Counts the ops that launch a kernel on the GPU: every aten op but views and bare allocations."""

    FREE = {"view", "_unsafe_view", "t", "transpose", "slice", "select", "unsqueeze", "squeeze", "expand", "permute",
            "alias", "as_strided", "detach", "split", "split_with_sizes", "unbind", "reshape", "empty", "empty_like",
            "empty_strided"}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.__name__.split(".")[0] not in self.FREE
        return func(*args, **(kwargs or {}))


def _kernels(fn) -> int:
    fn()  # once first: what a first call of a shape does once (compiling ahead) is not the step's
    with _Kernels() as k:
        fn()
    return k.count


def _launch_counts(rank: int, world: int) -> None:
    """The cost model's kernel counts for TP Newton–Schulz (``cost.tp_newton_schulz_launches``) are what
    tp_newton_schulz launches: around ``duplicated``'s iteration on the gathered stack, and per step and around the
    steps of ``distributed``; in bf16 iterations on a bf16 stack, so the casts are the GPU's."""
    X = torch.randn(2, 8, 12, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)  # (b, rows, cols_p)
    sizes = [12] * world
    cfg = {k: NewtonSchulzConfig(steps=k, dtype=torch.bfloat16) for k in (1, 3)}
    full = torch.randn(2, 8, 12 * world).to(torch.bfloat16)
    gather = (_kernels(lambda: tp_newton_schulz(X, 1, None, config=cfg[3], mode="duplicated", sizes=sizes))
              - _kernels(lambda: ortho.newton_schulz_with(full, cfg[3])))
    one, three = (_kernels(lambda k=k: tp_newton_schulz(X, 1, None, config=cfg[k], mode="distributed", sizes=sizes))
                  for k in (1, 3))
    assert gather == TP_GATHER_LAUNCHES, gather
    assert (three - one) / 2 == TP_STEP_LAUNCHES, (one, three)
    assert one - TP_STEP_LAUNCHES == TP_NORMALIZE_LAUNCHES, one


def _all_checks(rank: int, world: int) -> None:
    for check in (_equals_unsharded, _dtensor_api, _overlap_and_warning, _auto, _launch_counts):
        check(rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_tp_newton_schulz_matches_unsharded(world):
    run(_all_checks, world)


# ----------------------------------------------------------------------------------------------------------
# single-process pieces


def test_auto_choice_follows_the_cost_model():
    kw = dict(batch=1, steps=5, itemsize=2, chunks=4)
    assert choose_mode(4096, 14336, 2, cost=LATENCY_BOUND, **kw) == "duplicated"
    assert choose_mode(4096, 14336, 2, cost=COMPUTE_BOUND, **kw) == "distributed"
    # with overlap the Gram all-reduce hides behind the Gram compute; without it, it adds up
    h100ish = CostModel(latency=2e-5, bandwidth=3e11, flops=7e14)
    overlapped = mode_costs(8192, 8192, 2, cost=h100ish, chunks=4)["distributed"]
    serial = mode_costs(8192, 8192, 2, cost=h100ish, chunks=1)["distributed"]
    assert overlapped < serial


def test_cost_model_counts_the_shared_flops():
    """With a free network, each mode's time is its FLOPs (linalg.ortho's counts) over the matmul rate."""
    free = CostModel(latency=0.0, bandwidth=1e300, flops=1e12)
    costs = mode_costs(96, 320, 4, batch=3, steps=5, chunks=1, cost=free)
    assert costs["duplicated"] == pytest.approx(ortho.newton_schulz_flops(96, 320, 5, "standard", batch=3) / 1e12)
    assert costs["distributed"] == pytest.approx(5 * ortho.ns_step_flops(96, 80, batch=3) / 1e12)
    tall = mode_costs(320, 96, 4, batch=1, steps=2, chunks=1, cost=free)  # iterates on the short side
    assert tall["duplicated"] == pytest.approx(2 * ortho.ns_step_flops(96, 320) / 1e12)


def test_row_blocks_and_chunk_sizes():
    assert tp.row_blocks(7, 3) == [(0, 2), (2, 4), (4, 7)]
    assert tp.row_blocks(2, 5) == [(0, 1), (1, 2)]
    assert comm.chunk_sizes(5, 4) == [2, 2, 1, 0]
    assert comm.chunk_sizes(3, 4) == [1, 1, 1, 0]
    assert comm.chunk_sizes(7, 2) == [4, 3]
    assert [t.shape[0] for t in torch.arange(5).chunk(4)] == comm.chunk_sizes(5, 4)[:3]


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="mode 'fast'"):
        tp_newton_schulz(torch.ones(2, 2), 0, mode="fast")
    with pytest.raises(ValueError, match="partition_dim"):
        tp_newton_schulz(torch.ones(2, 2), 2)
    with pytest.raises(ValueError, match="bandwidth"):
        CostModel(latency=0.0, bandwidth=0.0, flops=1.0)
    with pytest.raises(ValueError, match="latency"):
        CostModel(latency=float("nan"), bandwidth=1.0, flops=1.0)
