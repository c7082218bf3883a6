"""Shampoo and SOAP under FSDP2 (ShardedShampoo, ShardedSOAP) against one process, at 2 and 4 ranks; their DCP
checkpoints resumed at another world size (2 -> 4, 2 -> 1, 4 -> 2) with the state moved exactly to the new
owners; and layer-wise Shampoo and SOAP checkpoints resumed at 1 and 4 ranks (CPU, gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import run
from test_layerwise import batch, loss_of, make
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import matrixopt.distributed as mdist
from matrixopt.cli import main
from matrixopt.distributed import checkpoint, comm
from matrixopt.distributed.fsdp import apply_fsdp
from matrixopt.distributed.sharded_precond import ShardedShampoo, ShardedSOAP
from matrixopt.optim.layout import mark_experts, mark_split
from matrixopt.optim.nonfinite import NonFiniteGradientError
from matrixopt.optim.routing import param_groups
from matrixopt.optim.shampoo import Shampoo
from matrixopt.optim.soap import SOAP

# The sharded runs see the gradients of one process up to the order of fp32 sums (FSDP's reduce-scatter, per-rank
# mean losses). SOAP's eigenbases turn that round-off into differences of up to 3e-5 of the largest entry over 8
# steps (measured; one process summing the batch in two halves differs from the whole batch as much), Shampoo's
# roots into less; the entries are ~0.3. A wrong owner, row order or decay moves them by ~lr = 1e-2.
RTOL, ATOL = 1e-4, 1e-5
STEPS, SAVE_AT = 8, 4
BATCH = 16  # divisible by 1, 2 and 4 ranks; more rows than any matrix side, so the factors have full rank
# Roots and eigenbases are refreshed every 3 steps (Shampoo preconditions from step 3 on). Matrices are cut into
# blocks of at most 6. SOAP rotates only the short side of matrices 1.5 times longer than wide: the long side's
# factor would have a degenerate zero eigenspace whose basis round-off picks, which moves SOAP's steps even in one
# process (see tests/distributed/test_layerwise.py).
OPTIMIZERS = {
    "shampoo": (Shampoo, ShardedShampoo, dict(lr=1e-2, precondition_frequency=3, max_preconditioner_dim=6)),
    "soap": (SOAP, ShardedSOAP, dict(lr=1e-2, precondition_frequency=3, max_preconditioner_dim=6,
                                     one_sided_ratio=1.5)),
    # the refreshes spread over the steps: the owners refresh one phase's matrices at each step
    "soap_staggered": (SOAP, ShardedSOAP, dict(lr=1e-2, precondition_frequency=3, max_preconditioner_dim=6,
                                               one_sided_ratio=1.5, stagger_refresh=True)),
    # eigenbasis roots, refreshed a phase at a time: the first refresh's eigh reads the host on every rank alike
    "shampoo_eigen": (Shampoo, ShardedShampoo, dict(lr=1e-2, precondition_frequency=3, max_preconditioner_dim=6,
                                                    root_method="eigenbasis", stagger_refresh=True)),
    # products from bf16 operands: the owners gather the gradients in bf16, which is how the step reads them
    "soap_bf16": (SOAP, ShardedSOAP, dict(lr=1e-2, precondition_frequency=3, max_preconditioner_dim=6,
                                          one_sided_ratio=1.5, matmul_precision="bf16")),
}


class Net(nn.Module):
    """Linear layers in a ModuleList (each an FSDP unit) and a stack of 3 experts. Rows over 2 / 4 ranks: fc0's
    (5, 8) weight 3 + 2 / 2 + 2 + 1 + 0 (an empty shard); the head's (6, 12) 3 + 3 / 2 + 2 + 2 + 0; the experts'
    (3, 8, 8) stack 2 + 1 / 1 + 1 + 1 + 0. Two (8, 8) weights share their block batches; the (12, 8) weight is
    split into three (4, 8) pieces, as QKV is."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 5), nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 8),
                                     nn.Linear(8, 12), nn.Linear(12, 6)])
        self.experts = nn.Parameter(torch.randn(3, 8, 8) / 8)

    def mark(self) -> Net:
        """Mark the layouts on the parameters the optimizer sees (after ``fully_shard``, which replaces them)."""
        mark_split(self.layers[4].weight, 3)
        mark_experts(self.experts)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 3:
                x = x + torch.tanh(torch.einsum("bi,eoi->bo", x, self.experts)) / 3  # (B, 8)
        return x


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 6, generator=g)


def reference(name: str) -> tuple[list[float], list[torch.Tensor]]:
    """One process over the whole batch: the loss of every step and the parameters after the last."""
    cls, _, hp = OPTIMIZERS[name]
    torch.manual_seed(0)
    model = Net().mark()
    opt = cls(param_groups(model, matrix_flag=cls.matrix_flag), **hp)
    losses = []
    for step in range(STEPS):
        x, y = data(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def sharded(name: str, world: int, seed: int = 0, **extra: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    _, cls, hp = OPTIMIZERS[name]
    torch.manual_seed(seed)
    model = apply_fsdp(Net(), init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))).mark()
    return model, cls(param_groups(model, matrix_flag=cls.matrix_flag), **hp, **extra)


def global_losses(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    losses = []
    for step in steps:
        x, y = data(step)
        loss = nn.functional.mse_loss(model(x[mine]), y[mine])
        loss.backward()  # FSDP averages the gradients over ranks
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def owned_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``{name/key: tensor}``: the matrix state this rank holds (its owned matrices')."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"{names[id(p)]}/{k}": v.clone() for g in opt.param_groups if g[opt.matrix_flag] for p in g["params"]
            for k, v in opt.state[p].items() if torch.is_tensor(v)}


def assert_state_on_owners(model: nn.Module, opt: torch.optim.Optimizer, what: str) -> None:
    """Every matrix's state on exactly one rank, its owner; the others hold its step only."""
    for g in opt.param_groups:
        if not g[opt.matrix_flag]:
            continue
        for p in g["params"]:
            st = opt.state[p]
            mine = opt.owner(p) == dist.get_rank()
            assert (len(st) > 1) == mine and "step" in st, (what, tuple(p.shape), sorted(st))
            holders = torch.tensor(float(len(st) > 1))
            dist.all_reduce(holders)
            assert holders.item() == 1, f"{what}: the state of a {tuple(p.shape)} matrix is on {holders} ranks"


def assert_params(model: nn.Module, want: list[torch.Tensor] | dict[str, torch.Tensor], what: str,
                  exact: bool = False) -> None:
    want = list(want.values()) if isinstance(want, dict) else want
    for (n, p), q in zip(model.named_parameters(), want):
        if exact:
            assert torch.equal(p.full_tensor(), q), f"{what}: {n} not restored exactly"
        else:
            torch.testing.assert_close(p.full_tensor(), q, rtol=RTOL, atol=ATOL, msg=f"{what}: {n} differs")


# ----------------------------------------------------------------------------------------------------------
# FSDP2: against one process, and the checkpoints


def _equivalence_and_save(rank: int, world: int, d: str) -> None:
    """Sharded against one process over STEPS steps, saving a checkpoint at SAVE_AT (and each rank's state)."""
    gathered, real = [], comm.gather_rows  # the owners' gradients, as the exchange delivers them

    def spy(*args, **kwargs):
        flight = real(*args, **kwargs)

        def finish():
            gathered.extend(out := flight.wait())
            return out

        return comm.InFlight([], finish, None)

    comm.gather_rows = spy
    for name in OPTIMIZERS:
        ref_losses, ref_params = reference(name)
        model, opt = sharded(name, world)
        gathered.clear()
        losses = global_losses(model, opt, range(SAVE_AT))
        want = torch.bfloat16 if name == "soap_bf16" else torch.float32  # bf16 products: a bf16 exchange
        assert gathered and {g.dtype for g in gathered} == {want}, f"{name}: gathered {set(g.dtype for g in gathered)}"
        checkpoint.save_dtensor(f"{d}/{name}", model, opt, extra={"step": SAVE_AT})
        torch.save(owned_state(model, opt), f"{d}/{name}_state{rank}.pt")
        at_save = full_params(model)  # collective
        if rank == 0:
            torch.save(at_save, f"{d}/{name}_params.pt")
        losses += global_losses(model, opt, range(SAVE_AT, STEPS))
        torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=0, msg=f"{name} losses at {world} ranks")
        assert_params(model, ref_params, f"{name} at {world} ranks")
        assert_state_on_owners(model, opt, f"{name} at {world} ranks")
        torch.manual_seed(0)
        moved = max((p - q.detach()).abs().max().item() for p, q in zip(ref_params, Net().parameters()))
        assert moved > 100 * RTOL, f"{name}: parameters barely moved ({moved}); the comparison would prove nothing"


def _resume(rank: int, world: int, d: str) -> None:
    """Load the checkpoint of another world size into a model of other weights; the parameters and every
    matrix's state come back exactly, on the new owners, and the run goes on as the uninterrupted one."""
    for name in OPTIMIZERS:
        ref_losses, ref_params = reference(name)
        model, opt = sharded(name, world, seed=1)
        assert checkpoint.load_dtensor(f"{d}/{name}", model, opt) == {"step": SAVE_AT}
        assert_params(model, torch.load(f"{d}/{name}_params.pt"), f"{name} resumed at {world}", exact=True)
        saved = {}
        for f in Path(d).glob(f"{name}_state*.pt"):
            saved |= torch.load(f)
        mine = owned_state(model, opt)
        for k, v in mine.items():
            assert torch.equal(v, saved[k]), f"{name} resumed at {world} ranks: state {k} differs"
        count = torch.tensor(float(len(mine)))
        dist.all_reduce(count)
        assert count.item() == len(saved), f"{name}: {count.item()} state tensors loaded, {len(saved)} saved"
        assert_state_on_owners(model, opt, f"{name} resumed at {world} ranks")
        losses = global_losses(model, opt, range(SAVE_AT, STEPS))
        torch.testing.assert_close(losses, ref_losses[SAVE_AT:], rtol=RTOL, atol=0, msg=f"{name} resumed losses")
        assert_params(model, ref_params, f"{name} resumed at {world} ranks")


def _four_ranks(rank: int, world: int, two: str, four: str) -> None:
    _resume(rank, world, two)
    _layerwise_resume(rank, world, two)
    _equivalence_and_save(rank, world, four)
    # tensor parallelism (a 2-D mesh) is not supported: the error says so
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    w = nn.Parameter(distribute_tensor(torch.ones(8, 8), mesh, [Shard(0), Shard(1)]))
    with pytest.raises(ValueError, match=r"placements \(Shard\(0\),\).*Tensor parallelism"):
        ShardedShampoo([w])


def _staggered_owners(rank: int, world: int) -> None:
    """With stagger_refresh each refresh phase's matrices are spread over the ranks: four equal matrices in two
    phases (0, 1, 0, 1) go to ranks 0, 0, 1, 1, where packing them by cost alone (0, 1, 0, 1) would leave all of
    one phase's refreshes to one rank."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    ws = [nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])) for _ in range(4)]
    for stagger, owners in ((True, [0, 0, 1, 1]), (False, [0, 1, 0, 1])):
        opt = ShardedShampoo(ws, precondition_frequency=2, stagger_refresh=stagger)
        assert [opt._phase(opt.param_groups[0], w) for w in ws] == ([0, 1, 0, 1] if stagger else [0] * 4)
        assert [opt.owner(w) for w in ws] == owners, (stagger, [opt.owner(w) for w in ws])


def _two_ranks(rank: int, world: int, d: str) -> None:
    _equivalence_and_save(rank, world, d)
    _staggered_owners(rank, world)
    _state_dict_round_trip(rank, world)
    _layerwise_save(rank, world, d)


def _copy(model: nn.Module) -> tuple[dict[int, nn.Parameter], ShardedShampoo]:
    """Copies of the model's DTensor parameters and gradients (by id of the original) and a ShardedShampoo on them."""
    clones = {id(p): nn.Parameter(p.detach().clone()) for p in model.parameters()}
    for p in model.parameters():
        clones[id(p)].grad = p.grad.clone()
    mark_split(clones[id(model.layers[4].weight)], 3)
    mark_experts(clones[id(model.experts)])
    groups = param_groups(model, matrix_flag="use_shampoo")
    return clones, ShardedShampoo([g | {"params": [clones[id(p)] for p in g["params"]]} for g in groups],
                                  **OPTIMIZERS["shampoo"][2])


def _state_dict_round_trip(rank: int, world: int) -> None:
    """A fresh optimizer loaded from ``state_dict()``, or from a state dict holding every matrix's state, takes the
    same next step; one rank's state dict at another world size (the step only of a matrix this rank owns) is
    refused; compact state is refused; a NaN in one rank's shard stops the step on every rank."""
    model, opt = sharded("shampoo", world)
    global_losses(model, opt, range(3))
    x, y = data(3)
    nn.functional.mse_loss(model(x), y).backward()
    sd = opt.state_dict()
    everyone = [None] * world
    dist.all_gather_object(everyone, sd)
    # every matrix's state from its owner; this rank's own where the ranks hold as much (AdamW's DTensor shards)
    whole = sd | {"state": {i: max((e["state"][i] for e in [sd, *everyone]), key=len) for i in sd["state"]}}
    copies = [_copy(model), _copy(model)]
    copies[0][1].load_state_dict(sd)
    copies[1][1].load_state_dict(whole)
    opt.step()
    for clones, copy in copies:
        copy.step()
        for p in model.parameters():
            assert torch.equal(p.to_local(), clones[id(p)].to_local())
    steps_only = opt.state_dict()
    steps_only["state"] = {i: {"step": st["step"]} if "left_root0" in st else st
                           for i, st in steps_only["state"].items()}
    with pytest.raises(ValueError, match="holds only the step of a .* matrix that this rank owns"):
        copies[0][1].load_state_dict(steps_only)
    with pytest.raises(ValueError, match="state_dtype"):
        ShardedShampoo(param_groups(model, matrix_flag="use_shampoo"), state_dtype="bf16")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    if rank == 0:
        model.layers[2].weight.grad.to_local()[0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"`layers.2.weight` \(shape \(8, 8\)\)"):
        opt.step()


def _one_rank(rank: int, world: int, d: str) -> None:
    _resume(rank, world, d)
    _layerwise_resume(rank, world, d)


@pytest.fixture(scope="module")
def saved_at_2(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("fsdp_precond_2"))
    run(_two_ranks, 2, d)
    return d


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory, saved_at_2) -> str:
    d = str(tmp_path_factory.mktemp("fsdp_precond_4"))
    run(_four_ranks, 4, saved_at_2, d)
    return d


def test_two_ranks_match_one_process(saved_at_2):
    """Shampoo and SOAP at 2 ranks (the work is in the fixture): losses and parameters of one process, state on
    the owners, the state_dict round trip; a layer-wise checkpoint saved."""


def test_four_ranks_match_one_process_and_resume_from_two(saved_at_4):
    """At 4 ranks (empty shards): one process's losses and parameters, the 2-rank checkpoint resumed exactly."""


def test_checkpoint_from_two_ranks_resumes_at_one(saved_at_2):
    run(_one_rank, 1, saved_at_2)


def test_checkpoint_from_four_ranks_resumes_at_two(saved_at_4):
    run(_resume, 2, saved_at_4)


def _deferred(rank: int, world: int) -> None:
    """deferred_nonfinite=True under FSDP2: the ranks agree on the local shards' flags on the device. A NaN in one
    rank's shard at a step whose refresh (if any) runs on the device writes nothing on any rank (the owners' state,
    every rank's step counts, AdamW's shards) and every rank raises at the next call; at a step whose refresh reads
    the host (Shampoo's Newton roots) every rank raises in the step. Either way the run then equals the run without
    that step, bit for bit."""
    import copy

    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    def run(name: str, nan_at: int | None, left_out: int | None, how: list[bool]) -> dict[str, torch.Tensor]:
        _, cls, hp = OPTIMIZERS[name]
        torch.manual_seed(0)
        model = apply_fsdp(Net(), mesh).mark()
        opt = cls(param_groups(model, matrix_flag=cls.matrix_flag), deferred_nonfinite=True, **hp)
        for step in range(5):
            if step == left_out:
                continue
            x, y = data(step)
            nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            if step != nan_at:
                opt.step()
                opt.zero_grad()
                continue
            if rank == 1:
                model.layers[3].weight.grad.to_local()[0, 0] = float("nan")
            params = [local(p).clone() for p in model.parameters()]
            state = [(p, copy.deepcopy({k: local(v) for k, v in st.items()})) for p, st in opt.state.items()]
            try:
                opt.step()
            except NonFiniteGradientError as e:  # a step computing roots or bases: read on the host, every rank
                assert "layers.3.weight" in str(e)
                how.append(False)
            else:
                how.append(True)
                with pytest.raises(NonFiniteGradientError, match=r"at the last step in `layers\.3\.weight`"):
                    opt.state_dict()
            opt.zero_grad()
            assert all(torch.equal(a, local(p)) for a, p in zip(params, model.parameters())), name
            for p, st in state:
                assert opt.state[p].keys() == st.keys(), name
                for k, v in st.items():
                    w = local(opt.state[p][k])
                    assert torch.equal(v, w) if torch.is_tensor(v) else v == w, (name, k)
        return full_params(model)

    for name in OPTIMIZERS:
        how: list[bool] = []
        for nan_at in (1, 2, 3):
            got, want = run(name, nan_at, None, how), run(name, None, nan_at, how)
            assert all(torch.equal(got[n], want[n]) for n in want), (name, nan_at)
        # Shampoo's Newton roots read the host at their refresh steps, its eigenbasis roots at the first (an eigh);
        # SOAP's QR refreshes run on the device
        assert True in how and (False in how) == name.startswith("shampoo"), (name, how)


def test_deferred_nonfinite_check_skips_on_every_rank():
    run(_deferred, 2, timeout=300)


def _host_reads(rank: int, world: int) -> None:
    """Staggered eigenbasis roots under a deferred check read its flag on the host only at the first refresh (the
    eigh), on every rank alike: a rank holding only the step of a matrix another rank owns does not take it for a
    state without bases, whose refresh would read the host. A state without bases (Newton roots before) takes its
    power steps from the identity."""
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    model, opt = sharded("shampoo_eigen", world, deferred_nonfinite=True)
    real, reads = opt.nonfinite.on_host, []

    def on_host(skip):
        reads.append(step)
        return real(skip)

    opt.nonfinite.on_host = on_host
    for step in range(STEPS):
        x, y = data(step)
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
    start = OPTIMIZERS["shampoo_eigen"][2]["precondition_frequency"]  # the first refresh, at step `start`
    assert reads and set(reads) == {start - 1}, f"rank {rank}: the flag was read on the host at steps {reads}"

    model, opt = sharded("shampoo", world)  # Newton roots, then eigenbasis roots from the owners' roots alone
    global_losses(model, opt, range(4))
    for group in opt.param_groups:
        group["root_method"] = "eigenbasis"
    global_losses(model, opt, range(4, STEPS))
    owned = [st for p, st in opt.state.items() if any(k.startswith("left") or k.startswith("right") for k in st)]
    assert owned and all(any("_basis" in k for k in st) for st in owned)
    assert all(torch.isfinite(p.full_tensor()).all() for p in model.parameters())


def test_staggered_eigenbasis_refreshes_read_the_flag_on_the_host_only_at_the_first():
    run(_host_reads, 2)


def test_plain_parameters_are_refused():
    with pytest.raises(ValueError, match=r"ShardedShampoo handles the DTensor matrices of an FSDP2 model; "
                                         r"`params\[0\]` \(shape \(4, 4\)\) is a plain Parameter"):
        ShardedShampoo([nn.Parameter(torch.ones(4, 4))])
    with pytest.raises(ValueError, match="use matrixopt.SOAP unsharded"):
        ShardedSOAP([nn.Parameter(torch.ones(4, 4))])


# ----------------------------------------------------------------------------------------------------------
# layer-wise Shampoo and SOAP: saved at 2 ranks, resumed at 1 and 4

LAYERWISE = {"shampoo": dict(lr=2e-2, precondition_frequency=2), "soap": dict(lr=2e-2, precondition_frequency=2)}


def layerwise_steps(model: nn.Module, opt, steps: range) -> None:
    for step in steps:
        idx, tgt = batch(step, "square")
        sl = mdist.batch_slice(idx.shape[0])
        opt.zero_grad()
        loss_of(model, idx[sl], tgt[sl]).backward()
        opt.step()
    opt.wait_params()


def _layerwise_save(rank: int, world: int, d: str) -> None:
    for name, hp in LAYERWISE.items():
        model, opt = mdist.layerwise(make("square"), name, bucket_cap_mb=1e-4, **hp)
        layerwise_steps(model, opt, range(SAVE_AT))
        checkpoint.save(f"{d}/lw_{name}", model, opt, extra={"step": SAVE_AT})
        if rank == 0:
            torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, f"{d}/lw_{name}_at_save.pt")
        layerwise_steps(model, opt, range(SAVE_AT, STEPS))
        if rank == 0:
            torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, f"{d}/lw_{name}_end.pt")


def _layerwise_resume(rank: int, world: int, d: str) -> None:
    for name, hp in LAYERWISE.items():
        model, opt = mdist.layerwise(make("square", seed=123), name, bucket_cap_mb=1e-4, **hp)
        assert checkpoint.load(f"{d}/lw_{name}", model, opt) == {"step": SAVE_AT}
        for n, p in torch.load(f"{d}/lw_{name}_at_save.pt").items():
            assert torch.equal(dict(model.named_parameters())[n].detach(), p), f"{name}: {n} not restored"
        layerwise_steps(model, opt, range(SAVE_AT, STEPS))
        for n, p in torch.load(f"{d}/lw_{name}_end.pt").items():
            torch.testing.assert_close(dict(model.named_parameters())[n].detach(), p, rtol=RTOL, atol=1e-5,
                                       msg=f"layer-wise {name} resumed at {world} ranks: {n} differs")


# ----------------------------------------------------------------------------------------------------------
# the trainer: `--parallel fsdp --optimizer shampoo` at 2 ranks logs the losses of one process

ROOT = Path(__file__).resolve().parents[2]
TRAIN = [
    "train", "--optimizer", "shampoo", "--lr", "0.003", "--opt", "precondition_frequency=2", "--n-layer", "1",
    "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4", "--steps", "4",
    "--eval-every", "2", "--eval-iters", "1", "--warmup", "1", "--log-every", "1", "--threads", "1",
    "--no-progress",
]  # fmt: skip


def logged(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_trainer_fsdp_shampoo_logs_single_process_losses(tmp_path):
    assert main([*TRAIN, "--out", str(tmp_path / "one")]) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "matrixopt",
           *TRAIN, "--out", str(tmp_path / "fsdp"), "--parallel", "fsdp"]
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = logged(tmp_path / "fsdp"), logged(tmp_path / "one")
    assert [m["step"] for m in got] == [m["step"] for m in want] and len(want) >= 4
    for g, w in zip(got, want):
        for k in ("loss", "val_loss"):
            if w.get(k) is not None:
                assert g[k] == pytest.approx(w[k], rel=RTOL), (k, g["step"])
    assert (tmp_path / "fsdp" / "ckpt" / ".metadata").is_file()
