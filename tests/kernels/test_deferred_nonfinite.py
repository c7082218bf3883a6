"""Muon's deferred non-finite check (``deferred_nonfinite=True``) on the CPU: the fused kernels skip on a device
flag (through Triton's interpreter, see conftest.py), fused AdamW through ``found_inf``. A step with a NaN or Inf
gradient writes nothing and the error comes from the next call; the run then goes on as if that step never
happened."""

import os

import pytest
import torch
from torch import nn

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU tensors through Triton's interpreter; on a GPU see test_gpu.py")

from matrixopt import AdaMuon, Muon, NonFiniteGradientError, NorMuon  # noqa: E402
from matrixopt.kernels import muon_fused as fused  # noqa: E402
from matrixopt.kernels.muon_elementwise import elementwise_backend  # noqa: E402


def _setup(deferred, cuda_graph=False, cls=Muon, mode="decoupled"):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(16, 24)), nn.Parameter(torch.randn(24, 16)), nn.Parameter(torch.randn(16))]
    graph = {"cuda_graph": cuda_graph} if cls is Muon else {}
    opt = cls([{"params": params[:2]}, {"params": params[2:], "use_muon": False}], lr=0.05, weight_decay=0.1,
              deferred_nonfinite=deferred, weight_decay_mode=mode, **graph)
    return params, opt


def _set_grads(params, seed, bad=None):
    g = torch.Generator().manual_seed(seed)
    for i, p in enumerate(params):
        p.grad = torch.randn(p.shape, generator=g)
        if i == bad:
            p.grad[3, 5] = float("nan")


def _snapshot(params, opt):
    return [p.detach().clone() for p in params] + [v.clone() for st in opt.state.values() for v in st.values()]


@pytest.mark.parametrize("cls,mode", [(Muon, "decoupled"), (NorMuon, "decoupled"), (AdaMuon, "decoupled"),
                                      (Muon, "cautious"), (Muon, "independent")])
def test_a_bad_step_writes_nothing_raises_next_and_the_run_goes_on(cls, mode):
    """Also NorMuon's and AdaMuon's second moments, and the decay modes (fused AdamW decays around its kernel): a
    skipped step leaves everything as it was."""
    with elementwise_backend("triton"):
        params, opt = _setup(True, cls=cls, mode=mode)
        ref_params, ref = _setup(False, cls=cls, mode=mode)
        for seed in range(2):
            for ps, o in ((params, opt), (ref_params, ref)):
                _set_grads(ps, seed)
                o.step()
        before = _snapshot(params, opt)
        _set_grads(params, 9, bad=1)
        opt.step()  # no host sync, no error yet
        after = _snapshot(params, opt)
        assert all(torch.equal(a, b) for a, b in zip(before, after)), "a skipped step wrote something"
        with pytest.raises(NonFiniteGradientError, match=r"params\[1\]` \(shape \(24, 16\)\).*was skipped"):
            opt.step()
        for seed in (2, 3):  # reported once; then the same run as an optimizer that never saw the bad step
            for ps, o in ((params, opt), (ref_params, ref)):
                _set_grads(ps, seed)
                o.step()
    for a, b in zip(params, ref_params):
        assert torch.equal(a, b)
    assert torch.equal(opt.state[params[2]]["step"], ref.state[ref_params[2]]["step"])


def test_state_dict_raises_a_pending_error_and_finite_steps_equal_the_host_check():
    with elementwise_backend("triton"):
        params, opt = _setup(True)
        _set_grads(params, 0, bad=0)
        opt.step()
        with pytest.raises(NonFiniteGradientError, match=r"params\[0\]"):
            opt.state_dict()
        opt.state_dict()  # reported once
        ref_params, ref = _setup(False)
        for seed in range(3):
            for ps, o in ((params, opt), (ref_params, ref)):
                _set_grads(ps, seed)
                o.step()
    for a, b in zip(params, ref_params):
        assert torch.equal(a, b)


def test_a_clip_before_the_step_is_its_check():
    """With clip_grad_norm_ the deferred check reuses the clip's norms: a NaN still skips the step on the device
    and is reported by the next call; finite clipped steps equal torch's clip followed by the step."""
    with elementwise_backend("triton"):
        params, opt = _setup(True)
        ref_params, ref = _setup(False)
        for seed in range(2):
            for ps in (params, ref_params):
                _set_grads(ps, seed)
            opt.clip_grad_norm_(1.0)
            torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
            opt.step()
            ref.step()
        before = _snapshot(params, opt)
        _set_grads(params, 9, bad=1)
        opt.clip_grad_norm_(1.0)
        opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(params, opt))), "a skipped step wrote"
        with pytest.raises(NonFiniteGradientError, match=r"params\[1\]"):
            opt.raise_deferred_nonfinite()
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_skip_flag_in_the_fused_kernels():
    torch.manual_seed(0)
    grads = [torch.randn(16, 24), torch.randn(24, 16)]
    bufs = [torch.randn(16, 24), torch.randn(24, 16)]
    params = [torch.randn(16, 24), torch.randn(24, 16)]
    out = torch.zeros(2, 16, 24)
    b0, p0 = [b.clone() for b in bufs], [p.clone() for p in params]
    fused.momentum_pack_triton(grads, bufs, out, 0.9, True, skip=torch.ones(()))
    fused.apply_update_triton(params, torch.randn(2, 16, 24), lambda m, n: 1.0, 0.1, 0.1, skip=torch.ones(()))
    assert all(torch.equal(a, b) for a, b in zip(bufs + params, b0 + p0)) and not out.any()
    fused.momentum_pack_triton(grads, bufs, out, 0.9, True, skip=torch.zeros(()))
    assert not torch.equal(bufs[0], b0[0]) and out.any()


def test_layouts_off_the_fused_kernels_check_on_the_host_at_once():
    params, opt = _setup(True)  # CPU, backend auto: the torch references, which can't skip on a flag
    p0 = [p.detach().clone() for p in params]
    _set_grads(params, 0, bad=1)
    with pytest.raises(NonFiniteGradientError, match=r"params\[1\]"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, p0))
    with pytest.raises(ValueError, match="skip_nonfinite"):
        Muon(params[:2], skip_nonfinite=True, deferred_nonfinite=True)
