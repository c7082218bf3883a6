"""The Parallelism interface: the factory checks its settings before joining any process group, one process
builds, clips and checkpoints as torch does, and on 2 gloo ranks every mode splits batches, agrees on flags and
rank 0's results, and round-trips its checkpoint."""

import contextlib
import math
from pathlib import Path

import pytest
import torch
from _mp import run
from torch import nn

from matrixopt.distributed import FSDP, SingleProcess, make_parallelism
from matrixopt.distributed.checkpoint import CheckpointError
from matrixopt.distributed.parallelism import parallelism_class


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16))


def loss(net: nn.Module, rows: slice = slice(None)) -> torch.Tensor:
    torch.manual_seed(1)
    idx = torch.randint(0, 16, (4, 3))[rows]
    return net(idx).square().mean()


@pytest.mark.parametrize("mode, kw, message", [
    ("dp", {}, "parallel must be one of none, ddp, layerwise, fsdp, got 'dp'"),
    ("layerwise", {"tp": 2}, "tp=2 needs --parallel fsdp"),
    ("fsdp", {"tp": 0}, "tp must be a positive integer"),
    ("fsdp", {"tp_mode": "distributed"}, "has tp=1; use it with --tp N"),
    ("fsdp", {"tp": 2, "tp_mode": "fastest"}, "tp_mode must be one of"),
])  # fmt: skip
def test_bad_settings_are_named_before_any_process_group(mode, kw, message):
    with pytest.raises(ValueError, match=message):
        parallelism_class(mode, **kw)
    with pytest.raises(ValueError, match=message):
        make_parallelism(mode, device="cpu", **kw)


def test_tensor_parallelism_needs_a_plan():
    with pytest.raises(ValueError, match="tp=2 needs a tp_plan"):
        make_parallelism("fsdp", device="cpu", tp=2)


def test_fsdp_mesh_dims():
    assert FSDP.mesh_dims(4) == {"dp": 4} and FSDP.mesh_dims(4, tp=2) == {"dp": 2, "tp": 2}


def test_single_process_refuses_to_run_as_one_of_several_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE=2"):
        make_parallelism("none", device="cpu")


def test_single_process_builds_clips_and_checkpoints(tmp_path):
    par = make_parallelism("none", device="cpu")
    assert (par.rank, par.world, par.checkpoint_name, par.describe()) == (0, 1, "ckpt.pt", dict(
        parallel="none", world_size=1, tp=1))
    net = model()
    with pytest.raises(RuntimeError, match=r"call wrap\(model\) before build_optimizer"):
        par.build_optimizer(net, "muon")
    assert par.wrap(net) is net
    with pytest.raises(ValueError, match="optimizer 'muon' rejected its hyperparameters"):
        par.build_optimizer(net, "muon", momentumm=0.9)
    opt = par.build_optimizer(net, "muon", lr=0.02)
    assert par.batch_rows(4) == slice(None) and par.any(True) and not par.any(False)

    ref = model()
    loss(net).backward()
    loss(ref).backward()
    want = nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
    torch.testing.assert_close(par.clip_grad_norm_(1e-3), want)
    opt.step()

    path = tmp_path / par.checkpoint_name
    par.save(path, {"step": 3})
    other = SingleProcess("cpu")
    other.wrap(model())
    other.build_optimizer(other.model, "muon", lr=0.02)
    assert other.load(path) == {"step": 3}
    for a, b in zip(net.parameters(), other.model.parameters()):
        assert torch.equal(a, b)
    assert other.optimizer.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated"):
        other.load(path)


def _every_mode(rank: int, world: int, tmp: str) -> None:
    """Each mode: batch rows, agreement, rank 0's results and errors, a step with accumulation and clipping, and
    a checkpoint that restores the saved parameters after a further step."""
    for mode in ("ddp", "layerwise", "fsdp"):  # tensor parallelism needs a model's plan: see tests/train
        par = make_parallelism(mode, device="cpu")
        assert (par.rank, par.world) == (rank, world)
        rows = par.batch_rows(4)
        assert rows == slice(2 * rank, 2 * rank + 2)
        assert par.mean(torch.tensor(float(rank))).item() == 0.5
        assert par.any(rank == 1) and not par.any(False)
        assert par.from_rank_zero(lambda: rank) == 0
        with pytest.raises(ValueError, match="only on rank 0"):
            par.from_rank_zero(lambda: (_ for _ in ()).throw(ValueError("only on rank 0")))

        net = model()
        module = par.wrap(net)
        opt = par.build_optimizer(net, "adamw", lr=1e-2)
        with par.no_sync():
            loss(module, rows).backward()
        loss(module, rows).backward()
        norm = par.clip_grad_norm_(1e-3)
        assert math.isfinite(float(norm)) and float(norm) > 0
        opt.step()
        opt.zero_grad()
        path = Path(tmp) / f"{mode}-{par.checkpoint_name}"
        par.save(path, {"step": 1})
        want = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in net.parameters()]
        loss(module, rows).backward()
        opt.step()  # moves away from the checkpoint
        opt.zero_grad()
        assert par.load(path)["step"] == 1
        got = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in net.parameters()]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_every_mode_on_two_ranks(tmp_path):
    run(_every_mode, 2, str(tmp_path), timeout=240)


class Blocks(nn.Module):
    """Embedding, two blocks in a ModuleList (each its own FSDP2 group, as apply_fsdp shards them), head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _gather_once(rank: int, world: int) -> None:
    """Two steps of three micro-batches under FSDP2, gathering once per step or per micro-batch: the same
    parameters, fewer all-gathers; an exception inside ``no_sync`` leaves the parameters sharded."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    gathers = {"n": 0}
    real = dist.all_gather_single

    def counted(*args, **kwargs):
        gathers["n"] += 1
        return real(*args, **kwargs)

    dist.all_gather_single = counted
    results = {}
    for once in (False, True):
        par = make_parallelism("fsdp", device="cpu", gather_once=once)
        net = Blocks()
        module = par.wrap(net)
        opt = par.build_optimizer(net, "adamw", lr=1e-2)
        gathers["n"] = 0
        ahead = []  # gathers issued on entering no_sync, before the forward
        for step in range(2):
            for i in range(3):
                torch.manual_seed(10 * step + i + rank)
                idx = torch.randint(0, 16, (2, 3))
                before = gathers["n"]
                with par.no_sync() if i < 2 else contextlib.nullcontext():
                    ahead.append(gathers["n"] - before)
                    module(idx).square().mean().backward()
            opt.step()
            opt.zero_grad()
        results[once] = ([p.detach().full_tensor() for p in net.parameters()], gathers["n"])
        # gathering once, the second step's first micro-batch issues every module's gather (root and 2 blocks) up
        # front; the first step's (FSDP2 initializes lazily in its first forward) and the later micro-batches' none
        assert ahead == ([0, 0, 0, 3, 0, 0] if once else [0] * 6), ahead
        if once:
            for with_forward in (False, True):  # stopped before the forward takes its pending gathers, and after
                with pytest.raises(RuntimeError, match="stopped"), par.no_sync():
                    if with_forward:
                        module(idx).square().mean().backward()
                    raise RuntimeError("stopped")
                assert all(isinstance(p, DTensor) for p in net.parameters())  # none left gathered
            module(idx).square().mean().backward()  # and the next step runs
            opt.step()
    dist.all_gather_single = real
    (per_micro, n_per_micro), (once, n_once) = results[False], results[True]
    for a, b in zip(per_micro, once):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert n_once < n_per_micro, (n_once, n_per_micro)


def test_fsdp_gather_once_matches_and_gathers_less():
    run(_gather_once, 2, timeout=240)


def test_gather_once_is_fsdp_only():
    with pytest.raises(ValueError, match="--fsdp-gather-once"):
        parallelism_class("ddp", gather_once=True)
