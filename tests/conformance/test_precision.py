"""(2) Parameter dtypes and devices, the batched path, and torch.compile.

- fp32, bf16 and fp16 parameters on CPU and (where present) CUDA: one step on low-precision parameters equals
  the fp32 step on the same values up to the final rounding, and matrixopt keeps its state in float32.
- Several same-shape matrices in one optimizer (one batched orthogonalization) move exactly as each alone.
- A whole training step (forward, backward, optimizer step) under torch.compile matches eager.
"""

import io

import pytest
import torch
from torch import nn

import matrixopt

from .common import (
    LR,
    NAMES,
    assert_identical,
    build,
    is_plain_torch,
    matrixopt_names,
    set_grads,
    state_tensors,
    tiny_net,
    train,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]



def assert_within_rounding(name: str, p: torch.Tensor, p_old: torch.Tensor, q: torch.Tensor) -> None:
    """``p``: one step on low-precision parameters ``p_old``; ``q``: the float32 step from the same values.
    matrixopt computes in float32 and rounds to the parameter dtype once or twice (weight decay, then the update):
    at most one ulp of the old and one of the new value. Plain torch AdamW runs its math in the parameter dtype:
    a few ulps more, relative to the update (about lr) as well."""
    eps = torch.finfo(p.dtype).eps  # one ulp of x is at most eps * |x|
    p, p_old = p.float(), p_old.float()
    bound = eps * (p_old.abs() + q.abs())
    if is_plain_torch(name):
        bound = 4 * (bound + eps * LR)
    err = (p - q).abs()
    assert (err <= bound).all(), f"worst error {err.max().item():.3g}, {(err / bound).max().item():.3g}x the bound"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_low_precision_step_equals_fp32_step_up_to_rounding(name, dtype, device):
    if is_plain_torch(name) and dtype == torch.float16:
        pytest.skip("not applicable by design: torch.optim.AdamW keeps fp16 state, where eps=1e-8 underflows to 0 "
                    "and a small gradient's update becomes inf (torch expects fp32 master weights)")
    model = tiny_net(dtype=dtype, device=device)
    ref = tiny_net(dtype=dtype, device=device).float()  # the same (representable) values, in fp32
    opt, ref_opt = build(name, model), build(name, ref)
    for step in range(2):
        old = [p.detach().clone() for p in model.parameters()]
        set_grads(model, step)
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.float()
        opt.step()
        ref_opt.step()
        assert all(p.dtype == dtype and p.device.type == device for p in model.parameters())
        assert all(torch.isfinite(p).all() for p in model.parameters())
        for p, p_old, q in zip(model.parameters(), old, ref.parameters()):
            assert_within_rounding(name, p, p_old, q)
            q.data.copy_(p.float())  # compare one step at a time: restart the reference from the rounded values


@pytest.mark.parametrize("name", matrixopt_names("keeps its state in the parameter dtype"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_state_is_fp32_for_every_param_dtype_and_survives_a_reload(name, dtype, device):
    model = tiny_net(dtype=dtype, device=device)
    opt = build(name, model)
    train(opt, model, 2)
    floats = [(k, v) for k, v in state_tensors(opt) if v.is_floating_point()]
    assert floats and all(v.dtype == torch.float32 and v.device.type == device for _, v in floats), \
        [(k, v.dtype) for k, v in floats if v.dtype != torch.float32]
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt2 = build(name, model)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    assert_identical(opt2.state_dict(), opt.state_dict(), "reloaded state (torch would cast it to the param dtype)")


class Mats(nn.Module):
    def __init__(self, mats):
        super().__init__()
        self.mats = nn.ParameterList(mats)


# Batched vs one-at-a-time orthogonalization run the same float32 matmuls in a different grouping (bmm vs mm):
# equal up to a few float32 roundings.
BATCH_TOL = dict(rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(5, 7), (7, 5), (6, 6)], ids=str)
def test_batched_equals_each_matrix_alone(name, shape):
    torch.manual_seed(0)
    mats = [torch.randn(shape) for _ in range(3)] + [torch.randn(4, 3)]  # 3 of one shape, one odd one out
    together = Mats([nn.Parameter(m.clone()) for m in mats])
    alone = [Mats([nn.Parameter(m.clone())]) for m in mats]
    opt = build(name, together)
    opts = [build(name, a) for a in alone]
    for step in range(3):
        set_grads(together, step)
        for a, p in zip(alone, together.mats):
            a.mats[0].grad = p.grad.clone()
        opt.step()
        for o in opts:
            o.step()
    for p, a in zip(together.mats, alone):
        torch.testing.assert_close(p, a.mats[0], **BATCH_TOL)


@pytest.mark.parametrize("name", NAMES)
def test_compiled_training_step_matches_eager(name):
    """The whole step (forward, backward, optimizer.step, zero_grad) in one torch.compile call. The backend is
    aot_eager: Dynamo tracing plus AOTAutograd's functionalization, which is where an optimizer's in-place state
    updates break; Inductor's code generation adds 30-60 s per optimizer on 2 CPU cores and nothing optimizer-
    specific, so it is left to GPU runs. A tiny model keeps tracing short."""
    torch._dynamo.reset()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3, bias=False))
        return model, matrixopt.build_optimizer(model, name, lr=LR)  # registry defaults: tracing stays short

    def step(model, opt):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    model, opt = make()
    ref, ref_opt = make()
    compiled = torch.compile(step, backend="aot_eager")
    for _ in range(3):  # the first step creates the state, the next ones read it
        loss = compiled(model, opt)
        ref_loss = step(ref, ref_opt)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
