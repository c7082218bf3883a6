"""weight_decay_mode on every matrix optimizer and on their AdamW groups. An update does not depend on the weights,
so from the same state a step with decay minus the same step without it is the decay alone: -lr wd W (decoupled),
-wd W (independent), or -lr wd W where the update and W agree in sign (cautious)."""

import pytest
import torch
from torch import nn

from matrixopt import MOP, SOAP, AdaMuon, Muon, NorMuon, Shampoo
from matrixopt.kernels.decay import decay_

LR, WD = 0.05, 0.2
TOL = dict(rtol=1e-5, atol=1e-6)
FLAGS = {Muon: "use_muon", MOP: "use_muon", NorMuon: "use_muon", AdaMuon: "use_muon", Shampoo: "use_shampoo",
         SOAP: "use_soap"}


def second_step(cls, W0, b0, grads, weight_decay, **kw):
    """From (W0, b0), W in a matrix group and b in an AdamW group, a step without decay (SOAP's first step only
    sets up its eigenbases), then one with ``weight_decay``; returns (W, b) before and after the second step."""
    W, b = nn.Parameter(W0.clone()), nn.Parameter(b0.clone())
    opt = cls([{"params": [W]}, {"params": [b], FLAGS[cls]: False}], lr=LR, weight_decay=0.0, **kw)
    for step, (gW, gb) in enumerate(grads):
        if step == 1:
            before = W.detach().double().clone(), b.detach().double().clone()
            for g in opt.param_groups:
                g["weight_decay"] = weight_decay
        W.grad, b.grad = gW.clone(), gb.clone()
        opt.step()
    return before, (W.detach().double(), b.detach().double())


@pytest.mark.parametrize("cls", list(FLAGS))
@pytest.mark.parametrize("mode", ["decoupled", "independent", "cautious"])
def test_each_mode_decays_as_defined(cls, mode):
    torch.manual_seed(0)
    W0, b0 = torch.randn(12, 20), torch.randn(20, 6)  # b: a matrix in an AdamW group (a 2-D embedding, say)
    grads = [(torch.randn(12, 20), torch.randn(20, 6)) for _ in range(2)]
    start, undecayed = second_step(cls, W0, b0, grads, 0.0, weight_decay_mode=mode)
    start_again, decayed = second_step(cls, W0, b0, grads, WD, weight_decay_mode=mode)
    for w0, again, plain, got in zip(start, start_again, undecayed, decayed):
        assert torch.equal(w0, again)
        update = w0 - plain  # lr times the update direction
        assert update.abs().max() > 0
        keep = {"decoupled": 1 - LR * WD, "independent": 1 - WD,
                "cautious": 1 - LR * WD * (update * w0 >= 0).double()}[mode]
        torch.testing.assert_close(got, keep * w0 - update, **TOL)
        if mode == "cautious":  # the mask matters: some coordinates keep their weight, others decay
            assert 0 < (update * w0 >= 0).double().mean() < 1


def test_default_is_decoupled_and_groups_can_choose_their_own():
    W, b = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(6))
    opt = Muon([{"params": [W]}, {"params": [b], "use_muon": False, "weight_decay_mode": "independent"}])
    assert [g["weight_decay_mode"] for g in opt.param_groups] == ["decoupled", "independent"]
    with pytest.raises(ValueError, match="weight_decay_mode: 'l2'.*decoupled, independent, cautious"):
        Muon([{"params": [W]}, {"params": [b], "use_muon": False, "weight_decay_mode": "l2"}])


def test_state_dict_saved_before_the_option_existed_loads_with_this_optimizers_mode():
    W = nn.Parameter(torch.randn(4, 6))
    opt = Shampoo([W], weight_decay_mode="cautious")
    W.grad = torch.randn(4, 6)
    opt.step()
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        del g["weight_decay_mode"]
    twin = Shampoo([nn.Parameter(W.detach().clone())], weight_decay_mode="cautious")
    twin.load_state_dict(sd)
    assert twin.param_groups[0]["weight_decay_mode"] == "cautious"


def test_cautious_needs_directions_and_unknown_modes_name_the_choices():
    p = [torch.ones(3)]
    with pytest.raises(ValueError, match="directions"):
        decay_(p, 0.1, 0.1, "cautious")
    with pytest.raises(ValueError, match="use one of decoupled, independent, cautious"):
        decay_(p, 0.1, 0.1, "sometimes")
