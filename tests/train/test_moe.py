"""The mixture-of-experts GPT on one process: the MoE layer against a dense float64 reference of the same routing
(outputs and gradients), the grouped products, the load-balancing loss, auxiliary-loss-free balancing, routing to
the optimizer (stacks to Muon as one matrix per expert, the router to AdamW), presets, bad settings, and the
routing statistics in metrics.jsonl."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import matrixopt
from matrixopt.cli import main
from matrixopt.optim.layout import matrix_shape
from matrixopt.train.config import ModelConfig, TrainConfig
from matrixopt.train.model import GPT, GROUP_ALIGN, PRESETS, GPTConfig, MoE, _grouped_mm_aligned, _padded_mm, grouped_mm

# float64 end to end: the MoE layer and the reference differ only in summation order (~1e-15 relative).
F64_RTOL = 1e-10
# bf16 operands carry 8 significant bits (relative rounding 2^-9 ~ 2e-3 per element); norms of whole results
# after two products and a GELU stay within a few times that.
BF16_RTOL = 2e-2


def tiny(**kw) -> GPTConfig:
    return GPTConfig(vocab_size=50, **(PRESETS["moe-tiny"] | kw))


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax router, top-k, renormalized gates, each chosen expert's MLP, weighted sum."""
    B, T, C = x.shape
    xf = x.reshape(B * T, C)
    probs = (xf @ moe.router.weight.T).softmax(-1)
    scores = probs + moe.router_bias if moe.biased else probs
    idx = scores.topk(moe.topk, dim=-1).indices
    out = []
    for n in range(B * T):
        gates = probs[n, idx[n]] / probs[n, idx[n]].sum()
        y = sum(g * (moe.experts.c_proj[e] @ F.gelu(moe.experts.c_fc[e] @ xf[n])) for g, e in zip(gates, idx[n]))
        out.append(y + (moe.shared(xf[n]) if moe.shared is not None else 0))
    return torch.stack(out).view(B, T, C)


@pytest.mark.parametrize("shared,biased", [(False, False), (True, True)])
def test_moe_matches_dense_reference(shared, biased):
    torch.manual_seed(0)
    model = GPT(tiny(shared_expert=shared, router_bias_rate=0.1 if biased else 0.0)).double()
    moe = model.moe_layers()[0]
    if biased:
        moe.router_bias.copy_(torch.randn(moe.router_bias.shape) * 0.1)
    x = torch.randn(3, 5, 32, dtype=torch.float64, requires_grad=True)
    y = moe(x)
    params = [x, *moe.parameters()]
    grads = torch.autograd.grad(y.square().sum(), params)
    y_ref = reference_moe(moe, x)
    grads_ref = torch.autograd.grad(y_ref.square().sum(), params)
    torch.testing.assert_close(y, y_ref, rtol=F64_RTOL, atol=1e-14)
    for g, r in zip(grads, grads_ref):
        torch.testing.assert_close(g, r, rtol=F64_RTOL, atol=1e-14)


def test_grouped_mm_paths_agree_with_empty_groups():
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    x, w = torch.randn(9, 6, dtype=torch.float64), torch.randn(4, 7, 6, dtype=torch.float64)
    want = torch.cat([b @ w[g].T for g, b in enumerate(x.split(counts.tolist()))])
    torch.testing.assert_close(grouped_mm(x, w, counts), want, rtol=F64_RTOL, atol=1e-14)
    torch.testing.assert_close(_padded_mm(x, w, counts), want, rtol=F64_RTOL, atol=1e-14)
    w.requires_grad_(True)
    grouped_mm(x, w, counts).sum().backward()
    assert w.grad is not None and w.grad[1].abs().sum() == 0  # the empty group: zero gradient, not None


def test_grouped_mm_takes_the_rows_dtype_outside_autocast():
    """bf16 rows (FSDP2's bf16 compute) times fp32 expert stacks (kept out of its mixed precision): bf16 products,
    and fp32 gradients for the stacks."""
    torch.manual_seed(0)
    x = torch.randn(7, 8, dtype=torch.bfloat16)
    w = torch.randn(3, 5, 8, requires_grad=True)
    counts = torch.tensor([2, 0, 5])
    y = grouped_mm(x, w, counts)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, grouped_mm(x, w.detach().bfloat16(), counts), rtol=0, atol=0)
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32 and torch.equal(w.grad[1], torch.zeros(5, 8))


def test_grouped_gemm_padding_on_cpu(monkeypatch):
    """The CUDA grouped-GEMM path's row bookkeeping (groups padded to 16 rows), with torch._grouped_mm replaced by
    a loop over the offsets it is given."""

    def grouped(xp, wt, offs):
        y, start = xp.new_zeros(xp.size(0), wt.size(-1)), 0
        for g, end in enumerate(offs.tolist()):
            assert end % GROUP_ALIGN == 0
            y[start:end] = xp[start:end] @ wt[g]
            start = end
        return y

    monkeypatch.setattr(torch, "_grouped_mm", grouped, raising=False)
    counts = torch.tensor([3, 0, 17, 1])
    x, w = torch.randn(21, 6, dtype=torch.float64), torch.randn(4, 7, 6, dtype=torch.float64)
    want = torch.cat([b @ w[g].T for g, b in enumerate(x.split(counts.tolist()))])
    torch.testing.assert_close(_grouped_mm_aligned(x, w, counts), want, rtol=F64_RTOL, atol=1e-14)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_cuda_grouped_gemm_matches_cpu_reference():
    """The MoE layer on CUDA under bf16 autocast (grouped GEMM, or the padded batched matmul without
    torch._grouped_mm) against the fp32 CPU path: outputs and gradients within bf16 rounding (relative norm)."""
    torch.manual_seed(0)
    moe = GPT(tiny(n_embd=64, expert_ffn=128)).moe_layers()[0]
    moe_gpu = copy.deepcopy(moe).cuda()  # before the forward, which leaves its routing statistics on the module
    x = torch.randn(4, 16, 64, requires_grad=True)
    y = moe(x)
    grads = torch.autograd.grad(y.square().sum(), [x, *moe.parameters()])
    x_gpu = x.detach().cuda().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_gpu = moe_gpu(x_gpu)
    grads_gpu = torch.autograd.grad(y_gpu.float().square().sum(), [x_gpu, *moe_gpu.parameters()])
    for got, want in [(y_gpu, y), *zip(grads_gpu, grads)]:
        assert (got.float().cpu() - want).norm() <= BF16_RTOL * want.norm()


def test_aux_loss_is_one_when_balanced_and_independent_of_batch_split():
    torch.manual_seed(0)
    model = GPT(tiny())
    idx = torch.randint(0, 50, (4, 16))
    _, loss = model(idx, idx)
    whole = model.aux_loss().item()
    halves = []
    for rows in (slice(0, 2), slice(2, 4)):
        model(idx[rows], idx[rows])
        halves.append(model.aux_loss().item())
    assert whole == pytest.approx(sum(halves) / 2, rel=1e-6)  # a mean over sequences: ranks can split the batch
    assert 0.9 < whole < 1.5
    model.eval()
    _, eval_loss = model(idx, idx)
    assert loss.item() == pytest.approx(eval_loss.item() + 0.01 * whole, rel=1e-6)  # aux only in training


def test_router_bias_moves_towards_balance():
    model = GPT(tiny(router_bias_rate=0.01))
    counts = torch.tensor([[10.0, 0.0, 5.0, 5.0]] * 2)
    model.update_router_bias(counts)
    for m in model.moe_layers():
        torch.testing.assert_close(m.router_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    model(torch.randint(0, 50, (2, 16)), None)
    assert model.pop_moe_stats().sum().item() == 2 * 16 * 2 * 2  # layers x tokens x topk
    assert model.pop_moe_stats().sum().item() == 0


def test_routing_sends_stacks_to_muon_one_matrix_per_expert():
    model = GPT(tiny())
    groups = matrixopt.param_groups(model)
    route = {n: g["use_muon"] for g in groups for n in g["names"]}
    assert route["transformer.h.0.mlp.experts.c_fc"] and route["transformer.h.0.mlp.experts.c_proj"]
    assert not route["transformer.h.0.mlp.router.weight"]
    assert matrix_shape(model.moe_layers()[0].experts.c_fc) == (32, 32)
    # Muon's step on the stack is the per-expert step: each expert's update orthogonal on its own
    opt = matrixopt.build_optimizer(model, "muon", lr=0.1, weight_decay=0.0)
    w = model.moe_layers()[0].experts.c_fc
    w.grad = torch.randn_like(w) * torch.tensor([1.0, 100.0, 0.01, 1.0]).view(4, 1, 1)
    before = w.detach().clone()
    opt.step()
    update = before - w.detach()
    for e in range(4):  # the same update size whatever the gradient's scale: one matrix per expert
        torch.testing.assert_close(update[e].norm(), update[0].norm(), rtol=0.05, atol=0)


def test_presets_and_flops():
    cfg = GPTConfig(vocab_size=151936, **(PRESETS["qwen3-30b-a3b"] | {"n_layer": 1}))
    with torch.device("meta"):
        model = GPT(cfg)
    stacks = sum(p.numel() for p in model.moe_layers()[0].experts.parameters())
    assert stacks == 128 * 2 * 768 * 2048
    active = model.estimate_flops_per_token() - 12 * cfg.block_size * cfg.n_embd
    matmuls = 4 * 2048**2 + 128 * 2048 + 151936 * 2048  # attention, router, head (tied: the lookup is no matmul)
    assert active == 6 * (matmuls + 8 * 2 * 768 * 2048)
    with torch.device("meta"):
        local = GPT(cfg)  # half the experts held, as one rank of expert parallelism 2: the same model FLOPs
    local.moe_layers()[0].experts.c_fc = torch.nn.Parameter(local.moe_layers()[0].experts.c_fc[:64])
    local.moe_layers()[0].experts.c_proj = torch.nn.Parameter(local.moe_layers()[0].experts.c_proj[:64])
    assert local.estimate_flops_per_token() == model.estimate_flops_per_token()
    assert ModelConfig(preset="moe-small").gpt_config(vocab_size=100).n_expert == 16
    cfg = GPTConfig(vocab_size=50304, tie_embeddings=False, **PRESETS["moe-2b"])  # as bench scale builds it
    with torch.device("meta"):
        model = GPT(cfg)
    active = (model.estimate_flops_per_token() - 12 * cfg.n_layer * cfg.block_size * cfg.n_embd) / 6
    assert model.num_params() >= 2e9 and active <= 0.5e9  # the 2-GPU expert-parallel benchmark's size


def test_bad_settings_raise_before_training():
    with pytest.raises(ValueError, match="topk=5 must be between 1 and n_expert=4"):
        ModelConfig(preset="moe-tiny", topk=5)
    with pytest.raises(ValueError, match="ep=3 must divide the model's n_expert=4"):
        TrainConfig(model=ModelConfig(preset="moe-tiny"), parallel="ddp", ep=3)
    with pytest.raises(ValueError, match="ep=2 needs --parallel ddp, layerwise, fsdp .* got --parallel none"):
        TrainConfig(model=ModelConfig(preset="moe-tiny"), parallel="none", ep=2)
    with pytest.raises(ValueError, match="tp=2 and ep=2 do not compose under --parallel fsdp"):
        TrainConfig(model=ModelConfig(preset="moe-tiny"), parallel="fsdp", tp=2, ep=2)
    with pytest.raises(ValueError, match="ep=2 must divide the model's n_expert=0"):
        TrainConfig(parallel="ddp", ep=2)


def test_train_logs_routing_statistics(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--model", "moe-tiny", "--optimizer", "muon", "--lr", "0.01", "--steps", "8", "--batch-size",
            "4", "--eval-every", "8", "--eval-iters", "2", "--warmup", "2", "--log-every", "1", "--threads", "1",
            "--no-progress", "--router-bias-rate", "0.001", "--shared-expert", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(9))
    for m in lines[1:]:
        assert len(m["expert_load"]) == 4 and sum(m["expert_load"]) == pytest.approx(1, abs=1e-4)
        assert m["expert_max_load"] >= 1 and m["aux_loss"] >= 1 - 1e-6
