"""SYRK and the fused X update against float64 torch, on the CPU through Triton's interpreter (see conftest.py).

Sizes are odd and not multiples of the tile, batched, and every code path is reached through explicit configs:
one-pass and split-K SYRK (with and without the ``beta Y`` term), several GEMM tile shapes, transposed input, and
the persistent TMA kernels (sizes multiples of 8, as TMA needs, but not of the tile; more tiles than programs).
"""

import os

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU tensors through Triton's interpreter; on a GPU see test_gpu.py")

from matrixopt.kernels.ns_update import GemmConfig, ns_update, ns_update_reference  # noqa: E402
from matrixopt.kernels.syrk import SyrkConfig, get_syrk_configs, syrk, syrk_reference  # noqa: E402

# Relative Frobenius error against float64 on the same (already rounded) inputs. fp32: the interpreter's dot
# is exact fp32 (observed ~1e-7). bf16: the result is rounded to bf16 (unit round-off 2^-8, observed ~3.5e-3
# for these sizes) after fp32 accumulation; METHOD.md's band for bf16 operands is 1e-3..1e-2.
FP32_TOL = 1e-5
BF16_TOL = 1e-2
FP16_TOL = 2e-3  # unit round-off 2^-11
TOL = {torch.float32: FP32_TOL, torch.bfloat16: BF16_TOL, torch.float16: FP16_TOL}

SYRK_CONFIGS = [SyrkConfig(16, 16, 1, 4, 1), SyrkConfig(32, 16, 1, 4, 1), SyrkConfig(16, 16, 3, 4, 1)]
GEMM_CONFIGS = [GemmConfig(16, 32, 16, 2, 4, 1), GemmConfig(32, 16, 16, 1, 4, 1)]
SYRK_TMA = [SyrkConfig(16, 16, 1, 4, 1, persistent=True), SyrkConfig(32, 16, 1, 4, 1, persistent=True),
            SyrkConfig(16, 16, 1, 4, 1, persistent=True, pair=True),
            SyrkConfig(16, 16, 1, 4, 1, wide=True), SyrkConfig(16, 32, 1, 4, 1, wide=True)]
GEMM_TMA = [GemmConfig(16, 32, 16, 2, 4, 1, persistent=True), GemmConfig(32, 16, 16, 1, 4, 1, persistent=True)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("cfg", SYRK_CONFIGS, ids=lambda c: f"b{c.block}-split{c.split_k}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 37, 75), (1, 50, 21)])
def test_syrk_gram(shape, dtype, cfg):
    X = torch.randn(shape).to(dtype)
    C = syrk(X, config=cfg)
    assert C.shape == (shape[0], shape[1], shape[1]) and C.dtype == dtype and C.is_contiguous()
    assert torch.equal(C, C.mT)  # each element computed once and stored at both places
    assert rel_err(C, syrk_reference(X.double())) < TOL[dtype]


@pytest.mark.parametrize("cfg", SYRK_CONFIGS, ids=lambda c: f"b{c.block}-split{c.split_k}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_syrk_with_y_is_b_a_plus_c_a_squared(dtype, cfg):
    X = torch.randn(2, 33, 47, dtype=torch.float64)
    A = (X @ X.mT / 47).to(dtype)  # symmetric, like X X^T in Newton–Schulz
    b, c = -2.8089, 0.5000178  # a quintic step's b and c, passed at run time
    out = syrk(A, alpha=c, beta=b, Y=A, config=cfg)
    A64 = A.double()
    assert rel_err(out, b * A64 + c * A64 @ A64) < TOL[dtype]


@pytest.mark.parametrize("cfg", SYRK_CONFIGS + SYRK_TMA,
                         ids=lambda c: f"b{c.block}-split{c.split_k}{'-tma' * c.persistent}{'-pair' * c.pair}"
                                       f"{'-wide' * c.wide}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_syrk_two_operands_multiplies_commuting_symmetric_matrices(dtype, cfg, monkeypatch):
    import matrixopt.kernels.syrk as syrk_mod

    monkeypatch.setattr(syrk_mod, "num_sms", lambda device: 4)
    G = torch.randn(2, 40, 72, dtype=torch.float64)
    R = G @ G.mT / 72
    S, T = (R + 0.5 * R @ R).to(dtype), (2 * R - R @ R @ R / 8).to(dtype)  # polynomials in R: S T = T S
    out = syrk(S, alpha=0.75, beta=3.0, Y=S, W=T, config=cfg)  # 0.75 S T + 3 S, not S S^T
    assert torch.equal(out, out.mT)  # exactly symmetric, though the rounded S and T do not quite commute
    S64, T64 = S.double(), T.double()
    assert rel_err(out, 0.75 * S64 @ T64 + 3.0 * S64) < TOL[dtype]
    assert rel_err(syrk_reference(S, 0.75, 3.0, S, W=T).double(), 0.75 * S64 @ T64 + 3.0 * S64) < TOL[dtype]


def test_syrk_rejects_w_unlike_x():
    with pytest.raises(ValueError, match="W must match X"):
        syrk(torch.randn(2, 8, 8), W=torch.randn(2, 8, 9))


def test_syrk_transposed_input_and_alpha():
    X = torch.randn(2, 41, 19).mT  # (2, 19, 41) column-major view
    out = syrk(X, alpha=0.5, config=SYRK_CONFIGS[0])
    assert rel_err(out, 0.5 * syrk_reference(X.double())) < FP32_TOL


def test_syrk_rejects_bad_y():
    X = torch.randn(2, 8, 16)
    with pytest.raises(ValueError, match="contiguous"):
        syrk(X, beta=1.0, Y=torch.randn(2, 8, 9))


def test_syrk_configs_split_only_small_problems():
    assert all(c.split_k == 1 for c in get_syrk_configs(24, 768, 3072))
    assert any(c.split_k > 1 for c in get_syrk_configs(1, 1024, 4096))
    # 64-tiles only where 128-tiles cannot fill the SMs: a single 1024-row matrix has 36, 24 x 768 rows 504
    assert any(c.block == 64 for c in get_syrk_configs(1, 1024, 4096))
    assert all(c.block == 128 for c in get_syrk_configs(24, 768, 3072))


@pytest.mark.parametrize("cfg", GEMM_CONFIGS, ids=lambda c: f"{c.block_m}x{c.block_n}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 37, 75), (2, 29, 29)])
def test_ns_update(shape, dtype, cfg):
    batch, m, n = shape
    B = torch.randn(batch, m, m).to(dtype)
    X = torch.randn(shape).to(dtype)
    out = ns_update(B, X, 3.4445, config=cfg)
    assert out.shape == shape and out.dtype == dtype
    assert rel_err(out, ns_update_reference(B.double(), X.double(), 3.4445)) < TOL[dtype]


def test_ns_update_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="B \\(batch, m, m\\)"):
        ns_update(torch.randn(2, 5, 6), torch.randn(2, 5, 6), 1.0)


@pytest.mark.parametrize("cfg", SYRK_TMA, ids=lambda c: f"b{c.block}k{c.block_k}{'-pair' * c.pair}{'-wide' * c.wide}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 40, 72), (1, 48, 16), (2, 64, 24)])  # 3, 3 and 4 tiles of 16 per side
def test_persistent_tma_syrk(shape, dtype, cfg, monkeypatch):
    import matrixopt.kernels.syrk as syrk_mod

    monkeypatch.setattr(syrk_mod, "num_sms", lambda device: 4)  # fewer programs than tiles: each walks several
    X = torch.randn(shape).to(dtype)
    C = syrk(X, config=cfg)
    assert C.shape == (shape[0], shape[1], shape[1]) and C.is_contiguous()
    assert torch.equal(C, C.mT)
    assert rel_err(C, syrk_reference(X.double())) < TOL[dtype]
    A = (X.double() @ X.double().mT / shape[2]).to(dtype)
    out = syrk(A, alpha=0.5000178, beta=-2.8089, Y=A, config=cfg)
    A64 = A.double()
    assert rel_err(out, -2.8089 * A64 + 0.5000178 * A64 @ A64) < TOL[dtype]


@pytest.mark.parametrize("cfg", GEMM_TMA, ids=lambda c: f"{c.block_m}x{c.block_n}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 40, 72), (2, 24, 24)])
def test_persistent_tma_ns_update(shape, dtype, cfg, monkeypatch):
    import matrixopt.kernels.ns_update as upd_mod

    monkeypatch.setattr(upd_mod, "num_sms", lambda device: 3)
    B = torch.randn(shape[0], shape[1], shape[1]).to(dtype)
    X = torch.randn(shape).to(dtype)
    out = ns_update(B, X, 3.4445, config=cfg)
    assert rel_err(out, ns_update_reference(B.double(), X.double(), 3.4445)) < TOL[dtype]


def test_tma_configs_only_where_tma_can_address_the_tensors():
    from matrixopt.kernels.syrk import tma_compatible

    X = torch.randn(2, 40, 72).bfloat16()
    assert tma_compatible(X)
    assert not tma_compatible(torch.randn(2, 37, 75).bfloat16())  # rows of 150 bytes: not 16-byte aligned
    assert not tma_compatible(X.mT)  # last dimension not contiguous
    assert not tma_compatible(torch.randn(2 * 40 * 72 + 1).bfloat16()[1:].view(2, 40, 72))  # base 2 bytes off
    assert not any(c.persistent for c in get_syrk_configs(2, 40, 72))
    assert any(c.persistent for c in get_syrk_configs(2, 40, 72, tma=True))
    # the wide kernel (TMA) takes the pointer 64-tiles' place for a single matrix, not for a GPT-2-medium stack
    single = get_syrk_configs(1, 1024, 2048, tma=True)
    assert any(c.wide for c in single) and not any(c.block == 64 and not c.wide and c.split_k == 1 for c in single)
    assert not any(c.wide for c in get_syrk_configs(48, 1024, 4096, tma=True))
    assert not any(c.wide for c in get_syrk_configs(1, 1024, 2048))
    with pytest.raises(ValueError, match="TMA"):
        syrk(torch.randn(2, 37, 75).bfloat16(), config=SYRK_TMA[0])
    with pytest.raises(ValueError, match="TMA"):
        ns_update(torch.randn(2, 37, 37), torch.randn(2, 37, 75), 1.0, config=GEMM_TMA[0])
