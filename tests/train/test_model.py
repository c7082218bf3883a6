import pytest
import torch

from matrixopt.train.config import ModelConfig
from matrixopt.train.model import GPT, PRESETS, GPTConfig


def small(**kw) -> GPTConfig:
    return GPTConfig(**(dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16) | kw))


@pytest.mark.parametrize("kw", [{}, {"rope": True}, {"norm": "rmsnorm", "bias": True}, {"tie_embeddings": False}])
def test_forward_shapes_and_initial_loss(kw):
    torch.manual_seed(0)
    model = GPT(small(**kw))
    idx, targets = torch.randint(0, 11, (2, 3, 8))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 8, 11)
    # At init the logits are near zero, so the loss is near log(vocab).
    assert abs(loss.item() - torch.log(torch.tensor(11.0)).item()) < 0.2


@pytest.mark.parametrize("rope", [False, True])
def test_attention_is_causal(rope):
    torch.manual_seed(0)
    model = GPT(small(rope=rope)).eval()
    a = torch.randint(0, 11, (1, 8))
    b = a.clone()
    b[0, 5:] = (b[0, 5:] + 1) % 11  # change the future only
    la, _ = model(a)
    lb, _ = model(b)
    torch.testing.assert_close(la[:, :5], lb[:, :5])
    assert not torch.allclose(la[:, 5:], lb[:, 5:])


def test_tied_head_shares_the_embedding():
    tied, untied = GPT(small()), GPT(small(tie_embeddings=False))
    assert tied.lm_head.weight is tied.transformer.wte.weight
    assert untied.num_params() == tied.num_params() + 11 * 16


def test_rope_replaces_the_position_table():
    assert "wpe" not in GPT(small(rope=True)).transformer
    assert "wpe" in GPT(small()).transformer


def test_presets_have_the_published_shapes():
    assert PRESETS["shakespeare-char"] == dict(n_layer=6, n_head=6, n_embd=384, block_size=256)
    gpt2 = GPT(ModelConfig(preset="gpt2-small", block_size=1024).gpt_config(50257))
    assert gpt2.num_params() == 124_337_664  # GPT-2 small without biases (nanoGPT prints 123.65M non-embedding)
    big = ModelConfig(preset="1.3b").gpt_config(50257)
    assert (big.n_layer, big.n_embd) == (24, 2048)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(n_embd=30, n_head=4), "not divisible by n_head=4"),
        (dict(dropout=1.0), "dropout must be in [0, 1)"),
        (dict(norm="batchnorm"), "norm must be one of"),
        (dict(n_layer=0), "n_layer must be a positive integer"),
    ],
)
def test_bad_shapes_are_named(kw, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
        small(**kw)


def test_sequence_longer_than_context_is_refused():
    with pytest.raises(ValueError, match="exceeds the model's block_size 8"):
        GPT(small())(torch.zeros(1, 9, dtype=torch.long))
