"""ShardedMuon under FSDP2 ``fully_shard`` and on a DP x TP mesh against single-process Muon, and sharded NorMuon
and AdaMuon under FSDP2 against theirs (CPU, gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _fake_copy import FakeDeviceCopy
from _mp import run
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from matrixopt.distributed.comm import chunk_sizes, gather_to_owners, scatter_from_owners
from matrixopt.distributed.fsdp import apply_fsdp
from matrixopt.distributed.sharded import ShardedAdaMuon, ShardedMuon, ShardedNorMuon
from matrixopt.distributed.tp import CostModel
from matrixopt.optim.adaptive import AdaMuon, NorMuon
from matrixopt.optim.layout import mark_split
from matrixopt.optim.muon import Muon
from matrixopt.optim.offload import Offload
from matrixopt.optim.routing import param_groups
from matrixopt.train.parallelize import rank_major_qkv

# Three Muon steps in fp32: the sharded run differs from the single-process one only by the order of float
# sums (FSDP's gradient reduce-scatter, distributed Newton–Schulz's Gram all-reduce); measured <= 2e-6. A wrong
# owner, shard order or update scale moves weights by about lr * 0.2 * sqrt(n) = 1e-2.
ATOL = 2e-5
STEPS = 3
HPARAMS = dict(lr=0.02, weight_decay=0.01)


class Net(nn.Module):
    """Linear layers in a ModuleList (each one FSDP unit). fc0's weight is (5, 8): 5 rows over 2 ranks are 3 + 2,
    over 4 ranks 2 + 2 + 1 + 0. Two (8, 8) weights share a Newton–Schulz batch. The tall (12, 5) weight's shards
    are tall over 2 ranks, wide over 4. The (12, 8) weight is split into three (4, 8) pieces, as QKV is. The shards
    of one matrix may differ in shape: (9, 4) is 5 + 4 rows over 2 ranks (tall and square), (13, 3) is 4 + 4 + 4
    + 1 over 4 (tall and wide), and every rank must lay them out alike for the owner gather."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 5), nn.Linear(5, 12), nn.Linear(12, 8, bias=False),
                                     nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 12),
                                     nn.Linear(12, 4), nn.Linear(4, 9), nn.Linear(9, 3), nn.Linear(3, 13)])

    def mark_qkv(self) -> Net:
        """Mark the split on the parameter the optimizer sees (after ``fully_shard``, which replaces it)."""
        mark_split(self.layers[5].weight, 3)
        return self

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 13, generator=g)  # global batch of 8


def _reference(cls: type = Muon) -> Net:
    torch.manual_seed(0)
    model = Net().mark_qkv()
    opt = cls(param_groups(model), **HPARAMS)
    for step in range(STEPS):
        x, y = _data(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


def _fsdp_matches_single_process(rank: int, world: int, cls: type = Muon, sharded: type = ShardedMuon) -> None:
    ref = _reference(cls)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = apply_fsdp(Net(), mesh).mark_qkv()
    opt = sharded(param_groups(model), **HPARAMS)
    per_rank = 8 // world
    for step in range(STEPS):
        x, y = _data(step)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()  # FSDP averages gradients over ranks
        opt.step()
        opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), (name, p)
        err = (p.full_tensor() - q).abs().max().item()
        assert err < ATOL, f"{name}: {err}"
    # state_dict round trip: a fresh optimizer loaded from it takes the same next step
    x, y = _data(STEPS)
    nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    groups = param_groups(model)
    clones = {id(p): nn.Parameter(p.detach().clone()) for g in groups for p in g["params"]}
    for g in groups:
        for p in g["params"]:
            clones[id(p)].grad = p.grad.clone()
    qkv = model.layers[5].weight
    mark_split(clones[id(qkv)], 3)
    opt2 = sharded([dict(g, params=[clones[id(p)] for p in g["params"]]) for g in groups], **HPARAMS)
    opt2.load_state_dict(opt.state_dict())
    opt.step()
    opt2.step()
    for p in model.parameters():
        assert torch.equal(p.to_local(), clones[id(p)].to_local())


def _groups(model: Net, cls: type) -> list[dict]:
    """fc0..fc7's weights as a matrix group, every bias in an AdamW group; fc8 and fc9 join later."""
    return [dict(params=[layer.weight for layer in model.layers[:8]]),
            {"params": [layer.bias for layer in model.layers if layer.bias is not None], cls.matrix_flag: False}]


def _changing_run(model: Net, opt: torch.optim.Optimizer, rows: slice) -> None:
    """Steps with what a step's kept layout must follow changed in between: hyperparameters, a parameter without
    a gradient, a param group added, the state loaded into a new optimizer."""
    for step in range(6):
        x, y = _data(step)
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        if step == 1:
            model.layers[3].weight.grad = None  # a step over fewer parameters: other owners
        if step == 2:
            group = opt.param_groups[0]
            group["lr"], group["momentum"], group["scaling"] = 0.03, 0.8, "spectral"
        if step == 3:
            opt.add_param_group(dict(params=[model.layers[8].weight, model.layers[9].weight], lr=0.01))
        if step == 4:
            fresh = type(opt)([dict(g, params=list(g["params"])) for g in opt.param_groups], **HPARAMS)
            fresh.load_state_dict(opt.state_dict())
            opt = fresh
        opt.step()
        opt.zero_grad()


def _fsdp_follows_changes_between_steps(rank: int, world: int, cls: type = Muon,
                                        sharded: type = ShardedMuon) -> None:
    torch.manual_seed(0)
    ref = Net().mark_qkv()
    _changing_run(ref, cls(_groups(ref, cls), **HPARAMS), slice(None))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = apply_fsdp(Net(), mesh).mark_qkv()
    per_rank = 8 // world
    _changing_run(model, sharded(_groups(model, cls), **HPARAMS), slice(rank * per_rank, (rank + 1) * per_rank))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (p.full_tensor() - q).abs().max().item()
        assert err < ATOL, f"{name}: {err}"


def _owner_gather_sends_whole_matrices_to_owners_only(rank: int, world: int) -> None:
    sizes = chunk_sizes(5, world)  # uneven, possibly empty
    full = torch.arange(3 * 5 * 4, dtype=torch.float32).view(3, 5, 4)  # 3 matrices (5, 4)
    counts = [0] * world
    for owner in (0, 1 % world, 1 % world):  # matrix 0 to rank 0, matrices 1 and 2 to rank 1 (stack order)
        counts[owner] += 1
    mine = [i for i, o in enumerate((0, 1 % world, 1 % world)) if o == rank]
    for rows_dim in (1, 2):  # rows as they lie, or the stack transposed as Muon packs tall matrices
        stack = full if rows_dim == 1 else full.mT
        local = stack.split(sizes, dim=rows_dim)[rank].contiguous()
        owned = gather_to_owners(local, counts, sizes, rows_dim, None).wait()
        assert owned.shape == (len(mine), *stack.shape[1:])  # nothing but the matrices this rank owns
        assert torch.equal(owned, stack[mine])
        back = scatter_from_owners(-owned.mT.contiguous().mT, counts, sizes, rows_dim, None).wait()  # any strides
        assert torch.equal(back, -local)
    with pytest.raises(ValueError, match="does not match counts"):
        gather_to_owners(local, [3] * world, sizes, 2, None)


def _held_clip_matches_clipped_gradients(rank: int, world: int) -> None:
    """A clip coefficient held for the step (the trainer's FSDP2 clip) moves the weights as gradients multiplied by
    it before the step: the Muon matrices through the momentum pass (bit for bit), the AdamW biases through AdamW's
    kernel (which divides by the reciprocal: within an ulp or two). A wrong or missing coefficient moves a weight by
    about lr * 0.2 = 4e-3."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    per_rank = 8 // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    coef = torch.tensor(0.3)
    runs = []
    for held in (True, False):
        torch.manual_seed(0)
        model = apply_fsdp(Net(), mesh).mark_qkv()
        opt = ShardedMuon(param_groups(model), **HPARAMS)
        weights = []
        for step in range(2):
            x, y = _data(step)
            nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            grads = [p.grad.to_local().clone() for p in model.parameters()]
            if held:
                opt.scale_grads_(coef)
                assert opt.nonfinite._clip is not None  # held: the gradients are as backward left them
                assert all(torch.equal(p.grad.to_local(), g) for p, g in zip(model.parameters(), grads))
            else:
                torch._foreach_mul_([p.grad for p in model.parameters()], coef)
            opt.step()
            opt.zero_grad()
            weights.append({name: p.to_local().clone() for name, p in model.named_parameters()})
        runs.append(weights)
    (first, second), (first_ref, second_ref) = runs
    for name, w in first.items():  # one step: the same gradients
        if name.endswith("weight"):
            assert torch.equal(w, first_ref[name]), name
        torch.testing.assert_close(w, first_ref[name], rtol=0, atol=1e-7, msg=name)  # an ulp or two
    for name, w in second.items():  # a second step from biases a rounding apart
        torch.testing.assert_close(w, second_ref[name], rtol=0, atol=2e-6, msg=name)


def _fsdp_checks(rank: int, world: int) -> None:
    _owner_gather_sends_whole_matrices_to_owners_only(rank, world)
    _held_clip_matches_clipped_gradients(rank, world)
    _fsdp_matches_single_process(rank, world)
    for cls, sharded in ((NorMuon, ShardedNorMuon), (AdaMuon, ShardedAdaMuon)):
        _fsdp_matches_single_process(rank, world, cls, sharded)
    for cls, sharded in ((Muon, ShardedMuon), (NorMuon, ShardedNorMuon)):
        _fsdp_follows_changes_between_steps(rank, world, cls, sharded)


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_muon_matches_single_process(world):
    run(_fsdp_checks, world, timeout=180)


def _deferred_nonfinite(rank: int, world: int) -> None:
    """deferred_nonfinite=True under FSDP2 (Muon, NorMuon, AdaMuon): the ranks agree on the local shards' flags on
    the device. With the fused kernels (Triton's interpreter here, as on a GPU) a step with a NaN in one rank's
    shard writes nothing on any rank and every rank raises at the next step; the run then goes on as if that step
    never happened. Off the fused kernels (the torch references) the flag is read on the host mid-step: every rank
    raises in that step, nothing written."""
    import _interpreter  # noqa: F401  (the interpreter's patches, in this worker process)

    from matrixopt import NonFiniteGradientError
    from matrixopt.kernels.muon_elementwise import elementwise_backend

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    per_rank = 8 // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)

    def run_steps(sharded: type, nan: bool) -> list[torch.Tensor]:
        """Steps 0, 1 and 3, with a NaN in step 2's gradients (or step 2 left out)."""
        torch.manual_seed(0)
        model = apply_fsdp(Net(), mesh).mark_qkv()
        opt = sharded(param_groups(model), deferred_nonfinite=True, **HPARAMS)
        nan_at = 2 if nan else None
        for step in range(4):
            x, y = _data(step)
            if step == 2 and not nan:
                continue
            nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            if step == nan_at and rank == 1:
                model.layers[3].weight.grad.to_local()[0, 0] = float("nan")
            if step != nan_at:
                opt.step()
                opt.zero_grad()
                continue
            before = [p.to_local().clone() for p in model.parameters()]
            state = [t.to_local().clone() if isinstance(t, DTensor) else t.clone()
                     for st in opt.state.values() for t in st.values()]
            try:
                opt.step()  # with the fused kernels: no error yet
                opt.zero_grad()
                nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
                with pytest.raises(NonFiniteGradientError, match=r"layers\.3\.weight.*skipped"):
                    opt.step()  # raises before anything, on every rank
            except NonFiniteGradientError as e:
                assert elementwise == "torch", e  # read on the host in the bad step itself
            assert all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))
            after = [t.to_local() if isinstance(t, DTensor) else t for st in opt.state.values() for t in st.values()]
            assert len(state) == len(after) and all(torch.equal(a, b) for a, b in zip(state, after))
            opt.zero_grad()
        return [p.full_tensor() for p in model.parameters()]

    for elementwise in ("triton", "torch"):
        with elementwise_backend(elementwise):
            for sharded in (ShardedMuon, ShardedNorMuon, ShardedAdaMuon):
                clean = run_steps(sharded, False)
                for a, b in zip(run_steps(sharded, True), clean):
                    assert torch.equal(a, b), (elementwise, sharded.__name__)


@pytest.mark.parametrize("world", [2, 4])  # over 4 ranks one rank's shard of fc0 is empty
def test_fsdp2_deferred_nonfinite_check_agrees_and_skips_on_every_rank(world):
    pytest.importorskip("triton")
    run(_deferred_nonfinite, world, timeout=300)


# ----------------------------------------------------------------------------------------------------------
# DP x TP on a 2 x 2 mesh

# name: (shape, placements on ("dp", "tp")). FSDP rows x TP columns (uneven rows), DDP x TP rows (uneven),
# FSDP only, and a same-shape pair batched together.
MESH_2D = {
    "fsdp_x_tp_cols": ((7, 10), (Shard(0), Shard(1))),
    "ddp_x_tp_rows": ((9, 6), (Replicate(), Shard(0))),
    "fsdp_only": ((5, 8), (Shard(0), Replicate())),
    "pair_a": ((8, 8), (Shard(0), Shard(1))),
    "pair_b": ((8, 8), (Shard(0), Shard(1))),
}


def _weights_and_grads() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(7)
    weights = {k: torch.randn(*shape, generator=g) * 0.1 for k, (shape, _) in MESH_2D.items()}
    grads = [{k: torch.randn(*shape, generator=g) for k, (shape, _) in MESH_2D.items()} for _ in range(STEPS)]
    return weights, grads


# Muon in every TP mode; NorMuon and AdaMuon (whose second moments see the shards) in one
TP_RUNS = [(Muon, ShardedMuon, "duplicated"), (Muon, ShardedMuon, "distributed"), (Muon, ShardedMuon, "auto"),
           (NorMuon, ShardedNorMuon, "duplicated"), (AdaMuon, ShardedAdaMuon, "distributed")]


def _dp_tp_mesh(rank: int, world: int) -> None:
    weights, grads = _weights_and_grads()
    refs = {}
    for cls in dict.fromkeys(cls for cls, _, _ in TP_RUNS):
        ref = refs[cls] = {k: nn.Parameter(w.clone()) for k, w in weights.items()}
        ref_opt = cls(list(ref.values()), **HPARAMS)
        for gs in grads:
            for k, p in ref.items():
                p.grad = gs[k].clone()
            ref_opt.step()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # a fixed cost model that makes auto choose distributed: no start-up measurement in the test
    for cls, sharded, mode in TP_RUNS:
        ref = refs[cls]
        params = {k: nn.Parameter(distribute_tensor(w, mesh, list(MESH_2D[k][1]))) for k, w in weights.items()}
        opt = sharded(list(params.values()), tp_mode=mode, tp_chunks=2,
                      tp_cost_model=CostModel(latency=0.0, bandwidth=1e15, flops=1e3), **HPARAMS)
        for gs in grads:
            for k, p in params.items():
                p.grad = distribute_tensor(gs[k], mesh, list(MESH_2D[k][1]))
            opt.step()
        for k, p in params.items():
            assert p.placements == MESH_2D[k][1]
            err = (p.full_tensor() - ref[k].detach()).abs().max().item()
            assert err < ATOL, f"{sharded.__name__} {mode} {k}: {err}"
    # offloaded float32 state on these layouts (NorMuon's row state replicated over TP): the same bits
    for sharded in (ShardedMuon, ShardedNorMuon):
        runs = []
        for options in ({}, {"offload": Offload(device_copy=FakeDeviceCopy())}):
            params = {k: nn.Parameter(distribute_tensor(w, mesh, list(MESH_2D[k][1]))) for k, w in weights.items()}
            opt = sharded(list(params.values()), tp_mode="duplicated", **HPARAMS, **options)
            for gs in grads:
                for k, p in params.items():
                    p.grad = distribute_tensor(gs[k], mesh, list(MESH_2D[k][1]))
                opt.step()
            runs.append([p.to_local() for p in params.values()])
        assert all(torch.equal(a, b) for a, b in zip(*runs)), sharded.__name__
    bad = nn.Parameter(distribute_tensor(weights["pair_a"], mesh, [Shard(0), Shard(0)]))
    bad.grad = distribute_tensor(grads[0]["pair_a"], mesh, [Shard(0), Shard(0)])
    with pytest.raises(ValueError, match="both shard the rows"):
        ShardedMuon([bad]).step()
    dist.barrier()


def test_dp_x_tp_mesh_matches_single_process():
    run(_dp_tp_mesh, 4, timeout=180)


# Column-parallel weights on a 2 x 2 mesh, under TP alone and with FSDP2 on top (placements (_StridedShard(0),
# Shard(0))): a rank-major fused QKV weight split into Q, K, V, and an uneven (10, 8) weight (TP rows 5 + 5, FSDP
# rows 3 + 2).
COLWISE = {"qkv": (24, 8), "fc": (10, 8)}


def _column_parallel(rank: int, world: int) -> None:
    dp, tp = 2, 2
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    g = torch.Generator().manual_seed(3)
    weights = {k: torch.randn(*shape, generator=g) * 0.1 for k, shape in COLWISE.items()}
    grads = [{k: torch.randn(*shape, generator=g) for k, shape in COLWISE.items()} for _ in range(STEPS)]
    order = {"qkv": rank_major_qkv(8, tp), "fc": torch.arange(10)}  # row order of the sharded weights
    refs, ref_opts = {}, {}
    for cls in dict.fromkeys(cls for cls, _, _ in TP_RUNS):
        ref = refs[cls] = {k: nn.Parameter(w.clone()) for k, w in weights.items()}
        mark_split(ref["qkv"], 3)
        ref_opt = ref_opts[cls] = cls(list(ref.values()), **HPARAMS)
        for gs in grads:
            for k, p in ref.items():
                p.grad = gs[k].clone()
            ref_opt.step()
    for fsdp in (False, True):
        for cls, sharded, mode in TP_RUNS:
            if mode == "auto":
                continue
            ref = refs[cls]
            net = nn.ModuleDict({k: nn.Linear(n, m, bias=False) for k, (m, n) in COLWISE.items()})
            with torch.no_grad():
                for k, linear in net.items():
                    linear.weight.copy_(weights[k][order[k]])
            parallelize_module(net, mesh["tp"], {k: ColwiseParallel() for k in COLWISE})
            if fsdp:
                for linear in net.values():
                    fully_shard(linear, mesh=mesh["dp"])
                assert isinstance(net["fc"].weight.placements[0], _StridedShard)
            mark_split(net["qkv"].weight, 3)
            opt = sharded([net[k].weight for k in COLWISE], tp_mode=mode, **HPARAMS)
            for gs in grads:
                for k, linear in net.items():  # this rank's rows: its TP shard, then (fsdp) its FSDP rows of that
                    rows = gs[k][order[k]].split(chunk_sizes(COLWISE[k][0], tp))[tp_rank]
                    if fsdp:
                        rows = rows.split(chunk_sizes(rows.size(0), dp))[dp_rank]
                    linear.weight.grad = torch.zeros_like(linear.weight)
                    linear.weight.grad.to_local().copy_(rows)
                opt.step()
            for k, linear in net.items():
                err = (linear.weight.full_tensor()[order[k].argsort()] - ref[k].detach()).abs().max().item()
                assert err < ATOL, f"fsdp={fsdp} {sharded.__name__} {mode} {k}: {err}"
                if cls is NorMuon:  # the row second moments are DTensors laid out as the rows: whole, they match
                    v = opt.state[linear.weight]["row_second_moment"]
                    assert v.placements == linear.weight.placements
                    v_ref = ref_opts[cls].state[ref[k]]["row_second_moment"].flatten()  # (3, 8) for the split qkv
                    torch.testing.assert_close(v.full_tensor()[order[k].argsort()], v_ref, rtol=1e-4, atol=1e-7)
    dist.barrier()


def test_column_parallel_and_fsdp_over_tp_match_single_process():
    run(_column_parallel, 4, timeout=120)


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="tp_mode 'fast'"):
        ShardedMuon([nn.Parameter(torch.ones(4, 4))], tp_mode="fast")
    with pytest.raises(ValueError, match="tp_chunks"):
        ShardedMuon([nn.Parameter(torch.ones(4, 4))], tp_chunks=0)


# ----------------------------------------------------------------------------------------------------------
# offloaded and compact state under FSDP2

SHARDED = (ShardedMuon, ShardedNorMuon, ShardedAdaMuon)


class Embedded(nn.Module):
    """Net between an embedding (20, 8) and a LayerNorm, which param_groups routes to AdamW (with and without weight
    decay): DTensors of the AdamW groups beside the matrices."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.net = Net()
        self.norm = nn.LayerNorm(13)

    def forward(self, tokens):
        return self.norm(self.net(self.emb(tokens).mean(1)))


def _tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randint(0, 20, (8, 4), generator=g), torch.randn(8, 13, generator=g)


def _embedded(world: int, sharded: type, seed: int = 0, **options) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Embedded()
    if world:
        model = apply_fsdp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    model.net.mark_qkv()
    return model, sharded(param_groups(model), **(HPARAMS | options))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    world = dist.get_world_size() if isinstance(next(model.parameters()), DTensor) else 1
    rank = dist.get_rank() if world > 1 else 0
    mine = slice(rank * 8 // world, (rank + 1) * 8 // world)
    for step in steps:
        x, y = _tokens(step)
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _local_state(opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Every state tensor as this rank holds it, in parameter order."""
    return [(k, _local(v)) for g in opt.param_groups for p in g["params"] for k, v in opt.state[p].items()
            if torch.is_tensor(v)]


def _assert_same(a: nn.Module, oa: torch.optim.Optimizer, b: nn.Module, ob: torch.optim.Optimizer, what: str) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(_local(p), _local(q)), f"{what}: {name}"
    sa, sb = _local_state(oa), _local_state(ob)
    assert [k for k, _ in sa] == [k for k, _ in sb], what
    for (k, u), (_, v) in zip(sa, sb):
        assert u.dtype == v.dtype and torch.equal(u, v), f"{what}: state {k}"


def _offloaded_matches_on_device(rank: int, world: int) -> None:
    """offload="cpu" with float32 state: bit for bit the step without offload, parameters and state, with the
    AdamW groups' DTensors in chunks of their own (a small CHUNK_NUMEL); the state stays DTensors laid out as
    the parameters, their local tensors in host memory."""
    from matrixopt.optim import base

    base.CHUNK_NUMEL = 64  # several AdamW chunks: the embedding (80 values a rank) alone, the norms and biases
    for sharded in SHARDED:
        copies = FakeDeviceCopy()
        ref, opt_ref = _embedded(world, sharded)
        model, opt = _embedded(world, sharded, offload=Offload(device_copy=copies))
        _steps(ref, opt_ref, range(STEPS))
        _steps(model, opt, range(STEPS))
        _assert_same(ref, opt_ref, model, opt, sharded.__name__)
        assert copies.calls > 0  # the state went through the device copy
        # the host-memory check counts this rank's shards: the state twice and a copy of the parameters
        each = [(sharded.matrix_state_tensors if g["use_muon"] else 2, p.to_local().numel())
                for g in opt.param_groups for p in g["params"]]
        assert opt._offload_host_bytes()[0] == sum((2 * k + 1) * 4 * n for k, n in each)
        assert sum(n for _, n in each) < sum(p.numel() for p in model.parameters())
        for p, q in zip(model.parameters(), ref.parameters()):
            for k, v in opt.state[p].items():
                want = opt_ref.state[q][k]
                assert type(v) is type(want) and (not isinstance(v, DTensor) or v.placements == want.placements), k
                assert _local(v).device.type == "cpu"


def _compact_state(rank: int, world: int) -> None:
    """state_dtype="bf16" under FSDP2. Each shard rounds with bits keyed by where it starts in the whole parameter,
    so the run can't match one process bit for bit (whose parameter draws one stream from its first value); it is
    checked against float32 state instead:

    - with lr=0 the gradients are the same at every step, so the float32 momentum approaches the gradient
      geometrically. Stored in bf16 its increments soon fall below half a unit in the last place: rounded to
      nearest, the stored momentum stops short (measured: 1% low after 40 steps at momentum 0.9, 2.3% after 60),
      while stochastic rounding keeps it unbiased (measured: within 0.03%). The mean relative error of the matrix
      momentum and of the AdamW first moment after 50 steps must stay below 0.2% (a momentum not carried from step
      to step would be 90% low);
    - with the learning rate on, three steps of Muon, NorMuon and AdaMuon stay within 1e-2 of the float32 run
      (the weights move by 1.6e-2 to 6e-2; bf16 momentum measured up to 6e-3 off, which Newton–Schulz amplifies
      along these small matrices' weakest directions), and the state is bf16 DTensors laid out as the parameters;
      offloaded, the same bits."""
    steps = 50
    for options in ({}, {"offload": Offload(device_copy=FakeDeviceCopy())}):
        f32, opt32 = _embedded(world, ShardedMuon, lr=0.0, momentum=0.9, adamw_betas=(0.9, 0.95))
        bf16, opt16 = _embedded(world, ShardedMuon, lr=0.0, momentum=0.9, adamw_betas=(0.9, 0.95),
                                state_dtype="bf16", **options)
        for _ in range(steps):  # the same batch: lr=0 keeps the weights, so the gradients repeat
            _steps(f32, opt32, range(1))
            _steps(bf16, opt16, range(1))
        for key in ("momentum_buffer", "exp_avg"):
            a = torch.cat([_local(opt32.state[p][key]).flatten() for p in f32.parameters() if key in opt32.state[p]])
            b = torch.cat([_local(opt16.state[p][key]).float().flatten() for p in bf16.parameters()
                           if key in opt16.state[p]])
            mask = a.abs() > 1e-6
            total = torch.stack([((b - a)[mask] / a[mask]).sum(), mask.sum().float()])  # < 0: short of a
            dist.all_reduce(total)
            bias = (total[0] / total[1]).item()
            assert abs(bias) < 2e-3, f"{key} {options}: mean relative error {bias}"
    for sharded in SHARDED:
        runs = []
        for options in ({}, {"state_dtype": "bf16"}, {"state_dtype": "bf16", "offload": "cpu"}):
            model, opt = _embedded(world, sharded, **options)
            _steps(model, opt, range(STEPS))
            runs.append((model, opt))
        (ref, _), (model, opt), (off, opt_off) = runs
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            err = (p.full_tensor() - q.full_tensor()).abs().max().item()
            assert err < 1e-2, f"{sharded.__name__} bf16 {name}: {err}"
        _assert_same(model, opt, off, opt_off, f"{sharded.__name__} bf16 offloaded")
        emb = opt.state[model.emb.weight]["exp_avg"]
        assert isinstance(emb, DTensor) and emb.dtype == torch.bfloat16 and emb.placements == (Shard(0),)
    with pytest.raises(NotImplementedError, match=r"int8.*emb\.weight.*state_dtype='bf16'"):
        _embedded(world, ShardedMuon, state_dtype="int8")
    model, opt = _embedded(world, ShardedMuon)
    groups = [g for g in param_groups(model) if g["use_muon"]]  # int8: the matrices' state in bf16
    opt = ShardedMuon(groups, state_dtype="int8", **HPARAMS)
    _steps(model, opt, range(2))
    assert all(opt.state[p]["momentum_buffer"].dtype == torch.bfloat16 for p in groups[0]["params"])


class _FailingAt:
    """Stands in for ``fn``: raises RuntimeError at the ``n``-th call, calls ``fn`` otherwise."""

    def __init__(self, fn, n: int) -> None:
        self.fn, self.n, self.calls = fn, n, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("injected")
        return self.fn(*args, **kwargs)


def _faults(rank: int, world: int) -> None:
    """An exception mid-step (the update of the second bucket, on every rank: at 2 ranks no shard is empty, so each
    rank fails at the same bucket and the collectives stay matched) leaves the parameters and state of the step
    before on every rank; the same step then succeeds as the run without offload."""
    from matrixopt.distributed import sharded as sharded_module

    for sharded in (ShardedMuon, ShardedNorMuon):
        ref, opt_ref = _embedded(world, sharded)
        model, opt = _embedded(world, sharded, offload=Offload(device_copy=FakeDeviceCopy()))
        _steps(ref, opt_ref, range(2))
        _steps(model, opt, range(2))
        real = sharded_module.apply_update
        x, y = _tokens(2)
        mine = slice(rank * 8 // world, (rank + 1) * 8 // world)
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        sharded_module.apply_update = _FailingAt(real, 2)
        try:
            with pytest.raises(RuntimeError, match="injected"):
                opt.step()
        finally:
            sharded_module.apply_update = real
        _assert_same(ref, opt_ref, model, opt, f"{sharded.__name__} after the failed step")
        opt.step()
        opt.zero_grad()
        _steps(ref, opt_ref, range(2, 3))
        _assert_same(ref, opt_ref, model, opt, f"{sharded.__name__} the step again")


def _offloaded(on: bool) -> dict:
    return {"offload": Offload(device_copy=FakeDeviceCopy())} if on else {}


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``{name/key: whole tensor}`` of every state tensor (collective)."""
    return {f"{n}/{k}": v.full_tensor() if isinstance(v, DTensor) else v.clone()
            for n, p in model.named_parameters() for k, v in opt.state[p].items() if torch.is_tensor(v)}


def _checkpoints(rank: int, world: int, d: str) -> None:
    """DCP checkpoints do not depend on offload: saved offloaded and loaded into a run without offload, and the
    reverse, the run goes on as the uninterrupted one, bit for bit (float32 state). Saves the offloaded run's
    checkpoint, whole parameters and state for :func:`_reshard_offloaded`."""
    from matrixopt.distributed import checkpoint

    for sharded in (ShardedMuon, ShardedNorMuon):
        ref, opt_ref = _embedded(world, sharded)
        _steps(ref, opt_ref, range(4))
        final = {n: p.full_tensor() for n, p in ref.named_parameters()}
        for save_offloaded in (True, False):
            path = f"{d}/{sharded.__name__}_{save_offloaded}"
            model, opt = _embedded(world, sharded, **_offloaded(save_offloaded))
            _steps(model, opt, range(2))
            checkpoint.save_dtensor(path, model, opt, extra={"step": 2})
            state = _full_state(model, opt)
            if save_offloaded and rank == 0:
                torch.save({"state": state, "final": final}, f"{path}.pt")
            resumed, opt2 = _embedded(world, sharded, seed=1, **_offloaded(not save_offloaded))
            assert checkpoint.load_dtensor(path, resumed, opt2) == {"step": 2}
            loaded = _full_state(resumed, opt2)
            assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())
            _steps(resumed, opt2, range(2, 4))
            _assert_same(ref, opt_ref, resumed, opt2, f"{sharded.__name__} saved offloaded={save_offloaded}")


def _compact_resumes_exactly(rank: int, world: int, d: str) -> None:
    """bf16 state, offloaded: a DCP checkpoint keeps the rounding's step counter, so the resumed run rounds with
    the bits of the uninterrupted one and ends bit for bit the same; a checkpoint loaded into another optimizer
    class is refused."""
    from matrixopt.distributed import checkpoint

    compact = {"state_dtype": "bf16", **_offloaded(True)}
    ref, opt_ref = _embedded(world, ShardedMuon, **compact)
    _steps(ref, opt_ref, range(4))
    model, opt = _embedded(world, ShardedMuon, **compact)
    _steps(model, opt, range(2))
    path = f"{d}/compact"
    checkpoint.save_dtensor(path, model, opt, extra={"step": 2})
    resumed, opt2 = _embedded(world, ShardedMuon, seed=1, **compact)
    assert checkpoint.load_dtensor(path, resumed, opt2) == {"step": 2} and opt2.rounding_step == 2
    _steps(resumed, opt2, range(2, 4))
    _assert_same(ref, opt_ref, resumed, opt2, "bf16 state resumed")
    other, opt3 = _embedded(world, ShardedNorMuon, **compact)
    with pytest.raises(ValueError, match="saved by ShardedMuon, not ShardedNorMuon"):
        checkpoint.load_dtensor(path, other, opt3)
    # a checkpoint written before the optimizer's own entries were saved still loads
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "trainer": checkpoint._pickled({"step": 2})},
             checkpoint_id=f"{d}/older")
    older, opt4 = _embedded(world, ShardedMuon, seed=1, **compact)
    assert checkpoint.load_dtensor(f"{d}/older", older, opt4) == {"step": 2}
    assert torch.equal(_local(next(older.parameters())), _local(next(model.parameters())))


def _reshard_offloaded(rank: int, world: int, d: str) -> None:
    """The offloaded 2-rank checkpoint of :func:`_checkpoints` at another number of ranks, offloaded: the whole
    state comes back exactly, and the run ends as the 2-rank run (up to the order of float sums)."""
    from matrixopt.distributed import checkpoint

    for sharded in (ShardedMuon, ShardedNorMuon):
        path = f"{d}/{sharded.__name__}_True"
        saved = torch.load(f"{path}.pt")
        model, opt = _embedded(world, sharded, seed=1, **_offloaded(True))
        assert checkpoint.load_dtensor(path, model, opt) == {"step": 2}
        loaded = _full_state(model, opt)
        assert loaded.keys() == saved["state"].keys()
        assert all(torch.equal(loaded[k], v) for k, v in saved["state"].items())
        _steps(model, opt, range(2, 4))
        for n, p in model.named_parameters():
            err = (p.full_tensor() - saved["final"][n]).abs().max().item()
            assert err < ATOL, f"{sharded.__name__} at {world} ranks: {n} {err}"


def _offload_and_compact(rank: int, world: int, d: str) -> None:
    _offloaded_matches_on_device(rank, world)
    _faults(rank, world)
    _checkpoints(rank, world, d)
    _compact_resumes_exactly(rank, world, d)
    _compact_state(rank, world)


def test_fsdp2_offloaded_and_compact_state(tmp_path):
    run(_offload_and_compact, 2, str(tmp_path), timeout=300)
    run(_reshard_offloaded, 1, str(tmp_path), timeout=120)
