"""Expert parallelism under FSDP2, on gloo: EP 2 (world 2, no replicas) and EP 2 x DP 2 (world 4) train the MoE
GPT to the single-process losses (router and load-balancing loss active), the dense parameters FSDP2 DTensors and
the expert blocks plain tensors stepped in the same optimizer; checkpoints hold the whole stacks and reshard
exactly (EP 2 -> EP 1 at 2 ranks, 4 ranks -> 2, and into one process), and training continues from them; a rank
whose experts receive no tokens still steps."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _mp import run
from test_ep import (
    RTOL,
    assert_idle_experts_decay_only,
    assert_same,
    config,
    keep_checkpoints_at,
    metrics,
    no_tokens_model,
    resume_from,
)
from test_ep_layerwise import SEED, reshard
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

import matrixopt.train.trainer as trainer
from matrixopt.distributed.parallelism import make_parallelism
from matrixopt.train.config import TrainConfig, from_dict
from matrixopt.train.data import load_dataset
from matrixopt.train.model import GPT, PRESETS


def fsdp(optimizer: str, ep: int, **kw) -> TrainConfig:
    return from_dict(TrainConfig, config(optimizer, parallel="fsdp", ep=ep, seed=SEED, **kw))


def _runs_w4(rank: int, world: int, tmp: Path) -> None:
    keep_checkpoints_at(4)
    for name in RTOL:
        trainer.train(fsdp(name, 2, ckpt_every=2), tmp / f"{name}-ep2-w4", progress=False)


def _runs_w2(rank: int, world: int, tmp: Path, w4: Path) -> None:
    keep_checkpoints_at(4)
    trainer.train(fsdp("adamw", 2), tmp / "adamw-ep2-w2", progress=False)
    ep2, ep1 = fsdp("muon", 2, ckpt_every=2), fsdp("muon", 1, ckpt_every=2)
    trainer.train(ep2, tmp / "muon-ep2-w2", progress=False)
    if rank == 0:
        resume_from(tmp / "muon-ep2-w2", "ckpt4", tmp / "ep1")
        resume_from(w4 / "muon-ep2-w4", "ckpt4", tmp / "w4-to-w2")
        resume_from(tmp / "muon-ep2-w2", "ckpt4", tmp / "one-process")
    trainer.train(ep1, tmp / "ep1", resume=True, progress=False)  # EP 2 -> EP 1 x DP 2 at step 4
    trainer.train(ep2, tmp / "w4-to-w2", resume=True, progress=False)  # EP 2 x DP 2 -> EP 2 at step 4
    reshard(tmp / "muon-ep2-w2" / "ckpt4", tmp / "ep2-to-ep1", ep1)
    reshard(w4 / "muon-ep2-w4" / "ckpt4", tmp / "w4-to-ep2", ep2)
    _no_tokens(rank, tmp)


def _one_process(rank: int, world: int, tmp: Path) -> None:
    trainer.train(fsdp("muon", 1, ckpt_every=2), tmp / "one-process", resume=True, progress=False)
    reshard(tmp / "muon-ep2-w2" / "ckpt4", tmp / "ep2-to-w1", fsdp("muon", 1))


def _no_tokens(rank: int, tmp: Path) -> None:
    """One step of Muon where no token reaches rank 1's experts; records, per expert stack, the largest entry of
    its reduced gradient and its largest distance from weight decay alone, and the clip's global gradient norm
    with one process's on the whole batch."""
    par = make_parallelism("fsdp", device="cpu", ep=2)
    rows = [torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(r)) for r in range(2)]
    ref = no_tokens_model()
    for _ in range(2):
        ref(torch.cat(rows), torch.cat(rows))[1].backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
    model = no_tokens_model()
    module = par.wrap(model)
    lr, wd = 0.1, 0.5
    opt = par.build_optimizer(model, "muon", lr=lr, weight_decay=wd)
    stacks = [p for m in model.moe_layers() for p in m.experts.parameters()]
    assert stacks and not any(isinstance(p, DTensor) for p in stacks)  # kept out of FSDP2
    before = [p.detach().clone() for p in stacks]
    idx = rows[rank]
    for micro in range(2):  # two micro-batches, the first without gradient sync
        with par.no_sync() if micro == 0 else torch.enable_grad():
            module(idx, idx)[1].backward()
    par.sync_grads()
    norm = par.clip_grad_norm_(1.0).item()
    grads = [p.grad.abs().max().item() for p in stacks]
    opt.step()
    record = [dict(grad=g, off_decay=(p.detach() - b * (1 - lr * wd)).abs().max().item(), scale=b.abs().max().item())
              for g, p, b in zip(grads, stacks, before)]
    (tmp / f"no-tokens-{rank}.json").write_text(json.dumps(dict(stacks=record, norm=norm, want=want)))


def export(path: Path) -> dict[str, Any]:
    """A DCP checkpoint folder read in one process: ``{"model": ..., "optim": ..., "trainer": ...}``."""
    buf = io.BytesIO()
    dcp_to_torch_save(path, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def assert_equal(got: Any, want: Any, where: str = "") -> None:
    """Bit-for-bit equality of two exported checkpoints, but for the pickled trainer state (RNG, timings) and the
    lr schedule's ``initial_lr``, which the trainer's schedule sets on the groups and a bare reload does not."""
    if isinstance(want, dict):
        want = {k: v for k, v in want.items() if k != "initial_lr"}
        assert got.keys() == want.keys(), where
        for k in want:
            assert_equal(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_equal(g, w, f"{where}/{i}")
    elif torch.is_tensor(want):
        assert torch.equal(got, want), where
    elif where != "/trainer":
        assert got == want, where


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, Path]:
    """World size -> the folder of its runs: 4 ranks, then 2 (which resume from a 4-rank checkpoint), then one
    process (which resumes from a 2-rank one, in the 2-rank folder)."""
    w4, w2 = tmp_path_factory.mktemp("ep-fsdp-w4"), tmp_path_factory.mktemp("ep-fsdp-w2")
    run(_runs_w4, 4, w4, timeout=180)
    run(_runs_w2, 2, w2, w4, timeout=180)
    run(_one_process, 1, w2, timeout=120)
    return {2: w2, 4: w4}


@pytest.mark.parametrize("world", [2, 4])
def test_matches_single_process(runs, ep_single, world):
    out = runs[world]
    for name, rtol in RTOL.items():
        assert_same(metrics(out / f"{name}-ep2-w{world}"), metrics(ep_single / name), rtol)


def test_reshard_is_exact(runs):
    """A checkpoint loaded at another EP degree or rank count and saved again holds the same tensors, bit for bit:
    the parameters and every optimizer state, in the single-process layout."""
    w2, w4 = runs[2], runs[4]
    ep2, dp2 = w2 / "muon-ep2-w2" / "ckpt4", w4 / "muon-ep2-w4" / "ckpt4"
    for src, dst in ((ep2, w2 / "ep2-to-ep1"), (ep2, w2 / "ep2-to-w1"), (dp2, w2 / "w4-to-ep2")):
        assert_equal(export(dst), export(src))


def test_resume_across_ep_degrees_and_ranks(runs):
    w2, w4 = runs[2], runs[4]
    want = metrics(w2 / "muon-ep2-w2")
    assert_same(metrics(w2 / "ep1"), want, RTOL["muon"])
    assert_same(metrics(w2 / "one-process"), want, RTOL["muon"])
    assert_same(metrics(w2 / "w4-to-w2"), metrics(w4 / "muon-ep2-w4"), RTOL["muon"])


def test_checkpoint_holds_whole_stacks(runs):
    """The expert stacks and their momenta are saved whole: the model loads into a single-process GPT."""
    ck = export(runs[4] / "muon-ep2-w4" / "ckpt")
    cfg = fsdp("muon", 1)
    model = GPT(cfg.model.gpt_config(load_dataset(cfg.data).vocab_size))
    model.load_state_dict(ck["model"])
    n_expert = PRESETS["moe-tiny"]["n_expert"]
    stacks = {n: p for n, p in model.named_parameters() if p.ndim == 3}
    assert stacks and all(p.shape[0] == n_expert for p in stacks.values())
    assert all(ck["optim"]["state"][n]["momentum_buffer"].shape == p.shape for n, p in stacks.items())


def test_experts_without_tokens_still_step(runs):
    assert_idle_experts_decay_only(*(json.loads((runs[2] / f"no-tokens-{r}.json").read_text())["stacks"]
                                     for r in (1, 0)))


def test_clip_takes_the_global_norm(runs):
    """The norm clipping sees: the dense DTensor gradients' and every expert's once (summed over the EP group), as
    one process's on the whole batch (fp32 reduction order)."""
    for r in range(2):
        record = json.loads((runs[2] / f"no-tokens-{r}.json").read_text())
        assert record["norm"] == pytest.approx(record["want"], rel=1e-5)


VARIANTS = ("normuon", "adamuon")  # Muon's variants on the expert stacks, beside their sharded DTensor form


def variant(name: str, **kw) -> TrainConfig:
    return from_dict(TrainConfig, config("muon", seed=SEED, **kw) | dict(optim=dict(name=name, lr=1e-2)))


def _variant_runs(rank: int, world: int, tmp: Path) -> None:
    for name in VARIANTS:
        trainer.train(variant(name, parallel="fsdp", ep=2), tmp / f"{name}-fsdp", progress=False)


def test_muon_variants_step_the_expert_stacks(tmp_path):
    run(_variant_runs, 2, tmp_path, timeout=180)
    for name in VARIANTS:
        trainer.train(variant(name), tmp_path / f"{name}-single", progress=False)
        assert_same(metrics(tmp_path / f"{name}-fsdp"), metrics(tmp_path / f"{name}-single"), 1e-4)
