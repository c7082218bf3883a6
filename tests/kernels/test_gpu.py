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


@pytest.mark.parametrize("shape", [(12, 768, 2304), (2, 129, 333)])
def test_dispatched_step_matches_float64(shape):
    from matrixopt.kernels import ns_step as ns
    from matrixopt.linalg.ortho import QUINTIC

    X = torch.randn(shape, device="cuda", dtype=torch.float64)
    X = (X / X.norm(dim=(-2, -1), keepdim=True)).bfloat16()
    ref = ns.ns_step_reference(X.double(), *QUINTIC[1])
    for backend in ("auto", "triton", "torch"):
        with ns.ns_backend(backend):
            assert rel_err(ns.ns_step(X, *QUINTIC[1]), ref) < STEP_BF16_TOL, backend
