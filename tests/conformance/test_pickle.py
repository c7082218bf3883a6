"""(1) Pickling an optimizer (what copy.deepcopy, multiprocessing and some checkpointers do) keeps everything
it needs: state, hyperparameters, and matrixopt's own attributes (the non-finite policy and its counter, the
defaults that add_param_group fills in)."""

import pickle

import pytest
import torch
from torch import nn

from matrixopt import NonFiniteGradientError

from .common import NAMES, assert_identical, build, matrixopt_names, set_grads, tiny_net, train


def _params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


@pytest.mark.parametrize("name", NAMES)
def test_pickle_round_trip_keeps_state_and_steps_identically(name):
    model = tiny_net()
    opt = build(name, model)
    train(opt, model, 2)
    opt2 = pickle.loads(pickle.dumps(opt))
    assert type(opt2) is type(opt)
    assert_identical(opt2.state_dict(), opt.state_dict(), "unpickled state_dict")
    set_grads(_params(opt), 7)
    set_grads(_params(opt2), 7)
    opt.step()
    opt2.step()
    for p, q in zip(_params(opt), _params(opt2)):
        assert torch.equal(p, q)
    extra = nn.Parameter(torch.randn(4, 4))
    opt2.add_param_group({"params": [extra]})  # needs the defaults to survive the pickle


@pytest.mark.parametrize("name", matrixopt_names("has no non-finite gradient policy"))
@pytest.mark.parametrize("skip", [False, True])
def test_pickle_keeps_the_nonfinite_policy(name, skip):
    model = tiny_net()
    opt = build(name, model, skip_nonfinite=skip)
    train(opt, model, 1)
    opt2 = pickle.loads(pickle.dumps(opt))
    params = _params(opt2)
    set_grads(params, 2)
    params[0].grad[0, 0] = float("nan")
    if skip:
        opt2.step()
        assert opt2.skipped_updates == 1
    else:
        with pytest.raises(NonFiniteGradientError):
            opt2.step()
