"""The per-head max-logit kernel (QK-clip's max without the scores in memory) against dense float64 scores, in
Triton's interpreter on the CPU (see conftest.py): causal and not, GQA, sizes that do not fill a tile, fp32 and
bf16 inputs."""

import math
import os

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU tensors through Triton's interpreter; on a GPU see test_gpu.py")

from matrixopt.kernels.max_logits import max_logits_triton  # noqa: E402

# fp32 inputs in IEEE fp32: d products accumulated, ~sqrt(d) * 6e-8 of |q||k|; bf16 inputs: exact products
ATOL32 = 1e-5


def dense(q, k, causal):
    """Float64: every score at once, GQA by repeating key heads; unscaled."""
    q, k = q.double(), k.double()
    H, H_kv, T, T_k = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    s = q @ k.repeat_interleave(H // H_kv, dim=1).transpose(-1, -2)  # (B, H, T, T_k)
    if causal:
        s = s.masked_fill(torch.ones(T, T_k, dtype=torch.bool).triu(1), -math.inf)
    return s.amax(dim=(0, 2, 3))


@pytest.mark.parametrize("B, H, H_kv, T, T_k, d", [
    (2, 3, 3, 70, 70, 8),     # two query blocks, the second partly empty; d padded to 16
    (1, 4, 2, 64, 64, 16),    # GQA, one full block
    (2, 2, 1, 20, 90, 32),    # more keys than queries (top-left causal), MQA
    (1, 2, 2, 90, 20, 24),    # more queries than keys: late query blocks see every key
])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_dense_scores(B, H, H_kv, T, T_k, d, causal, dtype):
    g = torch.Generator().manual_seed(T * 7 + d)
    q = torch.randn(B, T, H, d, generator=g).to(dtype).transpose(1, 2)  # (B, H, T, d), strided as in the model
    k = (torch.randn(B, H_kv, T_k, d, generator=g) + 0.3).to(dtype)
    got = max_logits_triton(q, k, causal)
    assert got.shape == (H,) and got.dtype == torch.float32
    tol = dict(rtol=0, atol=ATOL32) if dtype == torch.float32 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.double(), dense(q, k, causal), **tol)


def test_a_head_with_nothing_to_attend_is_minus_inf_and_bad_input_is_named():
    q = torch.randn(1, 2, 0, 16)
    assert torch.equal(max_logits_triton(q, torch.randn(1, 2, 0, 16)), torch.full((2,), -math.inf))
    with pytest.raises(ValueError, match="H_kv dividing H"):
        max_logits_triton(torch.randn(1, 3, 4, 16), torch.randn(1, 2, 4, 16))
