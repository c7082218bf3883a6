"""matrixopt with Hugging Face transformers on CPU: routing of real model families (tiny configs, no downloads),
Trainer against our own loop (same losses, exact resume from Trainer's checkpoint, gradient accumulation, bf16),
and FSDP2 (``fully_shard``, as Accelerate applies it) on 2 gloo ranks against one process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import matrixopt  # noqa: E402
from matrixopt.integrations import hf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from _mp import run  # noqa: E402

transformers.logging.set_verbosity_error()

# Trainer runs the same float ops as the plain loop (forward, backward, torch's clip, our step), in the same
# order: measured equal to the last bit. rtol 1e-5 leaves room for a different summation order only.
RTOL = 1e-5
# FSDP2 on 2 ranks against 1 process: the gradient reduce-scatter sums in another order; 4 Muon steps,
# measured <= 2e-7 relative on the losses.
FSDP_RTOL = 1e-4

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, head_dim=8, max_position_embeddings=32)
DATA = torch.randint(0, 64, (48, 16), generator=torch.Generator().manual_seed(1))  # 48 sequences of 16 tokens


def routes(model) -> dict[str, str]:
    out = {}
    for g in matrixopt.param_groups(model):
        kind = "matrix" if g["use_muon"] else ("adamw" if g.get("weight_decay") != 0.0 else "no_decay")
        out.update(dict.fromkeys(g["names"], kind))
    return out


def split_of(p):
    return getattr(p, "_matrixopt_split", None)


# ----------------------------------------------------------------------------------------------- routing


@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_conv1d_and_fused_c_attn(tied):
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16,
                                  tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    model = transformers.GPT2LMHeadModel(cfg)
    r = routes(model)
    assert r["transformer.wte.weight"] == r["transformer.wpe.weight"] == "adamw"
    assert ("lm_head.weight" in r) != tied and r.get("lm_head.weight", "adamw") == "adamw"
    for i in range(2):
        h = f"transformer.h.{i}."
        for w in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            assert r[h + w + ".weight"] == "matrix" and r[h + w + ".bias"] == "no_decay"
        assert r[h + "ln_1.weight"] == r[h + "ln_2.bias"] == "no_decay"
        # Conv1D stores (in, out) = (32, 96): Q, K, V are column blocks
        assert split_of(model.transformer.h[i].attn.c_attn.weight) == (1, (32, 32, 32))
        assert split_of(model.transformer.h[i].mlp.c_fc.weight) is None
    text = matrixopt.routing_summary(matrixopt.param_groups(model))
    assert "Conv1D (in, out), Q|K|V [32, 32, 32] on dim 1" in text and "unrecognized" not in text
    if tied:
        assert "embedding (tied: lm_head.weight)" in text


def test_gpt2_qkv_pieces_are_orthogonalized_separately():
    """One Muon step on GPT-2's c_attn moves each of Q, K, V by a (scaled) orthogonal matrix: U^T U = I."""
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64,
                                                                 n_positions=16, bos_token_id=1, eos_token_id=2))
    w = model.transformer.h[0].attn.c_attn.weight
    opt = matrixopt.build_optimizer(model, "mop", lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False)
    before = w.detach().clone()
    model(input_ids=DATA[:4], labels=DATA[:4]).loss.backward()
    opt.step()
    scale = 0.2 * 32 ** 0.5  # match_adamw on each (32, 32) piece
    for U in ((before - w.detach()) / scale).split(32, dim=1):
        torch.testing.assert_close(U.T @ U, torch.eye(32), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_llama_like(family):
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[family]
    tied = family == "qwen3"
    model = cls[1](cls[0](**TINY, tie_word_embeddings=tied))
    r = routes(model)
    assert r["model.embed_tokens.weight"] == "adamw"
    assert ("lm_head.weight" in r) != tied and r.get("lm_head.weight", "adamw") == "adamw"
    for w in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj"):
        assert r[f"model.layers.1.{w}.weight"] == "matrix"
    assert {k for k, v in r.items() if v == "no_decay"} == {n for n, p in model.named_parameters() if p.ndim == 1}
    assert all(split_of(p) is None for p in model.parameters())


def test_phi3_fused_qkv_and_gate_up():
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**TINY))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert routes(model)["model.layers.0.self_attn.qkv_proj.weight"] == "matrix"
    assert split_of(attn.qkv_proj.weight) == (0, (32, 16, 16))  # 4 query heads, 2 key/value heads of 8
    assert split_of(mlp.gate_up_proj.weight) == (0, (64, 64))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_expert_stacks(family):
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
        model, inter = transformers.Qwen3MoeForCausalLM(cfg), 16
    else:
        model, inter = transformers.MixtralForCausalLM(transformers.MixtralConfig(**TINY, num_local_experts=4)), 64
    experts = model.model.layers[0].mlp.experts
    if not isinstance(getattr(experts, "gate_up_proj", None), nn.Parameter):
        pytest.skip(f"this transformers version stores {family} experts as per-expert linear layers")
    r = routes(model)
    assert r["model.layers.0.mlp.experts.gate_up_proj"] == r["model.layers.0.mlp.experts.down_proj"] == "matrix"
    assert r["model.layers.0.mlp.gate.weight"] == "adamw"  # the router: one logit per expert
    assert experts.gate_up_proj._matrixopt_experts and experts.down_proj._matrixopt_experts
    assert split_of(experts.gate_up_proj) == (0, (inter, inter))
    opt = matrixopt.build_optimizer(model, "muon", lr=1e-2)
    model(input_ids=DATA[:2], labels=DATA[:2]).loss.backward()
    before = experts.down_proj.detach().clone()
    opt.step()
    assert not torch.equal(before, experts.down_proj)


# ----------------------------------------------------------------------------------------------- Trainer


def tiny_llama() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))


class Rows(torch.utils.data.IterableDataset):
    """DATA's rows in order (no sampler: Trainer and the plain loop see the same batches)."""

    def __iter__(self):
        for row in DATA:
            yield {"input_ids": row, "labels": row}


class Recording(transformers.Trainer):
    """Trainer that keeps each micro-batch's loss (Trainer logs them rounded)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.losses = []

    def training_step(self, *a, **k):
        loss = super().training_step(*a, **k)
        self.losses.append(loss.item())
        return loss


def trainer_args(out, **kw):
    return transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=kw.pop("batch", 4), learning_rate=3e-3, weight_decay=0.1,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, logging_steps=100, **kw)


def plain_loop(steps, *, batch=4, bf16=False):
    """Our own loop: the optimizer Trainer gets, Trainer's default linear schedule and clip (max_grad_norm 1)."""
    model = tiny_llama()
    opt = matrixopt.build_optimizer(model, "muon", lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (steps - s) / steps))
    losses = []
    for s in range(steps):
        rows = DATA[batch * s:batch * (s + 1)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


def test_trainer_equals_plain_loop_and_resumes_exactly(tmp_path):
    steps = 6
    ref, ref_losses = plain_loop(steps)
    model = tiny_llama()
    args = trainer_args(tmp_path, max_steps=steps, save_steps=3)
    opt = hf.create_optimizer(model, args, name="muon")
    assert isinstance(opt, matrixopt.Muon) and opt.param_groups[0]["weight_decay"] == 0.1
    trainer = Recording(model=model, args=args, train_dataset=Rows(), optimizers=(opt, None))
    trainer.train()
    torch.testing.assert_close(torch.tensor(trainer.losses), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=1e-7)

    resumed = tiny_llama()  # a fresh process would start so: the checkpoint brings weights, optimizer, schedule
    trainer = Recording(model=resumed, args=args, train_dataset=Rows(),
                        optimizers=(hf.create_optimizer(resumed, args, name="muon"), None))
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert trainer.losses == ref_losses[3:]
    for p, q in zip(resumed.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_trainer_gradient_accumulation(tmp_path):
    """2 micro-batches of 2 rows per step take the step of one batch of 4 (up to float summation order)."""
    ref, _ = plain_loop(3)
    model = tiny_llama()
    args = trainer_args(tmp_path, batch=2, gradient_accumulation_steps=2, max_steps=3, save_strategy="no")
    transformers.Trainer(model=model, args=args, train_dataset=Rows(),
                         optimizer_cls_and_kwargs=hf.optimizer_cls_and_kwargs(args, name="muon")).train()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_trainer_bf16(tmp_path):
    ref, ref_losses = plain_loop(3, bf16=True)
    model = tiny_llama()
    args = trainer_args(tmp_path, bf16=True, max_steps=3, save_strategy="no")
    trainer = Recording(model=model, args=args, train_dataset=Rows(),
                        optimizers=(hf.create_optimizer(model, args, name="muon"), None))
    trainer.train()
    torch.testing.assert_close(torch.tensor(trainer.losses), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    state = trainer.optimizer.state[model.model.layers[0].self_attn.q_proj.weight]
    assert state["momentum_buffer"].dtype == torch.float32


class PoisonOneGradient(transformers.TrainerCallback):
    """Writes a NaN into q_proj's gradient before the optimizer step of step ``at`` (after Trainer's clipping)."""

    def __init__(self, weight, at):
        self.weight, self.at = weight, at

    def on_pre_optimizer_step(self, args, state, control, **kw):
        if state.global_step == self.at:
            self.weight.grad[0, 0] = float("nan")


@pytest.mark.parametrize("skip", [False, True])
def test_trainer_nonfinite_gradient(tmp_path, skip):
    """A NaN gradient stops the run naming the parameter, or with skip_nonfinite=True skips that update only."""
    model = tiny_llama()
    weight = model.model.layers[0].self_attn.q_proj.weight
    args = trainer_args(tmp_path, max_steps=3, save_strategy="no")
    opt = hf.create_optimizer(model, args, name="muon", skip_nonfinite=skip)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(), optimizers=(opt, None),
                                   callbacks=[PoisonOneGradient(weight, at=1)])
    if not skip:
        with pytest.raises(matrixopt.NonFiniteGradientError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight"):
            trainer.train()
        return
    trainer.train()
    assert opt.skipped_updates == 1 and torch.isfinite(weight).all()


def test_unknown_optimizer_name_lists_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown matrixopt optimizer 'lion'; valid names: adamuon, adamw, mop"):
        hf.create_optimizer(tiny_llama(), trainer_args(tmp_path), name="lion")
    with pytest.raises(ValueError, match="valid names"):
        hf.optimizer_cls_and_kwargs(name="Muon")


def test_wrapped_models_route_as_the_model():
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**TINY))
    opt = hf.create_optimizer(torch.compile(model), name="muon")
    names = [n for g in opt.param_groups for n in g["names"]]
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert model.model.layers[0].self_attn.qkv_proj.weight._matrixopt_split == (0, (32, 16, 16))


def test_trainer_hparams_reach_every_group(tmp_path):
    args = trainer_args(tmp_path, adam_beta1=0.8, adam_epsilon=1e-6)
    opt = hf.create_optimizer(tiny_llama(), args, name="soap")
    adam = [g for g in opt.param_groups if not g[opt.matrix_flag]]
    assert all(g["betas"] == (0.8, 0.999) and g["eps"] == 1e-6 and g["lr"] == 3e-3 for g in adam)
    plain = hf.create_optimizer(tiny_llama(), args, name="adamw", lr=1e-4)
    assert isinstance(plain, torch.optim.AdamW) and plain.param_groups[0]["lr"] == 1e-4


# ----------------------------------------------------------------------------------------------- FSDP2


def _fsdp_losses(rank: int, world: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from matrixopt.distributed.sharded import ShardedMuon

    transformers.logging.set_verbosity_error()
    model = tiny_llama()
    if world > 1:  # what Accelerate's FSDP2 plugin does: each decoder layer, then the root
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = hf.create_optimizer(model, name="muon", lr=3e-3, weight_decay=0.1)
    assert isinstance(opt, ShardedMuon) == (world > 1)
    losses = []
    per_rank = 4 // world
    for s in range(4):
        rows = DATA[4 * s + rank * per_rank:4 * s + (rank + 1) * per_rank]
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()  # FSDP averages the gradients over the ranks
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    losses = torch.stack(losses)
    if world > 1:
        torch.distributed.all_reduce(losses)
        losses /= world
    if rank == 0:
        torch.save(losses, out)


def test_fsdp2_equals_one_process(tmp_path):
    """ShardedMuon on FSDP2's DTensor shards of a Llama, built by create_optimizer, against one process.
    (Accelerate's FSDP2 plugin needs GPUs; on CPU Accelerate falls back to DDP, so this applies fully_shard as
    it does.)"""
    _fsdp_losses(0, 1, str(tmp_path / "one.pt"))
    run(_fsdp_losses, 2, str(tmp_path / "two.pt"), timeout=180)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    torch.testing.assert_close(two, one, rtol=FSDP_RTOL, atol=0)
