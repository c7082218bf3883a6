"""(1) The torch.optim.Optimizer contract, for every registered optimizer: state_dict round trips, refusing
foreign state, param groups, zero_grad, parameters without gradients, tensor learning rates, lr
schedulers and closures."""

import copy
import io

import pytest
import torch
from torch import nn

from .common import (
    LR,
    NAMES,
    assert_identical,
    batch,
    build,
    loss_fn,
    matrixopt_names,
    set_grads,
    snapshot,
    tiny_net,
    train,
)


def _through_bytes(sd):
    """A state dict as a checkpoint file would give it back."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("via", ["memory", "torch.save"])
def test_state_dict_round_trip_gives_bit_identical_next_steps(name, via):
    model = tiny_net()
    opt = build(name, model)
    train(opt, model, 3)
    sd = opt.state_dict()
    sd = copy.deepcopy(sd) if via == "memory" else _through_bytes(sd)

    model2 = copy.deepcopy(model)
    opt2 = build(name, model2)
    opt2.load_state_dict(sd)
    assert_identical(opt2.state_dict(), opt.state_dict(), "reloaded state_dict")
    for step in (3, 4):  # two steps: the second one uses state written by the first after the reload
        for m, o in ((model, opt), (model2, opt2)):
            set_grads(m, step)
            o.step()
        assert_identical(snapshot(model2, opt2), snapshot(model, opt), f"after step {step}")


@pytest.mark.parametrize("name", matrixopt_names("aliases the loaded state tensors (torch's documented "
                                                  "behaviour: load_state_dict does not copy same-device tensors)"))
def test_loaded_state_is_not_shared_with_the_source(name):
    model = tiny_net()
    opt = build(name, model)
    train(opt, model, 2)
    model2 = copy.deepcopy(model)
    opt2 = build(name, model2)
    opt2.load_state_dict(opt.state_dict())
    before = snapshot(model2, opt2)
    train(opt, model, 2, seed=10)  # the source trains on; the reloaded optimizer must not move
    assert_identical(snapshot(model2, opt2), before)


def _other_shapes():
    return tiny_net(d=8, h=16)  # the same parameter names and count, other shapes


def _more_params():
    net = tiny_net()
    net.extra = nn.Linear(12, 12, bias=False)
    return net


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("other", [_more_params, _other_shapes], ids=["more_params", "other_shapes"])
def test_state_dict_from_a_different_model_is_refused(name, other):
    if other is _other_shapes and name == "adamw":
        pytest.skip("not applicable by design: plain torch.optim.AdamW checks only group sizes, not shapes")
    src_model = other()
    src = build(name, src_model)
    train(src, src_model, 1)
    model = tiny_net()
    opt = build(name, model)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"(?i)different|doesn't match|does not match|shape"):
        opt.load_state_dict(src.state_dict())
    assert_identical(snapshot(model, opt), before, "a refused load must leave the optimizer as it was")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("source", NAMES)
def test_state_dict_from_a_different_optimizer_is_refused(name, source):
    if source == name:
        pytest.skip("same optimizer: covered by the round-trip test")
    src_model = tiny_net()
    src = build(source, src_model)
    train(src, src_model, 1)
    model = tiny_net()
    opt = build(name, model)
    with pytest.raises(ValueError, match=r"(?i)different|saved by|n't match|not match"):
        opt.load_state_dict(src.state_dict())


@pytest.mark.parametrize("name", NAMES)
def test_add_param_group(name):
    model = tiny_net()
    opt = build(name, model)
    flag = getattr(opt, "matrix_flag", None)
    extra_w = nn.Parameter(torch.randn(12, 12))
    extra_b = nn.Parameter(torch.randn(12))
    opt.add_param_group({"params": [extra_w], "lr": 0.05})
    opt.add_param_group({"params": [extra_b]} | ({flag: False} if flag else {}))
    assert opt.param_groups[-2]["lr"] == 0.05
    for k, v in opt.param_groups[-1].items():  # the new group is complete: defaults filled in
        assert k == "params" or v is not None or k in opt.defaults
    before = [extra_w.detach().clone(), extra_b.detach().clone()]
    for step in range(2):  # two: SOAP's first step only sets up its eigenbases
        set_grads([*model.parameters(), extra_w, extra_b], step)
        opt.step()
    assert not torch.equal(extra_w, before[0]) and not torch.equal(extra_b, before[1])
    assert extra_w in opt.state and extra_b in opt.state
    with pytest.raises(ValueError, match="more than one"):
        opt.add_param_group({"params": [extra_w]})
    sd = opt.state_dict()  # the added groups round-trip too
    assert len(sd["param_groups"]) == len(opt.param_groups)


@pytest.mark.parametrize("name", matrixopt_names("does not route by shape: any tensor is fine in any group"))
def test_add_param_group_validates_like_init(name):
    model = tiny_net()
    opt = build(name, model)
    with pytest.raises(ValueError, match="1-D"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(5))]})
    with pytest.raises(ValueError, match="(?i)learning rate"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3, 3))], "lr": -1.0})
    with pytest.raises(ValueError, match="empty"):
        opt.add_param_group({"params": []})


@pytest.mark.parametrize("name", NAMES)
def test_zero_grad(name):
    model = tiny_net()
    opt = build(name, model)
    set_grads(model, 0)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_params_without_grads_are_untouched_and_do_not_change_the_others(name):
    """fc3 shares fc2's shape (the batched path) and has no gradient: it keeps its value and gets no state, and
    every other parameter moves exactly as in a model where fc3 is frozen from the start."""
    model, ref = tiny_net(), tiny_net()
    ref.fc3.weight.requires_grad_(False)  # routed out of the optimizer entirely
    opt, ref_opt = build(name, model), build(name, ref)
    w3 = model.fc3.weight.detach().clone()
    for step in range(3):
        set_grads(model, step)
        model.fc3.weight.grad = None
        for p, q in zip(model.parameters(), ref.parameters()):
            if p.grad is not None:
                q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    assert torch.equal(model.fc3.weight, w3)
    assert not opt.state.get(model.fc3.weight)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", NAMES)
def test_tensor_lr_matches_float_lr_and_is_read_at_each_step(name):
    runs = []
    for lr in (LR, torch.tensor(LR)):
        model = tiny_net()
        opt = build(name, model, lr=lr)
        train(opt, model, 2)
        runs.append((model, opt))
    for p, q in zip(runs[0][0].parameters(), runs[1][0].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)  # fused kernels may round a tensor lr apart
    model, opt = runs[1]
    for g in opt.param_groups:
        g["lr"].fill_(0.0)  # in place, as a compiled step would see it
        g["weight_decay"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    set_grads(model, 9)
    opt.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b), "a tensor lr set to 0 in place must freeze the parameters"


def _schedulers():
    return {
        "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5 ** s),
        "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.1),
        "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4),
        "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=LR, total_steps=4),
        "LinearLR": lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=2),
    }


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("sched", sorted(_schedulers()))
def test_lr_schedulers_drive_every_group(name, sched):
    model = tiny_net()
    opt = build(name, model)
    scheduler = _schedulers()[sched](opt)
    history = []
    for step in range(4):
        history.append([float(g["lr"]) for g in opt.param_groups])
        set_grads(model, step)
        opt.step()
        scheduler.step()
        assert all(torch.isfinite(p).all() for p in model.parameters())
    for i, lrs in enumerate(zip(*history)):
        assert len(set(lrs)) > 1, f"the scheduler must drive group {i}'s lr, it stayed {lrs[0]}"
    # a zero lr (and no weight decay) from the scheduler freezes every group, matrix ones included
    zero = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0)
    for g in opt.param_groups:
        g["weight_decay"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    set_grads(model, 11)
    opt.step()
    zero.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("name", NAMES)
def test_closure_returns_loss_and_matches_explicit_backward(name):
    xy = batch()
    model, ref = tiny_net(), tiny_net()
    opt, ref_opt = build(name, model), build(name, ref)
    for _ in range(2):
        def closure():
            opt.zero_grad()
            loss = loss_fn(model, xy)
            loss.backward()
            return loss

        with torch.no_grad():  # step must enable grad for the closure itself
            loss = opt.step(closure)
        ref_opt.zero_grad()
        ref_loss = loss_fn(ref, xy)
        ref_loss.backward()
        ref_opt.step()
        assert torch.equal(loss, ref_loss.detach())
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
