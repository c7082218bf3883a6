"""The Adam moment helper (:mod:`matrixopt.optim.adam`) that AdamW groups, Shampoo's graft and SOAP share: the
moments and the bias-corrected direction against a float64 reference, with int and 0-d tensor step counts, and bit
for bit the expression of torch.optim.AdamW's foreach path."""

import pytest
import torch

from matrixopt.optim.adam import adam_direction, adam_moments_

BETAS, EPS, LR = (0.9, 0.99), 1e-8, 3e-3
RTOL = 1e-6  # float32 round-off of a few operations, relative to each element of the moments
# the direction also divides by float32 bias corrections 1 - beta**t, which lose up to eps32 / (1 - beta2) ~ 6e-6
# relative for early steps with beta2 = 0.99 (halved by the square root)
DIRECTION_RTOL = 1e-5


def _tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in [(4, 5), (7,), (2, 3, 3)]]


@pytest.mark.parametrize("tensor_steps", [False, True])
def test_moments_and_direction_match_a_float64_reference(tensor_steps):
    m, v = [torch.zeros_like(t) for t in _tensors(0)], [torch.zeros_like(t) for t in _tensors(0)]
    m64, v64 = [t.double() for t in m], [t.double() for t in v]
    b1, b2 = BETAS
    for t in range(1, 4):
        grads = _tensors(t)
        adam_moments_(m, v, grads, BETAS)
        steps = [torch.tensor(float(t))] * 3 if tensor_steps else [t] * 3
        direction = adam_direction(m, v, steps, BETAS, EPS, LR)
        for i, gr in enumerate(grads):
            m64[i] = b1 * m64[i] + (1 - b1) * gr.double()
            v64[i] = b2 * v64[i] + (1 - b2) * gr.double() ** 2
            ref = LR * (m64[i] / (1 - b1**t)) / ((v64[i] / (1 - b2**t)).sqrt() + EPS)
            torch.testing.assert_close(m[i].double(), m64[i], rtol=RTOL, atol=0)
            torch.testing.assert_close(v[i].double(), v64[i], rtol=RTOL, atol=0)
            torch.testing.assert_close(direction[i].double(), ref, rtol=DIRECTION_RTOL, atol=0)


def test_direction_is_torch_adamw_foreach_expression_bit_for_bit():
    m, v = _tensors(1), [t.abs() for t in _tensors(2)]
    steps = [torch.tensor(5.0)] * 3
    b1, b2 = BETAS
    direction = adam_direction(m, v, steps, BETAS, EPS, LR)
    for mi, vi, t, d in zip(m, v, steps, direction):
        denom = (vi.sqrt() / (1 - b2**t).sqrt()).add_(EPS)
        assert torch.equal(d, mi / denom * (LR / (1 - b1**t)))
