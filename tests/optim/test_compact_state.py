"""Compact optimizer state (``state_dtype="bf16"`` / ``"int8"``): the rounding primitives against float64, one
step's state against a float64 step from the decoded state, exact checkpoint round trips and conversions."""

import os

import pytest
import torch
from torch import nn

import matrixopt
from matrixopt.kernels.muon_elementwise import elementwise_backend
from matrixopt.optim.state import (
    BLOCK,
    decode,
    dequantize_blockwise,
    quantize_blockwise,
    stochastic_round_bf16,
)

DRAWS = 4000  # stochastic roundings per value in the unbiasedness tests
# the mean of DRAWS roundings, each off by at most one step (ulp or level) with variance <= step^2 / 4, lies within
# 6 standard deviations of the value: 6 * (step / 2) / sqrt(DRAWS)
MEAN_TOL = 3.0 / DRAWS**0.5


def _bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and above ``x`` in magnitude (equal where x is a bf16 value), as float64."""
    bits = x.view(torch.int32)
    lo = bits.bitwise_and(-65536)
    hi = torch.where(lo == bits, lo, lo + 65536)
    return lo.view(torch.float32).double(), hi.view(torch.float32).double()


@pytest.fixture(params=["torch", "triton"])
def rounding_device(request):
    """Where stochastic rounding runs: the torch reference on the CPU, or the fused Triton kernel (on the GPU, or
    on the CPU through Triton's interpreter)."""
    if request.param == "torch":
        with elementwise_backend("torch"):
            yield torch.device("cpu")
        return
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        yield torch.device("cuda")
    elif os.environ.get("TRITON_INTERPRET") == "1":
        with elementwise_backend("triton"):
            yield torch.device("cpu")
    else:
        pytest.skip("the Triton kernel needs a GPU or TRITON_INTERPRET=1")


def test_bf16_stochastic_rounding_is_unbiased_within_one_ulp(rounding_device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(257, generator=g) * torch.logspace(-20, 20, 257)
    r = stochastic_round_bf16(x.expand(DRAWS, -1).contiguous().to(rounding_device), g).cpu().double()
    lo, hi = _bf16_neighbours(x)
    assert torch.all((r == lo) | (r == hi)), "each rounding is one of the two neighbours (within one ulp)"
    ulp = (hi - lo).abs()
    err = (r.mean(0) - x.double()).abs()
    assert torch.all(err <= MEAN_TOL * ulp), (err / ulp).max()
    assert torch.all((r == hi).any(0) == (lo != hi)), "a value between two neighbours rounds both ways"


def test_bf16_stochastic_rounding_keeps_exact_and_special_values(rounding_device):
    x = torch.tensor([0.0, -0.0, 1.0, -2.5, float("inf"), float("-inf"), float("nan"), 3.0e38, -3.0e38])
    r = stochastic_round_bf16(x.to(rounding_device), torch.Generator().manual_seed(1)).cpu()
    assert r.dtype == torch.bfloat16
    torch.testing.assert_close(r[:7].float(), x[:7], equal_nan=True, rtol=0, atol=0)
    lo, hi = _bf16_neighbours(x[7:])
    assert torch.all((r[7:].double() == lo) | (r[7:].double() == hi)), "large finite values stay finite or round up"


def test_bf16_stochastic_rounding_repeats_with_the_generator(rounding_device):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(4)).to(rounding_device)
    a = stochastic_round_bf16(x, torch.Generator().manual_seed(7))
    b = stochastic_round_bf16(x, torch.Generator().manual_seed(7))
    c = stochastic_round_bf16(x, torch.Generator().manual_seed(8))
    assert torch.equal(a, b), "the same generator state gives the same rounding"
    assert not torch.equal(a, c), "another seed draws other bits"


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("shape", [(1000,), (3, 7, 50), (256,)])
def test_int8_blockwise_error_within_one_level(signed, shape):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])
    x = x if signed else x.square()
    q, scale = quantize_blockwise(x, signed, g)
    assert q.shape == x.shape and q.dtype == (torch.int8 if signed else torch.uint8)
    assert scale.shape == (-(-x.numel() // BLOCK),)
    y = dequantize_blockwise(q, scale)
    level = (scale / (127.0 if signed else 255.0)).repeat_interleave(BLOCK)[:x.numel()].view(shape)
    if signed:
        assert torch.all((y - x).abs() <= level * (1 + 1e-5))
    else:  # the square-root domain
        assert torch.all((y.sqrt() - x.sqrt()).abs() <= level * (1 + 1e-5))
        assert torch.all((y > 0) == (x > 0)), "a positive second moment never decodes to zero"


def test_int8_rounding_is_unbiased():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(BLOCK, generator=g)
    x[0] = 4.0  # the block's scale: exact
    ys = torch.stack([dequantize_blockwise(*quantize_blockwise(x, True, g)) for _ in range(DRAWS)])
    level = 4.0 / 127
    assert torch.all((ys.double().mean(0) - x.double()).abs() <= MEAN_TOL * level)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(40, 16), nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 16), nn.LayerNorm(16))


def _train(opt: torch.optim.Optimizer, model: nn.Module, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 40, (4, 8), generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"])
@pytest.mark.parametrize("name", ["muon", "adamuon"])
def test_one_step_matches_float64_from_decoded_state(name, state_dtype):
    """Each step computes in float32 from the decoded state: the stored new state is the float64 update of the
    decoded old state, to within one rounding step (a bf16 ulp, an int8 level). int8 quantizes the AdamW groups'
    moments; the momentum is stored in bf16."""
    model = _model()
    opt = matrixopt.build_optimizer(model, name, lr=1e-2, state_dtype=state_dtype)
    _train(opt, model, 3)
    groups = {id(p): g for g in opt.param_groups for p in g["params"]}
    x = torch.randint(0, 40, (4, 8), generator=torch.Generator().manual_seed(9))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    before = {p: {k: decode(st, k).double() for k in ("momentum_buffer", "exp_avg", "exp_avg_sq") if k in st}
              for p, st in opt.state.items()}
    opt.step()
    checked = 0
    for p, old in before.items():
        g, group, st = p.grad.double(), groups[id(p)], opt.state[p]
        if "momentum_buffer" in old:
            ref = {"momentum_buffer": old["momentum_buffer"].lerp(g, 1 - group["momentum"])}
        else:
            b1, b2 = group["betas"]
            ref = {"exp_avg": old["exp_avg"].lerp(g, 1 - b1), "exp_avg_sq": old["exp_avg_sq"] * b2 + (1 - b2) * g * g}
        for k, r in ref.items():
            new = decode(st, k).double()
            # int8 quantizes the AdamW moments; the matrix groups' momentum stays bf16
            if state_dtype == torch.bfloat16 or "momentum_buffer" in old:
                assert st[k].dtype == torch.bfloat16
                lo, hi = _bf16_neighbours(r.float())
                step = (hi - lo).abs() + 1e-6 * r.abs() + 1e-30  # fp32 arithmetic vs float64: a few fp32 ulps
                assert torch.all((new - r).abs() <= step), k
            else:
                signed = k != "exp_avg_sq"
                level = (st[k + "_scale"].double() / (127 if signed else 255)).repeat_interleave(BLOCK)
                level = level[:p.numel()].view(p.shape) * (1 + 1e-5) + 1e-30
                a, b = (new, r) if signed else (new.sqrt(), r.sqrt())
                assert torch.all((a - b).abs() <= level), k
            checked += 1
    assert checked >= 4


def test_bf16_second_moment_keeps_small_increments():
    """beta2 = 0.999 moves v by less than half a bf16 ulp per step: rounding to nearest would stall it near 0.25,
    stochastic rounding follows float32 in the mean."""
    b = nn.Parameter(torch.zeros(2000))
    opt = matrixopt.Muon([{"params": [b], "use_muon": False}], lr=0.0, adamw_betas=(0.9, 0.999),
                         state_dtype="bf16")
    b.grad = torch.ones(2000)
    steps = 500
    for _ in range(steps):
        opt.step()
    v = decode(opt.state[b], "exp_avg_sq")
    expected = 1 - 0.999**steps
    assert abs(v.mean().item() - expected) < 0.01 * expected
    assert opt.state[b]["exp_avg_sq"].dtype == torch.bfloat16


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_compact_state_round_trips_exactly(state_dtype):
    model, twin = _model(), _model()
    opt = matrixopt.build_optimizer(model, "normuon", lr=1e-2, state_dtype=state_dtype)
    _train(opt, model, 2)
    sd = opt.state_dict()
    twin.load_state_dict(model.state_dict())
    opt2 = matrixopt.build_optimizer(twin, "normuon", lr=1e-2, state_dtype=state_dtype)
    opt2.load_state_dict(sd)
    for st, st2 in zip(opt.state.values(), opt2.state.values()):
        assert st.keys() == st2.keys()
        for k in st:
            if torch.is_tensor(st[k]):
                assert st2[k].dtype == st[k].dtype and torch.equal(st2[k], st[k]), k
    _train(opt, model, 2, seed=5)  # same rounding draws after the resume: the same training
    _train(opt2, twin, 2, seed=5)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("saved, loaded", [("bf16", None), ("int8", None), (None, "bf16"), (None, "int8"),
                                           ("bf16", "int8")])
def test_state_dict_converts_between_state_dtypes(saved, loaded):
    model = _model()
    opt = matrixopt.build_optimizer(model, "muon", lr=1e-2, state_dtype=saved)
    _train(opt, model, 3)
    sd = opt.state_dict()
    opt2 = matrixopt.build_optimizer(model, "muon", lr=1e-2, state_dtype=loaded)
    opt2.load_state_dict(sd)
    for p, st in opt.state.items():
        st2 = opt2.state[p]
        for k in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
            if k not in st:
                continue
            want, got = decode(st, k), decode(st2, k)
            fmt = "bf16" if loaded == "int8" and k == "momentum_buffer" else loaded  # int8: AdamW's moments only
            if fmt is None:  # decoding is exact
                assert st2[k].dtype == torch.float32 and torch.equal(got, want), k
                assert k + "_scale" not in st2
            elif fmt == "bf16":
                lo, hi = _bf16_neighbours(want)
                assert st2[k].dtype == torch.bfloat16
                assert torch.all((got.double() == lo) | (got.double() == hi)), k
            else:
                signed = k != "exp_avg_sq"
                level = (st2[k + "_scale"] / (127 if signed else 255)).repeat_interleave(BLOCK)[:p.numel()]
                a, b = (got, want) if signed else (got.sqrt(), want.sqrt())
                assert torch.all((a - b).abs() <= level.view(p.shape) * (1 + 1e-5) + 1e-30), k
    _train(opt2, model, 2)  # and it steps


@pytest.mark.parametrize("name", ["muon", "shampoo", "soap"])
def test_bf16_state_trains_like_float32(name):
    losses = {}
    for state_dtype in (None, "bf16"):
        model = _model()
        opt = matrixopt.build_optimizer(model, name, lr=1e-2, state_dtype=state_dtype)
        _train(opt, model, 30)
        x = torch.randint(0, 40, (16, 8), generator=torch.Generator().manual_seed(7))
        losses[state_dtype] = model(x).pow(2).mean().item()
    assert abs(losses["bf16"] - losses[None]) < 0.02 * losses[None]


@pytest.mark.parametrize("value", ["fp16", torch.float16, "int4", 8])
def test_unknown_state_dtype_lists_choices(value):
    w = nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError, match=r"state_dtype.*'bf16'.*'int8'"):
        matrixopt.Muon([w], state_dtype=value)


def test_default_state_is_float32_as_before():
    model = _model()
    opt = matrixopt.build_optimizer(model, "muon", lr=1e-2)
    _train(opt, model, 2)
    assert opt.state_dtype is None and opt.offload is None
    assert all(v.dtype == torch.float32 for st in opt.state.values() for v in st.values())
    assert "rounding_step" not in opt.state_dict()
