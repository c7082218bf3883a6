"""The Triton AdamW kernel against float64 formulas and torch.optim.AdamW, on the CPU through Triton's interpreter
(see conftest.py): tensors spanning several chunks, an empty one, 16-bit parameters, per-tensor step counts, a
tensor learning rate, and the skip flag of the deferred non-finite check."""

import os

import pytest
import torch
from torch import nn

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU tensors through Triton's interpreter; on a GPU see test_gpu.py")

import matrixopt  # noqa: E402
from matrixopt.kernels import adamw_fused  # noqa: E402
from matrixopt.kernels import muon_elementwise as ew  # noqa: E402

B1, B2, EPS, WD = 0.9, 0.95, 1e-8, 0.1
SHAPES = [(adamw_fused.CHUNK + 1000,), (37, 5), (1,), (0,)]  # two chunks, odd, one element, empty


def _tensors(param_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g).to(param_dtype) for s in SHAPES]
    grads = [torch.randn(s, generator=g).to(param_dtype) for s in SHAPES]
    m = [torch.randn(s, generator=g) * 0.1 for s in SHAPES]
    v = [torch.rand(s, generator=g) * 0.01 for s in SHAPES]
    steps = [torch.tensor(float(t)) for t in (1, 4, 7, 2)]
    return params, grads, m, v, steps


def _reference(p, g, m, v, t, lr):
    """One AdamW step in float64 (torch.optim.AdamW's formula)."""
    p, g, m, v = p.double(), g.double(), m.double(), v.double()
    m = B1 * m + (1 - B1) * g
    v = B2 * v + (1 - B2) * g * g
    p = p * (1 - lr * WD) - lr / (1 - B1**t) * m / (v.sqrt() / (1 - B2**t) ** 0.5 + EPS)
    return p, m, v


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_adamw_matches_float64(param_dtype, tensor_lr):
    params, grads, m, v, steps = _tensors(param_dtype, 0)
    lr = 0.01
    want = [_reference(*x, t.item(), lr) for *x, t in zip(params, grads, m, v, steps)]
    adamw_fused.adamw_triton(params, grads, m, v, steps, lr=torch.tensor(lr) if tensor_lr else lr, beta1=B1,
                             beta2=B2, eps=EPS, weight_decay=WD)
    # float32 math: relative error ~1e-6 (the update's division amplifies it where v is tiny); a bf16 parameter
    # is one rounding of the float32 result (the interpreter truncates: below 2^-7 relative)
    p_tol = dict(rtol=1e-5, atol=1e-6) if param_dtype == torch.float32 else dict(rtol=2**-7, atol=1e-6)
    for (p_ref, m_ref, v_ref), p, mi, vi in zip(want, params, m, v):
        torch.testing.assert_close(mi.double(), m_ref, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(vi.double(), v_ref, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(p.double(), p_ref, **p_tol)


def test_skip_flag_writes_nothing():
    params, grads, m, v, steps = _tensors(torch.float32, 1)
    before = [t.clone() for t in params + m + v]
    adamw_fused.adamw_triton(params, grads, m, v, steps, lr=0.01, beta1=B1, beta2=B2, eps=EPS, weight_decay=WD,
                             skip=torch.ones(()))
    assert all(torch.equal(a, b) for a, b in zip(params + m + v, before))
    adamw_fused.adamw_triton(params, grads, m, v, steps, lr=0.01, beta1=B1, beta2=B2, eps=EPS, weight_decay=WD,
                             skip=torch.zeros(()))
    assert not torch.equal(params[0], before[0])


def test_bad_tensors_raise():
    params, grads, m, v, steps = _tensors(torch.float32, 2)
    with pytest.raises(ValueError, match="tensor 1 needs contiguous"):
        adamw_fused.adamw_triton(params, grads, m, [v[0], v[1].double(), *v[2:]], steps, lr=0.01, beta1=B1,
                                 beta2=B2, eps=EPS, weight_decay=WD)
    with pytest.raises(ValueError, match="tensor 1 needs contiguous"):
        adamw_fused.adamw_triton([params[0], torch.randn(5, 37).mT, *params[2:]], grads, m, v, steps, lr=0.01,
                                 beta1=B1, beta2=B2, eps=EPS, weight_decay=WD)
    with pytest.raises(ValueError, match="share one dtype"):
        adamw_fused.adamw_triton([params[0].bfloat16(), *params[1:]], grads, m, v, steps, lr=0.01, beta1=B1,
                                 beta2=B2, eps=EPS, weight_decay=WD)


def test_muon_adamw_groups_through_the_kernel_match_torch_adamw():
    """Muon's AdamW groups (two dtypes: one launch each) step like torch.optim.AdamW, step counts included."""
    torch.manual_seed(0)
    shapes = [(300, 7), (11,), (5, 3)]
    ours = [nn.Parameter(torch.randn(s)) for s in shapes] + [nn.Parameter(torch.randn(9).bfloat16())]
    ref = [nn.Parameter(p.detach().float().clone()) for p in ours]
    opt = matrixopt.Muon([{"params": ours, "use_muon": False}], lr=0.01, adamw_betas=(B1, B2), weight_decay=WD)
    torch_opt = torch.optim.AdamW(ref, lr=0.01, betas=(B1, B2), eps=1e-8, weight_decay=WD, foreach=False)
    assert ew.adamw_kernels(ours) is None  # CPU tensors keep torch's AdamW unless the backend is forced
    with ew.elementwise_backend("triton"):
        assert ew.adamw_kernels(ours) is not None
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            for p, r in zip(ours, ref):
                r.grad = torch.randn(r.shape, generator=g).to(p.dtype).float()
                p.grad = r.grad.to(p.dtype)
            opt.step()
            torch_opt.step()
    for p, r in zip(ours[:3], ref[:3]):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[3].float(), ref[3], rtol=2**-6, atol=1e-3)  # bf16 parameter: its rounding
    assert opt.state[ours[0]]["step"].item() == 3
