"""SOAP against a float64 reference written here; eigenbasis schedule, moment rotation, blocks, state_dict."""

import copy

import pytest
import torch
from torch import nn

import matrixopt
from matrixopt import SOAP
from matrixopt.linalg.roots import REFRESH_SHIFT
from matrixopt.optim.shampoo import split_dim

# fp32 optimizer vs float64 reference over 9 steps (measured max |W - W_ref| about 5e-7; with
# factor_update="kl" and damping 1e-2 about 8e-7). Allowed with margin:
ATOL = 2e-5


def ref_soap(W, grads, Q0, *, lr, betas, eps, wd, freq, kl=False, damping=1e-2, sides=("left", "right"), phase=0,
             rnd=lambda x: x):
    """SOAP on one matrix in float64: the first call builds the factors, whose eigenbases ``Q0`` (``{"left": (m, m),
    "right": (n, n)}``, as the optimizer took them) are checked; Adam in the eigenbasis; factors after the step;
    every ``freq`` Adam steps (from Adam step ``phase``, 0 meaning ``freq``) one QR power step, V' permuted, M'
    rotated. ``rnd``: applied to the operands of the step's products (rotations, factor products; not KL's) and to
    the rotations' inner products."""
    W = W.double().clone()
    b1, b2 = betas
    m, n = W.shape
    eye = {"left": torch.eye(m, dtype=torch.float64), "right": torch.eye(n, dtype=torch.float64)}
    Q = dict(eye)
    M, V = torch.zeros_like(W), torch.zeros_like(W)
    for t, G in enumerate(grads):
        G = G.double()
        Gp = rnd(rnd(Q["left"]).T @ rnd(G)) @ rnd(Q["right"])
        if t == 0:
            F = {"left": (1 - b2) * rnd(G) @ rnd(G).T / (n if kl else 1),
                 "right": (1 - b2) * rnd(G).T @ rnd(G) / (m if kl else 1)}
            for s in sides:  # the eigenbasis Q0 chose (eigh picks any basis of a factor's null space): check it
                Q[s] = Q0[s].double()
                D = Q[s].T @ F[s] @ Q[s]
                off = D - torch.diag(torch.diag(D))
                assert off.norm() < 1e-5 * F[s].norm() and (torch.diag(D)[:-1] >= torch.diag(D)[1:] - 1e-6).all()
            d = {s: torch.diag(Q[s].T @ F[s] @ Q[s]) for s in sides}
            continue
        M = b1 * M + (1 - b1) * Gp
        V = b2 * V + (1 - b2) * Gp**2
        N = (M / (1 - b1**t)) / ((V / (1 - b2**t)).sqrt() + eps)
        W = (1 - lr * wd) * W - lr * rnd(rnd(Q["left"]) @ rnd(N)) @ rnd(Q["right"]).T
        if kl:
            inv = {s: (1 / (d[s] + damping * d[s].max()) if s in sides else torch.ones(len(eye[s]), dtype=W.dtype))
                   for s in ("left", "right")}
            Rinv = Q["right"] @ torch.diag(inv["right"]) @ Q["right"].T
            Linv = Q["left"] @ torch.diag(inv["left"]) @ Q["left"].T
            F = {"left": b2 * F["left"] + (1 - b2) / n * G @ Rinv @ G.T,
                 "right": b2 * F["right"] + (1 - b2) / m * G.T @ Linv @ G}
            d = {"left": b2 * d.get("left", 0) + (1 - b2) / n * (Gp**2 * inv["right"][None, :]).sum(1),
                 "right": b2 * d.get("right", 0) + (1 - b2) / m * (Gp**2 * inv["left"][:, None]).sum(0)}
        else:
            F = {"left": b2 * F["left"] + (1 - b2) * rnd(G) @ rnd(G).T,
                 "right": b2 * F["right"] + (1 - b2) * rnd(G).T @ rnd(G)}
        if (t - phase) % freq == 0:
            old = dict(Q)
            for s in sides:
                est = torch.diag(Q[s].T @ F[s] @ Q[s])
                o = torch.argsort(est, descending=True)  # a power step with the shift REFRESH_SHIFT * max(est)
                shifted = F[s] + REFRESH_SHIFT * est.max() * torch.eye(len(est), dtype=torch.float64)
                Qn, R = torch.linalg.qr(shifted @ Q[s][:, o])
                Q[s] = Qn * torch.sign(torch.diag(R))[None, :]
                V = V[o] if s == "left" else V[:, o]
                d[s] = torch.diag(Q[s].T @ F[s] @ Q[s])
            M = Q["left"].T @ old["left"] @ M @ old["right"].T @ Q["right"]
    return W


HP = dict(lr=0.05, betas=(0.9, 0.95), eps=1e-8, wd=0.1, freq=3)


def kwargs(hp):
    return dict(lr=hp["lr"], betas=hp["betas"], eps=hp["eps"], weight_decay=hp["wd"],
                precondition_frequency=hp["freq"], factor_update="kl" if hp.get("kl") else "shampoo",
                damping=hp.get("damping", 1e-2))


def data(shape, steps=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), [torch.randn(shape, generator=g) for _ in range(steps)]


def run(W0, grads, **kw):
    """The optimizer's weights after ``grads``, the optimizer, and the eigenbases it took at the first call."""
    W = nn.Parameter(W0.clone())
    opt = SOAP([W], **kw)
    for t, g in enumerate(grads):
        W.grad = g.clone()
        opt.step()
        if t == 0:
            st = opt.state[W]
            Q0 = {s: st[f"{s}_basis0"].clone() for s in ("left", "right") if f"{s}_basis0" in st}
    return W.detach(), opt, Q0


@pytest.mark.parametrize("shape", [(7, 5), (6, 6), (4, 9)])
@pytest.mark.parametrize("variant", [{}, dict(freq=1), dict(kl=True), dict(kl=True, freq=2)])
def test_matches_float64_reference(shape, variant):
    hp = HP | variant
    W0, grads = data(shape)
    W, opt, Q0 = run(W0, grads, **kwargs(hp))
    assert (W.double() - ref_soap(W0, grads, Q0, **hp)).abs().max() < ATOL
    assert opt.root_failures == 0


# An operand within float32's error of a bfloat16 rounding boundary may round the other way in the reference (float64
# sums), which moves the weights by about 1e-5 over the steps here (the CPU's instruction set decides where that
# happens); the bf16 products move them by 2e-3 or more from the float32 ones.
BF16_ATOL = 1e-4


@pytest.mark.parametrize("shape", [(7, 5), (6, 6), (4, 9)])
@pytest.mark.parametrize("variant", [{}, dict(freq=1)])
def test_bf16_products_match_float64_reference_of_rounded_operands(shape, variant):
    """matmul_precision="bf16": the reference with every operand of the step's products rounded to bfloat16 (the
    rotations' inner products too) and float64 sums; the CPU emulates what the GPU's bf16 products compute. The
    result is not the fp32 one (the rounding took place)."""
    hp = HP | variant
    W0, grads = data(shape)
    W, opt, Q0 = run(W0, grads, **kwargs(hp), matmul_precision="bf16")
    bf16 = lambda x: x.to(torch.bfloat16).double()  # noqa: E731
    assert (W.double() - ref_soap(W0, grads, Q0, **hp, rnd=bf16)).abs().max() < BF16_ATOL
    W32, _, Q0_32 = run(W0, grads, **kwargs(hp))
    assert (W - W32).abs().max() > 100 * (W32.double() - ref_soap(W0, grads, Q0_32, **hp)).abs().max()
    assert (W - W32).abs().max() > 10 * BF16_ATOL


def test_first_call_only_initializes():
    W0, grads = data((5, 4), steps=1)
    W, opt, _ = run(W0, grads, **kwargs(HP))
    assert torch.equal(W, W0)
    st = opt.state[next(iter(opt.state))]
    assert st["step"] == 1 and not torch.equal(st["left_basis0"], torch.eye(5))


def test_blocks_and_one_sided():
    W0, grads = data((10, 7))
    W, opt, _ = run(W0, grads, **kwargs(HP), max_preconditioner_dim=4)
    _, opt1, _ = run(W0, grads[:1], **kwargs(HP), max_preconditioner_dim=4)
    st = opt1.state[next(iter(opt1.state))]  # the bases of every block after the first call
    blocks = [(r, c) for r in split_dim(10, 4) for c in split_dim(7, 4)]
    for k, ((r0, r1), (c0, c1)) in enumerate(blocks):
        Q0 = {s: st[f"{s}_basis{k}"] for s in ("left", "right")}
        ref = ref_soap(W0[r0:r1, c0:c1], [g[r0:r1, c0:c1] for g in grads], Q0, **HP)
        assert (W[r0:r1, c0:c1].double() - ref).abs().max() < ATOL
    W0, grads = data((3, 12))
    for kl in (False, True):
        W, opt, Q0 = run(W0, grads, **kwargs(HP | dict(kl=kl)), one_sided_ratio=2.0)
        assert "right0" not in opt.state[next(iter(opt.state))]
        assert (W.double() - ref_soap(W0, grads, Q0, **HP, kl=kl, sides=("left",))).abs().max() < ATOL


def test_bases_refresh_schedule_and_first_moment_rotation():
    """Bases change at the first call and every ``precondition_frequency`` Adam steps; the first moment, stored
    in eigen-coordinates, always equals the plain EMA of the gradients once rotated back."""
    W0, grads = data((6, 5), steps=11)
    W = nn.Parameter(W0.clone())
    opt = SOAP([W], lr=0.01, betas=(0.9, 0.95), precondition_frequency=4)
    ema = torch.zeros(6, 5, dtype=torch.float64)
    changed = []
    for call, g in enumerate(grads, 1):
        before = opt.state[W]["right_basis0"].clone() if opt.state else torch.eye(5)
        W.grad = g.clone()
        opt.step()
        st = opt.state[W]
        if not torch.equal(before, st["right_basis0"]):
            changed.append(call)
        if call > 1:
            ema = 0.9 * ema + 0.1 * g.double()
        back = st["left_basis0"].double() @ st["exp_avg"].double() @ st["right_basis0"].double().T
        torch.testing.assert_close(back, ema, atol=1e-5, rtol=0)
    assert changed == [1, 5, 9]  # Adam steps 0 (eigh), 4 and 8


def test_refresh_runs_after_the_updates_are_handed_on(monkeypatch):
    """The refresh follows the step's update: ``_matrix_updates`` hands the updates to ``then`` (where a sharded
    optimizer sends them) before it runs the refresh, and the updates handed on are the ones it returns."""
    W0, grads = data((6, 5), steps=6)
    W = nn.Parameter(W0.clone())
    opt = SOAP([W], lr=0.01, precondition_frequency=2)
    group = opt.param_groups[0]
    events, handed, real = [], [], opt._refresh
    monkeypatch.setattr(opt, "_refresh", lambda *a: (events.append("refresh"), real(*a)))
    for call, g in enumerate(grads, 1):
        events.clear()
        handed.clear()
        basis = opt.state[W]["right_basis0"].clone() if opt.state else None
        out = opt._matrix_updates(group, [W], [g], then=lambda u: (events.append("then"), handed.append(u)))
        assert handed == [out]
        if call > 1:
            assert events == (["then", "refresh"] if call % 2 == 1 else ["then"]), (call, events)
            # the update was computed in the bases the refresh then replaced
            assert call % 2 == 0 or not torch.equal(basis, opt.state[W]["right_basis0"])


def test_staggered_refreshes_match_float64_reference():
    """stagger_refresh: each matrix's bases refreshed every ``freq`` Adam steps from its own phase, the phases
    packed by refresh cost (m^3 + n^3: 793, 468, 432 -> phases 0, 1, 2), so every step refreshes one matrix."""
    shapes, phases = [(4, 9), (7, 5), (6, 6)], [0, 1, 2]
    runs = [data(shape, seed=i) for i, shape in enumerate(shapes)]
    Ws = [nn.Parameter(W0.clone()) for W0, _ in runs]
    opt = SOAP(Ws, **kwargs(HP), stagger_refresh=True)
    assert [opt._phase(opt.param_groups[0], W) for W in Ws] == phases
    changed = {i: [] for i in range(len(Ws))}
    for call in range(1, len(runs[0][1]) + 1):
        before = [opt.state[W]["left_basis0"].clone() if opt.state else None for W in Ws]
        for W, (_, grads) in zip(Ws, runs):
            W.grad = grads[call - 1].clone()
        opt.step()
        if call == 1:
            Q0 = [{s: opt.state[W][f"{s}_basis0"].clone() for s in ("left", "right")} for W in Ws]
        for i, W in enumerate(Ws):
            if before[i] is not None and not torch.equal(before[i], opt.state[W]["left_basis0"]):
                changed[i].append(call)
    assert changed == {0: [4, 7, 10], 1: [2, 5, 8], 2: [3, 6, 9]}  # Adam step t = call - 1
    for W, (W0, grads), q0, phase in zip(Ws, runs, Q0, phases):
        assert (W.detach().double() - ref_soap(W0, grads, q0, **HP, phase=phase)).abs().max() < ATOL
    with pytest.raises(ValueError, match="set one of them"):
        SOAP(Ws, stagger_refresh=True, side_stream=True)


@pytest.mark.parametrize("cls", [SOAP, matrixopt.Shampoo])
def test_kept_step_stacks_take_only_what_changed(cls):
    """SOAP's bases and Shampoo's roots, stacked for the step's products, are kept between steps, and only the
    matrices a refresh installed or anything else wrote since are copied into the stack again (with the refreshes
    staggered, one of the two per refresh): the updates are bit for bit those of an optimizer that stacks them at
    every step."""
    torch.manual_seed(0)
    W0 = [torch.randn(6, 5), torch.randn(6, 5)]  # one run of two blocks, refresh phases 0 and 1
    grads = [[torch.randn(6, 5) for _ in W0] for _ in range(9)]
    hp = dict(lr=0.01, precondition_frequency=3, stagger_refresh=True,
              **({"start_preconditioning_step": 2} if cls is not SOAP else {}))
    name = "left_basis" if cls is SOAP else "left_root"
    runs = []
    for kept in (True, False):
        Ws = [nn.Parameter(w.clone()) for w in W0]
        opt = cls(Ws, **hp)
        copies = []
        for t, gs in enumerate(grads):
            if not kept:
                opt._operand_cache.clear()
            if t == 6:  # a write from outside (as a checkpoint load's copy would be)
                opt.state[Ws[0]][f"{name}0"].mul_(-1.0)
            for W, g in zip(Ws, gs):
                W.grad = g.clone()
            before = {k: (v[3], v[3]._version) for k, v in opt._operand_cache.items() if k[1] == name}
            opt.step()
            after = {k: v[3] for k, v in opt._operand_cache.items() if k[1] == name}
            # blocks copied into the kept stack (each copy into a view bumps its version), or "new"
            copies.append([after[k]._version - before[k][1] if k in before and before[k][0] is after[k] else "new"
                           for k in after])
        runs.append([W.detach().clone() for W in Ws])
        if kept:
            # SOAP: the first call builds its state only, stacked at the second; its refreshes follow that step's
            # products (phase 0 at calls 4 and 7, phase 1 at calls 2, 5 and 8), so each shows at the next call.
            # Shampoo: every root at call 2, then phase 0's at calls 5 and 8 and phase 1's at 3, 6 and 9, before
            # that step's products. And the write before call 7.
            assert copies == [[], ["new"], [1], [0], [1], [1], [1], [1], [1]]
            assert len(opt._operand_cache) == 2  # one stack per side: what the step keeps is bounded
            # a run of other blocks (a subset of the parameters) gets a stack of its own, which the next step,
            # not taking it, drops
            group, states = opt.param_groups[0], [opt.state[W] for W in Ws]
            ents = [(i, 0, opt._plan(group, W)[0]) for i, W in enumerate(Ws)]
            one = opt._step_stack(group, Ws, states, ents[1:], name)
            both = opt._step_stack(group, Ws, states, ents, name)
            assert one.shape[0] == 1 and both.shape[0] == 2 and len(opt._operand_cache) == 3
            assert torch.equal(both, torch.stack([st[f"{name}0"] for st in states]))
            for W, g in zip(Ws, grads[0]):
                W.grad = g.clone()
            opt.step()
            assert len(opt._operand_cache) == 2
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cls", [SOAP, matrixopt.Shampoo])
def test_kept_step_stacks_hold_for_a_block_shape_cut_into_several_runs(cls, monkeypatch):
    """A bucket of one block shape larger than a batch's cap is cut into several runs: each keeps its own stack,
    and a step whose bases or roots did not change copies none of them again."""
    monkeypatch.setattr("matrixopt.optim.layout.BUCKET_NUMEL", 2 * 36)  # two 6x6 factors per run
    torch.manual_seed(0)
    Ws = [nn.Parameter(torch.randn(6, 6)) for _ in range(5)]  # one block shape, three runs
    opt = cls(Ws, lr=0.01, precondition_frequency=100, **({} if cls is SOAP else {"start_preconditioning_step": 2}))
    name = "left_basis" if cls is SOAP else "left_root"
    for t in range(4):
        for W in Ws:
            W.grad = torch.randn(6, 6)
        before = {k: (v[3], v[3]._version) for k, v in opt._operand_cache.items() if k[1] == name}
        opt.step()
        after = {k: v[3] for k, v in opt._operand_cache.items() if k[1] == name}
        assert sorted(v.shape[0] for v in after.values()) == ([] if t == 0 else [1, 2, 2])  # the first step stacks none
        if t == 3:  # no refresh since the last step: the same three stacks, nothing copied into them
            assert before.keys() == after.keys()
            assert all(before[k][0] is after[k] and before[k][1] == after[k]._version for k in after)


def test_state_dict_round_trip_is_bit_identical():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    x, y = torch.randn(32, 6), torch.randn(32, 3)

    def train(m, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()

    hp = dict(lr=0.01, precondition_frequency=2, factor_update="kl")
    opt = matrixopt.build_optimizer(model, "soap", **hp)
    train(model, opt, 5)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    train(model, opt, 4)
    model2 = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    model2.load_state_dict(saved_model)
    opt2 = matrixopt.build_optimizer(model2, "soap", **hp)
    opt2.load_state_dict(saved_opt)
    train(model2, opt2, 4)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="Muon"):
        matrixopt.build_optimizer(model2, "muon").load_state_dict(saved_opt)


def test_non_finite_factor_keeps_basis():
    W0, grads = data((6, 5), steps=6)
    W = nn.Parameter(W0.clone())
    opt = SOAP([W], lr=0.01, precondition_frequency=2)
    for g in grads[:2]:
        W.grad = g.clone()
        opt.step()
    st = opt.state[W]
    basis = st["left_basis0"].clone()
    st["left0"][1, 1] = float("inf")
    for g in grads[2:4]:
        W.grad = g.clone()
        opt.step()
    assert opt.root_failures == 1 and torch.equal(st["left_basis0"], basis)
    assert torch.isfinite(W).all() and torch.isfinite(st["exp_avg"]).all() and torch.isfinite(st["exp_avg_sq"]).all()


def test_bf16_params_keep_fp32_state():
    W0, grads = data((8, 6))
    W = nn.Parameter(W0.bfloat16())
    opt = SOAP([W], **kwargs(HP), factor_dtype=torch.bfloat16)
    for g in grads:
        W.grad = g.bfloat16()
        opt.step()
    st = opt.state[W]
    assert st["exp_avg"].dtype == torch.float32 and st["left_basis0"].dtype == torch.bfloat16
    _, _, Q0 = run(W0.bfloat16().float(), [g.bfloat16().float() for g in grads[:1]], **kwargs(HP))
    ref = ref_soap(W0.bfloat16(), [g.bfloat16() for g in grads], Q0, **HP)
    assert (W.double() - ref).abs().max() < 0.2  # bf16 bases are orthogonal to ~1e-2 only


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=float("inf")), "learning rate"), (dict(betas=(0.9, 1.0)), "beta parameter at index 1"),
    (dict(factor_update="adafactor"), "factor_update"), (dict(precondition_frequency=-1), "precondition_frequency"),
    (dict(shampoo_beta=-0.5), "shampoo_beta"), (dict(damping=-1e-3), "damping"),
    (dict(factor_dtype=torch.float64), "factor_dtype"),
])
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SOAP([nn.Parameter(torch.zeros(3, 3))], **kwargs)


def test_build_optimizer_routes():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    opt = matrixopt.build_optimizer(model, "soap", lr=1e-3)
    assert [g["use_soap"] for g in opt.param_groups].count(True) == 1
    with pytest.raises(ValueError, match=r"1-D.*use_soap=False"):
        SOAP([nn.Parameter(torch.zeros(3))])
