"""Layer-wise distributed optimizer on CPU with gloo: the same parameters as the single-process optimizer on the
same global batch, at 1 to 4 ranks, for every registered optimizer; LPT ownership; faults."""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import subprocess
import sys
import time
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _mp import run
from torch import nn

import matrixopt.distributed as mdist
from matrixopt import OPTIMIZERS, NonFiniteGradientError, build_optimizer, mark_split
from matrixopt.distributed.balance import COST_TOLERANCE, assign, lpt, matrix_cost, muon_cost, rebalance_state
from matrixopt.optim.routing import param_groups
from matrixopt.train.model import GPT, PRESETS, GPTConfig

# fp32 sums over ranks add the per-rank gradients in another order than one process's batch sum; the difference
# (~1e-7 relative) passes through a few optimizer steps. Measured differences are below 1e-6; a wrong reduction
# (sum instead of mean, a missing rank, a stale parameter) moves parameters by > 1e-3.
RTOL, ATOL = 1e-4, 1e-5
layerwise_module = importlib.import_module("matrixopt.distributed.layerwise")  # the package exports a function so named
BATCH, T, VOCAB, D = 24, 4, 16, 8  # BATCH and BATCH / 2 divide by 1, 2, 3 and 4 ranks
LR = {"adamw": 1e-2}
DEFAULT_LR = 2e-2


class Net(nn.Module):
    """Embedding -> MLP with residual -> optional big matrix -> RMSNorm -> head; routing sends fc1/fc2 (and
    big) to the matrix optimizer, the rest to AdamW."""

    def __init__(self, hidden: int = 12, big: int = 0):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.fc1 = nn.Linear(D, hidden)
        self.fc2 = nn.Linear(hidden, D, bias=False)
        self.big = nn.Parameter(torch.randn(big, D) / D) if big else None
        self.ln = nn.RMSNorm(D)  # LayerNorm would make fc2's gradient rank-deficient (rows sum to 0): ill-posed MOP
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # (B, T, D)
        x = x + self.fc2(F.gelu(self.fc1(x)))
        if self.big is not None:
            x = x + torch.tanh(x @ self.big.T) @ self.big / self.big.shape[0]  # (B, T, D)
        return self.head(self.ln(x))  # (B, T, VOCAB)


class Tiny(nn.Module):
    """Two parameters (a matrix and a bias): fewer than 3 or 4 ranks."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lin(F.one_hot(idx, D).float())


def make(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return {"net": Net, "square": lambda: Net(hidden=D), "big": lambda: Net(big=256), "tiny": Tiny}[kind]()


def batch(step: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    hi = D if kind == "tiny" else VOCAB
    idx = torch.randint(0, hi, (BATCH, T), generator=g)
    return idx, torch.randint(0, VOCAB, (BATCH, T), generator=g)


def loss_of(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tgt.reshape(-1))


def reference(kind: str, name: str, steps: int, accum: int = 1, clip: float | None = None,
              **hp) -> tuple[nn.Module, list[float]]:
    """The single-process optimizer on the whole global batch."""
    model = make(kind)
    opt = build_optimizer(model, name, lr=LR.get(name, DEFAULT_LR), **hp)
    norms = []
    for s in range(steps):
        opt.zero_grad()
        idx, tgt = batch(s, kind)
        for mi, ti in zip(idx.chunk(accum), tgt.chunk(accum)):
            (loss_of(model, mi, ti) / accum).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return model, norms


def distributed(kind: str, name: str, steps: int, accum: int = 1, clip: float | None = None, model=None,
                **kw) -> tuple[nn.Module, mdist.LayerwiseOptimizer, list[float]]:
    model = make(kind) if model is None else model
    kw.setdefault("bucket_cap_mb", 1e-4)  # a bucket per parameter: each gradient reduced in place
    model, opt = mdist.layerwise(model, name, lr=LR.get(name, DEFAULT_LR), **kw)
    norms = []
    for s in range(steps):
        opt.zero_grad()
        idx, tgt = batch(s, kind)
        micro = list(zip(idx.chunk(accum), tgt.chunk(accum)))
        for i, (mi, ti) in enumerate(micro):
            sl = mdist.batch_slice(mi.shape[0])
            ctx = opt.no_sync() if i < accum - 1 else torch.enable_grad()
            with ctx:
                (loss_of(model, mi[sl], ti[sl]) / accum).backward()
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
    opt.wait_params()
    return model, opt, norms


def same_on_every_rank(model: nn.Module) -> None:
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, flat)
    for r, other in enumerate(everyone):
        assert torch.equal(other, flat), f"rank {r}'s parameters differ from rank {dist.get_rank()}'s"


def assert_matches(model: nn.Module, ref: nn.Module, init: nn.Module, what: str) -> None:
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=f"{what}: {n} differs")
    moved = max((p.detach() - p0.detach()).abs().max().item() for p, p0 in zip(model.parameters(), init.parameters()))
    assert moved > 100 * ATOL, f"{what}: parameters barely moved ({moved}); the comparison would prove nothing"


def _equivalence_worker(rank: int, world: int) -> None:
    names = sorted(OPTIMIZERS)
    # SOAP runs Adam in the eigenbasis of its factors; a rectangular matrix's larger factor has a degenerate zero
    # eigenspace whose basis is arbitrary, so round-off moves SOAP's steps by ~10% even in one process (batch
    # summed in two halves vs whole). Square hidden matrices make it well-posed (~1e-6).
    cases = [(n, "square" if n == "soap" else "net", {}) for n in names]
    cases += [("muon", "net", {"accum": 2}), ("muon", "net", {"clip": 0.05}), ("muon", "big", {}),
              ("adamw", "tiny", {}), ("muon", "tiny", {}),
              ("muon", "net", {"accum": 2, "clip": 0.05, "bucket_cap_mb": 25.0}),  # gradients copied into buckets
              ("muon", "net", {"clip": 0.05, "offload": "cpu"}),  # each owner's state in host memory
              ("adamuon", "net", {"offload": "cpu"})]
    for name, kind, extra in cases:
        what = f"{name}/{kind}/{extra} at {world} ranks"
        ref, ref_norms = reference(kind, name, steps=3, **{k: v for k, v in extra.items()
                                                          if k in ("accum", "clip")})
        model, opt, norms = distributed(kind, name, steps=3, **extra)
        if "bucket_cap_mb" in extra:
            assert any(len(b.params) > 1 for b in opt.buckets), what
        if "offload" in extra:
            assert opt.chunks and all(c.optimizer.offload is not None for c in opt.chunks), what
        assert_matches(model, ref, make(kind), what)
        same_on_every_rank(model)
        for a, b in zip(norms, ref_norms):
            assert abs(a - b) <= 1e-5 * b, f"{what}: global grad norm {a} != single-process {b}"
        if extra.get("clip"):
            assert all(n > extra["clip"] for n in ref_norms), "clip threshold must bind for the test to mean anything"
        # each rank holds the state of the parameters it owns, and nothing else
        owned = set(opt.owned_names())
        assert set(opt.state_dict()["state"]) == owned, what
        counts = [None] * world
        dist.all_gather_object(counts, len(owned))
        assert sum(counts) == len(opt.params), what
        if kind == "tiny" and world > 2:
            assert 0 in counts, f"{what}: with 2 parameters some rank must own nothing, got {counts}"
        if kind == "big":
            big_owner = opt.owner[id(model.big)]
            others = [p for p in opt.params if p is not model.big and p.ndim >= 2 and opt.owner[id(p)] == big_owner
                      and opt.names[id(p)] in ("fc1.weight", "fc2.weight")]
            assert world == 1 or not others, f"{what}: LPT should leave the big matrix's owner no other matrix"
    if world <= 2:
        _bf16_checks(rank, world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matches_single_process(world):
    """Every registered optimizer, accumulation, clipping, a big matrix, fewer parameters than ranks; and at 1 and
    2 ranks bf16 parameters with fp32 masters on owners."""
    run(_equivalence_worker, world, timeout=200)


def _bf16_checks(rank: int, world: int) -> None:
    """bf16 parameters: fp32 masters and fp32 state on the owner only, every rank's bf16 copy the master's cast."""
    # reference: one process with fp32 master weights of a bf16 model
    ref = make("net").to(torch.bfloat16)
    master = make("net")
    mark_split(master.fc1.weight, 2)  # the fp32 masters keep the layout marks: each half orthogonalized alone
    opt_ref = build_optimizer(master, "muon", lr=DEFAULT_LR)
    for s in range(3):
        idx, tgt = batch(s, "net")
        loss_of(ref, idx, tgt).backward()
        for p, m in zip(ref.parameters(), master.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        opt_ref.step()
        with torch.no_grad():
            for p, m in zip(ref.parameters(), master.parameters()):
                p.copy_(m)
    model = make("net").to(torch.bfloat16)
    mark_split(model.fc1.weight, 2)
    model, opt, _ = distributed("net", "muon", steps=3, model=model, reduce_dtype=torch.float32)
    same_on_every_rank(model)
    for p in model.parameters():
        assert p.dtype == torch.bfloat16
        mine = opt.owner[id(p)] == rank
        assert (id(p) in opt.masters) == mine, "fp32 masters must exist on the owner only"
        if mine:
            m = opt.masters[id(p)]
            assert m.dtype == torch.float32 and torch.equal(m.to(torch.bfloat16), p.detach())
            assert getattr(m, "_matrixopt_split", None) == getattr(p, "_matrixopt_split", None)
            state = opt._inner_optimizer(p).state[m]
            assert all(v.dtype == torch.float32 for v in state.values() if v.ndim > 0)
    for p, q in zip(model.parameters(), ref.parameters()):
        # bf16 local gradients of a half batch vs of the whole batch: bf16 rounding, then 3 steps
        torch.testing.assert_close(p.float(), q.float(), rtol=0, atol=2e-2)


def _faults_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    # a rank whose model differs is named in an error on every rank, not a hang
    model = Net()
    if rank == 1:
        model.fc2 = nn.Linear(12, D + 1, bias=False)
    with pytest.raises(ValueError, match=r"`fc2.weight` has shape \(8, 12\) on rank 0 but \(9, 12\) on rank 1"):
        mdist.layerwise(model, "muon", lr=0.01)
    with pytest.raises(ValueError, match=r"rank 0 is built with .*'param_dtype': None.*, rank 1 with "
                                         r".*'param_dtype': torch.bfloat16"):
        mdist.layerwise(Net(), "muon", lr=0.01, param_dtype=torch.bfloat16 if rank else None)
    with pytest.raises(ValueError, match=r"rank 0 builds 'muon' .* rank 1 builds 'muon'"):
        mdist.layerwise(Net(), "muon", lr=0.01 * (rank + 1))
    with pytest.raises(ValueError, match="exists on rank 1 but not on rank 0"):
        m = Net()
        if rank == 1:
            m.extra = nn.Linear(3, 3)
        mdist.layerwise(m, "muon", lr=0.01)

    # NaN on one rank's batch: every rank raises, nothing is written
    model, opt = mdist.layerwise(Net(), "muon", lr=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    idx, tgt = batch(0, "net")
    loss = loss_of(model, idx, tgt) * (float("nan") if rank == 1 else 1.0)
    loss.backward()
    with pytest.raises(NonFiniteGradientError, match="no parameter or state was updated on any rank"):
        opt.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    assert not opt.state_dict()["state"]
    assert all(c.optimizer.nonfinite.wrapped for c in opt.chunks)  # the agreed check is the only one
    _, skipping = mdist.layerwise(Net(), "muon", lr=0.01, skip_nonfinite=True)
    assert not any(c.optimizer.nonfinite.wrapped for c in skipping.chunks)  # owners skip their own bad gradients

    # clipped first: the clip's per-gradient norms are the agreement's flags (no second read of the gradients),
    # and the step still raises on every rank, naming the bad parameters, with nothing written
    model, opt = mdist.layerwise(Net(), "muon", lr=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    (loss_of(model, idx, tgt) * (float("nan") if rank == 1 else 1.0)).backward()
    assert not torch.isfinite(opt.clip_grad_norm_(1.0))
    reads = layerwise_module.nonfinite_flags
    layerwise_module.nonfinite_flags = None  # calling it would fail the step with a TypeError
    try:
        with pytest.raises(NonFiniteGradientError, match=r"fc1\.weight.*no parameter or state was updated"):
            opt.step()
    finally:
        layerwise_module.nonfinite_flags = reads
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    # gloo cannot average inside a reduction: the owners divide the sums
    assert not any(b.mean for b in opt.buckets)
    with pytest.raises(ValueError, match="gloo backend cannot average"):
        mdist.comm.reduce_to_owner(torch.zeros(3), 0, opt.group, mean=True)
    # a backward after the clip makes its flags stale: the step reads the new gradients itself
    model, opt = mdist.layerwise(Net(), "muon", lr=0.01)
    loss_of(model, idx, tgt).backward()
    opt.clip_grad_norm_(1.0)
    opt.zero_grad()
    (loss_of(model, idx, tgt) * (float("nan") if rank == 0 else 1.0)).backward()
    with pytest.raises(NonFiniteGradientError):
        opt.step()

    # a second backward without no_sync is an error that says how to accumulate
    loss_of(model, idx, tgt).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        loss_of(model, idx, tgt).backward()
    opt.zero_grad()

    # a dead rank makes the others fail within the timeout instead of hanging
    model, opt = mdist.layerwise(Net(), "muon", lr=0.01, timeout=timedelta(seconds=5))
    if rank == 1:
        os._exit(0)
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        loss_of(model, idx, tgt).backward()
        opt.step()
    assert time.monotonic() - start < 30


def test_faults_mismatch_nonfinite_dead_rank():
    run(_faults_worker, 2)


def _deferred_nonfinite_worker(rank: int, world: int, name: str) -> None:
    """deferred_nonfinite=True: the ranks agree on the device, a NaN step writes nothing on any rank and raises at
    the next step() or state_dict() on every rank; training then goes on as if the bad step never happened (SOAP's
    and Shampoo's step counts, host ints, are taken back too)."""
    import copy

    def run_steps(nan_at: int | None, raise_by: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model, opt = mdist.layerwise(Net(), name, lr=0.01, deferred_nonfinite=True)
        assert opt.nonfinite.deferred and all(c.optimizer.nonfinite.wrapped for c in opt.chunks)
        for s in range(4):
            idx, tgt = batch(s, "net")
            bad = s == nan_at
            loss = loss_of(model, idx, tgt) * (float("nan") if bad and rank == 1 else 1.0)
            loss.backward()
            if not bad:
                opt.step()
                continue
            params = [p.detach().clone() for p in model.parameters()]
            states = [{id(p): copy.deepcopy(st) for p, st in c.optimizer.state.items()} for c in opt.chunks]
            opt.step()  # no error yet, nothing written
            assert all(torch.equal(a, b.detach()) for a, b in zip(params, model.parameters()))
            for before, c in zip(states, opt.chunks):
                after = {id(p): st for p, st in c.optimizer.state.items()}
                assert before.keys() == after.keys()
                for k, st in before.items():
                    assert all(torch.equal(v, after[k][n]) for n, v in st.items() if isinstance(v, torch.Tensor))
            with pytest.raises(NonFiniteGradientError, match="at the last step .* skipped: no parameter or state"):
                if raise_by == "state_dict":
                    opt.state_dict()
                else:  # the next step raises before anything, its gradients dropped; the step after runs
                    loss_of(model, *batch(s, "net")).backward()
                    opt.step()
            for before, c in zip(states, opt.chunks):  # the counts too, once the error is out
                after = {id(p): st for p, st in c.optimizer.state.items()}
                for k, st in before.items():
                    assert all(v == after[k][n] for n, v in st.items() if not isinstance(v, torch.Tensor)), name
        return [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(0)
    model, opt = mdist.layerwise(Net(), name, lr=0.01, deferred_nonfinite=True)
    for s in (0, 1, 3):  # the run without the bad step
        loss_of(model, *batch(s, "net")).backward()
        opt.step()
    for raise_by in ("state_dict", "step"):
        for a, b in zip(run_steps(2, raise_by), model.parameters()):
            assert torch.equal(a, b.detach()), (name, raise_by)


@pytest.mark.parametrize("name", ["muon", "soap", "shampoo"])
def test_deferred_nonfinite_agreement(name):
    run(_deferred_nonfinite_worker, 2, name)


def _bf16_broadcast_worker(rank: int, world: int) -> None:
    """Under bf16 autocast, broadcasting the matrices in bf16 changes no loss and no owner's value; the other
    ranks hold the owner's value rounded to bf16."""
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    runs = {}
    for wire in (None, torch.bfloat16):
        torch.manual_seed(0)
        model, opt = mdist.layerwise(GPT(cfg), "muon", lr=DEFAULT_LR, bucket_cap_mb=0.01, broadcast_dtype=wire)
        losses = []
        for s in range(3):
            x = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(70 + s))
            sl = mdist.batch_slice(8)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x[sl, :-1], x[sl, 1:])[1]
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        opt.wait_params()
        runs[wire] = (model, opt, losses)
    (ref, _, ref_losses), (model, opt, losses) = runs[None], runs[torch.bfloat16]
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses)), (ref_losses, losses)
    wires = {b.wire for b in opt.buckets}
    assert wires == {None, torch.bfloat16}, wires
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        b = opt._bucket_of[id(p)][0]
        if b.wire is None or b.owner == rank:
            assert torch.equal(p, q), f"{name}: the owner's value (or an unnarrowed one) must be exact"
        else:
            assert torch.equal(p, q.bfloat16().float()) and not torch.equal(p, q), f"{name}: not its bf16 rounding"


def test_bf16_broadcast_changes_no_result_under_autocast():
    run(_bf16_broadcast_worker, 2)


def test_broadcast_dtype_must_be_floating():
    with pytest.raises(ValueError, match="broadcast_dtype must be a floating-point torch.dtype"):
        mdist.layerwise(Net(), "muon", broadcast_dtype=torch.int8)
    with pytest.raises(ValueError, match="param_dtype must be a floating-point torch.dtype"):
        mdist.layerwise(Net(), "muon", param_dtype=torch.int8)


def _bf16_params_worker(rank: int, world: int, folder: str) -> None:
    """Matrices kept in bf16 (fp32 masters on their owners, micro-batch gradients summed in fp32 buffers) train
    bit for bit as fp32 matrices broadcast in bf16 under bf16 autocast: the same losses, the owners' masters equal
    the fp32 run's parameters, every rank's bf16 copy is their rounding, and a checkpoint's values are the masters.
    Gradients summed in bf16 ``p.grad`` over the micro-batches, or reduced in bf16, would change the losses."""
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    runs = {}
    for lowered in (False, True):
        torch.manual_seed(0)
        kw = {"param_dtype": torch.bfloat16} if lowered else {"broadcast_dtype": torch.bfloat16}
        model, opt = mdist.layerwise(GPT(cfg), "muon", lr=DEFAULT_LR, bucket_cap_mb=0.01, **kw)
        losses = []
        for s in range(3):
            for micro in range(3):  # accumulation: the first two micro-batches under no_sync
                x = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(70 + 10 * s + micro))
                sl = mdist.batch_slice(8)
                with opt.no_sync() if micro < 2 else contextlib.nullcontext():
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = model(x[sl, :-1], x[sl, 1:])[1]
                    loss.backward()
                losses.append(loss.detach())
            opt.clip_grad_norm_(0.5)
            opt.step()
        opt.wait_params()
        runs[lowered] = (model, opt, losses)
    (ref, ref_opt, ref_losses), (model, opt, losses) = runs[False], runs[True]
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses)), (ref_losses, losses)
    lowered = [n for n, p in model.named_parameters() if p.dtype == torch.bfloat16]
    assert lowered and all(".mlp." in n or ".attn." in n for n in lowered), lowered
    assert any(b.flat is not None for b in opt.buckets), "no bucket of several bf16 matrices: the views untested"
    compared = 0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.dtype != torch.bfloat16:
            assert torch.equal(p, q), name
            continue
        # q is the fp32 run's exact value where that run's owner is this rank, else its bf16 rounding
        assert torch.equal(p, q.bfloat16()), f"{name}: not the fp32 run's value rounded to bf16"
        if opt.owns(p) and ref_opt.owns(q):
            assert torch.equal(opt.masters[id(p)], q), f"{name}: the owner's master is not the fp32 run's value"
            compared += 1
    assert sum(mdist.comm.all_gather_object(compared, None)) > 0
    # a checkpoint holds the exact masters, and loading one sets each master and its bf16 copy
    path = f"{folder}/ckpt"
    mdist.checkpoint.save(path, model, opt)
    dist.barrier()
    saved = mdist.checkpoint.export(path)["model"]
    for name, p in model.named_parameters():
        assert saved[name].dtype == torch.float32, name
        if id(p) in opt.masters:
            assert torch.equal(saved[name], opt.masters[id(p)]), name
        assert torch.equal(saved[name].to(p.dtype), p), name
    torch.manual_seed(1)
    fresh, fresh_opt = mdist.layerwise(GPT(cfg), "muon", lr=DEFAULT_LR, bucket_cap_mb=0.01,
                                       param_dtype=torch.bfloat16)
    mdist.checkpoint.load(path, fresh, fresh_opt)
    for (name, p), q in zip(fresh.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
        if id(p) in fresh_opt.masters:
            assert torch.equal(fresh_opt.masters[id(p)], saved[name]), name
    # a step skipped on the device (deferred check, NaN on one rank) leaves every weight and master as it was
    model, opt = mdist.layerwise(GPT(cfg), "muon", lr=DEFAULT_LR, bucket_cap_mb=0.01, param_dtype=torch.bfloat16,
                                 deferred_nonfinite=True)
    x = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(99))
    sl = mdist.batch_slice(8)
    for bad in (False, True):
        opt.wait_params()  # the last step's broadcasts have landed
        before = [t.clone() for t in [*model.parameters(), *opt.masters.values()]]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x[sl, :-1], x[sl, 1:])[1] * (float("nan") if bad and rank == 1 else 1.0)
        loss.backward()
        opt.step()
        opt.wait_params()
        after = [*model.parameters(), *opt.masters.values()]
        assert all(torch.equal(a, b) for a, b in zip(before, after)) == bad, bad


def test_bf16_params_train_as_fp32_params_under_autocast(tmp_path):
    run(_bf16_params_worker, 2, str(tmp_path))


def _arrival_order_worker(rank: int, world: int) -> None:
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)  # wpe: registered last, used first

    def data(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(50 + s))
        return x[:, :-1], x[:, 1:]

    torch.manual_seed(0)
    ref = GPT(cfg)
    ref_opt = build_optimizer(ref, "muon", lr=DEFAULT_LR)
    torch.manual_seed(0)
    model, opt = mdist.layerwise(GPT(cfg), "muon", lr=DEFAULT_LR, bucket_cap_mb=0.01)  # several params a bucket
    guessed = [[opt.names[id(p)] for p in b.params] for b in opt.buckets]
    held_back: list[int] = []  # per step: most buckets complete but not yet launched at any gradient's arrival
    launch = opt._launch_ready_grads

    def watched() -> None:
        launch()
        complete = sum(b.arrived == len(b.params) for b in opt.buckets)
        held_back[-1] = max(held_back[-1], complete - (len(opt.buckets) - 1 - opt._next_grad))

    opt._launch_ready_grads = watched
    sl = mdist.batch_slice(8)
    for s in range(3):  # clipped (the threshold binds): the first step's clip must survive the rebuilt chunks
        x, y = data(s)
        ref_opt.zero_grad()
        ref(x, y)[1].backward()
        assert torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1) > 0.1
        ref_opt.step()
        held_back.append(0)
        model(x[sl], y[sl])[1].backward()
        opt.clip_grad_norm_(0.1)
        opt.step()
    assert held_back[0] > 0, "the guessed order must hold buckets back for this test to show anything"
    assert held_back[1:] == [0, 0], f"buckets waited for gradients outside them: {held_back}"
    assert [[opt.names[id(p)] for p in b.params] for b in opt.buckets] != guessed
    assert opt.names[id(opt.buckets[0].params[0])] in ("transformer.wte.weight", "transformer.wpe.weight"), \
        "the bucket broadcast first must hold what the forward uses first"
    opt.wait_params()
    assert_matches(model, ref, GPT(cfg), "after buckets rebuilt to the arrival order")

    # a fresh optimizer loading this state rebuilds its chunks at its first step and must carry the state over
    twin = GPT(cfg)
    twin.load_state_dict(model.state_dict())
    _, twin_opt = mdist.layerwise(twin, "muon", lr=DEFAULT_LR, bucket_cap_mb=0.01)
    twin_opt.load_state_dict(opt.state_dict())
    x, y = data(3)
    for m, o in ((model, opt), (twin, twin_opt)):
        m(x[sl], y[sl])[1].backward()
        o.step()
        o.wait_params()
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=RTOL, atol=ATOL, msg=f"resumed: {n} differs")


def _release_worker(rank: int, world: int) -> None:
    model, opt = mdist.layerwise(Net(), "muon", lr=DEFAULT_LR)
    x = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    opt.step()
    opt.wait_params()
    dead_opt, dead_model = weakref.ref(opt), weakref.ref(model)
    del opt
    gc.collect()
    assert dead_opt() is None, "the parameters' gradient hooks kept the optimizer alive"
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters()), "its hooks outlived it"
    model(x).square().mean().backward()  # the model trains on without it (no hook left to call)
    del model
    gc.collect()
    assert dead_model() is None


def test_a_dropped_optimizer_releases_itself_and_its_hooks():
    """An optimizer nothing refers to any more is freed with its state, and its hooks leave the parameters: a bound
    method in a gradient hook, which lives in autograd's C++ state, kept model and state alive for good."""
    run(_release_worker, 2)


def test_buckets_follow_gradient_arrival_order():
    """A model that registers a parameter out of the order it uses it in (GPT's wpe): from the second step on,
    each bucket is reduced as soon as its own gradients have arrived, the first bucket broadcast is one the forward
    needs first, results equal one process's, and a resumed optimizer keeps its state through the rebuild."""
    run(_arrival_order_worker, 2)


def test_lpt_is_deterministic_balanced_and_stable():
    costs = [5.0, 3.0, 3.0, 2.0, 2.0, 2.0, 1.0]
    owner, loads = lpt(costs, 3)
    assert owner == lpt(costs, 3)[0]
    assert owner == [0, 1, 2, 1, 2, 0, 1] and loads == [7.0, 6.0, 5.0]  # by hand; ties go to the lower rank
    assert lpt([1.0, 1.0], 4)[0] == [0, 1]  # fewer items than ranks: distinct ranks, the rest idle


def test_assign_puts_a_big_matrix_alone_and_spreads_adamw_memory():
    params = [torch.empty(256, 8), torch.empty(12, 8), torch.empty(8, 12), torch.empty(16, 8), torch.empty(8)]
    a = assign(params, [True, True, True, False, False], 2, muon_cost, lambda p, m: 4 * p.numel())
    assert a.owner[1] == a.owner[2] != a.owner[0]
    assert a.owner[3] == a.owner[1]  # the embedding's memory goes to the rank with fewer state bytes
    assert a.imbalance == pytest.approx(2 * max(a.compute) / sum(a.compute))
    assert "imbalance" in a.summary()


def test_rebalance_state_by_hand():
    # two layers of (QKV: 3 bytes, MLP in and out: 4 bytes each), the second QKV cheaper (12 instead of 18), then an
    # embedding (6 bytes, no cost). LPT's owners, embedding on the tie's lower rank: state 17 | 11, cost 54 | 48.
    costs, sizes = [18.0, 18.0, 18.0, 12.0, 18.0, 18.0, 0.0], [3, 4, 4, 3, 4, 4, 6]
    lpt_owner = [0, 1, 0, 1, 0, 1, 0]
    owner = rebalance_state(lpt_owner, costs, sizes, 2, cost_cap=54.0)
    assert owner == [0, 1, 1, 0, 0, 1, 0]  # item 2 (4 bytes) for item 3 (3 bytes): 16 | 12, cost 48 | 54; then none
    assert rebalance_state(lpt_owner, costs, sizes, 2, cost_cap=54.0) == owner
    assert rebalance_state(lpt_owner, costs, sizes, 2, cost_cap=53.0) == lpt_owner  # that swap would cost 54 > 53
    assert rebalance_state([0] * 7, costs, sizes, 1, cost_cap=0.0) == [0] * 7  # nothing to do on one rank...
    assert rebalance_state([], [], [], 3, cost_cap=0.0) == []  # ... or without parameters


def gpt_1_3b(world_size: int, cost_tolerance: float = COST_TOLERANCE):
    """Ownership of GPT 1.3B's parameters under layer-wise Muon, on the meta device: the trainer's preset with
    GPT-2's padded vocab, 50304 (tied embedding, fused QKV split in three), routed and ordered as
    LayerwiseOptimizer does. Returns the parameters, their routing and the assignment."""
    from matrixopt.train.model import QKV_SPLITS  # here: spawned ranks importing this module need no trainer

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=50304, **PRESETS["1.3b"]))
    matrix = {id(p): g["use_muon"] for g in param_groups(model, splits=QKV_SPLITS) for p in g["params"]}
    params = [p for _, p in model.named_parameters()]
    is_matrix = [matrix[id(p)] for p in params]
    a = assign(params, is_matrix, world_size, muon_cost, mdist.LayerwiseOptimizer._state_bytes, cost_tolerance)
    return params, is_matrix, a


def test_state_bytes_are_what_muon_allocates():
    """The bytes ownership balances are the optimizer state `matrixopt bench scale` measures: Muon's fp32 momentum
    for matrices, AdamW's two fp32 moments (plus a 4-byte step) for the rest. Checked on a small GPT; the 1.3B tests
    below rely on it."""
    from matrixopt.train.model import QKV_SPLITS

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    opt = build_optimizer(model, "muon", lr=1e-3, splits=QKV_SPLITS)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    held = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))
    groups = opt.param_groups
    expected = sum(mdist.LayerwiseOptimizer._state_bytes(p, g["use_muon"]) + (0 if g["use_muon"] else 4)
                   for g in groups for p in g["params"])
    assert held == expected


@pytest.mark.parametrize("world, tolerance, max_share, lpt_share",
                         [(2, COST_TOLERANCE, 0.55, 0.569), (4, 0.03, 0.33, 0.357)])
def test_gpt_1_3b_state_per_rank(world, tolerance, max_share, lpt_share):
    """Issue 6: at 1.3B shapes on 2 ranks, each rank's optimizer state is at most 0.55 of one process's. LPT on cost
    alone gives 0.569 (measured on 2 H200s, docs/results/distributed) and 0.357 at 4 ranks; rebalancing must get
    there without raising the largest matrix cost more than the tolerance above LPT's (the default, COST_TOLERANCE,
    at 2 ranks; 3% at 4, see balance.py)."""
    params, is_matrix, a = gpt_1_3b(world, tolerance)
    assert len(params) == 147 and sum(is_matrix) == 96
    assert a.state_share <= max_share < lpt_share, a.summary()
    _, lpt_loads = lpt([matrix_cost(p, muon_cost) for p, m in zip(params, is_matrix) if m], world)
    assert max(a.compute) <= (1 + tolerance) * max(lpt_loads)
    assert a.imbalance <= 1 + tolerance + 1e-12, a.summary()
    assert f"{a.state_share:.3f} of the total" in a.summary()


def test_gpt_1_3b_cost_tolerance_trades_compute_for_memory():
    _, _, exact = gpt_1_3b(2, cost_tolerance=0.0)
    _, _, loose = gpt_1_3b(2, cost_tolerance=0.05)
    assert loose.state_share < exact.state_share
    assert exact.imbalance <= 1 + 1e-12 and loose.imbalance <= 1.05 + 1e-12
    with pytest.raises(ValueError, match="cost_tolerance must be >= 0, got -0.1"):
        gpt_1_3b(2, cost_tolerance=-0.1)


def test_gpt_1_3b_assignment_is_deterministic():
    """Every rank computes the ownership on its own: the same owners on every call and in another interpreter
    (another hash seed), at several world sizes."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from test_layerwise import gpt_1_3b; "
            "print([list(gpt_1_3b(w)[2].owner) for w in (2, 3, 4, 8)])")
    here = [list(gpt_1_3b(w)[2].owner) for w in (2, 3, 4, 8)]
    assert here == [list(gpt_1_3b(w)[2].owner) for w in (2, 3, 4, 8)]
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == str(here)


def test_matrix_cost_counts_pieces():
    from matrixopt import mark_split
    p = mark_split(torch.empty(24, 8), 3)
    assert matrix_cost(p, muon_cost) == 3 * muon_cost(8, 8)
    assert muon_cost(8, 64) == muon_cost(64, 8) > muon_cost(8, 8)


def test_needs_an_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    with pytest.raises(RuntimeError, match="init_process_group"):
        mdist.layerwise(Net(), "muon")
