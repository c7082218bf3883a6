"""Layer-wise checkpoints: saved at 4 ranks, resumed at 2 and 1 (and from the exported single file) giving the
step the 4-rank run took; an interrupted resume cannot train on stale parameters."""

from __future__ import annotations

import pytest
import torch
from _mp import run
from test_layerwise import ATOL, RTOL, Net, batch, loss_of, make

import matrixopt.distributed as mdist
from matrixopt.distributed import checkpoint

HP = dict(lr=2e-2, bucket_cap_mb=1e-4)


def train_step(model, opt, step: int) -> None:
    idx, tgt = batch(step, "net")
    sl = mdist.batch_slice(idx.shape[0])
    opt.zero_grad()
    loss_of(model, idx[sl], tgt[sl]).backward()
    opt.clip_grad_norm_(1.0)
    opt.step()
    opt.wait_params()


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _save_worker(rank: int, world: int, d: str) -> None:
    model, opt = mdist.layerwise(make("net"), "muon", **HP)
    for s in range(2):
        train_step(model, opt, s)
    checkpoint.save(f"{d}/ckpt", model, opt, extra={"step": 2})
    if rank == 0:
        torch.save(params(model), f"{d}/at_save.pt")
    train_step(model, opt, 2)
    if rank == 0:
        torch.save(params(model), f"{d}/expected.pt")


def check_next_step(model, opt, d: str, what: str) -> None:
    for n, p in torch.load(f"{d}/at_save.pt").items():
        assert torch.equal(dict(model.named_parameters())[n].detach(), p), f"{what}: {n} not restored exactly"
    train_step(model, opt, 2)
    for n, p in torch.load(f"{d}/expected.pt").items():
        torch.testing.assert_close(dict(model.named_parameters())[n].detach(), p, rtol=RTOL, atol=ATOL,
                                   msg=f"{what}: {n} differs from the 4-rank run's next step")


def _resume_worker(rank: int, world: int, d: str) -> None:
    model, opt = mdist.layerwise(make("net", seed=123), "muon", **HP)  # other weights: stale ones would show

    def interrupted() -> None:
        raise KeyboardInterrupt("interrupted before the parameters were synchronised")

    opt.sync_params = interrupted
    with pytest.raises(KeyboardInterrupt):
        checkpoint.load(f"{d}/ckpt", model, opt)
    del opt.sync_params
    idx, tgt = batch(2, "net")
    with pytest.raises(RuntimeError, match="parameters are stale"):
        model(idx)
    with pytest.raises(RuntimeError, match="parameters are stale"):
        opt.step()

    assert checkpoint.load(f"{d}/ckpt", model, opt) == {"step": 2}
    check_next_step(model, opt, d, f"resumed at {world} ranks")

    if world == 1:
        sd = checkpoint.export(f"{d}/ckpt", f"{d}/plain.pt")
        assert torch.load(f"{d}/plain.pt", weights_only=False)["extra"] == {"step": 2}
        plain = make("net", seed=7)
        plain.load_state_dict(sd["model"])
        model, opt = mdist.layerwise(plain, "muon", **HP)
        opt.load_state_dict(sd["optimizer"])
        check_next_step(model, opt, d, "resumed from the exported file")

        other_model, other = mdist.layerwise(Net(hidden=10), "muon", **HP)
        with pytest.raises(ValueError, match=r"`fc1.weight` has shape \(12, 8\), the model's \(10, 8\)"):
            checkpoint.load(f"{d}/ckpt", other_model, other)
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            checkpoint.load(f"{d}/missing", model, opt)


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("layerwise_ckpt"))
    run(_save_worker, 4, d)
    return d


@pytest.mark.parametrize("world", [2, 1])
def test_saved_at_4_resumes_at_fewer_ranks(saved_at_4, world):
    run(_resume_worker, world, saved_at_4)
