"""NorMuon and AdaMuon against float64 references of their papers' updates, written here from the equations
(matrixopt.optim.adaptive's docstring), over several steps, on tall, wide, square, split and stacked-expert
matrices, in every weight-decay mode."""

import copy
import math

import pytest
import torch
from torch import nn

import matrixopt
from matrixopt import AdaMuon, NorMuon, newton_schulz

TOL = dict(rtol=1e-4, atol=1e-6)  # float32 optimizer (fp32 Newton–Schulz) vs the float64 reference, 4 steps
LR, MU, BETA2, EPS, WD = 0.02, 0.9, 0.95, 1e-8, 0.1


def ns64(X):
    return newton_schulz(X, 5, "modded_nanogpt", dtype=torch.float64, method="standard")


def ref_step_direction(kind, O, v, beta2, eps):
    """The normalized update of one (m, n) matrix (rows = neurons) and the new second moment."""
    if kind == "normuon":
        v = beta2 * v + (1 - beta2) * (O * O).mean(1)  # (m,)
        D = O / (v.sqrt() + eps)[:, None]
    else:
        v = beta2 * v + (1 - beta2) * O * O  # (m, n)
        D = O / (v.sqrt() + eps)
    return D * math.sqrt(min(O.shape)) / D.norm(), v


def ref_trajectory(kind, W0, grads, pieces, wd_mode="decoupled", sign=True):
    """Float64 reference: ``pieces(W)`` gives views of W's (m, n) matrices (the parameter's matrix layout)."""
    W = W0.double().clone()
    B = torch.zeros_like(W)
    vs = None
    for G in grads:
        G = G.double()
        B = MU * B + (1 - MU) * G
        U = (1 - MU) * G + MU * B
        new = W.clone()
        Ws, Us, News = pieces(W), pieces(U), pieces(new)
        if vs is None:
            vs = [torch.zeros(u.shape[0] if kind == "normuon" else u.shape, dtype=torch.float64) for u in Us]
        for i, (w, u, out) in enumerate(zip(Ws, Us, News)):
            O = ns64(torch.sign(u) if kind == "adamuon" and sign else u)
            D, vs[i] = ref_step_direction(kind, O, vs[i], BETA2, EPS)
            m, n = w.shape
            step = LR * 0.2 * math.sqrt(max(m, n)) * D
            if wd_mode == "decoupled":
                decayed = (1 - LR * WD) * w
            elif wd_mode == "independent":
                decayed = (1 - WD) * w
            else:  # cautious: decay only where the update and the weight agree in sign
                decayed = w - LR * WD * (D * w >= 0) * w
            out.copy_(decayed - step)
        W = new
    return W


def whole(W):
    return [W]


@pytest.mark.parametrize("kind, cls", [("normuon", NorMuon), ("adamuon", AdaMuon)])
@pytest.mark.parametrize("shape", [(24, 24), (16, 40), (40, 16)])
@pytest.mark.parametrize("wd_mode", ["decoupled", "independent", "cautious"])
def test_matches_the_papers_update(kind, cls, shape, wd_mode):
    torch.manual_seed(0)
    W0, grads = torch.randn(shape), [torch.randn(shape) for _ in range(4)]
    p = nn.Parameter(W0.clone())
    opt = cls([p], lr=LR, momentum=MU, beta2=BETA2, eps=EPS, weight_decay=WD, weight_decay_mode=wd_mode,
              ns_dtype=torch.float32)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    ref = ref_trajectory(kind, W0, grads, whole, wd_mode)
    torch.testing.assert_close(p.detach().double(), ref, **TOL)


@pytest.mark.parametrize("kind, cls", [("normuon", NorMuon), ("adamuon", AdaMuon)])
def test_fused_qkv_and_experts_are_normalized_per_matrix(kind, cls):
    torch.manual_seed(1)
    qkv0, experts0 = torch.randn(48, 16), torch.randn(3, 16, 24)
    g_qkv, g_exp = [torch.randn(48, 16) for _ in range(3)], [torch.randn(3, 16, 24) for _ in range(3)]
    qkv, experts = nn.Parameter(qkv0.clone()), nn.Parameter(experts0.clone())
    matrixopt.mark_split(qkv, 3)
    matrixopt.mark_experts(experts)
    opt = cls([qkv, experts], lr=LR, momentum=MU, beta2=BETA2, eps=EPS, weight_decay=WD, ns_dtype=torch.float32)
    for a, b in zip(g_qkv, g_exp):
        qkv.grad, experts.grad = a.clone(), b.clone()
        opt.step()
    torch.testing.assert_close(qkv.detach().double(),
                               ref_trajectory(kind, qkv0, g_qkv, lambda W: list(W.split(16, 0))), **TOL)
    torch.testing.assert_close(experts.detach().double(),
                               ref_trajectory(kind, experts0, g_exp, lambda W: list(W.unbind(0))), **TOL)
    state = opt.state[qkv]["row_second_moment" if kind == "normuon" else "exp_avg_sq"]
    assert state.shape == ((48,) if kind == "normuon" else (48, 16))


def test_normuon_keeps_one_moment_per_row_of_column_split_weights():
    torch.manual_seed(2)
    W0, grads = torch.randn(16, 48), [torch.randn(16, 48) for _ in range(3)]
    p = nn.Parameter(W0.clone())
    matrixopt.mark_split(p, 3, dim=1)
    opt = NorMuon([p], lr=LR, momentum=MU, beta2=BETA2, eps=EPS, weight_decay=WD, ns_dtype=torch.float32)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    assert opt.state[p]["row_second_moment"].shape == (3, 16)
    torch.testing.assert_close(p.detach().double(),
                               ref_trajectory("normuon", W0, grads, lambda W: list(W.split(16, 1))), **TOL)


def test_adamuon_without_sign_stabilization_orthogonalizes_the_momentum():
    torch.manual_seed(3)
    W0, grads = torch.randn(20, 12), [torch.randn(20, 12) for _ in range(3)]
    p = nn.Parameter(W0.clone())
    opt = AdaMuon([p], lr=LR, momentum=MU, beta2=BETA2, eps=EPS, weight_decay=WD, ns_dtype=torch.float32,
                  sign_stabilize=False)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    torch.testing.assert_close(p.detach().double(), ref_trajectory("adamuon", W0, grads, whole, sign=False), **TOL)


@pytest.mark.parametrize("cls", [NorMuon, AdaMuon])
def test_update_rms_is_adamws_and_state_dict_resumes_bit_exactly(cls):
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    opt = matrixopt.build_optimizer(model, cls.__name__.lower(), lr=1e-3, weight_decay=0.0)
    assert isinstance(opt, cls)
    w = model[0].weight
    before = w.detach().clone()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    rms = ((w.detach() - before).pow(2).mean().sqrt() / 1e-3).item()
    assert abs(rms - 0.2) < 1e-3  # match_adamw: the update's RMS is 0.2, AdamW's
    twin_model = copy.deepcopy(model)
    twin = matrixopt.build_optimizer(twin_model, cls.__name__.lower(), lr=1e-3, weight_decay=0.0)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    for _ in range(2):
        for p, q in zip(model.parameters(), twin_model.parameters()):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        twin.step()
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("cls", [NorMuon, AdaMuon])
@pytest.mark.parametrize("kwargs, match", [
    (dict(beta2=1.0), "beta2"), (dict(beta2=float("nan")), "beta2"), (dict(eps=0.0), "eps"),
    (dict(weight_decay_mode="l2"), "weight_decay_mode"), (dict(weight_decay=-0.1), "weight_decay"),
])
def test_bad_hyperparameters_name_themselves(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls([nn.Parameter(torch.randn(4, 4))], **kwargs)


def test_unknown_options_and_bad_sign_stabilize_are_refused():
    with pytest.raises(TypeError, match="sign_stabilize"):
        NorMuon([nn.Parameter(torch.randn(4, 4))], sign_stabilize=False)
    with pytest.raises(ValueError, match="sign_stabilize"):
        AdaMuon([nn.Parameter(torch.randn(4, 4))], sign_stabilize="yes")


@pytest.mark.parametrize("cls", [NorMuon, AdaMuon])
def test_nonfinite_gradient_raises_and_leaves_state_untouched(cls):
    torch.manual_seed(5)
    p = nn.Parameter(torch.randn(8, 12))
    opt = cls([p], lr=LR)
    p.grad = torch.randn(8, 12)
    opt.step()
    snapshot = [p.detach().clone()] + [v.clone() for v in opt.state[p].values()]
    p.grad = torch.randn(8, 12)
    p.grad[2, 3] = float("nan")
    with pytest.raises(matrixopt.NonFiniteGradientError):
        opt.step()
    after = [p.detach()] + list(opt.state[p].values())
    assert all(torch.equal(a, b) for a, b in zip(snapshot, after))
