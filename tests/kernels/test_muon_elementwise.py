"""Muon's fused elementwise kernels against float64 formulas, on the CPU through Triton's interpreter (see
conftest.py), and the whole Muon step through them against the foreach path.

Shapes are odd, not multiples of the 64 x 64 tile, tall and wide mixed in one stack, with strided pieces (a
column split of a fused weight) and stacked experts."""

import math
import os

import pytest
import torch
from torch import nn

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU tensors through Triton's interpreter; on a GPU see test_gpu.py")

import matrixopt  # noqa: E402
from matrixopt.kernels import muon_elementwise as ew  # noqa: E402
from matrixopt.kernels import muon_fused as fused  # noqa: E402

# fp32 elementwise math: a few ulps from float64 (observed ~2e-7 relative). bf16 outputs: one rounding, which
# Triton's interpreter does by truncation (relative error below 2^-7; a GPU rounds to nearest, 2^-8).
FP32_TOL = dict(rtol=1e-6, atol=1e-6)
BF16_TOL = dict(rtol=2**-7, atol=1e-6)

S, L = 37, 70  # stack shape (short, long)


def shapes():
    return [(S, L), (L, S), (S, L), (L, S), (L, S)]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_pack_matches_float64(grad_dtype, out_dtype, nesterov):
    torch.manual_seed(0)
    mu = 0.9
    grads = [torch.randn(s).to(grad_dtype) for s in shapes()]
    bufs = [torch.randn(s) for s in shapes()]
    bufs64 = [b.double() for b in bufs]
    out = torch.full((len(grads), S, L), float("nan"), dtype=out_dtype)
    parts = torch.full((len(grads), fused.pack_tiles(S, L)), float("nan"), dtype=torch.float64)
    fused.momentum_pack_triton(grads, bufs, out, mu, nesterov, parts=parts)
    # the partial sums of squares add up to each packed matrix's squared norm, of the values as stored
    torch.testing.assert_close(parts.sum(1), out.double().square().sum((1, 2)), rtol=1e-12, atol=0)
    for i, (g, b, b64) in enumerate(zip(grads, bufs, bufs64)):
        g64 = g.double()
        b_ref = mu * b64 + (1 - mu) * g64
        u_ref = (1 - mu) * g64 + mu * b_ref if nesterov else b_ref
        torch.testing.assert_close(b.double(), b_ref, **FP32_TOL)
        u = out[i].double()
        torch.testing.assert_close(u, u_ref.mT if g.shape[0] > g.shape[1] else u_ref,
                                   **(FP32_TOL if out_dtype == torch.float32 else BF16_TOL))


def test_momentum_pack_reads_gradients_scaled():
    """grad_scale (a deferred clipping coefficient) multiplies each gradient as it is read, in both paths, and
    leaves the gradients as they are."""
    torch.manual_seed(3)
    grads = [torch.randn(s) for s in shapes()]
    raw = [g.clone() for g in grads]
    scale = torch.tensor(0.37)
    outs, bufs = [], []
    for pack, gs, kw in ((fused.momentum_pack_triton, grads, dict(grad_scale=scale)),
                         (ew.momentum_pack_reference, grads, dict(grad_scale=scale)),
                         (fused.momentum_pack_triton, [g * scale for g in grads], {})):
        b = [torch.ones(s) for s in shapes()]
        out = torch.empty(len(grads), S, L)
        pack(gs, b, out, 0.9, True, **kw)
        outs.append(out)
        bufs.append(torch.cat([x.flatten() for x in b]))
    assert torch.equal(outs[0], outs[2]) and torch.equal(bufs[0], bufs[2])  # the same float32 product
    torch.testing.assert_close(outs[1], outs[0], **FP32_TOL)  # the reference: foreach lerps, a few ulps apart
    torch.testing.assert_close(bufs[1], bufs[0], **FP32_TOL)
    assert all(torch.equal(g, r) for g, r in zip(grads, raw))  # the gradients themselves are not written


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tensor_lr", [False, True])
@pytest.mark.parametrize("decay_mode", ["decoupled", "independent", "cautious"])
def test_apply_update_matches_float64(param_dtype, tensor_lr, decay_mode):
    torch.manual_seed(1)
    params = [torch.randn(s).to(param_dtype) for s in shapes()]
    before = [p.double() for p in params]
    Y = torch.randn(len(params), L, S).bfloat16().mT  # a transposed (k, S, L) view: strides are honoured
    lr, wd = 0.03, 0.1
    scale = lambda m, n: math.sqrt(m / n)  # noqa: E731  (differs between the orientations)
    fused.apply_update_triton(params, Y, scale, torch.tensor(lr) if tensor_lr else lr, wd, decay_mode=decay_mode)
    for i, (p, w) in enumerate(zip(params, before)):
        m, n = p.shape
        y = Y[i].double()
        y = y.mT if m > n else y
        keep = {"decoupled": 1 - lr * wd, "independent": 1 - wd,
                "cautious": 1 - lr * wd * (y * w >= 0)}[decay_mode]  # cautious: where the update agrees in sign
        ref = keep * w - lr * scale(m, n) * y
        torch.testing.assert_close(p.double(), ref, **(FP32_TOL if param_dtype == torch.float32 else BF16_TOL))
        if param_dtype == torch.float32:  # the torch reference rounds bf16 twice (decay, then update)
            reference = before[i].float()
            ew.apply_update_reference([reference], Y[i:i + 1], scale, lr, wd, decay_mode=decay_mode)
            torch.testing.assert_close(reference.double(), ref, **FP32_TOL)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("slot", [(S, S), (S, L), (L, S)])
def test_forced_orientation_lays_every_matrix_out_alike(transpose, slot):
    """transpose=True / False transposes every matrix / none, squares included, whatever the slot's shape (a
    sharded stack must be laid out alike on every rank); Triton and the references agree."""
    torch.manual_seed(2)
    shape = slot[::-1] if transpose else slot
    grads = [torch.randn(shape) for _ in range(3)]
    bufs = [torch.randn(shape) for _ in range(3)]
    mu = 0.9
    out, ref = torch.empty((3, *slot)), torch.empty((3, *slot))
    fused.momentum_pack_triton(grads, [b.clone() for b in bufs], out, mu, True, transpose)
    ew.momentum_pack_reference(grads, bufs, ref, mu, True, transpose)
    torch.testing.assert_close(out, ref, **FP32_TOL)
    u = (1 - mu) * grads[1].double() + mu * bufs[1].double()  # Nesterov, from the momentum the reference wrote
    torch.testing.assert_close(out[1].double(), u.mT if transpose else u, **FP32_TOL)
    params = [torch.randn(shape) for _ in range(3)]
    expect = [p.double() * (1 - 0.1 * 0.01) - 0.1 * 2.0 * (y.double().mT if transpose else y.double())
              for p, y in zip(params, out)]
    fused.apply_update_triton(params, out, lambda m, n: 2.0, 0.1, 0.01, transpose)
    for p, e in zip(params, expect):
        torch.testing.assert_close(p.double(), e, **FP32_TOL)
    with pytest.raises(ValueError, match="does not fill"):
        fused.momentum_pack_triton([torch.randn(S, L + 1)], [torch.randn(S, L + 1)], torch.empty(1, S, L), mu, True,
                                   transpose)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_frobenius_normalize_matches_float64(in_dtype, transposed, monkeypatch):
    monkeypatch.setattr(fused, "NORM_BLOCK", 256)  # several tiles per matrix, the last one partial
    torch.manual_seed(5)
    X = torch.randn(4, S, L if not transposed else S + 3).to(in_dtype)
    X[1] = 0  # a zero matrix stays zero
    X[2] *= 1e30  # squares beyond float32: the float64 sums hold them
    X[3] *= 1e-30
    X = X.mT if transposed else X  # a transposed view keeps its layout
    out = fused.frobenius_normalize_triton(X, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.stride() == X.stride()
    X64 = X.double()
    norm = X64.norm(dim=(-2, -1), keepdim=True)
    ref = torch.where(norm > 0, X64 / norm, 0.0)
    torch.testing.assert_close(out.double(), ref, **BF16_TOL)
    assert torch.equal(fused.frobenius_normalize_triton(X, torch.bfloat16), out)  # fixed summation order
    # with the sums of squares handed in (as the momentum pass gives them), in a few or in many partials
    X64 = X64.reshape(4, -1)
    few = torch.stack([c.sum(1) for c in X64.square().tensor_split(3, dim=1)], 1)
    for parts in (few, X64.square()):  # 3 partials; over 1024, which are summed first
        torch.testing.assert_close(fused.frobenius_normalize_triton(X, torch.bfloat16, parts).double(), ref,
                                   **BF16_TOL)
        torch.testing.assert_close(ew.frobenius_normalize_reference(X, torch.bfloat16, parts).double(), ref,
                                   **BF16_TOL)


def test_strided_pieces_are_written_in_place():
    """Column pieces of a fused weight have a row stride larger than their width."""
    torch.manual_seed(2)
    W, G, B = torch.randn(S, 3 * L), torch.randn(S, 3 * L), torch.zeros(S, 3 * L)
    pieces = lambda t: list(t.split(L, dim=1))  # noqa: E731
    out = torch.empty(3, S, L)
    fused.momentum_pack_triton(pieces(G), pieces(B), out, 0.5, False)
    torch.testing.assert_close(B, 0.5 * G)
    torch.testing.assert_close(out, 0.5 * G.reshape(S, 3, L).transpose(0, 1))
    W0 = W.clone()
    fused.apply_update_triton(pieces(W), out, lambda m, n: 2.0, 0.1, 0.0)
    torch.testing.assert_close(W, W0 - 0.2 * 0.5 * G)


def _stacks():
    """One ``(S, L)`` batch as the optimizer hands it over, 11 matrices in 5 tensors: a stack, a stack of column
    pieces (an offset and a row stride past their width), a tall stack, a matrix and a tall column piece."""
    return [torch.randn(3, S, L), torch.randn(2, S, 2 * L)[:, :, L:], torch.randn(4, L, S), torch.randn(S, L),
            torch.randn(L, S + 5)[:, :S]]


def _matrices(ts):
    """The stacks' matrices one by one, as views."""
    return [m for t in ts for m in (t.unbind(0) if t.ndim == 3 else [t])]


def test_a_stacks_table_rows_are_its_matrices_rows():
    """A stack's table is one run per tensor, which expands to the rows of its matrices one by one: each address a
    matrix stride past the last, their row strides, consecutive slots; tall and wide in separate tables."""
    grads = _stacks()
    bufs = [torch.zeros(t.shape) for t in grads]
    gs, bs = _matrices(grads), _matrices(bufs)
    tall = [g.shape[0] > g.shape[1] for g in gs]
    pack = fused.pack_runs(grads, bufs, len(gs), S, L)
    assert sum(len(runs) for _, runs in pack) == len(grads)
    assert {t: fused.table_rows(runs).tolist() for t, runs in pack} == {
        t: [[g.data_ptr(), b.data_ptr(), g.stride(0), b.stride(0), i] for i, (g, b) in enumerate(zip(gs, bs))
            if tall[i] == t] for t in (False, True)}
    assert {t: fused.table_rows(runs).tolist() for t, runs in fused.apply_runs(grads, len(gs), S, L)} == {
        t: [[g.data_ptr(), g.stride(0), i] for i, g in enumerate(gs) if tall[i] == t] for t in (False, True)}


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_stacks_give_what_their_matrices_give_one_by_one(backend):
    """Every pass over stacks (views among them) writes, bit for bit, what it writes over their matrices handed
    over one by one: the fused kernels through their tables, the torch references through their stacked ops."""
    runs = []
    for one_by_one in (False, True):
        torch.manual_seed(5)
        grads = _stacks()
        bufs, params, states = ([torch.rand(t.shape) for t in grads] for _ in range(3))
        row_scale = torch.rand(11, L)
        mats = _matrices if one_by_one else list
        out = torch.empty(11, S, L)
        with ew.elementwise_backend(backend):
            ew.momentum_pack(mats(grads), mats(bufs), out, 0.9, True)
            ew.apply_update(mats(params), out, lambda m, n: m / n, 0.1, 0.2, decay_mode="cautious",
                            row_scale=row_scale)
            rows = ew.row_sums_of_squares(out, mats(params))
            moments = ew.second_moment_normalize(out, mats(states), 0.95, 1e-8)
        runs.append([out, rows, moments, *bufs, *params, *states])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="must match"):
        fused.momentum_pack_triton([torch.randn(S, L)], [torch.randn(S, L + 1)], torch.empty(1, S, L), 0.9, True)
    with pytest.raises(ValueError, match="contiguous"):
        fused.momentum_pack_triton([torch.randn(S, L)], [torch.randn(S, L)], torch.empty(1, L, S).mT, 0.9, True)
    with pytest.raises(ValueError, match="2 matrices for a stack of 1"):
        fused.apply_update_triton([torch.randn(S, L)] * 2, torch.empty(1, S, L), lambda m, n: 1.0, 0.1, 0.0)
    with pytest.raises(ValueError, match="3 matrices for a stack of 2"):  # a stack counts its matrices
        fused.momentum_pack_triton([torch.randn(3, S, L)], [torch.randn(3, S, L)], torch.empty(2, S, L), 0.9, True)


def _model():
    torch.manual_seed(3)
    d = 24
    qkv = matrixopt.mark_split(nn.Parameter(torch.randn(3 * d, d)), 3)  # (d, d) row pieces
    cols = matrixopt.mark_split(nn.Parameter(torch.randn(d, 2 * d + 8)), [d + 4, d + 4], dim=1)  # strided pieces
    experts = matrixopt.mark_experts(nn.Parameter(torch.randn(3, d + 4, d)))  # tall experts
    wide, tall = nn.Parameter(torch.randn(d, d + 4)), nn.Parameter(torch.randn(d + 4, d))
    conv = nn.Parameter(torch.randn(8, 3, 3, 3))
    return [qkv, cols, experts, wide, tall, conv]


@pytest.mark.parametrize("cls,scaling", [(matrixopt.Muon, "match_adamw"), (matrixopt.Muon, "spectral"),
                                         (matrixopt.NorMuon, "match_adamw"), (matrixopt.AdaMuon, "match_adamw")])
def test_muon_step_through_kernels_matches_foreach_path(cls, scaling):
    """Every piece kind in one optimizer: the fused kernels give the foreach path's parameters and state (AdaMuon:
    its second-moment pass, NorMuon: its row sums, too)."""
    runs = {}
    for backend in ("triton", "torch"):
        params = _model()
        opt = cls(params, lr=0.02, momentum=0.9, weight_decay=0.1, scaling=scaling)
        torch.manual_seed(4)
        with ew.elementwise_backend(backend):
            for _ in range(3):
                for p in params:
                    p.grad = torch.randn_like(p)
                opt.step()
        runs[backend] = (params, [t for p in params for k, t in sorted(opt.state[p].items())])
    for a, b in zip(*(runs[k][0] + runs[k][1] for k in ("triton", "torch"))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="unknown elementwise backend"):
        with ew.elementwise_backend("cuda"):
            pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_flags_kernel_finds_each_nan_and_inf(dtype):
    """One launch over tensors of many sizes: a NaN past the first chunk of a large tensor, an Inf and a -Inf in
    small ones, an empty tensor, and finite values up to the dtype's largest (which are not flagged)."""
    big = fused.CHECK_CHUNK + 333  # two chunks, the second short
    grads = [torch.randn(n).to(dtype) for n in (big, 5, 37 * 70, 0, big, 1, 64)]
    grads[2] = grads[2].reshape(37, 70)
    grads[0][big - 1] = math.nan  # in the second chunk only
    grads[1][3] = math.inf
    grads[5][0] = -math.inf
    grads[6][7] = torch.finfo(dtype).max  # large but finite
    with ew.elementwise_backend("triton"):
        flags = ew.nonfinite_flags(grads)
    expected = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    assert torch.equal(flags, expected)
    assert torch.equal(ew.nonfinite_flags_reference(grads), expected)
    grads[0][big - 1] = 0.0  # the same tensors, now finite: the kernel reads them anew
    with ew.elementwise_backend("triton"):
        assert torch.equal(ew.nonfinite_flags(grads), torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]))


def test_apply_update_scales_each_row_of_each_matrix():
    """NorMuon's per-neuron scale: row r of W_i (as it lies, tall or wide) takes row_scale[i, r]; Triton and the
    torch reference agree with float64."""
    torch.manual_seed(4)
    params = [torch.randn(s) for s in shapes()]
    before = [p.double() for p in params]
    Y = torch.randn(len(params), S, L)
    row_scale = torch.rand(len(params), L) + 0.5
    reference = [p.clone() for p in params]
    fused.apply_update_triton(params, Y, lambda m, n: 2.0, 0.1, 0.01, row_scale=row_scale)
    ew.apply_update_reference(reference, Y, lambda m, n: 2.0, 0.1, 0.01, row_scale=row_scale)
    for i, (p, q, w) in enumerate(zip(params, reference, before)):
        m, n = p.shape
        y = Y[i].double().mT if m > n else Y[i].double()
        ref = (1 - 0.1 * 0.01) * w - 0.1 * 2.0 * row_scale[i, :m, None].double() * y
        torch.testing.assert_close(p.double(), ref, **FP32_TOL)
        torch.testing.assert_close(q.double(), ref, **FP32_TOL)
    with pytest.raises(ValueError, match="row_scale must be a contiguous float32"):
        fused.apply_update_triton(params, Y, lambda m, n: 2.0, 0.1, 0.01, row_scale=row_scale[:, :S])


@pytest.mark.parametrize("o_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transpose", [None, False])
def test_second_moment_normalize_matches_float64(o_dtype, transpose):
    """AdaMuon's pass: each V_i (tall or wide, read as it lies) steps from its O_i, O_i is divided by
    sqrt(V_i) + eps in place, and the row sums of squares come back per row as V_i lies; Triton and the torch
    reference agree with float64. A set skip flag leaves the moments as they were."""
    torch.manual_seed(5)
    beta2, eps = 0.95, 1e-8
    mats = shapes() if transpose is None else [(S, L)] * 3
    O = torch.randn(len(mats), S, L).to(o_dtype)
    if transpose is False:  # a rows-first view with strides, as the sharded path hands it over
        O = torch.randn(len(mats), L, S).to(o_dtype).mT
    V = [torch.rand(s) for s in mats]
    O64, V64 = O.double(), [v.double() for v in V]
    results = {}
    for name, fn in (("triton", fused.second_moment_normalize_triton), ("torch", ew.second_moment_normalize_reference)):
        o, v = O.clone(), [x.clone() for x in V]
        rows = fn(o, v, beta2, eps, transpose)
        results[name] = (o, v, rows)
        for i, (m, n) in enumerate(mats):
            tall = m > n if transpose is None else False
            o_i = O64[i].mT if tall else O64[i]
            v_ref = beta2 * V64[i] + (1 - beta2) * o_i.square()
            u_ref = o_i / (v_ref.sqrt() + eps)
            torch.testing.assert_close(v[i].double(), v_ref, **FP32_TOL)
            u = o[i].double().mT if tall else o[i].double()
            torch.testing.assert_close(u, u_ref, **(FP32_TOL if o_dtype == torch.float32 else BF16_TOL))
            torch.testing.assert_close(rows[i, :m].double(), u.square().sum(-1), rtol=1e-5, atol=1e-6)
            assert torch.all(rows[i, m:] == 0)
    # bf16: the interpreter truncates where torch rounds to nearest, so the stored values differ by an ulp
    tol = dict(rtol=1e-5, atol=1e-6) if o_dtype == torch.float32 else dict(rtol=2**-6, atol=1e-6)
    torch.testing.assert_close(results["triton"][2], results["torch"][2], **tol)
    for name, fn in (("triton", fused.second_moment_normalize_triton), ("torch", ew.second_moment_normalize_reference)):
        v = [x.clone() for x in V]
        fn(O.clone(), v, beta2, eps, transpose, skip=torch.tensor(1.0))
        assert all(torch.equal(a, b) for a, b in zip(v, V)), name
    with pytest.raises(ValueError, match="does not fill"):
        fused.second_moment_normalize_triton(O, [torch.rand(S, L + 1)] * len(mats), beta2, eps, transpose)
    # the same kernel without second moments: O's row sums as each matrix lies, O left as it is
    before = O.clone()
    rows = fused.row_sums_of_squares_triton(O, V, transpose)
    assert torch.equal(O, before)
    torch.testing.assert_close(rows, ew.row_sums_of_squares_reference(O, V, transpose), rtol=1e-5, atol=1e-6)
    for i, (m, n) in enumerate(mats):
        o_i = O64[i].mT if (m > n if transpose is None else False) else O64[i]
        torch.testing.assert_close(rows[i, :m].double(), o_i.square().sum(-1), rtol=1e-5, atol=1e-6)


def test_momentum_pack_packs_the_sign_when_asked():
    """sign=True packs sign(U) (AdaMuon's input) from the same pass, zeros kept, and the partial sums of squares are
    the sign's (its nonzero count); the momentum steps as without it. Triton and the reference agree."""
    torch.manual_seed(6)
    grads = [torch.randn(s) for s in shapes()]
    grads[0][3, :5] = 0.0  # U = 0 where both the gradient and the momentum are 0
    outs = {}
    for sign in (False, True):
        bufs = [torch.zeros(s) for s in shapes()]
        bufs[1] += 1.0
        out = torch.empty(len(grads), S, L)
        parts = torch.empty((len(grads), fused.pack_tiles(S, L)), dtype=torch.float64)
        fused.momentum_pack_triton(grads, bufs, out, 0.9, True, parts=parts, sign=sign)
        ref = torch.empty_like(out)
        ref_bufs = [torch.zeros(s) for s in shapes()]
        ref_bufs[1] += 1.0
        ew.momentum_pack_reference(grads, ref_bufs, ref, 0.9, True, sign=sign)
        torch.testing.assert_close(out, ref, **FP32_TOL)
        outs[sign] = (out, parts, bufs)
    assert torch.equal(outs[True][0], torch.sign(outs[False][0]))
    assert torch.all(outs[True][0][0, 3, :5] == 0)
    torch.testing.assert_close(outs[True][1].sum(1), (outs[True][0] != 0).sum((1, 2)).double(), rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(outs[True][2], outs[False][2]))


def test_adam_one_pass_matches_float64_and_skips_on_the_flag(monkeypatch):
    """Adam's one-pass kernel (SOAP's Adam in the eigenbasis): the moments and the bias-corrected direction of
    float64 math, over matrices of several shapes in one launch: more rows than a program takes, more columns than
    an iteration, an empty one, and blocks of larger tensors (row strides of their own); a set skip flag writes no
    moment and returns zeros; the directions can overwrite the gradients."""
    from matrixopt.optim.adam import adam_step

    launched = []
    kernel = fused.adam_triton
    monkeypatch.setattr(fused, "adam_triton", lambda *a, **k: launched.append(1) or kernel(*a, **k))
    monkeypatch.setattr(fused, "ADAM_BLOCK", 16)  # so that a row takes several iterations
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (21, 40), (0, 4), (16, 16)]
    big_m, big_v = torch.randn(30, 50, generator=g), torch.rand(30, 50, generator=g)
    M = [torch.randn(s, generator=g) for s in shapes] + [big_m[2:12, 7:40], big_m[12:30, 7:40]]
    V = [torch.rand(s, generator=g) for s in shapes] + [big_v[2:12, 7:40], big_v[12:30, 7:40]]
    G = [torch.randn(m.shape, generator=g) for m in M]
    (b1, b2), eps, t = (0.9, 0.95), 1e-8, 3
    want_m = [m.double() + (1 - b1) * (x.double() - m.double()) for m, x in zip(M, G)]
    want_v = [b2 * v.double() + (1 - b2) * x.double() ** 2 for v, x in zip(V, G)]
    want_d = [(m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps) for m, v in zip(want_m, want_v)]
    outside = big_m.clone(), big_v.clone()
    with ew.elementwise_backend("triton"):
        m0, v0 = [m.clone() for m in M], [v.clone() for v in V]
        zeros = adam_step(m0, v0, G, [t] * 6, (b1, b2), eps, skip=torch.ones(()))
        assert all(torch.equal(a, b) for a, b in zip(m0 + v0, M + V)) and all(not z.any() for z in zeros)
        grads = [x.clone() for x in G]
        d = adam_step(M, V, grads, [t] * 6, (b1, b2), eps, skip=torch.zeros(()), into_grads=True)
    assert len(launched) == 2 and all(a is b for a, b in zip(d, grads))
    for got, want in zip(M + V + d, want_m + want_v + want_d):
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-7)
    for big, before in zip((big_m, big_v), outside):  # the blocks' neighbours untouched
        assert torch.equal(big[:2], before[:2]) and torch.equal(big[:, :7], before[:, :7])
        assert torch.equal(big[:, 40:], before[:, 40:])


def test_adam_one_pass_takes_a_stack_of_gradients_as_its_matrices(monkeypatch):
    """A ``(n, R, C)`` stack in place of the gradients' list (SOAP's projected stack, addressed by arithmetic, not
    one view per block): the same moments and directions, bit for bit, written over the stack, which is returned;
    also for a stack whose matrices are not adjacent (a strided slice of a larger one)."""
    from matrixopt.optim.adam import adam_step

    monkeypatch.setattr(fused, "ADAM_BLOCK", 16)
    g = torch.Generator().manual_seed(0)
    big_m, big_v = torch.randn(30, 70, generator=g), torch.rand(30, 70, generator=g)
    M = [big_m[r:r + 10, c:c + 33] for r in (0, 15) for c in (1, 35)]  # blocks of a larger tensor
    V = [big_v[r:r + 10, c:c + 33] for r in (0, 15) for c in (1, 35)]
    for X in (torch.randn(4, 10, 33, generator=g), torch.randn(8, 10, 33, generator=g)[::2]):
        results = []
        for as_stack in (False, True):
            m, v = [x.clone() for x in M], [x.clone() for x in V]
            grads = X.clone() if as_stack else [x.clone() for x in X]
            with ew.elementwise_backend("triton"):
                d = adam_step(m, v, grads, [2] * 4, (0.9, 0.95), 1e-8, into_grads=True)
            assert d is grads if as_stack else all(a is b for a, b in zip(d, grads))
            results.append((m, v, list(d)))
        for a, b in zip(*(sum(r, []) for r in results)):
            assert torch.equal(a, b)
        assert not torch.equal(results[0][2][0], X[0])  # the directions were written


def _assert_copied(got: torch.Tensor, want: torch.Tensor, down: bool) -> None:
    if down:  # float32 to bfloat16: rounded to the nearest on a GPU, truncated by Triton's interpreter
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)
    else:
        assert torch.equal(got, want)


def test_copy_matrices_in_one_launch_match_torch_copies(monkeypatch):
    """The block copy kernel (Shampoo's and SOAP's stacks of blocks, and their writes back into the blocks): blocks
    of a larger tensor (odd widths, row strides of their own) into a stack, converting float32 and bfloat16 either
    way, and back into the blocks of another tensor whose other entries stay as they were; a strided stack; a list
    of matrices of several shapes, an empty one among them."""
    launched = []
    kernel = fused.copy_matrices_triton
    monkeypatch.setattr(fused, "copy_matrices_triton", lambda *a, **k: launched.append(1) or kernel(*a, **k))
    monkeypatch.setattr(fused, "ADAM_BLOCK", 16)  # several iterations per row
    g = torch.Generator().manual_seed(0)
    at = [(r, c) for r in (0, 15) for c in (1, 35)]
    for src, dst in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32,) * 2):
        big = torch.randn(30, 70, generator=g).to(src)
        blocks = [big[r:r + 10, c:c + 33] for r, c in at]
        stack = torch.full((4, 10, 33), 7.0, dtype=dst)
        with ew.elementwise_backend("triton"):
            ew.copy_matrices(stack, blocks)
        _assert_copied(stack, torch.stack(blocks).to(dst), down=dst.itemsize < src.itemsize)
        out = torch.full((30, 70), 5.0, dtype=src)
        X = torch.randn(8, 10, 33, generator=g).to(dst)[::2]  # matrices not adjacent
        with ew.elementwise_backend("triton"):
            ew.copy_matrices([out[r:r + 10, c:c + 33] for r, c in at], X)
        want = torch.full((30, 70), 5.0, dtype=src)
        for (r, c), x in zip(at, X):
            want[r:r + 10, c:c + 33] = x.to(src)
        _assert_copied(out, want, down=src.itemsize < dst.itemsize)
    shapes = [(3, 5), (21, 40), (0, 4), (16, 16)]
    srcs = [torch.randn(s, generator=g) for s in shapes]
    dsts = [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]
    with ew.elementwise_backend("triton"):
        ew.copy_matrices(dsts, srcs)
    for d, x in zip(dsts, srcs):
        _assert_copied(d, x.bfloat16(), down=True)
    assert len(launched) == 7


def test_soap_through_the_adam_kernel_matches_its_foreach_path():
    torch.manual_seed(0)
    runs = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 6))
        opt = matrixopt.build_optimizer(model, "soap", lr=1e-2, precondition_frequency=2)
        g = torch.Generator().manual_seed(1)
        with ew.elementwise_backend(backend):
            for _ in range(5):
                opt.zero_grad()
                model(torch.randn(8, 12, generator=g)).pow(2).mean().backward()
                opt.step()
        runs[backend] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(runs["torch"], runs["triton"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not all(torch.equal(a, b) for a, b in zip(runs["torch"], runs["triton"]))  # the kernel ran


@pytest.mark.parametrize("beta1", [0.9, 0.3])
def test_adam_one_pass_nesterov_numerator(monkeypatch, beta1):
    """With ``nesterov``, the kernel also writes the numerator ``lerp(g, m, beta1)`` (either branch of torch's
    lerp) and divides it, not m, by the root of v, as float64 math does; a set skip flag writes zeros there too."""
    monkeypatch.setattr(fused, "ADAM_BLOCK", 16)
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (21, 40)]
    M, V = [torch.randn(s, generator=g) for s in shapes], [torch.rand(s, generator=g) for s in shapes]
    G = [torch.randn(s, generator=g) for s in shapes]
    (b2, eps, t) = (0.99, 1e-8, 4)
    want_m = [m.double() + (1 - beta1) * (x.double() - m.double()) for m, x in zip(M, G)]
    want_v = [b2 * v.double() + (1 - b2) * x.double() ** 2 for v, x in zip(V, G)]
    want_n = [x.double() + beta1 * (m - x.double()) for m, x in zip(want_m, G)]
    want_d = [(n / (1 - beta1**t)) / ((v / (1 - b2**t)).sqrt() + eps) for n, v in zip(want_n, want_v)]
    with ew.elementwise_backend("triton"):
        nums = [torch.full(s, 7.0) for s in shapes]
        fused.adam_triton([m.clone() for m in M], [v.clone() for v in V], G, t, (beta1, b2), eps,
                          skip=torch.ones(()), nesterov=nums)
        assert all(not n.any() for n in nums)
        d = fused.adam_triton(M, V, G, t, (beta1, b2), eps, nesterov=nums)
    for got, want in zip(M + V + nums + d, want_m + want_v + want_n + want_d):
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("nesterov", [True, False])
def test_shampoo_graft_through_the_adam_kernel_matches_its_foreach_path(nesterov):
    """Shampoo's Adam graft (momentum, second moment, the Nesterov numerator and the Adam direction) in one pass
    gives the foreach path's tensors to round-off, for matrices of two shapes in one launch; a step skipped on the
    device leaves both moments as they were, bit for bit."""
    from matrixopt.optim.shampoo import Shampoo

    group = {"betas": (0.9, 0.999), "nesterov": nesterov, "grafting": "adam", "eps": 1e-8}

    def inputs() -> tuple[list[dict], list[torch.Tensor]]:
        g = torch.Generator().manual_seed(0)
        states = [{"momentum_buffer": torch.randn(s, generator=g), "exp_avg_sq": torch.rand(s, generator=g),
                   "step": 3} for s in ((16, 12), (5, 40))]
        return states, [torch.randn(st["momentum_buffer"].shape, generator=g) for st in states]

    out = {}
    for backend in ("torch", "triton"):
        states, grads = inputs()
        with ew.elementwise_backend(backend):
            D, A = Shampoo._graft(group, states, grads, None, None)
        out[backend] = [*D, *A, *(st[k] for st in states for k in ("momentum_buffer", "exp_avg_sq"))]
    for a, b in zip(out["torch"], out["triton"]):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    states, grads = inputs()
    before = [st[k].clone() for st in states for k in ("momentum_buffer", "exp_avg_sq")]
    with ew.elementwise_backend("triton"):
        D, A = Shampoo._graft(group, states, grads, torch.ones(()), torch.zeros(()))
    after = [st[k] for st in states for k in ("momentum_buffer", "exp_avg_sq")]
    assert all(torch.equal(x, b) for x, b in zip(after, before))
    assert all(not t.any() for t in A) and (not nesterov or all(not t.any() for t in D))


@pytest.mark.parametrize("graft", [True, False])
def test_graft_select_matches_the_torch_path(monkeypatch, graft):
    """Shampoo's last pass through its two kernels: each block of S scaled to its fallback's norm (or kept as is
    without grafting), a zero block left zero, a block with a NaN or an Inf replaced by its fallback; the fallbacks
    and updates are blocks of larger tensors, and nothing outside the update blocks is written."""
    monkeypatch.setattr(fused, "ADAM_BLOCK", 16)  # several iterations per row
    g = torch.Generator().manual_seed(0)
    b, m, n = 4, 21, 40
    S = torch.randn(b, m, n, generator=g)
    S[1] = 0.0
    S[2, 3, 4] = float("nan")
    S[3, 0, 0] = float("inf")
    big_f, big_u = torch.randn(2 * m, 3 * n, generator=g), torch.full((2 * m, 3 * n), 5.0)
    corners = [(0, 0), (0, n), (m, 0), (m, 2 * n)]
    Fs = [big_f[r:r + m, c:c + n] for r, c in corners]
    Us = [big_u[r:r + m, c:c + n] for r, c in corners]
    fused.graft_select_triton(S, Fs, Us, graft)
    for s, f, u in zip(S.double(), Fs, Us):
        if not torch.isfinite(s).all():
            want = f.double()
        elif graft:
            ns = torch.linalg.vector_norm(s)
            want = s * (torch.linalg.vector_norm(f.double()) / ns if ns > 0 else 0.0)
        else:
            want = s
        torch.testing.assert_close(u.double(), want, rtol=1e-6, atol=1e-6)
    outside = torch.ones_like(big_u, dtype=torch.bool)
    for r, c in corners:
        outside[r:r + m, c:c + n] = False
    assert (big_u[outside] == 5.0).all()


@pytest.mark.parametrize("beta", [0.95, 1.0])
def test_factor_update_one_pass_matches_the_reference_drops_non_finite_blocks_and_skips(monkeypatch, beta):
    """Shampoo's and SOAP's factor update (``accumulate``) through the one-pass kernel: the average (or, for
    beta = 1, the sum) of float64 math, over factors of several sizes in one launch; a product with a NaN or Inf
    entry counts as zeros (its factor only decays); a skipped step (live 0) leaves every factor as it was, bit for
    bit, whatever the products hold."""
    from matrixopt.optim.shampoo import accumulate

    launched = []
    kernel = fused.factor_ema_triton
    monkeypatch.setattr(fused, "factor_ema_triton", lambda *a, **k: launched.append(1) or kernel(*a, **k))
    monkeypatch.setattr(fused, "ADAM_BLOCK", 16)  # several iterations per row
    g = torch.Generator().manual_seed(0)
    for d in (5, 21):
        F = [torch.randn(d, d, generator=g) for _ in range(3)]
        GG = torch.randn(3, d, d, generator=g)
        GG[1, 2, 3] = float("nan") if d == 5 else float("inf")
        w = 1.0 if beta == 1.0 else 1.0 - beta
        want = [f.double() + w * p.double() if beta == 1.0 else (1 - w) * f.double() + w * p.double()
                for f, p in zip(F, torch.where(torch.isfinite(GG).all(dim=(1, 2), keepdim=True), GG, 0.0))]
        with ew.elementwise_backend("triton"):
            kept = [f.clone() for f in F]
            accumulate(kept, GG, beta, live=torch.zeros(()))
            assert all(torch.equal(a, b) for a, b in zip(kept, F))
            accumulate(F, GG, beta, live=torch.ones(()))
            again = [f.clone() for f in kept]
            accumulate(again, GG, beta)  # no flag: the same update
        for got, ref, other in zip(F, want, again):
            torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)
            assert torch.equal(got, other)
    assert len(launched) == 6


@pytest.mark.parametrize("mode", ["decoupled", "independent", "cautious"])
def test_decay_update_in_one_launch_matches_its_foreach_reference(mode, monkeypatch):
    """Shampoo's and SOAP's update step, ``W <- decay(W) - lr U``: the one-pass kernel against the foreach
    reference for matrices, an expert stack, a vector and an empty matrix, the learning rate a float or a device
    tensor; a set skip flag leaves every parameter as it was, bit for bit; and each decay mode on hand-computed
    values (cautious decays only where the update and the weight agree in sign)."""
    launched = []
    kernel = fused.decay_update_triton
    monkeypatch.setattr(fused, "decay_update_triton", lambda *a, **k: launched.append(1) or kernel(*a, **k))
    monkeypatch.setattr(fused, "ADAM_BLOCK", 16)  # several iterations per row
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 33), (3, 5, 17), (40,), (0, 4)]
    for lr in (0.05, torch.tensor(0.05)):
        for flag in (None, 0.0, 1.0):
            W = [torch.randn(s, generator=g) for s in shapes]
            U = [torch.randn(s, generator=g) for s in shapes]
            skip = None if flag is None else torch.tensor(flag)
            before, want = [w.clone() for w in W], [w.clone() for w in W]
            ew.decay_update_reference(want, U, lr, 0.1, mode, skip)
            with ew.elementwise_backend("triton"):
                ew.decay_update(W, U, lr, 0.1, mode, skip)
            for got, w, w0 in zip(W, want, before):
                assert torch.equal(got, w0) if flag == 1.0 else not got.numel() or not torch.equal(got, w0)
                torch.testing.assert_close(got, w, rtol=2e-7, atol=1e-7)
    W = [torch.ones(2, 4)]
    U = [torch.tensor([[1.0] * 4, [-1.0] * 4])]
    with ew.elementwise_backend("triton"):
        ew.decay_update(W, U, 0.5, 0.1, mode)
    agree, disagree = {"decoupled": (0.45, 1.45), "independent": (0.4, 1.4), "cautious": (0.45, 1.5)}[mode]
    torch.testing.assert_close(W[0], torch.tensor([[agree] * 4, [disagree] * 4]))
    assert len(launched) == 7
