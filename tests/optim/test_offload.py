"""Offloaded optimizer state (``offload="cpu"``) on a CPU-only machine: the offload path runs with the CPU as the
"device" and a counted copy standing in for the host-to-device transfer. Bit-identical to the step without
offload over 50 steps, checkpoints independent of where state lived, and all-or-nothing steps."""

import sys

import pytest
import torch
from _fake_copy import FakeDeviceCopy
from torch import nn

import matrixopt
from matrixopt.optim import base, layout
from matrixopt.optim.offload import Offload
from matrixopt.optim.state import decode


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(40, 16), nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 16),
                          nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 48), nn.LayerNorm(48))
    matrixopt.mark_split(model[6].weight, 3)  # pieces (16, 48) share a batch with the (48, 16) and (16, 48) weights
    return model


def _batch(g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 40, (4, 8), generator=g)


def _train(opt: torch.optim.Optimizer, model: nn.Module, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = _batch(g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def _state_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    params = [(p, q) for ga, gb in zip(a.param_groups, b.param_groups) for p, q in zip(ga["params"], gb["params"])]
    assert [p in a.state for p, _ in params] == [q in b.state for _, q in params]
    for st, st2 in ((a.state[p], b.state[q]) for p, q in params if p in a.state):
        assert st.keys() == st2.keys()
        for k, v in st.items():
            if torch.is_tensor(v):
                assert v.dtype == st2[k].dtype and torch.equal(v, st2[k]), k


@pytest.mark.parametrize("name, steps", [("muon", 50), ("normuon", 10), ("adamuon", 10), ("shampoo", 10),
                                         ("soap", 10)])
def test_offloaded_steps_are_bit_identical(name, steps, monkeypatch):
    copy = FakeDeviceCopy()
    ref, model = _model(), _model()
    opt_ref = matrixopt.build_optimizer(ref, name, lr=1e-2, weight_decay=0.1)
    opt = matrixopt.build_optimizer(model, name, lr=1e-2, weight_decay=0.1, offload=Offload(device_copy=copy))
    monkeypatch.setattr(base, "CHUNK_NUMEL", 1000)  # several chunks per group
    _train(opt_ref, ref, steps)
    _train(opt, model, steps)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    _state_equal(opt_ref, opt)
    assert copy.calls > 0  # the state went through the device copy


class _MixedBatches(nn.Module):
    """Pieces of one shape, (16, 48) or (48, 16), in Newton–Schulz batches of mixed sizes: two single matrices
    and a stack of three experts."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(40, 16)
        self.up = nn.Linear(16, 48, bias=False)
        self.experts = nn.Parameter(torch.randn(3, 16, 48) / 7)
        matrixopt.mark_experts(self.experts)
        self.down = nn.Linear(48, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.emb(x))
        return self.down(h) + sum(h @ e.T for e in self.experts)


def test_large_batches_are_split_and_offloaded_chunks_batch_as_the_whole_step(monkeypatch):
    """Newton–Schulz batches stop at BUCKET_NUMEL values (a larger piece alone), which bounds what a chunk of an
    offloaded step holds on the device; the chunked step batches exactly as the whole step."""
    monkeypatch.setattr(layout, "BUCKET_NUMEL", 1600)
    model = _MixedBatches()
    params = [model.up.weight, model.experts, model.down.weight]
    keys = layout.bucket_keys(params, params)
    assert [k[-1] for ks in keys for k in ks] == [0, 1, 2]  # 768, then 2304 alone, then 768
    bufs = [torch.zeros_like(p) for p in params]
    buckets, _ = layout.momentum_buckets(params, params, bufs)
    assert [b.count for b in buckets] == [1, 3, 1]
    assert [len(b.params) for b in buckets] == [1, 1, 1]  # the experts are one (3, 48, 16) view
    monkeypatch.setattr(layout, "BUCKET_NUMEL", 3100)
    assert [b.count for b in layout.momentum_buckets(params, params, bufs)[0]] == [4, 1]  # 768 + 2304, 768

    ref, offloaded = _MixedBatches(), _MixedBatches()
    opt_ref = matrixopt.build_optimizer(ref, "muon", lr=1e-2, weight_decay=0.1)
    opt = matrixopt.build_optimizer(offloaded, "muon", lr=1e-2, weight_decay=0.1,
                                    offload=Offload(device_copy=FakeDeviceCopy()))
    monkeypatch.setattr(base, "CHUNK_NUMEL", 1000)  # one batch per chunk
    _train(opt_ref, ref, 10)
    _train(opt, offloaded, 10)
    for a, b in zip(ref.parameters(), offloaded.parameters()):
        assert torch.equal(a, b)
    _state_equal(opt_ref, opt)


class _LiveCopies(FakeDeviceCopy):
    """The device copy, also tracking how many copied values are alive at once (the state on the "device")."""

    def __init__(self) -> None:
        super().__init__()
        self.live: list = []
        self.most = 0

    def __call__(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        import weakref

        out = super().__call__(t, device)
        self.live = [r for r in self.live if r() is not None] + [weakref.ref(out)]
        self.most = max(self.most, sum(r().numel() for r in self.live if r() is not None))
        return out


def test_an_offloaded_batch_moves_its_momentum_in_sub_chunks(monkeypatch):
    """Six (16, 48) weights share one Newton–Schulz batch of 4,608 values. Offloaded with chunks of 1,000 values,
    the batch stays whole (the results are the step's without offload, bit for bit), while its momentum comes to
    the device one weight at a time: at most two weights' momentum (the one packed, the next) at once."""
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(40, 16)
            self.ws = nn.ParameterList([nn.Parameter(torch.randn(48, 16) / 4) for _ in range(6)])

        def forward(self, x):
            h = self.emb(x)
            return sum(torch.tanh(h @ w.T) for w in self.ws)

    monkeypatch.setattr(base, "CHUNK_NUMEL", 1000)
    copies = _LiveCopies()
    ref, model = Stack(), Stack()
    opt_ref = matrixopt.build_optimizer(ref, "muon", lr=1e-2, weight_decay=0.1)
    opt = matrixopt.build_optimizer(model, "muon", lr=1e-2, weight_decay=0.1, offload=Offload(device_copy=copies))
    streamed = []
    stream = type(opt)._streamed_update
    monkeypatch.setattr(type(opt), "_streamed_update", lambda self, *a: streamed.append(a[3]) or stream(self, *a))
    _train(opt_ref, ref, 8)
    _train(opt, model, 8)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    _state_equal(opt_ref, opt)
    assert streamed and all(len(units) == 6 for units in streamed)  # the batch, one weight at a time
    # at most two weights' momentum, or the last one's and the embedding's AdamW state, never the batch's 4,608
    assert copies.most <= 768 + 2 * 640 + 1


def _two_batch_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(40, 16), nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 16), nn.LayerNorm(16),
                         nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16), nn.Linear(16, 16))


@pytest.mark.parametrize("chunk", [None, 600])
def test_offload_with_compact_state_matches_compact_state(chunk, monkeypatch):
    """Bit for bit, also where the offloaded step streams two batches' momentum and runs the AdamW groups'
    chunks between them, split (chunks of 600 values; the step without offload runs them after the matrices):
    every parameter rounds with random bits of its own, whatever the order."""
    order = []
    if chunk is not None:
        monkeypatch.setattr(base, "CHUNK_NUMEL", chunk)
        interleaved = base.MatrixOptimizer._interleaved

        def recorded(self, chunks, staged):
            out = interleaved(self, chunks, staged)
            order.append([units is not None for *_, units in out])
            return out
        monkeypatch.setattr(base.MatrixOptimizer, "_interleaved", recorded)
    ref, model = (_model(), _model()) if chunk is None else (_two_batch_model(), _two_batch_model())
    opt_ref = matrixopt.build_optimizer(ref, "muon", lr=1e-2, state_dtype="bf16")
    opt = matrixopt.build_optimizer(model, "muon", lr=1e-2, state_dtype="bf16",
                                    offload=Offload(device_copy=FakeDeviceCopy()))
    _train(opt_ref, ref, 10)
    _train(opt, model, 10)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    _state_equal(opt_ref, opt)
    if chunk is not None:  # streamed, element-wise, streamed, element-wise... (not the unstreamed step's order)
        streamed = order[-1]
        assert streamed.count(True) >= 2 and streamed[1] is False, streamed


@pytest.mark.parametrize("save_offloaded", [True, False])
def test_checkpoint_is_independent_of_where_state_lived(save_offloaded):
    def build(model, offloaded):
        return matrixopt.build_optimizer(model, "adamuon", lr=1e-2,
                                         offload=Offload(device_copy=FakeDeviceCopy()) if offloaded else None)

    ref, model = _model(), _model()
    opt_ref = build(ref, save_offloaded)
    _train(opt_ref, ref, 5)
    model.load_state_dict(ref.state_dict())
    opt = build(model, not save_offloaded)
    opt.load_state_dict(opt_ref.state_dict())
    _state_equal(opt_ref, opt)
    _train(opt_ref, ref, 5, seed=2)
    _train(opt, model, 5, seed=2)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_exception_mid_step_leaves_the_step_before(error, monkeypatch):
    ref, model = _model(), _model()
    opt_ref = matrixopt.build_optimizer(ref, "muon", lr=1e-2)
    opt = matrixopt.build_optimizer(model, "muon", lr=1e-2, offload=Offload(device_copy=FakeDeviceCopy()))
    monkeypatch.setattr(base, "CHUNK_NUMEL", 1000)
    _train(opt_ref, ref, 3)
    _train(opt, model, 3)
    x = _batch(torch.Generator().manual_seed(3))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    # the AdamW groups run after every matrix chunk has been updated: fail there
    monkeypatch.setattr(opt, "_adamw_update", lambda *args: (_ for _ in ()).throw(error("injected")))
    with pytest.raises(error, match="injected"):
        opt.step()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    _state_equal(opt_ref, opt)
    monkeypatch.undo()
    opt_ref.zero_grad()
    ref(x).pow(2).mean().backward()
    opt_ref.step()
    opt.step()  # the same step again succeeds, and is the reference's
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)


def _wide_model() -> nn.Module:
    """An embedding (3,200 values) larger than the patched chunk: its AdamW state moves in ranges."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(200, 16), nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 16))


@pytest.mark.parametrize("state_dtype", [None, "bf16", "int8"])
def test_large_adamw_parameters_move_in_ranges(state_dtype, monkeypatch):
    """A parameter of an AdamW group larger than a chunk is stepped range by range (whole int8 blocks): with
    float32 state the result is the unchunked step's bit for bit, offloaded or not; compact state, offloaded or
    on the device, gives the same bits (other random bits than unchunked: the rounding draws per range); the step
    count is the parameter's, counted once."""
    def run(offloaded, chunk):
        monkeypatch.setattr(base, "CHUNK_NUMEL", chunk)
        model = _wide_model()
        opt = matrixopt.build_optimizer(model, "muon", lr=1e-2, weight_decay=0.1, state_dtype=state_dtype,
                                        offload=Offload(device_copy=FakeDeviceCopy()) if offloaded else None)
        g = torch.Generator().manual_seed(1)
        for _ in range(6):
            opt.zero_grad()
            model(torch.randint(0, 200, (8, 16), generator=g)).pow(2).mean().backward()  # every embedding row
            opt.step()
        return model, opt

    ref, opt_ref = run(False, 1 << 24)  # one chunk per parameter
    (on_device, opt_dev), (offloaded, opt_off) = run(False, 1000), run(True, 1000)  # ranges of 768 values
    for model, opt in ((on_device, opt_dev), (offloaded, opt_off)):
        emb = opt.state[model[0].weight]
        assert int(emb["step"]) == 6
        moved = (decode(emb, "exp_avg") != 0).view(-1)
        assert all(moved[i:i + 768].any() for i in range(0, moved.numel(), 768))  # every range stepped
    if state_dtype is None:  # float32: the unchunked step, bit for bit
        pairs = ((ref, opt_ref, on_device, opt_dev), (ref, opt_ref, offloaded, opt_off))
    else:  # compact: offloaded or not, the same bits
        assert opt_dev.state[on_device[0].weight]["exp_avg"].dtype == {"bf16": torch.bfloat16,
                                                                        "int8": torch.int8}[state_dtype]
        pairs = ((on_device, opt_dev, offloaded, opt_off),)
    for a_model, a_opt, b_model, b_opt in pairs:
        for a, b in zip(a_model.parameters(), b_model.parameters()):
            assert torch.equal(a, b)
        _state_equal(a_opt, b_opt)


def test_a_parameter_changed_between_steps_is_backed_up_again(monkeypatch):
    """The backups refreshed after a step follow the parameters' version counters: a parameter changed in place
    before the next step is copied again, so a failed step restores the changed value."""
    model = _model()
    opt = matrixopt.build_optimizer(model, "muon", lr=1e-2, offload=Offload(device_copy=FakeDeviceCopy()))
    _train(opt, model, 2)
    w = model[1].weight
    assert torch.equal(opt.offload.backups[w], w)  # refreshed after the step
    with torch.no_grad():
        w.mul_(2)
    before = [p.detach().clone() for p in model.parameters()]
    model(_batch(torch.Generator().manual_seed(5))).pow(2).mean().backward()
    monkeypatch.setattr(opt, "_adamw_update", lambda *args: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected"):
        opt.step()
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fail_at", [1, 5])  # the first parameter backup; the first state buffer (4 matrices)
def test_out_of_host_memory_names_the_size(fail_at, monkeypatch):
    model = _model()
    offload = Offload(device_copy=FakeDeviceCopy())
    opt = matrixopt.build_optimizer(model, "muon", lr=1e-2, offload=offload)
    before = [p.detach().clone() for p in model.parameters()]
    calls = []
    allocate = offload._allocate

    def no_memory(shape, dtype):
        calls.append(shape)
        if len(calls) >= fail_at:
            raise RuntimeError("CUDA error: out of memory")
        return allocate(shape, dtype)

    monkeypatch.setattr(offload, "_allocate", no_memory)
    model(_batch(torch.Generator().manual_seed(0))).pow(2).mean().backward()
    with pytest.raises(MemoryError, match=r"could not allocate [0-9.]+ KiB of (pinned )?CPU memory .*offload"):
        opt.step()
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)
    assert not any(opt.state.values())  # no state of the failed first step


@pytest.mark.parametrize("name, state_dtype, tensors", [("muon", None, 1), ("soap", None, 2), ("adamuon", "bf16", 2)])
def test_too_little_host_memory_is_refused_at_construction(name, state_dtype, tensors, monkeypatch):
    """Before any state exists: the least the offloaded state holds (the state twice and a copy of the parameters)
    against the host's available memory."""
    from matrixopt.optim import offload as offload_module
    from matrixopt.optim.routing import param_groups

    if sys.platform == "linux":
        assert offload_module.available_host_bytes() > 0  # this machine's MemAvailable
    model = _model()
    groups = param_groups(model, matrix_flag=matrixopt.OPTIMIZERS[name].matrix_flag)
    each = 4 if state_dtype is None else 2
    state = sum(p.numel() * (tensors if g[matrixopt.OPTIMIZERS[name].matrix_flag] else 2) * each
                for g in groups for p in g["params"])
    needed = 2 * state + sum(p.numel() * 4 for p in model.parameters())
    monkeypatch.setattr(offload_module, "available_host_bytes", lambda: needed - 1)
    with pytest.raises(MemoryError, match=r"needs at least [0-9.]+ GiB of CPU memory .* is available"):
        matrixopt.build_optimizer(model, name, lr=1e-2, state_dtype=state_dtype,
                                  offload=Offload(pin_memory=False, device_copy=FakeDeviceCopy()))
    monkeypatch.setattr(offload_module, "available_host_bytes", lambda: needed)
    matrixopt.build_optimizer(model, name, lr=1e-2, state_dtype=state_dtype,
                              offload=Offload(pin_memory=False, device_copy=FakeDeviceCopy()))  # just enough


def test_the_memory_check_counts_pinned_blocks_rounded_to_powers_of_two(monkeypatch):
    """Pinned host memory comes in power-of-two blocks: a (48, 16) float32 tensor's 3,072 bytes take 4,096."""
    from matrixopt.optim import offload as offload_module

    model = _model()
    offload = Offload(pin_memory=True, device_copy=FakeDeviceCopy())
    assert [offload.block_bytes(n) for n in (3072, 4096, 4097, 0)] == [4096, 4096, 8192, 0]
    assert Offload(pin_memory=False).block_bytes(3072) == 3072
    groups = {id(p): g["use_muon"] for g in matrixopt.build_optimizer(model, "muon", lr=1e-2).param_groups
              for p in g["params"]}
    needed = sum(offload.block_bytes(p.numel() * 4) * (2 * (1 if groups[id(p)] else 2) + 1)
                 for p in model.parameters())  # the state twice (AdamW: two moments) and the parameter
    monkeypatch.setattr(offload_module, "available_host_bytes", lambda: needed - 1)
    monkeypatch.setattr(offload_module, "release_cached_pinned_memory", lambda: False)
    with pytest.raises(MemoryError, match="needs at least"):
        matrixopt.build_optimizer(model, "muon", lr=1e-2, offload=offload)
    monkeypatch.setattr(offload_module, "available_host_bytes", lambda: needed)
    matrixopt.build_optimizer(model, "muon", lr=1e-2, offload=offload)


def test_the_memory_check_counts_pinned_blocks_pytorch_holds_unused(monkeypatch):
    """Pinned blocks an earlier offloaded optimizer freed stay in PyTorch's host cache, which MemAvailable counts as
    used: the check returns them to the system and looks again before it refuses."""
    from matrixopt.optim import offload as offload_module

    free = iter([1, 1 << 40])  # too little; after the release, plenty
    monkeypatch.setattr(offload_module, "available_host_bytes", lambda: next(free))
    released = []
    monkeypatch.setattr(offload_module, "release_cached_pinned_memory", lambda: released.append(1) or True)
    matrixopt.build_optimizer(_model(), "muon", lr=1e-2, offload=Offload(pin_memory=True,
                                                                         device_copy=FakeDeviceCopy()))
    assert released == [1]
    monkeypatch.setattr(offload_module, "available_host_bytes", lambda: 1)
    with pytest.raises(MemoryError, match="needs at least"):
        matrixopt.build_optimizer(_model(), "muon", lr=1e-2, offload=Offload(pin_memory=True,
                                                                             device_copy=FakeDeviceCopy()))


@pytest.mark.parametrize("value", ["gpu", "nvme", True])
def test_unknown_offload_lists_choices(value):
    with pytest.raises(ValueError, match=r"offload.*'cpu'"):
        matrixopt.Muon([nn.Parameter(torch.randn(8, 8))], offload=value)


def test_offload_keeps_state_in_host_memory():
    model = _model()
    opt = matrixopt.build_optimizer(model, "muon", lr=1e-2, offload="cpu")
    _train(opt, model, 2)
    assert opt.offload.pin_memory == torch.cuda.is_available()
    assert all(v.device.type == "cpu" for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    assert opt.offload.host_bytes > 0


def test_trainer_config_passes_the_options():
    from matrixopt.train.config import OptimConfig

    kwargs = OptimConfig(name="muon", offload="cpu", state_dtype="bf16").optimizer_kwargs()
    assert kwargs["offload"] == "cpu" and kwargs["state_dtype"] == "bf16"
    assert "offload" not in OptimConfig(name="muon").optimizer_kwargs()
    with pytest.raises(ValueError, match="does not take offload; use one of muon, .*shampoo, soap"):
        OptimConfig(name="adamw", offload="cpu")
    with pytest.raises(ValueError, match="offload"):
        OptimConfig(name="muon", offload="disk")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned host state and copy streams")
@pytest.mark.parametrize("name, state_dtype", [("muon", None), ("adamuon", None), ("muon", "bf16")])
def test_offloaded_steps_are_bit_identical_on_cuda(name, state_dtype, monkeypatch):
    ref, model = _model().cuda(), _model().cuda()
    opt_ref = matrixopt.build_optimizer(ref, name, lr=1e-2, weight_decay=0.1, state_dtype=state_dtype)
    opt = matrixopt.build_optimizer(model, name, lr=1e-2, weight_decay=0.1, state_dtype=state_dtype, offload="cpu")
    monkeypatch.setattr(base, "CHUNK_NUMEL", 1000)  # several chunks: copies overlap the next chunk's update
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        x = _batch(g).cuda()
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    saved, want = opt.state_dict()["state"], opt_ref.state_dict()["state"]
    assert saved.keys() == want.keys()
    for i, st in want.items():
        for k, v in st.items():
            if torch.is_tensor(v):
                assert torch.equal(saved[i][k].cpu(), v.cpu()), (i, k)
    assert all(v.device.type == "cpu" and v.is_pinned() for st in opt.state.values() for v in st.values()
               if torch.is_tensor(v))


def test_trainer_resumes_an_offloaded_run_without_offload(tmp_path, monkeypatch):
    """--offload and --state-dtype on the command line; a run interrupted with its state offloaded resumes without
    offload (where the state lives is free to change) and ends as the run that never offloaded."""
    import json
    import os
    import signal

    from matrixopt.cli import main
    from matrixopt.train import trainer

    tiny = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "4",
            "--steps", "6", "--eval-every", "3", "--eval-iters", "1", "--warmup", "1", "--log-every", "1",
            "--threads", "1", "--no-progress", "--optimizer", "muon", "--lr", "0.01",
            "--device", "cpu"]  # deterministic: the runs are compared loss for loss

    def losses(out):
        return [(m["step"], m["loss"]) for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                if "loss" in m]

    assert main(["train", "--out", str(tmp_path / "plain"), *tiny]) == 0
    real_batch = trainer.train_batch

    def batch_then_ctrl_c(tokens, batch_size, block_size, seed, step, micro):
        if step == 3 and micro == 0:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during step 4: the checkpoint holds 3 steps
        return real_batch(tokens, batch_size, block_size, seed, step, micro)

    monkeypatch.setattr(trainer, "train_batch", batch_then_ctrl_c)
    assert main(["train", "--out", str(tmp_path / "off"), "--offload", "cpu", *tiny]) != 0  # interrupted, saved
    monkeypatch.setattr(trainer, "train_batch", real_batch)
    assert main(["train", "--out", str(tmp_path / "off"), "--resume", *tiny]) == 0
    assert losses(tmp_path / "off") == losses(tmp_path / "plain")
    assert main(["train", "--out", str(tmp_path / "bf16"), "--state-dtype", "bf16", *tiny]) == 0
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["optim"]["state_dtype"] == "bf16"
