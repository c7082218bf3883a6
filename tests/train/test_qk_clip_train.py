"""QK-clip in the trainer: the GPT's per-head max logits against dense float64 scores (with and without RoPE),
tracking that changes nothing else and costs nothing when off, the clipped heads landing on tau, ``--qk-clip`` runs
(clipped heads logged; a huge tau bitwise a run without it; 2 ranks as 1 process) and bad thresholds refused."""

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from test_cli import expect_error
from test_parallel import RTOL, assert_same_losses, torchrun

import matrixopt.train.model as model_module
import matrixopt.train.trainer as trainer
from matrixopt.cli import main
from matrixopt.distributed import make_parallelism
from matrixopt.distributed.checkpoint import load_checkpoint
from matrixopt.train.config import ModelConfig, OptimConfig, TrainConfig, from_dict
from matrixopt.train.model import GPT, GPTConfig
from matrixopt.train.qk_clip import GPTQKClip
from matrixopt.train.trainer import Interrupted, train

# The model computes q, k and the scores in fp32 over n_embd = 16 and head_size = 8 products: measured <= 2e-7
# relative to the float64 reference. A wrong scale, head, mask position or pre-RoPE q, k is off by >= 1%.
RTOL32 = 1e-5
# c_attn's init (std 0.02) gives max logits ~0.02; these gains on the query rows of heads 0 and 1 and on every key
# row bring them to ~1-10, two heads of clearly different sizes
Q_GAINS, K_GAIN = (30.0, 15.0), 10.0
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "4",
        "--grad-accum", "2", "--steps", "4", "--eval-every", "2", "--eval-iters", "2", "--warmup", "2",
        "--log-every", "1", "--threads", "1", "--no-progress", "--optimizer", "muon", "--lr", "0.01"]  # fmt: skip


def gpt(n_layer: int = 2, **kw) -> GPT:
    """A small GPT whose attentions have max logits of a few units, each head a different size."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=n_layer, n_head=2, n_embd=16, **kw))
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[:16] *= torch.tensor(Q_GAINS).repeat_interleave(8)[:, None]  # (16, 1)
            block.attn.c_attn.weight[16:32] *= K_GAIN
    return model


@torch.no_grad()
def dense_max_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """Float64 reference, ``(n_layer, n_head)``: every attention's scores at once, from the inputs it receives,
    through its fused weight, RoPE in float64, the causal mask."""
    inputs = []
    hooks = [b.attn.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach()))
             for b in model.transformer.h]
    model(idx)
    for h in hooks:
        h.remove()
    c, out = model.config, []
    hs, T = c.n_embd // c.n_head, idx.shape[1]
    for block, x in zip(model.transformer.h, inputs):
        attn = block.attn.c_attn
        qkv = x.double() @ attn.weight.double().T + (0 if attn.bias is None else attn.bias.double())  # (B, T, 3C)
        q, k, _ = (t.view(*x.shape[:2], c.n_head, hs).transpose(1, 2) for t in qkv.chunk(3, dim=-1))  # (B, nh, T, hs)
        if c.rope:
            q, k = rotate(q, model), rotate(k, model)
        s = q @ k.transpose(-1, -2) / math.sqrt(hs)  # (B, nh, T, T)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
        out.append(s.amax(dim=(0, 2, 3)))
    return torch.stack(out)


def rotate(x: torch.Tensor, model: GPT) -> torch.Tensor:
    """RoPE in float64 on ``(B, nh, T, hs)``: pairs (x1, x2) rotated by the model's angles."""
    cos, sin = (t[: x.shape[2]].double() for t in (model.rope_cos, model.rope_sin))  # (T, hs/2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


@pytest.mark.parametrize("rope", [False, True])
def test_max_logits_match_dense_scores_and_change_nothing_else(rope):
    model = gpt(rope=rope)
    a, b = torch.randint(0, 11, (2, 3, 8))
    logits_off, loss_off = model(a, b)
    loss_off.backward()
    grads_off = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    model.track_max_logits(True)
    logits_on, loss_on = model(a, b)
    loss_on.backward()
    assert torch.equal(logits_on, logits_off) and torch.equal(loss_on, loss_off)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads_off))
    got = model.max_logits()
    assert got.shape == (2, 2) and got.dtype == torch.float32 and not got.requires_grad
    want = dense_max_logits(model, a)
    assert want.min() > 1.0  # the heads are far from trivial
    torch.testing.assert_close(got.double(), want, rtol=RTOL32, atol=0)

    # a second micro-batch: the running max over both, as one forward of both would give
    model(b)
    torch.testing.assert_close(model.max_logits().double(), dense_max_logits(model, torch.cat([a, b])),
                               rtol=RTOL32, atol=0)
    model.reset_max_logits()
    model(b)
    torch.testing.assert_close(model.max_logits().double(), dense_max_logits(model, b), rtol=RTOL32, atol=0)


def test_tracking_off_computes_nothing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("max logits computed with tracking off")

    model = gpt()
    idx = torch.randint(0, 11, (2, 8))
    with pytest.raises(RuntimeError, match=r"call track_max_logits\(True\) and run a forward in training mode"):
        model.max_logits()
    monkeypatch.setattr(model_module, "max_logits_per_head", refuse)
    model(idx)  # off by default
    assert all(b.attn.max_logits is None for b in model.transformer.h)
    model.track_max_logits(True)
    model.eval()(idx)  # evaluation is not tracked
    model.track_max_logits(False)
    model.train()(idx)
    assert all(b.attn.max_logits is None for b in model.transformer.h)
    assert "max_logits" not in " ".join(model.state_dict())


@pytest.mark.parametrize("rope", [False, True])
def test_clipped_heads_recompute_to_tau(rope):
    """One layer, so that clipping does not change the attention's input: a head above tau lands on it, a head
    below is bitwise untouched, and so are V, c_proj and every other parameter."""
    model = gpt(n_layer=1, rope=rope, bias=True)
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.bias.normal_(std=0.5)  # nonzero, so that its scaling shows
    par = make_parallelism("none", device="cpu")
    par.wrap(model)
    par.build_optimizer(model, "adamw", lr=1e-3)
    idx = torch.randint(0, 11, (3, 8))
    model.track_max_logits(True)
    model(idx)
    before = model.max_logits()[0]
    assert before[0] > 1.2 * before[1]
    tau = (before[0] + before[1]).item() / 2  # head 0 above, head 1 below
    clip = GPTQKClip(model, par, tau)
    model(idx)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    clip.step()

    assert clip.metrics() == dict(qk_clipped_heads=1, max_logit=before[0].item())
    assert all(b.attn.max_logits is None for b in model.transformer.h)  # reset for the next step
    model(idx)
    after = model.max_logits()[0]
    torch.testing.assert_close(after[0], torch.tensor(tau), rtol=RTOL32, atol=0)
    assert after[1] == before[1]
    W, b = model.transformer.h[0].attn.c_attn.weight, model.transformer.h[0].attn.c_attn.bias
    changed = torch.zeros(48, dtype=torch.bool)
    changed[0:8] = changed[16:24] = True  # head 0's query and key rows
    for t, name in ((W, "weight"), (b, "bias")):
        old = params[f"transformer.h.0.attn.c_attn.{name}"]
        assert torch.equal(t[~changed], old[~changed])
        torch.testing.assert_close(t[changed], old[changed] * math.sqrt(tau / before[0].item()))
    for n, p in model.named_parameters():
        if "c_attn" not in n:
            assert torch.equal(p, params[n]), n


def tiny_config(**kw) -> TrainConfig:
    return TrainConfig(model=ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16),
                       optim=OptimConfig(name="muon", lr=1e-2), steps=4, batch_size=4, grad_accum=2, eval_every=2,
                       eval_iters=2, log_every=1, device="cpu", threads=1, **kw)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tiny_tau_clips_and_logs(tmp_path):
    tau = 1e-3  # below every head's max logit at init (~0.01-0.05)
    train(tiny_config(qk_clip=tau), tmp_path, progress=False)
    lines = read_metrics(tmp_path)
    assert "qk_clipped_heads" not in lines[0]  # step 0: evaluation only
    assert lines[1]["qk_clipped_heads"] == 2 and lines[1]["max_logit"] > 10 * tau  # both heads, as initialized
    # clipped to tau on each step's batches, the heads stay near it (without QK-clip they stay at ~20 tau)
    assert all(m["max_logit"] < 2 * tau for m in lines[2:])
    assert sum(m["qk_clipped_heads"] for m in lines[2:]) > 0


def test_huge_tau_is_bitwise_a_run_without_qk_clip(tmp_path):
    train(tiny_config(), tmp_path / "off", progress=False)
    train(tiny_config(qk_clip=1e9), tmp_path / "on", progress=False)
    off, on = read_metrics(tmp_path / "off"), read_metrics(tmp_path / "on")
    for a, b in zip(off, on, strict=True):
        assert (a["loss"], a.get("val_loss")) == (b["loss"], b.get("val_loss")), (a, b)
    assert [m["qk_clipped_heads"] for m in on[1:]] == [0] * 4
    assert all(0 < m["max_logit"] < 1 for m in on[1:])
    weights = [load_checkpoint(tmp_path / run / "ckpt.pt")["model"] for run in ("off", "on")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_interrupted_run_resumes_to_the_uninterrupted_clips(tmp_path, monkeypatch):
    """The clipped weights are in the checkpoint; QK-clip keeps no other state."""
    deterministic = ("step", "loss", "val_loss", "qk_clipped_heads", "max_logit")
    cfg = tiny_config(qk_clip=1e-2)
    train(cfg, tmp_path / "full", progress=False)
    real_batch = trainer.train_batch

    def batch_then_ctrl_c(tokens, batch_size, block_size, seed, step, micro):
        if step == 1 and micro == 0:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during step 2
        return real_batch(tokens, batch_size, block_size, seed, step, micro)

    monkeypatch.setattr(trainer, "train_batch", batch_then_ctrl_c)
    with pytest.raises(Interrupted):
        train(cfg, tmp_path / "resumed", progress=False)
    monkeypatch.setattr(trainer, "train_batch", real_batch)
    train(cfg, tmp_path / "resumed", resume=True, progress=False)
    full, resumed = ([{k: m[k] for k in deterministic if k in m} for m in read_metrics(tmp_path / run)]
                     for run in ("full", "resumed"))
    assert resumed == full and sum(m["qk_clipped_heads"] for m in full[1:]) > 0


@pytest.fixture(scope="module")
def single_clipped(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    assert main(["train", "--out", str(out), "--qk-clip", "0.01", *TINY]) == 0
    return read_metrics(out)


@pytest.mark.parametrize("parallel", [["ddp"], ["layerwise"], ["fsdp"], ["fsdp", "--tp", "2"]])
def test_two_ranks_clip_as_one_process(tmp_path, single_clipped, parallel):
    """Also under tensor parallelism: each TP rank reports its heads, and the rank-major c_attn rows it holds are
    scaled by their heads' factors."""
    proc = torchrun(2, ["train", "--out", str(tmp_path), "--qk-clip", "0.01", "--parallel", *parallel, *TINY])
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = read_metrics(tmp_path)
    fields = ("step", "loss", "val_loss")
    assert_same_losses([{k: m[k] for k in fields if k in m} for m in got],
                       [{k: m[k] for k in fields if k in m} for m in single_clipped])
    assert [m.get("qk_clipped_heads") for m in got] == [m.get("qk_clipped_heads") for m in single_clipped]
    assert sum(m.get("qk_clipped_heads", 0) for m in got) > 0
    for g, w in zip(got[1:], single_clipped[1:]):
        assert g["max_logit"] == pytest.approx(w["max_logit"], rel=RTOL)


def test_layerwise_bf16_weights_clip_their_masters(tmp_path):
    """Under bf16 autocast the layer-wise optimizer keeps the matrices in bf16 and steps fp32 masters: QK-clip
    scales the masters on their owners (and casts them into the weights), so the run clips as DDP's fp32 weights
    under the same autocast do. Scaling only the bf16 weights would be undone by the next step."""
    runs = {}
    for parallel in ("ddp", "layerwise"):
        out = tmp_path / parallel
        proc = torchrun(2, ["train", "--out", str(out), "--qk-clip", "0.01", "--parallel", parallel,
                            "--dtype", "bf16", *TINY])
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[parallel] = read_metrics(out)
    fields = ("step", "loss", "val_loss")
    got, want = ([{k: m[k] for k in fields if k in m} for m in runs[p]] for p in ("layerwise", "ddp"))
    assert_same_losses(got, want, rtol=1e-3)  # bf16 products: the same values, fp32 sums in another order
    assert [m.get("qk_clipped_heads") for m in runs["layerwise"]] == [m.get("qk_clipped_heads") for m in runs["ddp"]]
    assert sum(m.get("qk_clipped_heads", 0) for m in runs["ddp"]) > 0


@pytest.mark.parametrize("tau", [0, -1, math.nan, math.inf])
def test_bad_threshold_is_refused(tau):
    with pytest.raises(ValueError, match=r"qk_clip \(--qk-clip\) must be a finite number > 0, the largest "
                                         r"pre-softmax logit a head may reach .*; pass e.g. --qk-clip 100"):
        TrainConfig(qk_clip=tau)


@pytest.mark.parametrize("tau", ["0", "-1", "nan"])
def test_bad_threshold_on_the_command_line_exits_2(tmp_path, tiny, capsys, tau):
    expect_error(["train", "--qk-clip", tau, "--out", tmp_path / "o", *tiny], capsys,
                 f"qk_clip (--qk-clip) must be a finite number > 0, the largest pre-softmax logit a head may reach "
                 f"(Kimi K2 uses 100), got {float(tau)!r}")


def test_threshold_from_a_config_file():
    assert from_dict(TrainConfig, {"qk_clip": 100}).qk_clip == 100.0
    assert TrainConfig(qk_clip=100.0, parallel="fsdp", tp=2).qk_clip == 100.0
