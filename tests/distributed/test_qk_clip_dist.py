"""QK-clip over 2 gloo ranks: max logits MAX-reduced over the group (data parallel, and tensor parallel ranks that
pass -Inf for heads they do not hold), and weights sharded by rows (``distribute_tensor`` with ``Shard(0)``, FSDP2
``fully_shard``) ending exactly as the single-process clip leaves them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _mp import run
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from matrixopt.distributed.qk_clip import FusedQKV, QKClip, SplitQK

H, HKV, D, C = 6, 2, 3, 5  # fused rows (6 + 2 * 2) * 3 = 30; split W_k rows 6 = 3 + 3 over 2 ranks
TAU = 10.0


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rows = (H + 2 * HKV) * D
    return dict(W=torch.randn(rows, C, generator=g), b=torch.randn(rows, generator=g),
                Wq=torch.randn(H * D, C, generator=g), Wk=torch.randn(HKV * D, C, generator=g),
                order=torch.randperm(rows, generator=g))


def _logits(rank: int) -> torch.Tensor:
    """Each rank's max logits: rank 0 sees heads 0-2 large, rank 1 heads 3-5 (and head 5 at exactly tau)."""
    base = torch.tensor([25.0, 3.0, 40.0, 12.0, 1.0, TAU])
    other = torch.tensor([2.0, 1.0, 5.0, 60.0, 15.0, 4.0])
    return base if rank == 0 else other


def _clip_single(w: dict[str, torch.Tensor], S: torch.Tensor) -> dict[str, torch.Tensor]:
    w = {k: v.clone() for k, v in w.items()}
    QKClip(TAU, [FusedQKV(weight=w["W"], bias=w["b"], n_head=H, n_kv_head=HKV, row_order=w["order"]),
                 SplitQK(q_weight=w["Wq"], k_weight=w["Wk"], n_head=H, n_kv_head=HKV)]).step([S, S])
    return w


def _reduce_worker(rank: int, world: int) -> None:
    w = _weights()
    ref = _clip_single(w, torch.maximum(_logits(0), _logits(1)))
    for tp_style in (False, True):
        mine = {k: v.clone() for k, v in w.items()}
        S = _logits(rank)
        if tp_style:  # rank r holds heads 3r..3r+2 of every rank's batch and passes -inf for the others
            S = torch.maximum(_logits(0), _logits(1))
            S[torch.arange(H) // (H // world) != rank] = -float("inf")
        clip = QKClip(TAU, [FusedQKV(weight=mine["W"], bias=mine["b"], n_head=H, n_kv_head=HKV,
                                     row_order=mine["order"]),
                            SplitQK(q_weight=mine["Wq"], k_weight=mine["Wk"], n_head=H, n_kv_head=HKV)],
                      process_group=dist.group.WORLD)
        stats = clip.step([S, S.clone()])
        for k in ("W", "b", "Wq", "Wk"):
            assert torch.equal(mine[k], ref[k]), (rank, tp_style, k)
            others = [torch.empty_like(mine[k]) for _ in range(world)]
            dist.all_gather(others, mine[k])
            assert all(torch.equal(o, mine[k]) for o in others), (rank, k)
        assert stats.clipped.item() == 2 * 4 and stats.max_logit.item() == 60.0 and stats.nonfinite.item() == 0
    # without a group, each rank clips with its own max logits
    mine = {k: v.clone() for k, v in w.items()}
    QKClip(TAU, [FusedQKV(weight=mine["W"], bias=mine["b"], n_head=H, n_kv_head=HKV, row_order=mine["order"]),
                 SplitQK(q_weight=mine["Wq"], k_weight=mine["Wk"], n_head=H, n_kv_head=HKV)]).step(
        [_logits(rank)] * 2)
    assert torch.equal(mine["W"], _clip_single(w, _logits(rank))["W"])


def _sharded_worker(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    w = _weights()
    S = torch.maximum(_logits(0), _logits(1))
    ref = _clip_single(w, S)
    # distribute_tensor: Shard(0) for the fused weight and bias (30 rows: 15 + 15), Replicate for W_q
    dt = {k: distribute_tensor(w[k].clone(), mesh, [Shard(0)]) for k in ("W", "b", "Wk")}
    dt["Wq"] = distribute_tensor(w["Wq"].clone(), mesh, [Replicate()])
    QKClip(TAU, [FusedQKV(weight=dt["W"], bias=dt["b"], n_head=H, n_kv_head=HKV, row_order=w["order"]),
                 SplitQK(q_weight=dt["Wq"], k_weight=dt["Wk"], n_head=H, n_kv_head=HKV)]).step([S, S])
    for k in ("W", "b", "Wq", "Wk"):
        assert torch.equal(dt[k].full_tensor(), ref[k]), (rank, k)

    # FSDP2, uneven shards: fused MHA of 5 heads of d_head 1 (15 rows = 8 + 7), GQA W_k of 2 rows (1 + 1)
    torch.manual_seed(1)
    qkv, q, k = nn.Linear(C, 15), nn.Linear(C, 4), nn.Linear(C, 2)
    plain = [t.detach().clone() for t in (qkv.weight, qkv.bias, q.weight, q.bias, k.weight, k.bias)]
    S2 = torch.tensor([30.0, 2.0, 11.0, 9.0, 50.0])
    S3 = torch.tensor([1.0, 40.0, 3.0, 20.0])
    ref = [t.clone() for t in plain]
    QKClip(TAU, [FusedQKV(weight=ref[0], bias=ref[1], n_head=5),
                 SplitQK(q_weight=ref[2], q_bias=ref[3], k_weight=ref[4], k_bias=ref[5], n_head=4,
                         n_kv_head=2)]).step([S2, S3])
    for m in (qkv, q, k):
        fully_shard(m, mesh=mesh)
    sharded = [qkv.weight, qkv.bias, q.weight, q.bias, k.weight, k.bias]
    assert all(t.placements == (Shard(0),) for t in sharded)
    QKClip(TAU, [FusedQKV(weight=qkv.weight, bias=qkv.bias, n_head=5),
                 SplitQK(q_weight=q.weight, q_bias=q.bias, k_weight=k.weight, k_bias=k.bias, n_head=4, n_kv_head=2)],
           process_group=dist.group.WORLD).step([S2, S3])
    for t, r in zip(sharded, ref):
        assert torch.equal(t.full_tensor(), r), rank

    bad = distribute_tensor(w["W"].clone(), mesh, [Shard(1)])
    with pytest.raises(NotImplementedError, match=r"Shard\(dim=1\)"):
        QKClip(TAU, [FusedQKV(weight=bad, n_head=H, n_kv_head=HKV, name="blk")])


def test_max_logits_are_max_reduced_and_every_rank_scales_alike():
    run(_reduce_worker, 2)


def test_sharded_weights_match_single_process():
    run(_sharded_worker, 2)
