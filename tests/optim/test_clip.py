"""``MatrixOptimizer.clip_grad_norm_``: the same parameters as ``torch.nn.utils.clip_grad_norm_`` followed by the
step, whether the coefficient is applied inside the step (Muon, MOP: the gradients are left as they are) or to the
gradients at once (Shampoo, SOAP); its norms double as the step's non-finite check."""

import copy
import math

import pytest
import torch
from torch import nn

import matrixopt
from matrixopt import NonFiniteGradientError


def _model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))


def _grads(model, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * scale


@pytest.mark.parametrize("name", ["muon", "mop", "shampoo", "soap"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_then_step_matches_torch_clip_then_step(name, norm_type):
    ours, ref = _model(), _model()
    opt = matrixopt.build_optimizer(ours, name, lr=1e-2)
    ref_opt = matrixopt.build_optimizer(ref, name, lr=1e-2)
    deferred = opt.nonfinite.clip_in_step
    assert deferred == (name in ("muon", "mop"))
    for step in range(3):
        _grads(ours, step)
        _grads(ref, step)
        raw = [p.grad.clone() for p in ours.parameters()]
        total = opt.clip_grad_norm_(0.5, norm_type)
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type)
        torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=0)
        assert ref_total > 0.5  # the clip does something
        kept = all(torch.equal(p.grad, r) for p, r in zip(ours.parameters(), raw))
        assert kept == deferred, "deferred: the gradients are read scaled by the step, not written"
        opt.step()
        ref_opt.step()
    for (n, p), q in zip(ours.named_parameters(), ref.parameters()):
        # the matrices' momentum pass multiplies like torch's clip; fused AdamW divides by the reciprocal
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_a_nonfinite_gradient_found_by_the_clip_norms_stops_the_step():
    model = _model()
    opt = matrixopt.build_optimizer(model, "muon", lr=1e-2)
    _grads(model, 0)
    model[1].weight.grad[2, 3] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    assert torch.isnan(opt.clip_grad_norm_(1.0))
    with pytest.raises(NonFiniteGradientError, match=r"1\.weight"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) and not opt.state


def test_gradients_changed_after_the_clip_raise_and_zero_grad_drops_the_clip():
    model = _model()
    opt = matrixopt.build_optimizer(model, "muon", lr=1e-2)
    _grads(model, 0)
    opt.clip_grad_norm_(0.1)
    model[1].weight.grad.mul_(2)
    with pytest.raises(RuntimeError, match="changed between clip_grad_norm_"):
        opt.step()
    twin = copy.deepcopy(model)
    twin_opt = matrixopt.build_optimizer(twin, "muon", lr=1e-2)
    opt.clip_grad_norm_(0.1)
    opt.zero_grad()  # the clip is dropped with the gradients it was for
    for m, o in ((model, opt), (twin, twin_opt)):
        _grads(m, 1)
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_bad_max_norm_raises():
    opt = matrixopt.build_optimizer(_model(), "muon")
    with pytest.raises(ValueError, match="finite max_norm"):
        opt.clip_grad_norm_(float("nan"))
