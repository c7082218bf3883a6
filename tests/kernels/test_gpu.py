"""The compiled kernels on a GPU at real sizes, through the autotuner and the measured dispatcher."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# bf16 output rounding after fp32 accumulation (see test_syrk.py); one NS step compounds three roundings.
BF16_TOL = 1e-2
STEP_BF16_TOL = 2e-2


def rel_err(out, ref):
    assert torch.isfinite(out).all()
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("shape", [(1, 1024, 4096), (24, 768, 3072), (3, 300, 517)])
def test_syrk_and_update_on_gpu(shape):
    from matrixopt.kernels.ns_update import ns_update
    from matrixopt.kernels.syrk import syrk

    X = torch.randn(shape, device="cuda").bfloat16()
    X64 = X.double()
    A = syrk(X)
    assert rel_err(A, X64 @ X64.mT) < BF16_TOL
    B = syrk(A, alpha=0.5, beta=-2.0, Y=A)
    A64 = A.double()
    assert rel_err(B, -2.0 * A64 + 0.5 * A64 @ A64) < BF16_TOL
    out = ns_update(B, X, 3.0)
    assert rel_err(out, 3.0 * X64 + B.double() @ X64) < BF16_TOL


@pytest.mark.parametrize("shape", [(1, 1024, 4096), (24, 768, 3072), (3, 304, 520)])
def test_every_tma_syrk_config_on_gpu(shape):
    from matrixopt.kernels.ns_update import get_ns_update_configs, ns_update
    from matrixopt.kernels.syrk import get_syrk_configs, syrk

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9")
    from triton.runtime.errors import OutOfResources

    X = torch.randn(shape, device="cuda").bfloat16()
    X64 = X.double()
    ran = 0
    for cfg in [c for c in get_syrk_configs(*shape, tma=True) if c.persistent or c.wide]:
        A = syrk(X, config=cfg)
        assert rel_err(A, X64 @ X64.mT) < BF16_TOL, cfg
        assert torch.equal(A, A.mT), cfg
        A64 = A.double()
        try:  # the tuner passes over a config that does not fit (the paired tiles with the Y term may not)
            B = syrk(A, alpha=0.5, beta=-2.0, Y=A, config=cfg)
        except OutOfResources:
            continue
        assert rel_err(B, -2.0 * A64 + 0.5 * A64 @ A64) < BF16_TOL, cfg
        ran += 1
    assert ran >= 1  # at least the single-tile kernel; the pair may not fit with the Y term
    B = syrk(X) / shape[2]
    for cfg in [c for c in get_ns_update_configs(*shape, tma=True) if c.persistent]:
        assert rel_err(ns_update(B, X, 3.0, config=cfg), 3.0 * X64 + B.double() @ X64) < BF16_TOL, cfg


@pytest.mark.parametrize("shape", [(12, 768, 2304), (2, 129, 333)])
def test_dispatched_step_matches_float64(shape):
    from matrixopt.kernels import ns_step as ns
    from matrixopt.linalg.ortho import MODDED_NANOGPT

    X = torch.randn(shape, device="cuda", dtype=torch.float64)
    X = (X / X.norm(dim=(-2, -1), keepdim=True)).bfloat16()
    ref = ns.ns_step_reference(X.double(), *MODDED_NANOGPT[1])
    for backend in ("auto", "triton", "torch"):
        with ns.ns_backend(backend):
            assert rel_err(ns.ns_step(X, *MODDED_NANOGPT[1]), ref) < STEP_BF16_TOL, backend


@pytest.mark.parametrize("shape", [(12, 768, 2304), (2, 256, 1100)])  # TMA kernels; pointer kernels (1100 % 8)
def test_gram_newton_schulz_matches_float64_on_gpu(shape):
    from matrixopt.kernels import ns_step as ns
    from matrixopt.linalg.ortho import newton_schulz

    G = torch.randn(shape, device="cuda", dtype=torch.float64)
    ref = newton_schulz(G, dtype=torch.float64, method="standard")
    errs = {}
    for backend in ("auto", "triton", "torch"):
        with ns.ns_backend(backend):
            errs[backend] = rel_err(newton_schulz(G.float(), dtype=torch.bfloat16, method="gram"), ref)
    standard = rel_err(newton_schulz(G.float(), dtype=torch.bfloat16, method="standard"), ref)
    assert max(errs.values()) < min(2e-2, standard), (errs, standard)  # float16 Gram beats the bf16 standard form
    X = (G / G.norm(dim=(-2, -1), keepdim=True)).half()
    R = ns.gram_triton(X)
    S = ns.sym_mul_triton(R, R, 0.5, -2.0)
    assert torch.equal(R, R.mT) and torch.equal(S, S.mT)  # exactly symmetric, diagonal tiles included


def test_muon_elementwise_kernels_match_foreach_on_gpu():
    from matrixopt.kernels import muon_elementwise as ew
    from matrixopt.kernels import muon_fused as fused

    torch.manual_seed(0)
    shapes = [(768, 3072), (3072, 768), (300, 517)]
    lr = torch.tensor(0.01, device="cuda")
    for s, l in [(768, 3072), (300, 517)]:
        mats = [sh for sh in shapes if sorted(sh) == [s, l]] * 2
        grads = [torch.randn(sh, device="cuda") for sh in mats]
        bufs = [torch.randn(sh, device="cuda") for sh in mats]
        params = [torch.randn(sh, device="cuda") for sh in mats]
        Y = torch.randn(len(mats), s, l, device="cuda").bfloat16()  # one Newton–Schulz output for both paths
        outs, new_bufs, new_params = [], [], []
        for pack, apply in ((fused.momentum_pack_triton, fused.apply_update_triton),
                            (ew.momentum_pack_reference, ew.apply_update_reference)):
            b, p = [x.clone() for x in bufs], [x.clone() for x in params]
            out = torch.empty(len(mats), s, l, device="cuda", dtype=torch.bfloat16)
            pack(grads, b, out, 0.95, True)
            apply(p, Y, lambda m, n: (m / n) ** 0.5, lr, 0.1)
            outs.append(out.float())
            new_bufs.append(torch.cat([x.flatten() for x in b]))
            new_params.append(torch.cat([x.flatten() for x in p]))
        torch.testing.assert_close(new_bufs[0], new_bufs[1], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(outs[0], outs[1], rtol=2**-7, atol=1e-6)  # adjacent bf16 values at most
        torch.testing.assert_close(new_params[0], new_params[1], rtol=1e-6, atol=1e-6)


def test_frobenius_normalize_matches_float64_on_gpu():
    from matrixopt.kernels import muon_elementwise as ew
    from matrixopt.kernels import muon_fused as fused

    torch.manual_seed(0)
    X = torch.randn(24, 768, 3072, device="cuda").bfloat16()
    X[1] *= 1e30
    X[2] = 0
    out = fused.frobenius_normalize_triton(X, torch.bfloat16)
    ref = ew.frobenius_normalize_reference(X.double(), torch.float64)
    torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_deferred_nonfinite_check_skips_the_step_on_gpu(cuda_graph):
    from torch import nn

    from matrixopt import Muon, NonFiniteGradientError

    def setup(deferred):
        torch.manual_seed(0)
        ps = [nn.Parameter(torch.randn(s, device="cuda")) for s in [(64, 96), (96, 64), (64,)]]
        opt = Muon([{"params": ps[:2]}, {"params": ps[2:], "use_muon": False}], lr=0.05, weight_decay=0.1,
                   deferred_nonfinite=deferred, cuda_graph=cuda_graph)
        return ps, opt

    def grads(ps, seed, bad=False):
        g = torch.Generator("cuda").manual_seed(seed)
        for p in ps:
            p.grad = torch.randn(p.shape, device="cuda", generator=g)
        if bad:
            ps[0].grad[1, 2] = float("inf")

    ps, opt = setup(True)
    ref_ps, ref = setup(False)
    for seed in range(3):  # the graph is captured at the second step
        for q, o in ((ps, opt), (ref_ps, ref)):
            grads(q, seed)
            o.step()
    before = [p.detach().clone() for p in ps] + [v.clone() for st in opt.state.values() for v in st.values()]
    grads(ps, 9, bad=True)
    opt.step()
    after = [p.detach().clone() for p in ps] + [v.clone() for st in opt.state.values() for v in st.values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    with pytest.raises(NonFiniteGradientError, match="skipped"):
        opt.step()
    for seed in (3, 4):
        for q, o in ((ps, opt), (ref_ps, ref)):
            grads(q, seed)
            o.step()
    for a, b in zip(ps, ref_ps):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["normuon", "adamuon", "muon"])
@pytest.mark.parametrize("mode", ["decoupled", "cautious"])
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_fused_step_of_the_muon_family_matches_the_cpu_step(name, mode, cuda_graph):
    """The fused momentum and update kernels (decay modes included) with the second moments on the GPU, eager or
    captured (step 1 eager, 2 captured, 3 replayed): the same trajectory as the torch references on the CPU, both
    iterating in float32."""
    import matrixopt

    torch.manual_seed(0)
    shapes = [(256, 768), (768, 256), (256, 256)]
    cpu = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    opts = [matrixopt.OPTIMIZERS[name](ps, lr=0.02, weight_decay=0.1, weight_decay_mode=mode,
                                       ns_dtype=torch.float32, deferred_nonfinite=True, cuda_graph=graph)
            for ps, graph in ((cpu, False), (gpu, cuda_graph))]
    start = [p.detach().double() for p in cpu]
    for _ in range(4):
        for a, b in zip(cpu, gpu):
            a.grad = torch.randn(a.shape)
            b.grad = a.grad.cuda()
        for o in opts:
            o.step()
    for w0, a, b in zip(start, cpu, gpu):  # the change of the weights: updates and decay, ~5e-3 of them
        moved = a.detach().double() - w0
        assert rel_err(b.detach().cpu() - w0, moved) < 1e-3
    if cuda_graph:
        assert opts[1].__dict__.get("_last_replay"), "the GPU optimizer never replayed a captured step"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_max_logits_kernel_matches_dense_scores_on_gpu(dtype):
    """QK-clip's per-head max logit through the Triton kernel, at GPT-2-small's attention shape, GQA included."""
    from matrixopt.distributed.qk_clip import max_logits_per_head

    torch.manual_seed(0)
    q = torch.randn(4, 1024, 12, 64, device="cuda").to(dtype).transpose(1, 2)  # (B, H, T, d), strided
    k = torch.randn(4, 4, 1024, 64, device="cuda").to(dtype)
    s = q.double() @ k.double().repeat_interleave(3, dim=1).transpose(-1, -2) / 8.0
    ref = s.masked_fill(torch.ones(1024, 1024, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    torch.testing.assert_close(max_logits_per_head(q, k).double(), ref.amax(dim=(0, 2, 3)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("beta", [0.95, 1.0])
def test_factor_update_kernel_matches_the_torch_path_on_gpu(beta):
    """Shampoo's and SOAP's one-pass factor update, compiled, against the torch reference on 1024^2 factors: a
    non-finite product contributes nothing, and a skipped step (live 0) leaves the factors bit for bit."""
    from matrixopt.kernels import muon_elementwise as ew
    from matrixopt.optim.shampoo import accumulate

    g = torch.Generator(device="cuda").manual_seed(0)
    F = [torch.randn(1024, 1024, device="cuda", generator=g) for _ in range(3)] + [
        torch.randn(300, 300, device="cuda", generator=g)]
    GG = [torch.randn(3, 1024, 1024, device="cuda", generator=g), torch.randn(1, 300, 300, device="cuda", generator=g)]
    GG[0][1, 5, 7] = float("nan")
    out = {}
    for backend in ("torch", "triton"):
        with ew.elementwise_backend(backend):
            got = [f.clone() for f in F]
            accumulate(got[:3], GG[0], beta, live=torch.ones((), device="cuda"))
            accumulate(got[3:], GG[1], beta)
            kept = [f.clone() for f in got]
            accumulate(kept[:3], GG[0], beta, live=torch.zeros((), device="cuda"))
            assert all(torch.equal(a, b) for a, b in zip(kept, got))
            out[backend] = got
    for a, b in zip(out["torch"], out["triton"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["decoupled", "independent", "cautious"])
def test_decay_update_kernel_matches_the_torch_path_on_gpu(mode):
    """Shampoo's and SOAP's one-pass update, compiled, against the foreach reference on a model's shapes (a
    (6144, 2048) matrix, an expert stack, an odd-width one), a device learning rate and the skip flag: set, every
    parameter stays as it was, bit for bit."""
    from matrixopt.kernels import muon_elementwise as ew

    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(6144, 2048), (4, 768, 2048), (300, 517)]
    W = [torch.randn(s, device="cuda", generator=g) for s in shapes]
    U = [torch.randn(s, device="cuda", generator=g) for s in shapes]
    lr = torch.tensor(0.02, device="cuda")
    for flag in (0.0, 1.0):
        skip = torch.tensor(flag, device="cuda")
        out = {}
        for backend in ("torch", "triton"):
            with ew.elementwise_backend(backend):
                got = [w.clone() for w in W]
                ew.decay_update(got, U, lr, 0.1, mode, skip)
                out[backend] = got
        for a, b, w in zip(out["torch"], out["triton"], W):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
            assert torch.equal(b, w) == (flag == 1.0)


@pytest.mark.parametrize("name, hparams", [("soap", dict(precondition_frequency=2)),
                                           ("shampoo", dict(precondition_frequency=2, start_preconditioning_step=2,
                                                            root_method="eigenbasis"))])
def test_refresh_under_the_device_flag_drops_a_skipped_steps_results_on_gpu(name, hparams):
    """A NaN gradient at a step whose refresh runs on the device (SOAP's QR, Shampoo's eigenbasis) leaves every
    parameter and state entry as it was, bit for bit, compiled kernels and CholeskyQR on the GPU included."""
    import copy

    import matrixopt
    from matrixopt import NonFiniteGradientError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 32)).cuda()
    opt = matrixopt.build_optimizer(model, name, lr=1e-2, deferred_nonfinite=True, **hparams)
    x = torch.randn(16, 64, device="cuda")
    for step in range(1, 6):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        if step == 5:  # SOAP refreshes at steps 3, 5; Shampoo's first root at 2, refreshes at 4, 6
            if name == "shampoo":
                opt.step()
                opt.zero_grad()
                model(x).pow(2).mean().backward()
            model[0].weight.grad[0, 0] = float("nan")
            before = copy.deepcopy(opt.state_dict())
            params = [p.detach().clone() for p in model.parameters()]
            opt.step()  # skipped on the device: no error here
            assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
            with pytest.raises(NonFiniteGradientError):
                opt.state_dict()
            after = opt.state_dict()
            for k, st in before["state"].items():
                for key, v in st.items():
                    w = after["state"][k][key]
                    assert torch.equal(v, w) if torch.is_tensor(v) else v == w, (k, key)
        else:
            opt.step()


@pytest.mark.parametrize("nesterov", [True, False])
def test_shampoo_graft_kernel_matches_the_torch_path_on_gpu(nesterov):
    """Shampoo's Adam graft in one pass, compiled, against its foreach path on matrices of the 1.3B's shapes."""
    from matrixopt.kernels import muon_elementwise as ew
    from matrixopt.optim.shampoo import Shampoo

    group = {"betas": (0.9, 0.999), "nesterov": nesterov, "grafting": "adam", "eps": 1e-8}
    out = {}
    for backend in ("torch", "triton"):
        g = torch.Generator(device="cuda").manual_seed(0)
        states = [{"momentum_buffer": torch.randn(s, device="cuda", generator=g),
                   "exp_avg_sq": torch.rand(s, device="cuda", generator=g), "step": 7} for s in ((6144, 2048),
                                                                                                (2048, 8192))]
        grads = [torch.randn(st["exp_avg_sq"].shape, device="cuda", generator=g) for st in states]
        with ew.elementwise_backend(backend):
            D, A = Shampoo._graft(group, states, grads, None, None)
        out[backend] = [*D, *A, *(st[k] for st in states for k in ("momentum_buffer", "exp_avg_sq"))]
    for a, b in zip(out["torch"], out["triton"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_shampoo_eigenbasis_roots_in_tf32_keep_the_small_eigenvalues_on_gpu():
    """Under ``matmul_precision="tf32"`` the eigenbasis roots' power step and Rayleigh quotients keep float32
    accuracy (three TF32 products each) and only the root's product is TF32: on factors of condition number 1e6
    (from their exact eigenbasis) the root stays within a few 1e-3 of the float64 one, as in IEEE float32 (5e-4 on an
    H200), where the power step in one TF32 product left it 23% off."""
    from matrixopt.optim.shampoo import Shampoo, cuda_matmul_precision

    torch.manual_seed(0)
    n, damping = 512, 1e-6
    Q = torch.linalg.qr(torch.randn(4, n, n, dtype=torch.float64))[0]
    lam = torch.logspace(0, -6, n, dtype=torch.float64).expand(4, n)
    A = (Q * lam[:, None, :]) @ Q.mT
    want = (Q * (lam + damping).pow(-0.25)[:, None, :]) @ Q.mT
    states = [{"left0": a.float().cuda(), "left_basis0": q.float().cuda()} for a, q in zip(A, Q)]
    errors = {}
    for precision in ("tf32", "fp32"):
        with cuda_matmul_precision(precision):
            group = {"damping": damping, "matmul_precision": precision}
            _, roots, _, ok = Shampoo._eigen_roots(None, group, [(st, 0, "left") for st in states], 4, False, True)
        assert ok.all()
        errors[precision] = (torch.linalg.matrix_norm(roots.double().cpu() - want) /
                             torch.linalg.matrix_norm(want)).max().item()
    assert errors["fp32"] < 2e-3 and errors["tf32"] < 5e-3, errors


def test_graft_select_kernels_match_the_torch_path_on_gpu():
    """Shampoo's last pass, compiled, on 1024^2 blocks of 2048 x 6144 tensors against the torch expression."""
    from matrixopt.kernels import muon_fused as fused

    g = torch.Generator(device="cuda").manual_seed(0)
    S = torch.randn(6, 1024, 1024, device="cuda", generator=g)
    S[4, 7, 9] = float("nan")
    F, U = torch.randn(2048, 6144, device="cuda", generator=g), torch.empty(2048, 6144, device="cuda")
    Fs = [F[r:r + 1024, c:c + 1024] for r in (0, 1024) for c in (0, 2048, 4096)]
    Us = [U[r:r + 1024, c:c + 1024] for r in (0, 1024) for c in (0, 2048, 4096)]
    fused.graft_select_triton(S, Fs, Us, True)
    Fst = torch.stack(Fs)
    nS, nF = (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) for x in (S, Fst))
    want = S * torch.where(nS > 0, nF / nS, 0.0)
    want = torch.where(torch.isfinite(want.sum(dim=(-2, -1), keepdim=True)), want, Fst)
    torch.testing.assert_close(torch.stack(Us), want, rtol=1e-5, atol=1e-6)
