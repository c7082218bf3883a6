"""The non-finite gradient policy (:mod:`matrixopt.optim.nonfinite`) on its own: its three modes, the one error it
raises, what survives a pickle, and the clip's norms, which combine over disjoint sets of gradients (ranks,
shards) to torch's total."""

import math
import pickle

import pytest
import torch

from matrixopt import Muon, NonFiniteGradientError
from matrixopt.optim.nonfinite import NonFinitePolicy, clip_coefficient, current_grads, grad_norms

LABELS = ["`a` (shape (2,))", "`b` (shape (3,))", "`c` (shape (4,))"]


def _grads(bad=None):
    grads = [torch.ones(2), torch.full((3,), 2.0), torch.full((4,), 3.0)]
    if bad is not None:
        grads[bad][0] = float("nan")
    return grads


def _flags(grads):
    return torch.tensor([float(not torch.isfinite(g).all()) for g in grads])


def test_eager_raises_naming_the_bad_gradient_and_skip_counts_it():
    grads = _grads(bad=1)
    with pytest.raises(NonFiniteGradientError, match=r"in `b` \(shape \(3,\)\); no parameter.*skip_nonfinite=True"):
        NonFinitePolicy().screen(grads, lambda: _flags(grads), lambda: LABELS)
    skipping = NonFinitePolicy(skip=True)
    assert skipping.screen(grads, lambda: _flags(grads), lambda: LABELS) == (None, [True, False, True])
    assert skipping.skipped == 1
    assert NonFinitePolicy().screen(_grads(), lambda: _flags(_grads()), lambda: LABELS) == (None, None)


def test_deferred_skips_on_a_device_flag_and_raises_once_at_the_next_call():
    policy = NonFinitePolicy(deferred=True, ranks=True)
    grads = _grads(bad=2)
    skip, keep = policy.screen(grads, lambda: _flags(grads), lambda: LABELS)
    assert keep is None and skip.item() == 1.0
    with pytest.raises(NonFiniteGradientError, match=r"at the last step in `c`.*skipped: no parameter or state was "
                                                     r"updated on any rank"):
        policy.raise_pending()
    policy.raise_pending()  # reported once
    skip, _ = policy.screen(_grads(), lambda: _flags(_grads()), lambda: LABELS)
    assert skip.item() == 0.0
    policy.raise_pending()
    with pytest.raises(ValueError, match="can't be combined with deferred_nonfinite"):
        NonFinitePolicy(skip=True, deferred=True)


def test_a_wrapper_agreed_flag_is_the_verdict_and_is_read_on_the_host_where_it_cant_be_used():
    policy = NonFinitePolicy()
    policy.wrapped = True
    never = pytest.fail
    assert policy.screen(_grads(bad=0), never, never) == (None, None)  # the wrapper checked on the host
    policy.agreed = torch.ones(())
    assert policy.screen(_grads(), never, never)[0] is policy.agreed
    elsewhere = [torch.empty(2, device="meta")] * 3  # gradients the CPU flag can't be applied to: read it now
    assert policy.screen(elsewhere, never, never) == (None, [False] * 3)
    assert policy.on_host(torch.zeros(())) is False


def test_pickle_keeps_the_options_and_counter_but_nothing_in_flight():
    policy = NonFinitePolicy(skip=True, clip_in_step=True)
    policy.skipped = 3
    grads = _grads()
    policy.scale(grads, torch.tensor(0.5), _flags(grads))
    back = pickle.loads(pickle.dumps(policy))
    assert (back.skip, back.deferred, back.clip_in_step, back.skipped) == (True, False, True, 3)
    assert back.take_clip(grads) is None and policy.take_clip(grads).coef.item() == 0.5


def test_load_state_dict_keeps_the_optimizers_policy():
    # Optimizer.load_state_dict goes through __setstate__: the policy (and its clip in the step) must survive it
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = Muon([w], deferred_nonfinite=True)
    policy = opt.nonfinite
    w.grad = torch.randn(4, 3)
    opt.step()
    opt.load_state_dict(opt.state_dict())
    assert opt.nonfinite is policy and (policy.deferred, policy.clip_in_step) == (True, True)
    before = w.grad.clone()
    opt.clip_grad_norm_(1e-3)  # held for the step, not applied to the gradient now
    assert torch.equal(w.grad, before) and policy.take_clip(current_grads(opt)) is not None


def test_a_held_clip_refuses_changed_gradients_and_is_applied_at_once_without_clip_in_step():
    grads = _grads()
    held = NonFinitePolicy(clip_in_step=True)
    held.scale(grads, torch.tensor(0.5))
    assert torch.equal(grads[0], torch.ones(2))
    grads[0].mul_(2)
    with pytest.raises(RuntimeError, match="changed between clip_grad_norm_"):
        held.take_clip(grads)
    NonFinitePolicy().scale(grads, torch.tensor(0.5))
    assert torch.equal(grads[0], torch.ones(2))


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_totals_of_disjoint_gradients_combine_to_torchs_total(norm_type):
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=g) for s in [(4, 5), (7,), (3, 3), (6,)]]
    expected = torch.nn.utils.get_total_norm(grads, norm_type)
    total, flags = grad_norms(grads, norm_type, torch.device("cpu"))
    assert torch.equal(total, expected) and not flags.any()
    parts = [grad_norms(grads[:1], norm_type, torch.device("cpu"))[0],
             grad_norms(grads[1:], norm_type, torch.device("cpu"))[0]]
    if norm_type == math.inf:
        combined = torch.stack(parts).amax()
    else:
        combined = sum(t**norm_type for t in parts) ** (1 / norm_type)
    torch.testing.assert_close(combined, expected, rtol=1e-6, atol=0)
    assert clip_coefficient(expected, 2 * expected.item()) == 1.0
    torch.testing.assert_close(clip_coefficient(expected, 0.5), 0.5 / (expected + 1e-6))


def test_clip_flags_mark_nonfinite_norms_and_bad_clip_arguments_raise():
    grads = _grads(bad=1) + [torch.full((2,), 1e30)]  # a float32 norm overflow counts as non-finite
    _, flags = grad_norms(grads, 2.0, torch.device("cpu"))
    assert flags.tolist() == [0.0, 1.0, 0.0, 1.0]
    opt = Muon([torch.nn.Parameter(torch.ones(2, 2))])
    with pytest.raises(ValueError, match="norm_type > 0"):
        opt.clip_grad_norm_(1.0, norm_type=0)


@pytest.mark.parametrize("name", ["muon", "adamuon"])
def test_a_deferred_check_does_not_keep_the_gradients_alive(name, monkeypatch):
    """A deferred check holds the step's labels until the next step (on the GPU); the gradients they name are
    freed once the training loop drops them."""
    import weakref

    import matrixopt
    from matrixopt.optim.registry import accepted

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = matrixopt.build_optimizer(model, name, lr=1e-2, **accepted(name, deferred_nonfinite=True))
    held = []
    screen = opt.nonfinite.screen
    monkeypatch.setattr(opt.nonfinite, "screen", lambda grads, flags, labels, local: held.append(labels) or screen(
        grads, flags, labels, local))
    model(torch.randn(5, 8)).pow(2).mean().backward()
    opt.step()
    grads = [weakref.ref(p.grad) for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    assert held and all(g() is None for g in grads)
    assert held[0]() == [f"`{n}` (shape {tuple(p.shape)})" for n, p in model.named_parameters()
                         if n.endswith("weight")] + [f"`{n}` (shape {tuple(p.shape)})"
                                                     for n, p in model.named_parameters() if n.endswith("bias")]
