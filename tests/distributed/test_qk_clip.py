"""QK-clip against a float64 reference: the exact per-row rescale of the right heads (split and fused QKV, MHA and
GQA, with and without biases, permuted fused layouts), the clipped heads' recomputed max logit landing on the
threshold, the non-finite policy, validation, and ``max_logits_per_head`` against dense scores."""

from __future__ import annotations

import math

import pytest
import torch

from matrixopt.distributed.qk_clip import FusedQKV, QKClip, SplitQK, max_logits_per_head

# Everything below runs in float64, where a clip is one multiply per weight by sqrt(gamma) (1 ulp each) and a
# recomputed logit a d_model-long dot product: measured <= 1e-14 relative; a wrong head or factor is off by >= 1%.
RTOL64 = 1e-12
# max_logits_per_head on fp32 inputs accumulates d products in fp32: about sqrt(d) * 6e-8 relative to |q||k|.
ATOL32 = 1e-5


def _heads(x, W, b, n, d):
    """x (B, T, C) -> (B, n, T, d) through the rows of W (n * d, C)."""
    y = x @ W.T + (0 if b is None else b)  # (B, T, n * d)
    return y.view(x.shape[0], x.shape[1], n, d).transpose(1, 2)  # (B, n, T, d)


def _dense_max_logits(q, k, scale=None, causal=True):
    """Float64 reference: every score at once, GQA by repeating key heads."""
    q, k = q.double(), k.double()
    H, Hkv, T, Tk, d = q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]
    k = k.repeat_interleave(H // Hkv, dim=1)  # (B, H, Tk, d)
    s = q @ k.transpose(-1, -2) * (1 / math.sqrt(d) if scale is None else scale)  # (B, H, T, Tk)
    if causal:
        s = s.masked_fill(torch.ones(T, Tk, dtype=torch.bool).triu(1), -math.inf)
    return s.amax(dim=(0, 2, 3))  # (H,)


class Attn:
    """A tiny attention in float64 with separate W_q, W_k, W_v (and biases); heads get different sizes, so their
    max logits spread over a decade."""

    def __init__(self, H, Hkv, d, C, bias, seed):
        g = torch.Generator().manual_seed(seed)
        self.H, self.Hkv, self.d = H, Hkv, d
        gain_q = torch.logspace(0, 1, H, dtype=torch.float64)[torch.randperm(H, generator=g)].repeat_interleave(d)
        self.Wq = torch.randn(H * d, C, generator=g, dtype=torch.float64) * gain_q[:, None]
        self.Wk = torch.randn(Hkv * d, C, generator=g, dtype=torch.float64)
        self.Wv = torch.randn(Hkv * d, C, generator=g, dtype=torch.float64)
        self.bq = torch.randn(H * d, generator=g, dtype=torch.float64) if bias else None
        self.bk = torch.randn(Hkv * d, generator=g, dtype=torch.float64) if bias else None
        self.bv = torch.randn(Hkv * d, generator=g, dtype=torch.float64) if bias else None
        self.x = torch.randn(2, 7, C, generator=g, dtype=torch.float64)

    def max_logits(self, Wq=None, bq=None, Wk=None, bk=None):
        Wq, bq = (self.Wq, self.bq) if Wq is None else (Wq, bq)
        Wk, bk = (self.Wk, self.bk) if Wk is None else (Wk, bk)
        q = _heads(self.x, Wq, bq, self.H, self.d)
        k = _heads(self.x, Wk, bk, self.Hkv, self.d)
        return _dense_max_logits(q, k)

    def expected(self, S, tau):
        """The paper's rescale, row by row: query rows of head h by sqrt(min(1, tau / S_h)), key rows of KV head g
        by sqrt(min(1, tau / max_{h in g} S_h))."""
        Wq, Wk = self.Wq.clone(), self.Wk.clone()
        bq = None if self.bq is None else self.bq.clone()
        bk = None if self.bk is None else self.bk.clone()
        group = self.H // self.Hkv
        for h in range(self.H):
            f = math.sqrt(min(1.0, tau / S[h].item()))
            Wq[h * self.d:(h + 1) * self.d] *= f
            if bq is not None:
                bq[h * self.d:(h + 1) * self.d] *= f
        for g in range(self.Hkv):
            f = math.sqrt(min(1.0, tau / S[g * group:(g + 1) * group].max().item()))
            Wk[g * self.d:(g + 1) * self.d] *= f
            if bk is not None:
                bk[g * self.d:(g + 1) * self.d] *= f
        return Wq, bq, Wk, bk


def _tau_between(S):
    """A threshold with about half the heads above it, never equal to any of them."""
    s = S.sort().values
    k = len(s) // 2
    return float((s[k - 1] + s[k]) / 2) if len(s) > 1 else float(s[0]) / 2


HEADS = [(4, 4), (6, 2), (4, 1), (1, 1)]


@pytest.mark.parametrize("H,Hkv", HEADS)
@pytest.mark.parametrize("bias", [False, True])
def test_split_rescales_exactly_the_clipped_heads_rows(H, Hkv, bias):
    a = Attn(H, Hkv, d=3, C=10, bias=bias, seed=H * 10 + Hkv)
    S = a.max_logits()
    tau = _tau_between(S)
    Wq_ref, bq_ref, Wk_ref, bk_ref = a.expected(S, tau)
    Wq0, Wk0 = a.Wq.clone(), a.Wk.clone()
    clip = QKClip(tau, [SplitQK(q_weight=a.Wq, k_weight=a.Wk, q_bias=a.bq, k_bias=a.bk, n_head=H, n_kv_head=Hkv)])
    stats = clip.step([S])

    torch.testing.assert_close(a.Wq, Wq_ref, rtol=RTOL64, atol=0)
    torch.testing.assert_close(a.Wk, Wk_ref, rtol=RTOL64, atol=0)
    if bias:
        torch.testing.assert_close(a.bq, bq_ref, rtol=RTOL64, atol=0)
        torch.testing.assert_close(a.bk, bk_ref, rtol=RTOL64, atol=0)
    rows = (S <= tau).repeat_interleave(3)
    assert torch.equal(a.Wq[rows], Wq0[rows])  # heads at or below tau: bitwise unchanged
    group_max = S.view(Hkv, -1).amax(1)
    kv_rows = (group_max <= tau).repeat_interleave(3)
    assert torch.equal(a.Wk[kv_rows], Wk0[kv_rows])
    assert stats.clipped.item() == int((S > tau).sum())
    assert stats.max_logit.item() == S.max().item() and stats.nonfinite.item() == 0

    # The logit is bilinear in (W_q, W_k): a group's largest head lands on tau, every head ends <= tau.
    S_new = a.max_logits()
    for g in range(Hkv):
        heads = slice(g * (H // Hkv), (g + 1) * (H // Hkv))
        top = S[heads].max().item()
        for h in range(heads.start, heads.stop):
            gk = min(1.0, tau / top)
            want = S[h].item() * math.sqrt(min(1.0, tau / S[h].item()) * gk)
            assert S_new[h].item() == pytest.approx(want, rel=RTOL64)
        if top > tau:
            assert S_new[heads].max().item() == pytest.approx(tau, rel=RTOL64)
    assert (S_new <= tau * (1 + RTOL64)).all()
    if H == Hkv:  # MHA: exactly the clipped heads sit on tau, the rest are unchanged
        torch.testing.assert_close(S_new, torch.where(S > tau, torch.full_like(S, tau), S), rtol=RTOL64, atol=0)


@pytest.mark.parametrize("H,Hkv", HEADS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("permuted", [False, True])
def test_fused_qkv_matches_the_split_reference(H, Hkv, bias, permuted):
    a = Attn(H, Hkv, d=2, C=6, bias=bias, seed=100 + H * 10 + Hkv)
    S = a.max_logits()
    tau = _tau_between(S)
    Wq_ref, bq_ref, Wk_ref, bk_ref = a.expected(S, tau)
    W = torch.cat([a.Wq, a.Wk, a.Wv])  # ((H + 2 Hkv) d, C), [Q; K; V]
    b = torch.cat([a.bq, a.bk, a.bv]) if bias else None
    W_ref = torch.cat([Wq_ref, Wk_ref, a.Wv])
    b_ref = torch.cat([bq_ref, bk_ref, a.bv]) if bias else None
    order = torch.randperm(W.shape[0], generator=torch.Generator().manual_seed(H)) if permuted else None
    if permuted:  # stored row i is canonical row order[i]
        W, W_ref = W[order], W_ref[order]
        b, b_ref = (b[order], b_ref[order]) if bias else (None, None)
    V0 = W.clone()
    clip = QKClip(tau, [FusedQKV(weight=W, bias=b, n_head=H, n_kv_head=Hkv, row_order=order)])
    stats = clip.step(S.unsqueeze(0))  # the (n_attention, n_head) form

    torch.testing.assert_close(W, W_ref, rtol=RTOL64, atol=0)
    if bias:
        torch.testing.assert_close(b, b_ref, rtol=RTOL64, atol=0)
    v_rows = torch.zeros(W.shape[0], dtype=torch.bool)
    v_rows[(H + Hkv) * 2:] = True
    if permuted:
        v_rows = v_rows[order]
    assert torch.equal(W[v_rows], V0[v_rows])  # V never changes
    assert stats.clipped.item() == int((S > tau).sum())


def test_rank_major_order_of_the_reference_gpt():
    """The GPT under TP stores [q_0; k_0; v_0; q_1; ...]; its row_order is the rank-major index."""
    H, d, tp, C = 4, 2, 2, 5
    a = Attn(H, H, d=d, C=C, bias=True, seed=7)
    S = a.max_logits()
    tau = _tau_between(S)
    Wq_ref, bq_ref, Wk_ref, bk_ref = a.expected(S, tau)
    order = torch.arange(3 * H * d).view(3, tp, H * d // tp).transpose(0, 1).reshape(-1)  # (tp, 3, d/tp) flat
    W, b = torch.cat([a.Wq, a.Wk, a.Wv])[order], torch.cat([a.bq, a.bk, a.bv])[order]
    QKClip(tau, [FusedQKV(weight=W, bias=b, n_head=H, row_order=order)]).step([S])
    torch.testing.assert_close(W[order.argsort()], torch.cat([Wq_ref, Wk_ref, a.Wv]), rtol=RTOL64, atol=0)
    torch.testing.assert_close(b[order.argsort()], torch.cat([bq_ref, bk_ref, a.bv]), rtol=RTOL64, atol=0)


def test_several_attentions_list_and_stacked_forms_agree():
    attns = [Attn(4, 2, d=3, C=8, bias=False, seed=s) for s in range(3)]
    S = torch.stack([a.max_logits() for a in attns]).float()  # (3, 4), fp32 max logits on fp64 weights
    tau = float(S.median())
    refs = [a.expected(s.double(), tau) for a, s in zip(attns, S)]
    copies = [(a.Wq.clone(), a.Wk.clone()) for a in attns]
    stats = QKClip(tau, [SplitQK(q_weight=a.Wq, k_weight=a.Wk, n_head=4, n_kv_head=2) for a in attns]).step(list(S))
    QKClip(tau, [SplitQK(q_weight=q, k_weight=k, n_head=4, n_kv_head=2) for q, k in copies]).step(S)
    for a, (q, k), (Wq_ref, _, Wk_ref, _) in zip(attns, copies, refs):
        assert torch.equal(a.Wq, q) and torch.equal(a.Wk, k)
        torch.testing.assert_close(a.Wq, Wq_ref, rtol=1e-7, atol=0)  # gamma and its sqrt in fp32
        torch.testing.assert_close(a.Wk, Wk_ref, rtol=1e-7, atol=0)
    assert stats.clipped.item() == int((S > tau).sum()) > 0


def test_nothing_changes_at_or_below_tau():
    a = Attn(4, 4, d=3, C=8, bias=True, seed=3)
    S = a.max_logits()
    W0 = [t.clone() for t in (a.Wq, a.Wk, a.bq, a.bk)]
    tau = S.max().item()  # the largest head sits exactly on tau: not clipped
    stats = QKClip(tau, [SplitQK(q_weight=a.Wq, k_weight=a.Wk, q_bias=a.bq, k_bias=a.bk, n_head=4)]).step([S])
    assert all(torch.equal(t, t0) for t, t0 in zip((a.Wq, a.Wk, a.bq, a.bk), W0))
    assert stats.clipped.item() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_weights(dtype):
    a = Attn(4, 2, d=4, C=8, bias=False, seed=11)
    S = a.max_logits()
    tau = _tau_between(S)
    Wq_ref, _, Wk_ref, _ = a.expected(S, tau)
    Wq, Wk = a.Wq.to(dtype), a.Wk.to(dtype)
    QKClip(tau, [SplitQK(q_weight=Wq, k_weight=Wk, n_head=4, n_kv_head=2)]).step([S.float()])
    assert Wq.dtype == dtype
    # one rounding of the stored weight to dtype before and one after the scale (fp32 product)
    tol = 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(Wq.double(), Wq_ref, rtol=tol, atol=0)
    torch.testing.assert_close(Wk.double(), Wk_ref, rtol=tol, atol=0)


def test_nonfinite_max_logits_are_skipped_and_counted():
    a = Attn(6, 6, d=2, C=5, bias=False, seed=5)
    S = torch.tensor([50.0, float("nan"), float("inf"), -float("inf"), 1.0, 30.0], dtype=torch.float64)
    Wq0 = a.Wq.clone()
    stats = QKClip(10.0, [SplitQK(q_weight=a.Wq, k_weight=a.Wk, n_head=6)]).step([S])
    for h, f in enumerate([math.sqrt(10 / 50), 1, 1, 1, 1, math.sqrt(10 / 30)]):
        torch.testing.assert_close(a.Wq[2 * h:2 * h + 2], Wq0[2 * h:2 * h + 2] * f, rtol=RTOL64, atol=0)
    assert stats.clipped.item() == 2 and stats.nonfinite.item() == 2 and math.isnan(stats.max_logit.item())


@pytest.mark.parametrize("tau", [0.0, -1.0, float("nan"), float("inf"), True, "100"])
def test_bad_threshold(tau):
    W = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="threshold"):
        QKClip(tau, [SplitQK(q_weight=W, k_weight=W, n_head=2)])


def test_bad_layouts_name_the_parameter_and_shapes():
    W = torch.zeros(12, 5)
    with pytest.raises(ValueError, match="n_kv_head"):
        SplitQK(q_weight=W, k_weight=W, n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match=r"n_head"):
        SplitQK(q_weight=W, k_weight=W, n_head=0)
    with pytest.raises(ValueError, match=r"`blk\.q_weight` has shape \(12, 5\)"):
        SplitQK(q_weight=W, k_weight=W, n_head=5, name="blk")
    with pytest.raises(ValueError, match=r"`blk\.k_weight` has shape \(12, 5\), expected \(6, d_model\)"):
        SplitQK(q_weight=W, k_weight=W, n_head=4, n_kv_head=2, name="blk")
    with pytest.raises(ValueError, match=r"`blk\.q_bias` has shape \(11,\), expected \(12,\)"):
        SplitQK(q_weight=W, k_weight=W, n_head=4, q_bias=torch.zeros(11), name="blk")
    with pytest.raises(ValueError, match=r"`c_attn\.weight` has shape \(12, 5\).*\(8 \* d_head, d_model\)"):
        FusedQKV(weight=W, n_head=4, n_kv_head=2, name="c_attn")
    with pytest.raises(ValueError, match=r"`c_attn\.bias` has shape \(13,\)"):
        FusedQKV(weight=W, n_head=2, bias=torch.zeros(13), name="c_attn")
    with pytest.raises(ValueError, match="row_order"):
        FusedQKV(weight=W, n_head=2, row_order=torch.zeros(12, dtype=torch.long))
    with pytest.raises(ValueError, match="duplicate|twice"):
        QKClip(1.0, [FusedQKV(weight=W, n_head=2), FusedQKV(weight=W, n_head=2)])
    with pytest.raises(ValueError, match="attentions"):
        QKClip(1.0, [])


def test_bad_max_logits():
    W = torch.zeros(12, 5)
    clip = QKClip(1.0, [FusedQKV(weight=W, n_head=4), FusedQKV(weight=torch.zeros(6, 5), n_head=2)])
    for bad in ([torch.zeros(4)], [torch.zeros(4), torch.zeros(4)], torch.zeros(2, 4), torch.zeros(4)):
        with pytest.raises(ValueError, match="max_logits"):
            clip.step(bad)


@pytest.mark.parametrize("B,H,Hkv,T,Tk,d,block", [
    (2, 4, 4, 9, 9, 8, 4),  # query blocks that do not divide T
    (1, 6, 2, 16, 16, 4, 16),  # GQA, one block
    (3, 4, 1, 5, 5, 6, 1),  # MQA, one query at a time
    (2, 2, 2, 6, 10, 4, 4),  # more keys than queries (top-left causal)
    (2, 2, 1, 10, 6, 4, 3),  # more queries than keys
])
@pytest.mark.parametrize("causal", [True, False])
def test_max_logits_per_head_matches_dense(B, H, Hkv, T, Tk, d, block, causal):
    g = torch.Generator().manual_seed(B * 100 + T)
    q = torch.randn(B, T, H, d, generator=g).transpose(1, 2)  # (B, H, T, d), non-contiguous as in the model
    k = torch.randn(B, Hkv, Tk, d, generator=g) + 0.5
    got = max_logits_per_head(q, k, causal=causal, block=block)
    assert got.shape == (H,) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _dense_max_logits(q, k, causal=causal), rtol=0, atol=ATOL32)
    got = max_logits_per_head(q.double(), k.double(), scale=0.3, causal=causal, block=block)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, _dense_max_logits(q, k, scale=0.3, causal=causal), rtol=RTOL64, atol=0)


def test_max_logits_per_head_matches_sdpa_logits_in_bf16():
    """bf16 q, k (as under autocast): the max is taken over the exact products of the bf16 inputs."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 12, 8, generator=g).bfloat16() for _ in range(2))
    torch.testing.assert_close(max_logits_per_head(q, k, block=5).double(), _dense_max_logits(q, k), rtol=0,
                               atol=ATOL32)


def test_max_logits_per_head_validation():
    q = torch.zeros(1, 4, 3, 2)
    with pytest.raises(ValueError, match=r"q \(1, 4, 3, 2\), k \(1, 3, 3, 2\)"):
        max_logits_per_head(q, torch.zeros(1, 3, 3, 2))
    with pytest.raises(ValueError, match="scale"):
        max_logits_per_head(q, q, scale=0.0)
    with pytest.raises(ValueError, match="block"):
        max_logits_per_head(q, q, block=0)


def test_end_to_end_with_max_logits_per_head():
    """The measured max logits drive the clip; re-measured, the clipped heads sit on tau."""
    a = Attn(4, 2, d=4, C=8, bias=True, seed=21)
    q, k = _heads(a.x, a.Wq, a.bq, 4, 4), _heads(a.x, a.Wk, a.bk, 2, 4)
    S = max_logits_per_head(q, k, block=3)
    tau = _tau_between(S)
    QKClip(tau, [SplitQK(q_weight=a.Wq, k_weight=a.Wk, q_bias=a.bq, k_bias=a.bk, n_head=4, n_kv_head=2)]).step([S])
    S_new = max_logits_per_head(_heads(a.x, a.Wq, a.bq, 4, 4), _heads(a.x, a.Wk, a.bk, 2, 4))
    assert S_new.max().item() == pytest.approx(tau, rel=RTOL64)
    assert (S_new <= tau * (1 + RTOL64)).all()
