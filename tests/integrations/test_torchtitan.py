"""matrixopt inside torchtitan 0.3.0, on CPU: routing of torchtitan's Llama 3 (a tiny config, no downloads), the
optimizers container against matrixopt's optimizer in a plain loop (same losses), the container under torchtitan's
``parallelize_llama`` (FSDP2, and tensor parallelism) on 2 gloo ranks against one process, and checkpoints: the
``state_dict`` round trip, and a DCP save and resume through torchtitan's ``CheckpointManager``.

torchtitan's ``Trainer`` binds a CUDA device (it picks "cuda" when torch finds no accelerator), so these tests run its
parts in the order of ``Trainer.train_step``: zero_grad, forward, the sum cross-entropy divided by the global token
count, backward, ``clip_grad_norm_``, the optimizers' step, the lr schedulers' step.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("torchtitan")

from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.components.optimizer import (  # noqa: E402
    LRSchedulersContainer,
    OptimizersContainer,
    ParamGroupConfig,
)
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers, parallelize_llama  # noqa: E402
from torchtitan.models.llama3.sharding import set_llama3_sharding_config  # noqa: E402

import matrixopt  # noqa: E402
from matrixopt.integrations.torchtitan import SHARDED_NAMES, MatrixoptOptimizersContainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from _mp import run  # noqa: E402

# The container runs the same float ops as the plain loop (forward, backward, clip, the optimizer's step), in the
# same order: measured equal to the last bit. rtol 1e-5 leaves room for a different summation order only.
RTOL = 1e-5
# 2 ranks against 1 process: FSDP2's reduce-scatter and TP's partial sums add in another order; 4 steps, measured
# <= 2e-7 relative on the losses and 1e-6 absolute on the weights (of std 0.02 to 1). The losses of these 4 steps
# on random tokens tell the optimizers apart only at 1e-4; the weights do, by lr = 1e-2 per step.
DIST_RTOL, DIST_ATOL = 1e-4, 1e-5
# SOAP_UNSTABLE: SOAP is checked on its losses, not its weights. Its first eigenbases come from factors of rank
# <= 32 (one step's gradient of a (64, 32) matrix), whose null space has no preferred basis, and Adam in an
# arbitrary basis moves the weights arbitrarily: in one process a 1e-7 relative change of the gradients moves
# SOAP's weights by 0.04 here (Shampoo's and Muon's by 4e-7).
TP_NAMES = ("adamuon", "adamw", "muon", "normuon")  # Shampoo and SOAP shard over FSDP2 only

DIM, N_HEADS, N_KV_HEADS, VOCAB, SEQ = 32, 4, 2, 64, 16
BATCH, STEPS, MAX_NORM = 4, 4, 1.0
DATA = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(1))
HPARAMS = dict(lr=1e-2, weight_decay=0.1)


def llama_config(*, fuse_qkv: bool = True, tied: bool = False) -> Llama3Model.Config:
    """A 2-layer torchtitan Llama 3 of width 32 (4 query heads, 2 KV heads). Attention is SDPA: torchtitan's flex
    attention has no backward on CPU in torch 2.13."""
    linear, embedding = {"weight": lambda w: nn.init.trunc_normal_(w, std=0.02)}, {"weight": nn.init.normal_}
    cfg = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB, enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=embedding),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=linear),
        layers=_build_llama3_layers(n_layers=2, dim=DIM, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, hidden_dim=64,
                                    fuse_qkv=fuse_qkv, attn_backend="flex",
                                    rope=ComplexRoPE.Config(dim=DIM // N_HEADS, max_seq_len=SEQ, theta=10000.0)))
    for _, _, parent, attr in list(cfg.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    set_llama3_sharding_config(cfg, enable_sp=True)  # what Trainer's update_from_config does, for TP
    return cfg


def tiny_llama(**kw) -> nn.Module:
    torch.manual_seed(0)
    model = llama_config(**kw).build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def routes(model: nn.Module) -> dict[str, str]:
    out = {}
    for g in matrixopt.param_groups(model):
        kind = "matrix" if g["use_muon"] else ("adamw" if g.get("weight_decay") != 0.0 else "no_decay")
        out.update(dict.fromkeys(g["names"], kind))
    return out


def weights(model: nn.Module) -> torch.Tensor:
    """Every parameter, whole (gathered from its shards), flattened in name order."""
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in model.named_parameters()}
    return torch.cat([full[n].detach().flatten() for n in sorted(full)])


def schedulers(optimizers) -> LRSchedulersContainer:
    """torchtitan's warmup-stable-decay schedule, as its llama3 debug config sets it."""
    config = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5, decay_type="linear")
    return config.build(optimizers=optimizers, training_steps=STEPS)


def train(model: nn.Module, optimizers, lr_schedulers, steps: range, rows=slice(None)) -> list[torch.Tensor]:
    """Trainer.train_step's order; each step's loss is this rank's token sum over the global token count."""
    loss_fn = CrossEntropyLoss.Config(global_vocab_size=VOCAB).build()
    losses = []
    for s in steps:
        tokens = DATA[BATCH * s:BATCH * (s + 1)][rows]
        optimizers.zero_grad()
        loss, _ = loss_fn(model(tokens[:, :-1]), tokens[:, 1:], torch.tensor(BATCH * SEQ))
        loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), MAX_NORM, foreach=True)
        optimizers.step()
        lr_schedulers.step()
        losses.append(loss.detach())
    return losses


def container(model: nn.Module, name: str) -> MatrixoptOptimizersContainer:
    return MatrixoptOptimizersContainer.Config(name=name, **HPARAMS).build(model_parts=[model])


# ----------------------------------------------------------------------------------------------- routing


@pytest.mark.parametrize("fuse_qkv", [True, False])
@pytest.mark.parametrize("tied", [False, True])
def test_llama3_routes(fuse_qkv, tied):
    model = tiny_llama(fuse_qkv=fuse_qkv, tied=tied)
    r = routes(model)
    assert r["tok_embeddings.weight"] == "adamw"
    assert ("lm_head.weight" in r) != tied and r.get("lm_head.weight", "adamw") == "adamw"
    qkv = ("qkv_linear.wqkv",) if fuse_qkv else ("qkv_linear.wq", "qkv_linear.wk", "qkv_linear.wv")
    for i in range(2):
        for w in (*(f"attention.{q}" for q in qkv), "attention.wo", "feed_forward.w1", "feed_forward.w2",
                  "feed_forward.w3"):
            assert r[f"layers.{i}.{w}.weight"] == "matrix"
    assert {k for k, v in r.items() if v == "no_decay"} == {n for n, p in model.named_parameters() if p.ndim == 1}
    # wqkv interleaves Q, K and V per KV group: no contiguous split separates them, it stays one matrix
    assert all(getattr(p, "_matrixopt_split", None) is None for p in model.parameters())
    text = matrixopt.routing_summary(matrixopt.param_groups(model))
    assert "unrecognized" not in text
    assert ("embedding (tied: lm_head.weight)" if tied else "output head") in text


def test_config_checks_its_fields():
    with pytest.raises(ValueError, match=r"unknown matrixopt optimizer 'lion'; valid names: adamuon, adamw, mop"):
        MatrixoptOptimizersContainer.Config(name="lion")
    with pytest.raises(ValueError, match="Invalid lr: -1"):
        MatrixoptOptimizersContainer.Config(lr=-1.0)
    with pytest.raises(ValueError, match="lr is set twice"):
        MatrixoptOptimizersContainer.Config(lr=1e-3, hparams={"lr": 1e-2})
    with pytest.raises(ValueError, match="matrixopt routes the parameters itself"):
        MatrixoptOptimizersContainer.Config(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW")])
    assert isinstance(MatrixoptOptimizersContainer.Config(), OptimizersContainer.Config)  # --optimizer.lr on the CLI


# ----------------------------------------------------------------------------------------------- one process


def plain_loop(name: str, lr_lambda) -> tuple[list[torch.Tensor], nn.Module]:
    """The same optimizer without torchtitan: build_optimizer, a LambdaLR, torch's clip, mean cross-entropy."""
    model = tiny_llama()
    opt = matrixopt.build_optimizer(model, name, **HPARAMS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    losses = []
    for s in range(STEPS):
        tokens = DATA[BATCH * s:BATCH * (s + 1)]
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, model


@pytest.mark.parametrize("name", sorted(matrixopt.OPTIMIZERS))
def test_container_equals_plain_loop(name):
    model = tiny_llama()
    opts = container(model, name)
    assert len(opts) == 1
    lr_schedulers = schedulers(opts)
    losses = train(model, opts, lr_schedulers, range(STEPS))
    ref, ref_model = plain_loop(name, lr_schedulers.schedulers[0].lr_lambdas[0])
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref), rtol=RTOL, atol=0)
    torch.testing.assert_close(weights(model), weights(ref_model), rtol=RTOL, atol=1e-7)


@pytest.mark.parametrize("name", sorted(matrixopt.OPTIMIZERS))
def test_state_dict_round_trip_resumes_exactly(name):
    """torchtitan's flat layout (``state.<fqn>.<key>``, ``param_groups.<fqn>.<key>``) into a fresh container."""
    model = tiny_llama()
    opts = container(model, name)
    lr_schedulers = schedulers(opts)
    train(model, opts, lr_schedulers, range(2))
    saved = copy.deepcopy({"model": model.state_dict(), "optim": opts.state_dict(),
                           "lr": lr_schedulers.state_dict()})  # a checkpoint holds copies
    assert "state.layers.0.feed_forward.w1.weight.step" in saved["optim"] or name != "adamw"
    assert not any(k.endswith(".names") for k in saved["optim"])
    rest = train(model, opts, lr_schedulers, range(2, STEPS))

    resumed = tiny_llama()
    resumed.load_state_dict(saved["model"])
    opts = container(resumed, name)
    lr_schedulers = schedulers(opts)  # the trainer's order: build both, then load both
    opts.load_state_dict(saved["optim"])
    lr_schedulers.load_state_dict(saved["lr"])
    assert torch.equal(torch.stack(train(resumed, opts, lr_schedulers, range(2, STEPS))), torch.stack(rest))
    for p, q in zip(resumed.parameters(), model.parameters()):
        assert torch.equal(p, q)


# ----------------------------------------------------------------------------------------------- FSDP2, TP


def parallel_llama(dp_shard: int, tp: int) -> nn.Module:
    """The tiny Llama through torchtitan's parallelize_llama (FSDP2 over "fsdp", TP over "tp"), holding the
    weights of :func:`tiny_llama`."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import distribute_tensor
    from torchtitan.distributed import ParallelDims

    parallel_dims_module.device_type = "cpu"  # torchtitan chose "cuda" at import: no accelerator here
    # with torch 2.13, fully_shard does not read the spmd_types backend's annotations
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", data_parallel_shard_degree=dp_shard,
                                    tensor_parallel_degree=tp)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(parallelism, dp_shard * tp)
    parallel_dims.build_mesh()
    with torch.device("meta"):
        model = llama_config().build()
    model = parallelize_llama(model, parallel_dims=parallel_dims, parallelism=parallelism,
                              training=TrainingConfig(mixed_precision_param="float32"),
                              compile_config=CompileConfig(), ac_config=None, dump_folder="")
    for module in model.modules():
        if isinstance(module, FSDPModule):  # gloo has no PREMUL_SUM; a plain sum with torchtitan's factor of 1
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    reference = dict(tiny_llama().named_parameters())
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # the RoPE buffers; the weights come from the reference
        for n, p in model.named_parameters():
            p.copy_(distribute_tensor(reference[n].detach(), p.device_mesh, p.placements))
    return model


class TrainState:
    """The trainer's own entry in a checkpoint: the step."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state_dict):
        self.step = state_dict["step"]


def _ranks(rank: int, world: int, out: str, ckpt: str) -> None:
    """Losses and weights of FSDP2 (2-way, each rank half of every batch) and TP (2-way, both ranks the whole
    batch) runs, and whether runs resumed from torchtitan's DCP checkpoints take the uninterrupted runs' losses."""
    from torch.distributed.tensor import DTensor

    from matrixopt.distributed.parallelism import SHARDED

    results = {}
    half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    for name in SHARDED_NAMES:
        model = parallel_llama(dp_shard=2, tp=1)
        opts = container(model, name)
        assert isinstance(opts.optimizers[0], SHARDED[name] if name in SHARDED else torch.optim.AdamW)
        losses = torch.stack(train(model, opts, schedulers(opts), range(STEPS), rows=half))
        torch.distributed.all_reduce(losses)  # the token sums of both halves over the global token count
        results["fsdp", name] = losses, weights(model)
    with pytest.raises(ValueError, match="'mop' does not run on torchtitan's FSDP2"):
        container(model, "mop")
    assert isinstance(model.layers["0"].feed_forward.w1.weight, DTensor)
    for name in TP_NAMES:
        model = parallel_llama(dp_shard=1, tp=2)
        assert model.layers["0"].attention.wo.weight.placements[-1].is_shard(1)  # row-parallel
        opts = container(model, name)
        results["tp", name] = torch.stack(train(model, opts, schedulers(opts), range(STEPS))), weights(model)
    with pytest.raises(ValueError, match="Tensor parallelism and HSDP are not supported"):
        container(model, "shampoo")

    def checkpointed(model, name):
        opts = container(model, name)
        lr_schedulers = schedulers(opts)
        state = TrainState()
        manager = CheckpointManager.Config(enable=True, folder=f"ckpt-{name}", interval=2, last_save_model_only=False,
                                           keep_latest_k=0, initial_load_model_only=False).build(
            dataloader=None, model_parts=[model], optimizers=opts, lr_schedulers=lr_schedulers,
            states={"train_state": state}, sd_adapter=None, base_folder=ckpt)
        return opts, lr_schedulers, state, manager

    for name in ("muon", "shampoo"):  # DTensor state, and plain state held by each matrix's owner rank
        model = parallel_llama(dp_shard=2, tp=1)
        opts, lr_schedulers, state, manager = checkpointed(model, name)
        whole = []
        for s in range(STEPS):  # Trainer.train: step, then checkpointer.save(step)
            whole += train(model, opts, lr_schedulers, range(s, s + 1), rows=half)
            state.step = s + 1
            manager.save(state.step, last_step=state.step == STEPS)
        manager.close()
        model = parallel_llama(dp_shard=2, tp=1)
        opts, lr_schedulers, state, manager = checkpointed(model, name)
        assert manager.load(step=2) and state.step == 2
        resumed = train(model, opts, lr_schedulers, range(state.step, STEPS), rows=half)
        results["resumed", name] = torch.stack(resumed).eq(torch.stack(whole[2:])).all().reshape(1).float()
        torch.distributed.all_reduce(results["resumed", name], op=torch.distributed.ReduceOp.MIN)
        manager.close()
    if rank == 0:
        torch.save(results, out)


def test_fsdp2_and_tp_equal_one_process_and_resume_from_dcp(tmp_path):
    run(_ranks, 2, str(tmp_path / "two.pt"), str(tmp_path), timeout=180)
    two = torch.load(tmp_path / "two.pt")
    for name in SHARDED_NAMES:
        model = tiny_llama()
        opts = container(model, name)
        one = torch.stack(train(model, opts, schedulers(opts), range(STEPS))), weights(model)
        for case in ("fsdp", "tp"):
            if (case, name) not in two:
                continue
            losses, w = two[case, name]
            torch.testing.assert_close(losses, one[0], rtol=DIST_RTOL, atol=0, msg=f"{case} {name}: losses")
            if name != "soap":  # see SOAP_UNSTABLE
                torch.testing.assert_close(w, one[1], rtol=0, atol=DIST_ATOL, msg=f"{case} {name}: weights")
    for name in ("muon", "shampoo"):
        assert two["resumed", name].item() == 1.0, f"{name} resumed from the step-2 DCP checkpoint took other losses"
