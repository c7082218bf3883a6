"""Layer-wise Muon over NCCL on two GPUs against one process, clipped: the buckets rebuilt to the order gradients
arrive in, reductions (averaged by NCCL) and broadcasts on NCCL streams, the parameters each forward waits for.
Skipped without two GPUs; the same logic runs on gloo in test_layerwise.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from _mp import run

import matrixopt.distributed as mdist
from matrixopt import build_optimizer
from matrixopt.train.model import GPT, GPTConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

# fp32 Newton–Schulz and no TF32: the two runs differ only in the order fp32 gradients are summed (measured
# 5.5e-5 after 4 steps on an H200 pair); a missing or stale broadcast moves parameters by ~lr = 2e-2.
ATOL = 1e-3
CLIP = 0.5


def _worker(rank: int, world: int) -> None:
    dev = torch.device("cuda", rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=256)
    hp = dict(lr=2e-2, ns_dtype=torch.float32)
    torch.manual_seed(0)
    init = GPT(cfg)
    ref = GPT(cfg).to(dev)
    ref.load_state_dict(init.state_dict())
    ref_opt = build_optimizer(ref, "muon", **hp)
    model = GPT(cfg).to(dev)
    model.load_state_dict(init.state_dict())
    model, opt = mdist.layerwise(model, "muon", bucket_cap_mb=0.5, **hp)  # several parameters share buckets
    guessed = [[id(p) for p in b.params] for b in opt.buckets]
    assert all(b.mean for b in opt.buckets), "NCCL averages inside every reduction over all ranks"
    sl = mdist.batch_slice(8)
    for s in range(4):
        x = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(s)).to(dev)
        ref_opt.zero_grad()
        ref(x[:, :-1], x[:, 1:])[1].backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        model(x[sl, :-1], x[sl, 1:])[1].backward()
        got = opt.clip_grad_norm_(CLIP)  # of the mean gradient; its norms are also the step's non-finite check
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        assert s > 0 or want > 2 * CLIP, "the clip must bind for the test to mean anything"
        opt.step()
    opt.wait_params()
    rebuilt = [[id(p) for p in b.params] for b in opt.buckets]
    assert rebuilt != guessed, "GPT's wpe is registered out of use order: the buckets should have been rebuilt"
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(e, flat) for e in everyone), "ranks hold different parameters"
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=ATOL, msg=f"{n} differs from one process")
    moved = max((p.detach().cpu() - p0).abs().max().item() for p, p0 in zip(model.parameters(), init.parameters()))
    assert moved > 10 * ATOL, f"parameters barely moved ({moved}); the comparison would prove nothing"


def test_layerwise_muon_on_nccl_matches_one_process():
    run(_worker, 2, backend="nccl", timeout=300)


def _bf16_wire_worker(rank: int, world: int) -> None:
    """Matrices broadcast in bf16 from buckets of several parameters: each is cast into its segment of the
    broadcast buffer; the other rank holds the owner's value rounded to bf16, the rest exactly the owner's."""
    dev = torch.device("cuda", rank)
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128)
    torch.manual_seed(0)
    model, opt = mdist.layerwise(GPT(cfg).to(dev), "muon", lr=2e-2, bucket_cap_mb=0.5,
                                 broadcast_dtype=torch.bfloat16)
    assert any(len(b.params) > 1 and b.wire is torch.bfloat16 for b in opt.buckets)
    sl = mdist.batch_slice(8)
    for s in range(2):
        x = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(s)).to(dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(x[sl, :-1], x[sl, 1:])[1].backward()
        opt.step()
    opt.wait_params()
    for n, p in model.named_parameters():
        b = opt._bucket_of[id(p)][0]
        values = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(values, p.detach().contiguous())
        owner = values[b.owner]
        want = owner.bfloat16().float() if b.wire is torch.bfloat16 else owner
        assert torch.equal(p.detach(), owner if rank == b.owner else want), n


def test_layerwise_bf16_broadcast_on_nccl_sends_the_owners_rounded_values():
    run(_bf16_wire_worker, 2, backend="nccl", timeout=300)


def _bf16_params_worker(rank: int, world: int) -> None:
    """Matrices kept in bf16 (fp32 masters on their owners, views of one flat buffer per bucket, micro-batch
    gradients summed in fp32) train bit for bit as fp32 matrices broadcast in bf16 under CUDA autocast."""
    dev = torch.device("cuda", rank)
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128)
    torch.manual_seed(0)
    init = GPT(cfg).state_dict()
    sl = mdist.batch_slice(8)
    runs = []
    for kw in ({"broadcast_dtype": torch.bfloat16}, {"param_dtype": torch.bfloat16}):
        model = GPT(cfg).to(dev)
        model.load_state_dict(init)
        model, opt = mdist.layerwise(model, "muon", lr=2e-2, bucket_cap_mb=0.5, **kw)
        losses = []
        for s in range(3):
            for micro in range(2):
                x = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(10 * s + micro)).to(dev)
                with opt.no_sync() if micro == 0 else contextlib.nullcontext():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(x[sl, :-1], x[sl, 1:])[1]
                    loss.backward()
                losses.append(loss.detach())
            opt.clip_grad_norm_(CLIP)
            opt.step()
        opt.wait_params()
        runs.append((model, torch.stack(losses)))
    (ref, ref_losses), (model, losses) = runs
    assert torch.equal(ref_losses, losses), (ref_losses, losses)
    assert any(b.flat is not None for b in opt.buckets)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q.to(p.dtype)), n


def test_bf16_params_train_as_fp32_params_on_nccl():
    run(_bf16_params_worker, 2, backend="nccl", timeout=300)
