"""Muon and MOP against float64 reference implementations of the same update, written here."""

import copy
import math
import pickle

import pytest
import torch
from torch import nn

import matrixopt
from matrixopt import MOP, Muon, NonFiniteGradientError, newton_schulz, polar
from matrixopt.optim.layout import momentum_buckets

TOL = dict(rtol=2e-5, atol=2e-6)  # float32 optimizer vs float64 reference over a few steps


def ref_scale(scaling, m, n):
    return {"match_adamw": 0.2 * math.sqrt(max(m, n)), "original": math.sqrt(max(1, m / n)),
            "spectral": math.sqrt(m / n)}[scaling]


def ref_muon(W0, grads, lr, mu, wd, nesterov, scaling, ortho):
    """Float64 reference of one matrix's Muon trajectory; ``ortho`` maps an (m, n) float64 matrix."""
    W, B = W0.double().clone(), torch.zeros_like(W0, dtype=torch.float64)
    for G in grads:
        G = G.double()
        B = mu * B + (1 - mu) * G
        U = (1 - mu) * G + mu * B if nesterov else B
        m, n = W.shape[0], W[0].numel()
        O = ortho(U.reshape(m, n)).reshape(W.shape)
        W = (1 - lr * wd) * W - lr * ref_scale(scaling, m, n) * O
    return W


def ns64(X):
    """The same Newton–Schulz iteration (modded_nanogpt, 5 steps) in float64, standard form, for the reference."""
    return newton_schulz(X, 5, "modded_nanogpt", dtype=torch.float64, method="standard")


@pytest.mark.parametrize("shape", [(32, 32), (24, 56), (56, 24), (8, 3, 3, 3)])
@pytest.mark.parametrize("scaling", ["match_adamw", "original", "spectral"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("ns_method", ["auto", "standard", "gram"])
def test_muon_matches_reference(shape, scaling, nesterov, ns_method):
    torch.manual_seed(0)
    W0 = torch.randn(shape)
    grads = [torch.randn(shape) for _ in range(4)]
    p = nn.Parameter(W0.clone())
    opt = Muon([p], lr=0.02, momentum=0.9, nesterov=nesterov, weight_decay=0.1, scaling=scaling,
               ns_method=ns_method)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    ref = ref_muon(W0, grads, 0.02, 0.9, 0.1, nesterov, scaling, ns64)
    torch.testing.assert_close(p.detach().double(), ref, **TOL)


def test_mop_matches_reference_and_is_orthogonal_step():
    torch.manual_seed(1)
    W0, grads = torch.randn(20, 30), [torch.randn(20, 30) for _ in range(3)]
    p = nn.Parameter(W0.clone())
    opt = MOP([p], lr=0.05, momentum=0.8, weight_decay=0.0, scaling="original")
    for g in grads:
        p.grad = g.clone()
        opt.step()
    ref = ref_muon(W0, grads, 0.05, 0.8, 0.0, True, "original", polar)
    torch.testing.assert_close(p.detach().double(), ref, **TOL)
    # a single MOP step from zero momentum moves W by exactly lr * polar(G): all singular values equal lr
    q = nn.Parameter(torch.zeros(20, 30))
    o = MOP([q], lr=0.1, momentum=0.0, weight_decay=0.0, scaling="original")
    q.grad = torch.randn(20, 30)
    o.step()
    torch.testing.assert_close(torch.linalg.svdvals(q.detach()), torch.full((20,), 0.1), rtol=1e-5, atol=1e-6)


def test_batched_same_shape_equals_separate():
    torch.manual_seed(2)
    ws = [torch.randn(16, 24) for _ in range(3)]
    gs = [torch.randn(16, 24) for _ in range(3)]
    together = [nn.Parameter(w.clone()) for w in ws]
    opt = Muon(together, lr=0.01)
    for p, g in zip(together, gs):
        p.grad = g.clone()
    opt.step()
    for w, g, p in zip(ws, gs, together):
        q = nn.Parameter(w.clone())
        o = Muon([q], lr=0.01)
        q.grad = g.clone()
        o.step()
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_split_qkv_orthogonalizes_pieces():
    torch.manual_seed(3)
    d = 8
    W0, G = torch.randn(3 * d, d), torch.randn(3 * d, d)
    p = matrixopt.mark_split(nn.Parameter(W0.clone()), 3)
    opt = Muon([p], lr=0.1, momentum=0.0, weight_decay=0.0, scaling="original")
    p.grad = G.clone()
    opt.step()
    expected = W0 - 0.1 * torch.cat([newton_schulz(G[i * d:(i + 1) * d]) for i in range(3)])
    torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6)
    # the whole-matrix update differs: the split is really used
    assert (expected - (W0 - 0.1 * newton_schulz(G))).abs().max() > 1e-2


def test_experts_orthogonalized_per_expert():
    torch.manual_seed(4)
    W0, G = torch.randn(4, 12, 20), torch.randn(4, 12, 20)
    p = matrixopt.mark_experts(nn.Parameter(W0.clone()))
    opt = Muon([p], lr=0.1, momentum=0.0, weight_decay=0.0, scaling="match_adamw")
    p.grad = G.clone()
    opt.step()
    expected = W0 - 0.1 * 0.2 * math.sqrt(20) * newton_schulz(G)  # batched = per expert
    torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [Muon, matrixopt.NorMuon, matrixopt.AdaMuon])
def test_expert_stacks_step_as_separate_matrices_bit_for_bit(cls):
    """A stack of experts joins its Newton–Schulz batch as one view (wide and tall stacks in one batch), and steps
    its experts, state included, bit for bit as separate parameters in the same order would be."""
    torch.manual_seed(6)
    W0 = [torch.randn(4, 12, 20), torch.randn(3, 20, 12)]
    grads = [[torch.randn(w.shape) for w in W0] for _ in range(3)]
    stacks = [matrixopt.mark_experts(nn.Parameter(w.clone())) for w in W0]
    separate = [nn.Parameter(m.clone()) for w in W0 for m in w.unbind(0)]
    opts = [cls(ps, lr=0.1, weight_decay=0.1) for ps in (stacks, separate)]
    for gs in grads:
        for p, g in zip(stacks, gs):
            p.grad = g.clone()
        for p, g in zip(separate, [m for stack in gs for m in stack.unbind(0)]):
            p.grad = g.clone()
        for opt in opts:
            opt.step()

    def flat(opt, params, key):
        return torch.cat([(p.detach() if key == "param" else opt.state[p][key]).flatten() for p in params])

    for key in ["param", *opts[0].state[stacks[0]]]:
        assert torch.equal(flat(opts[0], stacks, key), flat(opts[1], separate, key)), key
    buckets, _ = momentum_buckets(stacks, [p.grad for p in stacks], [opts[0].state[p]["momentum_buffer"]
                                                                     for p in stacks])
    assert [(len(bk.params), bk.count) for bk in buckets] == [(2, 7)]


def test_channels_last_conv_kernel_is_updated_like_a_contiguous_one():
    """A channels_last kernel has no (out, in*kh*kw) view: the update must still land in the parameter and its
    momentum, not in a reshaped copy."""
    torch.manual_seed(5)
    W0 = torch.randn(8, 3, 3, 3)
    runs = []
    for fmt in (torch.contiguous_format, torch.channels_last):
        p = nn.Parameter(W0.clone().to(memory_format=fmt))
        opt = Muon([p], lr=0.1, weight_decay=0.1)
        torch.manual_seed(6)
        for _ in range(2):
            p.grad = torch.randn(8, 3, 3, 3).to(memory_format=fmt)
            opt.step()
        runs.append((p.detach().clone(), opt.state[p]["momentum_buffer"].clone()))
    assert (runs[0][0] - W0).abs().max() > 1e-2
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_adamw_groups_match_torch_adamw():
    torch.manual_seed(5)
    a, b = nn.Parameter(torch.randn(10, 7)), nn.Parameter(torch.randn(7))
    a2, b2 = copy.deepcopy(a), copy.deepcopy(b)
    opt = Muon([{"params": [a, b], "use_muon": False, "lr": 3e-3, "betas": (0.8, 0.99), "weight_decay": 0.1}])
    ref = torch.optim.AdamW([a2, b2], lr=3e-3, betas=(0.8, 0.99), weight_decay=0.1, foreach=False)
    for _ in range(5):
        ga, gb = torch.randn(10, 7), torch.randn(7)
        a.grad, b.grad, a2.grad, b2.grad = ga.clone(), gb.clone(), ga.clone(), gb.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(a, a2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b, b2, rtol=1e-5, atol=1e-6)


def test_bf16_params_keep_fp32_state_and_follow_fp32_run():
    torch.manual_seed(6)
    W0 = torch.randn(16, 32)
    p32, p16 = nn.Parameter(W0.clone()), nn.Parameter(W0.bfloat16())
    e32, e16 = nn.Parameter(torch.randn(5, 16)), None
    e16 = nn.Parameter(e32.detach().bfloat16())
    o32 = Muon([{"params": [p32]}, {"params": [e32], "use_muon": False}], lr=0.01)
    o16 = Muon([{"params": [p16]}, {"params": [e16], "use_muon": False}], lr=0.01)
    for _ in range(3):
        g, ge = torch.randn(16, 32), torch.randn(5, 16)
        p32.grad, p16.grad, e32.grad, e16.grad = g, g.bfloat16(), ge, ge.bfloat16()
        o32.step()
        o16.step()
    assert o16.state[p16]["momentum_buffer"].dtype == torch.float32
    assert o16.state[e16]["exp_avg"].dtype == torch.float32
    assert p16.dtype == torch.bfloat16
    torch.testing.assert_close(p16.float(), p32.detach(), rtol=0, atol=3e-2)
    torch.testing.assert_close(e16.float(), e32.detach(), rtol=0, atol=3e-2)


def _tiny_model():
    torch.manual_seed(7)
    return nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))


def _train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 20, (4, 6), generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("name", ["muon", "mop"])
def test_state_dict_roundtrip_bit_identical(name):
    m1 = _tiny_model()
    o1 = matrixopt.build_optimizer(m1, name, lr=1e-2)
    _train(m1, o1, 3)
    m2 = copy.deepcopy(m1)
    o2 = matrixopt.build_optimizer(m2, name, lr=1e-2)
    o2.load_state_dict(pickle.loads(pickle.dumps(o1.state_dict())))
    _train(m1, o1, 2, seed=1)
    _train(m2, o2, 2, seed=1)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_load_state_dict_from_other_optimizer_or_model_fails():
    m = _tiny_model()
    o = matrixopt.build_optimizer(m, "muon")
    _train(m, o, 1)
    mop = matrixopt.build_optimizer(m, "mop")
    with pytest.raises(ValueError, match="saved by Muon"):
        mop.load_state_dict(o.state_dict())
    other = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8), nn.LayerNorm(8))
    o2 = matrixopt.build_optimizer(other, "muon")
    with pytest.raises(ValueError, match="different model"):
        o2.load_state_dict(o.state_dict())


def test_load_state_dict_saved_before_an_option_existed():
    m = _tiny_model()
    o = matrixopt.build_optimizer(m, "muon")
    _train(m, o, 1)
    sd = o.state_dict()
    for g in sd["param_groups"]:
        g.pop("ns_method", None)  # as saved before ns_method was an option
    o2 = matrixopt.build_optimizer(copy.deepcopy(m), "muon", ns_method="standard")
    o2.load_state_dict(sd)
    assert all(g["ns_method"] == "standard" for g in o2.param_groups if g["use_muon"])
    assert "ns_method" not in sd["param_groups"][0]  # the caller's dict is left as it was
    del sd["param_groups"][0]["momentum"]  # a missing key that is not an option of this optimizer's still fails
    with pytest.raises(ValueError, match="lacks"):
        o2.load_state_dict(sd)


def test_load_state_dict_keeps_param_names():
    """torch's ``param_names`` (which torchtitan sets on every group, and leaves out of its flat checkpoints) are
    labels, as our ``names``: a state dict without them loads, and the optimizer keeps its own."""
    m = _tiny_model()
    o = matrixopt.build_optimizer(m, "muon")
    _train(m, o, 1)
    sd = copy.deepcopy(o.state_dict())
    o2 = matrixopt.build_optimizer(copy.deepcopy(m), "muon")
    for g in o2.param_groups:
        g["param_names"] = list(g["names"])
    o2.load_state_dict(sd)
    assert all(g["param_names"] == g["names"] for g in o2.param_groups)


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=-1.0), "learning rate"),
    (dict(lr=float("nan")), "learning rate"),
    (dict(momentum=1.0), "momentum"),
    (dict(momentum=-0.1), "momentum"),
    (dict(weight_decay=float("inf")), "weight_decay"),
    (dict(ns_coefficients="bogus"), "schedule"),
    (dict(ns_steps=0), "ns_steps"),
    (dict(ns_method="fast"), "Newton–Schulz method 'fast'"),
    (dict(scaling="wide"), "scaling"),
    (dict(adamw_betas=(0.9, 1.0)), "beta"),
])
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Muon([nn.Parameter(torch.randn(4, 4))], **kwargs)


def test_bad_parameters_name_the_parameter():
    model = nn.Sequential(nn.Linear(4, 4))
    groups = [{"params": list(model.parameters()), "names": ["0.weight", "0.bias"]}]
    with pytest.raises(ValueError, match=r"`0\.bias` \(shape \(4,\)\).*AdamW"):
        Muon(groups)
    with pytest.raises(ValueError, match="complex"):
        Muon([nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))])
    with pytest.raises(ValueError, match="empty"):
        Muon([])


def test_nonfinite_gradient_raises_and_leaves_everything_untouched():
    m = _tiny_model()
    o = matrixopt.build_optimizer(m, "muon", lr=1e-2)
    _train(m, o, 2)
    params = [p.detach().clone() for p in m.parameters()]
    state = copy.deepcopy(o.state_dict())
    x = torch.randint(0, 20, (4, 6))
    m(x).pow(2).mean().backward()
    m[3].weight.grad[0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"3\.weight"):
        o.step()
    for a, b in zip(params, m.parameters()):
        assert torch.equal(a, b)
    after = o.state_dict()
    for k, st in state["state"].items():
        for key, v in st.items():
            assert torch.equal(v, after["state"][k][key])


def test_skip_nonfinite_skips_only_that_parameter():
    a, b = nn.Parameter(torch.randn(6, 6)), nn.Parameter(torch.randn(6, 6))
    a0, b0 = a.detach().clone(), b.detach().clone()
    o = Muon([a, b], lr=0.1, skip_nonfinite=True)
    a.grad = torch.full((6, 6), float("inf"))
    b.grad = torch.randn(6, 6)
    o.step()
    assert torch.equal(a.detach(), a0) and a not in o.state
    assert not torch.equal(b.detach(), b0)
    assert o.skipped_updates == 1


def test_tensor_lr_and_scheduler_and_closure():
    p = nn.Parameter(torch.randn(8, 8))
    q = nn.Parameter(p.detach().clone())
    o1 = Muon([p], lr=torch.tensor(0.01))
    o2 = Muon([q], lr=0.01)
    g = torch.randn(8, 8)
    p.grad, q.grad = g.clone(), g.clone()
    o1.step()
    o2.step()
    torch.testing.assert_close(p, q)
    sched = torch.optim.lr_scheduler.LambdaLR(o2, lambda s: 0.5)
    assert o2.param_groups[0]["lr"] == 0.005
    loss = o2.step(lambda: torch.tensor(3.0))
    sched.step()
    assert loss.item() == 3.0


def test_zero_gradient_gives_no_nan():
    p = nn.Parameter(torch.randn(5, 7))
    o = Muon([p], lr=0.1, weight_decay=0.0)
    p.grad = torch.zeros(5, 7)
    before = p.detach().clone()
    o.step()
    assert torch.equal(p.detach(), before)


def _graph_run(device, cuda_graph, reload_at=None, steps=6, ns_method="auto", clip=None, move_at=None):
    """Muon on a small set of matrices (two buckets, tall and wide, a fused split, an expert stack) with a
    scheduler, fresh gradient tensors every step and, optionally, a state_dict round trip and the optimizer's
    gradient clipping at ``clip``; returns the parameters. With ``move_at`` (a set of steps) the gradients are
    written in place, at the same addresses, except at those steps, where they are fresh tensors at new
    addresses."""
    torch.manual_seed(7)
    params = [nn.Parameter(torch.randn(s, device=device))
              for s in [(48, 80), (80, 48), (32, 32), (96, 32), (3, 24, 40)]]
    matrixopt.mark_split(params[3], 3)
    matrixopt.mark_experts(params[4])  # three (24, 40) experts, each orthogonalized on its own
    opt = Muon(params, lr=0.02, weight_decay=0.1, cuda_graph=cuda_graph, ns_method=ns_method)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    gen = torch.Generator(device).manual_seed(8)
    keep = []
    for t in range(steps):
        if move_at is None or t in move_at or params[0].grad is None:
            keep.append(torch.empty(1000 * (t + 1), device=device))  # later gradients land at other addresses
            for p in params:
                p.grad = torch.randn(p.shape, device=device, generator=gen)
        else:
            for p in params:
                p.grad.copy_(torch.randn(p.shape, device=device, generator=gen))
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        sched.step()
        if t == reload_at:
            sd = copy.deepcopy(opt.state_dict())
            opt.load_state_dict(sd)  # new momentum tensors: the graph must read their addresses
    return [p.detach().clone() for p in params], opt


def test_cuda_graph_option_steps_eagerly_off_cuda_and_pickles():
    eager, _ = _graph_run("cpu", False)
    graphed, opt = _graph_run("cpu", True)
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert pickle.loads(pickle.dumps(opt)).cuda_graph is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ns_method,clip", [("standard", None), ("gram", None), ("gram", 5.0)])
def test_cuda_graph_step_matches_eager_step_on_gpu(ns_method, clip):
    from matrixopt.kernels.ns_step import ns_backend
    from matrixopt.optim.graphed import CapturedMuonStep

    # one Newton–Schulz path for both: "auto" decides graphed shapes apart, backend and form alike; with clip,
    # the graph must read each step's deferred coefficient as the eager kernels do (a coefficient left from
    # capture, or none, moves the momentum by a factor of ~20)
    with ns_backend("triton"):
        eager, _ = _graph_run("cuda", False, reload_at=3, ns_method=ns_method, clip=clip)
        graphed, opt = _graph_run("cuda", True, reload_at=3, ns_method=ns_method, clip=clip)
    assert any(isinstance(g, CapturedMuonStep) for g in opt._graphs.values()), "nothing was captured"
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_again_while_the_tensors_stay_put_on_gpu(monkeypatch):
    """Gradients written in place step after step: the captured step is replayed without regrouping the matrices
    (``Muon._replay_again``), and still equals the eager step when the gradients move (step 4) and when
    load_state_dict brings new momentum tensors (after step 2). One Newton–Schulz form for both: "auto" takes the
    Gram form for these small stacks only when replayed from a graph."""
    import matrixopt.optim.muon as muon_mod
    from matrixopt.kernels.ns_step import ns_backend

    groupings = []
    monkeypatch.setattr(muon_mod, "momentum_buckets", lambda *a: groupings.append(1) or momentum_buckets(*a))
    steps, moves = 9, {4}
    with ns_backend("triton"):
        eager, _ = _graph_run("cuda", False, reload_at=2, steps=steps, ns_method="gram", move_at=moves)
        groupings.clear()
        graphed, _ = _graph_run("cuda", True, reload_at=2, steps=steps, ns_method="gram", move_at=moves)
    # grouped at step 0 (eager), 1 (capture), 3 (new momentum), 4 (moved); replayed again at 2, 5, 6, 7, 8
    assert len(groupings) == 4, groupings
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("deferred", [False, True])
def test_adamw_on_a_side_stream_equals_one_stream_on_gpu(deferred):
    """AdamW runs beside the matrix groups on its own stream: same results, bit for bit, as one stream; a NaN
    gradient under the deferred check still writes nothing, AdamW's parameters included."""
    def run(overlap, nan_at=None):
        torch.manual_seed(3)
        model = _tiny_model().cuda()
        opt = matrixopt.build_optimizer(model, "muon", lr=1e-2, deferred_nonfinite=deferred)
        opt.overlap_adamw = overlap
        assert opt._adamw_stream([(g, g["params"], []) for g in opt.param_groups]) is not None or not overlap
        gen = torch.Generator("cuda").manual_seed(4)
        for t in range(4):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, device="cuda", generator=gen)
            if t == nan_at:
                next(model.parameters()).grad[0, 0] = float("nan")
                before = [p.detach().clone() for p in model.parameters()]
                try:
                    opt.step()
                    opt.raise_deferred_nonfinite()
                except NonFiniteGradientError:
                    pass
                assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
                continue
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)
    run(True, nan_at=2)
