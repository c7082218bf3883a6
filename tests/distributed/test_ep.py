"""Expert parallelism on gloo: EP 2 and EP 2 x DP 2 train the MoE GPT to the single-process losses (router and
load-balancing loss active), checkpoints resume across EP degrees (2 -> 1 -> 2), a rank whose experts receive no
tokens still steps (zero gradient, weight decay only) without deadlock, and bad degrees fail before training."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _mp import run

import matrixopt.train.trainer as trainer
from matrixopt.distributed.ep import expert_groups
from matrixopt.distributed.parallelism import make_parallelism
from matrixopt.train.config import TrainConfig, from_dict
from matrixopt.train.model import GPT, PRESETS, GPTConfig

# Each rank routes its own rows; the expert products see other row blocks and the gradients are summed in another
# order than in one process (all-to-all, gloo all-reduce): measured differences are ~1e-7 relative (fp32).
# Muon's Newton–Schulz amplifies them a little.
RTOL = {"adamw": 1e-5, "muon": 1e-4}
LR = {"adamw": 3e-3, "muon": 1e-2}
FIELDS = ("step", "loss", "val_loss", "aux_loss")
# The load-balancing loss counts each sequence's expert copies: one copy that moves between two nearly tied experts
# (a difference at the round-off level decides it) moves the logged aux_loss by the two experts' probability gap
# times E / (T k B L), at most that. Muon's steps carry such differences far enough for this to happen within 8 steps on
# some CPUs (a 8e-4 move measured), so under Muon the aux_loss is held to one such flip; the losses keep RTOL.
_MOE = PRESETS["moe-tiny"]
ONE_FLIP = _MOE["n_expert"] / (_MOE["block_size"] * _MOE["topk"] * 4 * _MOE["n_layer"])  # config's 4 rows: 1/64


def config(optimizer: str, **kw) -> dict:
    """moe-tiny (2 layers, 4 experts, top-2, load-balancing loss on) for 8 steps, 2 micro-batches a step."""
    return dict(model=dict(preset="moe-tiny", aux_loss_coef=0.01), optim=dict(name=optimizer, lr=LR[optimizer]),
                schedule=dict(warmup_steps=2), steps=8, batch_size=4, grad_accum=2, eval_every=4, eval_iters=2,
                log_every=1, threads=1) | kw  # fmt: skip


def metrics(out: Path) -> list[dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: m[k] for k in FIELDS if k in m} for m in lines]


def assert_same(got: list[dict], want: list[dict], rtol: float, aux_atol: float = 0.0) -> None:
    """The logged losses equal within ``rtol``; the aux_loss also within ``aux_atol`` (routing flips)."""
    assert [m["step"] for m in got] == [m["step"] for m in want] == list(range(9))
    for g, w in zip(got, want):
        assert g.keys() == w.keys(), (g, w)
        for k in FIELDS[1:]:
            if w.get(k) is not None:
                atol = aux_atol if k == "aux_loss" else 0.0
                assert g[k] == pytest.approx(w[k], rel=rtol, abs=atol), (k, g, w)


def keep_checkpoints_at(*steps: int) -> None:
    """Make the trainer keep a copy of the checkpoint it writes at each of ``steps`` (rank 0), beside it as
    ``ckpt<step>`` plus the checkpoint's suffix (a DDP file ``ckpt<step>.pt``, a DCP folder ``ckpt<step>``)."""
    real = trainer.save_checkpoint

    def save(par, path, tally, *args):
        real(par, path, tally, *args)
        if tally.step in steps and par.rank == 0:
            copy = path.parent / f"ckpt{tally.step}{path.suffix}"
            shutil.copytree(path, copy) if path.is_dir() else shutil.copy(path, copy)
        par.barrier()

    trainer.save_checkpoint = save


def resume_from(src: Path, ckpt: str, out: Path) -> None:
    """A new run folder ``out`` holding ``src``'s config and metrics and its kept checkpoint ``ckpt`` as the one
    the trainer resumes from."""
    out.mkdir()
    for f in ("config.json", "metrics.jsonl"):
        shutil.copy(src / f, out / f)
    kept = src / ckpt
    if kept.is_dir():
        shutil.copytree(kept, out / "ckpt")
    else:
        shutil.copy(kept, out / "ckpt.pt")


def _ep_runs(rank: int, world: int, tmp: Path) -> None:
    for name in RTOL:
        trainer.train(from_dict(TrainConfig, config(name, parallel="ddp", ep=2)), tmp / f"{name}-ep2-w{world}",
                      progress=False)
    if world == 2:  # the other 2-rank checks share the processes
        _resume_runs(rank, tmp)
        _no_tokens(rank, tmp)


def _resume_runs(rank: int, tmp: Path) -> None:
    keep_checkpoints_at(4, 6)
    run_cfg = from_dict(TrainConfig, config("muon", parallel="ddp", ep=2, ckpt_every=2))
    trainer.train(run_cfg, tmp / "ep2", progress=False)
    if rank == 0:
        resume_from(tmp / "ep2", "ckpt4.pt", tmp / "ep1")
    trainer.train(from_dict(TrainConfig, config("muon", parallel="ddp", ep=1, ckpt_every=2)), tmp / "ep1",
                  resume=True, progress=False)  # 2 -> 1 at step 4
    if rank == 0:
        resume_from(tmp / "ep1", "ckpt6.pt", tmp / "ep2-again")
    trainer.train(run_cfg, tmp / "ep2-again", resume=True, progress=False)  # 1 -> 2 at step 6


def no_tokens_model() -> GPT:
    """moe-tiny with top-1 routing whose selection bias keeps every token off experts 2 and 3 (rank 1's at ep 2)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, **(PRESETS["moe-tiny"] | dict(topk=1, router_bias_rate=1.0))))
    for m in model.moe_layers():
        m.router_bias.copy_(torch.tensor([0.0, 0.0, -10.0, -10.0]))
    return model


def _no_tokens(rank: int, tmp: Path) -> None:
    """One step of Muon where no token reaches rank 1's experts; records, per expert stack, the largest gradient
    entry and the largest distance from weight decay alone."""
    par = make_parallelism("ddp", device="cpu", ep=2)
    model = no_tokens_model()
    module = par.wrap(model)
    lr, wd = 0.1, 0.5
    opt = par.build_optimizer(model, "muon", lr=lr, weight_decay=wd)
    stacks = [p for m in model.moe_layers() for p in m.experts.parameters()]
    before = [p.detach().clone() for p in stacks]
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # two micro-batches, the first without gradient sync
        with par.no_sync():
            module(idx, idx)[1].backward()
    par.sync_grads()
    par.clip_grad_norm_(1.0)
    opt.step()
    record = [dict(grad=p.grad.abs().max().item(), off_decay=(p.detach() - b * (1 - lr * wd)).abs().max().item(),
                   scale=b.abs().max().item()) for p, b in zip(stacks, before)]
    (tmp / f"no-tokens-{rank}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory) -> Callable[[int], Path]:
    """The folder of :func:`_ep_runs` on ``world`` ranks, spawned once per world size for the module."""
    done: dict[int, Path] = {}

    def get(world: int) -> Path:
        if world not in done:
            done[world] = tmp_path_factory.mktemp(f"ep-w{world}")
            run(_ep_runs, world, done[world], timeout=180)
        return done[world]

    return get


@pytest.mark.parametrize("world", [2, 4])
def test_ep_matches_single_process(ep_runs, tmp_path, world):
    out = ep_runs(world)
    for name, rtol in RTOL.items():
        trainer.train(from_dict(TrainConfig, config(name)), tmp_path / name, progress=False)
        assert_same(metrics(out / f"{name}-ep2-w{world}"), metrics(tmp_path / name), rtol,
                    ONE_FLIP if name == "muon" else 0.0)


def test_resume_across_ep_degrees(ep_runs):
    out = ep_runs(2)
    want = metrics(out / "ep2")
    assert_same(metrics(out / "ep1"), want, RTOL["muon"], ONE_FLIP)
    assert_same(metrics(out / "ep2-again"), want, RTOL["muon"], ONE_FLIP)


def assert_idle_experts_decay_only(idle: list[dict], busy: list[dict]) -> None:
    """Per expert stack of the rank whose experts got no tokens (``idle``) and of one whose did (``busy``): its
    reduced gradient's largest entry, its largest distance from weight decay alone, and its largest weight."""
    for stack in idle:  # zero gradient: weight decay only (fp32 rounding of one multiply)
        assert stack["grad"] == 0 and stack["off_decay"] <= 1e-7 * stack["scale"]
    for stack in busy:
        assert stack["grad"] > 0 and stack["off_decay"] > 1e-4 * stack["scale"]


def test_experts_without_tokens_still_step(ep_runs):
    out = ep_runs(2)
    assert_idle_experts_decay_only(*(json.loads((out / f"no-tokens-{r}.json").read_text()) for r in (1, 0)))


def test_ep_must_divide_the_world():
    with pytest.raises(ValueError, match="--ep 2 must divide the number of ranks, 3"):
        expert_groups(3, 2)


def _clip_under_ep(rank: int, world: int) -> None:
    """EP 2 under DDP, Muon: the global norm as torch's clip over the whole model computes it (every expert once),
    handed to the step (the gradients are not scaled in place), and a NaN in one rank's expert gradient makes both
    ranks raise with nothing written."""
    import torch.distributed as dist
    from torch import nn

    from matrixopt import NonFiniteGradientError

    par = make_parallelism("ddp", device="cpu", ep=2)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, **PRESETS["moe-tiny"]))
    module = par.wrap(model)
    opt = par.build_optimizer(model, "muon", lr=0.1, deferred_nonfinite=True)
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(rank))
    module(idx, idx)[1].backward()
    par.sync_grads()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    total = par.clip_grad_norm_(1e-3)
    # torch's norm over every gradient, the expert shards gathered: dense ones once, each expert once
    experts = {id(p) for p in par.expert_params}
    dense = [p.grad for p in model.parameters() if id(p) not in experts]
    shard_sq = nn.utils.get_total_norm([p.grad for p in par.expert_params]).square()
    dist.all_reduce(shard_sq, group=par.ep_group)
    want = (nn.utils.get_total_norm(dense).square() + shard_sq).sqrt()
    torch.testing.assert_close(total, want, rtol=1e-6, atol=0)
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters()), "scaled in place, not in step"
    opt.step()

    opt.zero_grad()
    module(idx, idx)[1].backward()
    par.sync_grads()
    if rank == 1:
        par.expert_params[0].grad[0, 0, 0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    par.clip_grad_norm_(1.0)
    with pytest.raises(NonFiniteGradientError):  # raised now off the GPU's fused kernels, a step later on them
        opt.step()
        opt.raise_deferred_nonfinite()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), f"rank {rank} stepped"


def test_clipping_under_expert_parallelism_hands_the_norm_to_muon_and_skips_together():
    run(_clip_under_ep, 2)


def _sharded_norms(rank: int, world: int) -> None:
    import math

    from matrixopt.optim.nonfinite import grad_norms

    gen = torch.Generator().manual_seed(0)
    shared = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen)]  # the same on every rank
    shards = [torch.randn(2, 6, generator=gen) * (r + 1) for r in range(world)]  # rank r holds shards[r]
    mask = torch.tensor([False, False, True])
    for norm_type in (2.0, 3.0, math.inf):
        total, flags = grad_norms([*shared, shards[rank]], norm_type, torch.device("cpu"), mask, None)
        want = torch.nn.utils.get_total_norm([*shared, *shards], norm_type)
        torch.testing.assert_close(total, want, rtol=1e-6, atol=0)
        assert not flags.any()
    bad = shards[rank].clone()
    if rank == 1:
        bad[0, 0] = float("inf")
    _, flags = grad_norms([*shared, bad], 2.0, torch.device("cpu"), mask, None)
    assert flags.tolist() == [1.0, 1.0, 1.0]  # every rank flags every gradient


def test_sharded_norms_count_each_shard_once_and_flag_together():
    run(_sharded_norms, 2)
