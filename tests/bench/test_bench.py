"""The benchmark commands run on the CPU at toy sizes and write valid JSON."""

import json
import subprocess
import sys

import pytest
import torch

from matrixopt.bench import cli


def run_cli(argv):
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(argv))


def test_ns_writes_json(tmp_path, capsys):
    path = tmp_path / "ns.json"
    assert run_cli(["ns", "--device", "cpu", "--shapes", "2x12x20", "--gram", "1x16x40", "--reps", "2",
                    "--steps", "3", "--json", str(path)]) == 0
    rec = json.loads(path.read_text())
    assert rec["benchmark"] == "ns" and rec["env"]["device_type"] == "cpu" and rec["env"]["torch"]
    (row,) = rec["ns"]
    assert (row["batch"], row["m"], row["n"], row["steps"]) == (2, 12, 20, 3)
    assert {"matrixopt", "matrixopt cuBLAS only", "torch.optim.Muon"} <= set(row["methods"])
    for m in row["methods"].values():
        assert m["ms"]["median"] > 0 and 0 <= m["err_vs_polar"] < 1
    assert rec["gram"][0]["cublas"]["ms"]["median"] > 0
    assert "| 2x12x20 | matrixopt |" in capsys.readouterr().out


def test_step_writes_json(tmp_path):
    path = tmp_path / "step.json"
    assert run_cli(["step", "--device", "cpu", "--model", "toy", "--reps", "2", "--json", str(path),
                    "--only", "adamw (fused)", "torch.optim.Muon", "matrixopt muon", "emerging_optimizers Muon"]) == 0
    rec = json.loads(path.read_text())
    res = rec["results"]
    assert set(res) == {"adamw (fused)", "torch.optim.Muon", "matrixopt muon", "emerging_optimizers Muon"}
    assert res["matrixopt muon"]["status"] == "ok" and res["matrixopt muon"]["ms"]["median"] > 0
    assert res["adamw (fused)"]["vs_adamw"] == 1.0
    assert rec["limit"]["muon_params"] == 2 * (64 * 192 + 64 * 64 + 2 * 64 * 256)


def test_step_param_set_routes_like_the_issue():
    import torch

    from matrixopt.bench.step import hidden_matrices, param_set
    from matrixopt.optim.routing import route

    ps = param_set("toy", torch.device("cpu"))
    routes = {name: r for name, _, r in route(ps)}
    assert routes["lm_head.weight"] == routes["transformer.wte.weight"] == "adamw"
    assert routes["transformer.h.0.attn.c_attn.weight"] == "matrix"
    assert {id(p) for p in hidden_matrices(ps)} == {id(p) for n, p in ps.named_parameters() if routes[n] == "matrix"}


def test_train_writes_json(tmp_path):
    pytest.importorskip("matrixopt.train.model")
    path = tmp_path / "train.json"
    assert run_cli(["train", "--device", "cpu", "--model", "tiny-cpu", "--steps", "1", "--reps", "1",
                    "--optimizers", "adamw", "muon", "muon+eager", "normuon+qk_clip", "--json", str(path)]) == 0
    rec = json.loads(path.read_text())
    assert rec["results"]["adamw"]["vs_adamw"] == 1.0 and rec["results"]["muon"]["tokens_per_s"] > 0
    assert rec["results"]["muon+eager"]["tokens_per_s"] > 0 and rec["results"]["normuon+qk_clip"]["tokens_per_s"] > 0


def test_train_mixture_of_experts(tmp_path):
    path = tmp_path / "train.json"
    assert run_cli(["train", "--device", "cpu", "--model", "moe-tiny", "--steps", "1", "--reps", "1",
                    "--optimizers", "adamw", "muon", "torch.optim.Muon", "--json", str(path)]) == 0
    res = json.loads(path.read_text())["results"]
    assert res["muon"]["tokens_per_s"] > 0 and res["muon"]["mfu"] > 0
    assert "takes 2-D parameters" in res["torch.optim.Muon"]["status"]


def test_train_fused_qkv_variant_keeps_the_qkv_weight_whole():
    pytest.importorskip("matrixopt.train.model")
    from matrixopt.bench.train import _optimizer
    from matrixopt.train.model import GPT, GPTConfig

    def qkv_split(name):
        torch.manual_seed(0)
        net = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16))
        _optimizer(net, name)
        return getattr(net.transformer.h[0].attn.c_attn.weight, "_matrixopt_split", None)

    assert qkv_split("muon") == (0, (16, 16, 16))  # the trainer's Q, K, V
    assert qkv_split("muon+fused_qkv") is None  # the issue's fused (3d, d) matrix, as the peers take it
    with pytest.raises(ValueError, match="unknown optimizer variant"):
        qkv_split("muon+fused")


def test_train_state_variants(tmp_path, capsys):
    """+offload and +bf16/+int8 reach the optimizer; each row has the memory fields (None off CUDA)."""
    from matrixopt.bench.train import MEMORY, _optimizer
    from matrixopt.train.model import GPT, GPTConfig

    path = tmp_path / "train.json"
    names = ["muon+offload+bf16", "muon+int8", "normuon+offload"]
    assert run_cli(["train", "--device", "cpu", "--model", "tiny-cpu", "--steps", "1", "--reps", "1",
                    "--optimizers", *names, "--json", str(path)]) == 0
    res = json.loads(path.read_text())["results"]
    for name in names:
        assert res[name]["status"] == "ok" and res[name]["tokens_per_s"] > 0
        assert {k: res[name][k] for k in MEMORY} == dict.fromkeys(MEMORY)
    assert "| peak GB | opt GB |" in capsys.readouterr().out
    opt = _optimizer(GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)), "muon+offload+bf16")
    assert opt.offload is not None and opt.state_dtype == "bf16"


@pytest.mark.parametrize("name, match", [
    ("adamw+offload", "torch.optim.AdamW"), ("adamw+int8", "state_dtype"), ("muon+fp8", "unknown optimizer variant"),
    ("lion+eager", "unknown optimizer")])
def test_train_bad_names_fail_before_any_row(name, match, monkeypatch):
    from matrixopt.bench import train

    monkeypatch.setattr(train, "time_ms", lambda *a, **k: pytest.fail("timed a row before checking every name"))
    with pytest.raises(ValueError, match=match):
        train.run("tiny-cpu", ("muon", name), device=torch.device("cpu"), steps=1, reps=1, warmup=0)


def test_train_records_an_optimizer_that_rejects_its_setting(monkeypatch):
    from matrixopt.bench import train
    from matrixopt.optim.registry import OPTIMIZERS

    def rejects(groups, lr=1e-3, weight_decay=0.0, offload=None):
        raise ValueError(f"offload={offload!r} needs a GPU")

    monkeypatch.setitem(OPTIMIZERS, "rejects", rejects)
    res = train.run("tiny-cpu", ("rejects+offload", "muon"), device=torch.device("cpu"), steps=1, reps=1,
                    warmup=0)["results"]
    assert res["rejects+offload"] == {"status": "error: offload='cpu' needs a GPU"}
    assert res["muon"]["status"] == "ok"
    assert "error: offload" in train.format_tables({"model": "tiny-cpu", "batch": 2, "block_size": 32,
                                                    "results": res})


def test_train_records_a_row_that_runs_out_of_memory(monkeypatch):
    """A model that does not fit with one optimizer (say, without offload) is a row of the table, not the end of
    the run: the next rows are timed."""
    from matrixopt.bench import train

    timed = train.time_ms

    def time_ms(fn, device, **kw):
        if fn.args[2].state_dtype is None:  # float32 state: "does not fit"
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 26.00 GiB")
        return timed(fn, device, **kw)

    monkeypatch.setattr(train, "time_ms", time_ms)
    res = train.run("tiny-cpu", ("muon", "muon+bf16"), device=torch.device("cpu"), steps=1, reps=1,
                    warmup=0)["results"]
    assert res["muon"] == {"status": "out of memory: CUDA out of memory"}
    assert res["muon+bf16"]["status"] == "ok"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU memory needs CUDA")
def test_train_memory_on_cuda():
    """The state on the GPU counts each storage once; offloaded state is not on the GPU."""
    from matrixopt.bench import train

    state = torch.zeros(1024, device="cuda")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1, device="cuda"))])
    opt.state["p"] = {"a": state, "b": [state[:10], {"c": torch.zeros(256, device="cuda")}], "cpu": torch.zeros(99)}
    assert train.state_gpu_bytes(opt) == 4 * (1024 + 256)
    res = train.run("tiny-cpu", ("muon", "muon+offload"), device=torch.device("cuda"), steps=1, reps=1,
                    warmup=1)["results"]
    for r in res.values():
        assert r["peak_gb"] > 0 and r["optimizer_gpu_gb"] == pytest.approx(r["state_gpu_gb"] + r["step_extra_gb"])
    assert res["muon+offload"]["state_gpu_gb"] == 0 < res["muon"]["state_gpu_gb"]


def test_bad_shape_is_explained(capsys):
    with pytest.raises(SystemExit):
        run_cli(["ns", "--shapes", "12x-3"])
    assert "write BATCHxMxN" in capsys.readouterr().err


def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "matrixopt.bench", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    subcommands = set(out.stdout.split("{", 1)[1].split("}", 1)[0].split(","))
    assert {"ns", "step", "train", "kernels", "profile", "scale", "tp"} <= subcommands


def test_exposed_comm_counts_only_nccl_time_outside_compute():
    from types import SimpleNamespace

    import torch

    from matrixopt.bench.common import exposed_comm

    def ev(name, start, end, device=torch.autograd.DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [
        ev("ampere_gemm", 0, 100), ev("elementwise", 250, 300),
        ev("ncclKernel_AllReduce", 50, 150),   # 50 us under the gemm, 50 exposed
        ev("ncclKernel_Broadcast", 140, 260),  # overlaps the previous NCCL kernel; 10 us under elementwise
        ev("ncclKernel_cpu_side", 0, 1000, torch.autograd.DeviceType.CPU),  # host events are ignored
    ]
    comm, exposed = exposed_comm(SimpleNamespace(events=lambda: events))
    assert comm == pytest.approx(210e-6)  # union of [50, 260]
    assert exposed == pytest.approx(150e-6)  # [100, 250]


def test_stream_timer_on_cpu_adds_laps_to_its_offset():
    import time

    import torch

    from matrixopt.device import StreamTimer

    timer = StreamTimer(torch.device("cpu"), offset=2.0)
    for _ in range(2):
        timer.start()
        time.sleep(0.01)
        timer.stop()
    assert len(timer.resolve()) == 2 and all(lap >= 0.01 for lap in timer.laps)
    assert timer.total() == pytest.approx(2.0 + sum(timer.laps))


def test_host_ms_times_each_call_after_its_warmup():
    import time

    import torch

    from matrixopt.device import host_ms

    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002 if len(calls) > 2 else 0.05)  # two slow warm-up calls, not timed

    rec = host_ms(fn, torch.device("cpu"), reps=4, warmup=2)
    assert len(calls) == 6 and 2.0 <= rec["min"] <= rec["median"] < 40.0


def test_time_ms_heats_for_the_seconds_asked_right_before_the_timed_calls():
    import time

    import torch

    from matrixopt.device import time_ms

    stamps = []

    def fn():
        stamps.append(time.perf_counter())
        time.sleep(0.002)

    rec = time_ms(fn, torch.device("cpu"), reps=3, warmup=1, heat_s=0.1)
    heated = stamps[1:-3]  # between the warm-up call and the 3 timed ones
    assert len(heated) >= 20 and heated[-1] - heated[0] >= 0.09
    assert stamps[-3] - heated[-1] < 0.05  # the timed calls follow at once
    assert 2.0 <= rec["median"] < 40.0
    stamps.clear()
    time_ms(fn, torch.device("cpu"), reps=3, warmup=1)
    assert len(stamps) == 4  # no heating unless asked


def test_records_keep_the_hosts_pace_per_op_it_issues(monkeypatch, tmp_path):
    """``env.host``: the CPU, its cores and the host's microseconds per tiny op, from timing the op itself (an op
    slowed to 1 ms reads as about 1,000 µs)."""
    import time

    from matrixopt.bench.common import environment
    from matrixopt.device import host_pace

    env = environment(torch.device("cpu"))["host"]
    assert isinstance(env["cpu"], str) and env["cpu"] and env["cpus"] >= 1 and 0 < env["op_us"] < 1e4
    real_add, calls = torch.add, []

    def slow_add(*args, **kwargs):
        calls.append(1)
        time.sleep(1e-3)
        return real_add(*args, **kwargs)

    monkeypatch.setattr(torch, "add", slow_add)
    pace = host_pace(torch.device("cpu"), calls=5, rounds=3)
    assert len(calls) == 5 * 4 and 1000 <= pace["op_us"] < 5000


def test_frozen_heap_passes_over_the_setup_and_collects_what_the_block_makes():
    import gc

    from matrixopt.device import frozen_heap

    setup = [[] for _ in range(100)]
    with frozen_heap():
        assert gc.get_freeze_count() >= len(setup)
        cycle: list = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1  # made inside: collected as usual
    assert gc.get_freeze_count() == 0


def test_frozen_heap_blocks_nest_and_only_the_outermost_unfreezes():
    import gc

    from matrixopt.device import frozen_heap

    with frozen_heap():
        outer = gc.get_freeze_count()
        made_inside = [[] for _ in range(100)]
        with frozen_heap():
            assert gc.get_freeze_count() >= outer + len(made_inside)
        assert gc.get_freeze_count() >= outer  # the inner end left the outer block's objects frozen
        try:
            with frozen_heap():
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
        assert gc.get_freeze_count() >= outer
    assert gc.get_freeze_count() == 0


def test_step_amortizes_shampoo_and_soap_over_their_refresh(tmp_path):
    path = tmp_path / "step.json"
    rows = ["matrixopt shampoo, frequency 1", "matrixopt shampoo, frequency 10", "matrixopt soap, frequency 10"]
    assert run_cli(["step", "--device", "cpu", "--model", "toy", "--reps", "2", "--json", str(path),
                    "--only", *rows]) == 0
    res = json.loads(path.read_text())["results"]
    assert set(res) == set(rows)
    assert res["matrixopt shampoo, frequency 1"]["steps_per_block"] == 5  # the default inner block
    for name in rows[1:]:  # one block is one whole refresh period: every median block holds one refresh
        assert res[name]["steps_per_block"] == 10 and res[name]["ms"]["median"] > 0


def test_step_on_a_moe_layer(tmp_path):
    """One mixture-of-experts layer: our Muon routes each expert's three matrices to Newton–Schulz (batched) and the
    router to AdamW; torch.optim.Muon gets one 2-D copy per expert; the limit counts every expert's matrices."""
    import torch

    from matrixopt.bench.step import MODELS, hidden_matrices, param_set
    from matrixopt.optim.routing import route

    spec = MODELS["toy-moe"]
    ps = param_set("toy-moe", torch.device("cpu"))
    routes = {name: r for name, _, r in route(ps)}
    assert routes["transformer.h.0.mlp.router.weight"] == "adamw"
    assert routes["transformer.h.0.mlp.experts.up"] == routes["transformer.h.0.attn.q_proj.weight"] == "matrix"
    hidden = hidden_matrices(ps)
    assert len(hidden) == 4 + 3 * spec.experts and all(p.ndim == 2 and p.grad is not None for p in hidden)
    assert hidden_matrices(ps)[-1] is hidden[-1]  # the per-expert copies are made once
    path = tmp_path / "step.json"
    assert run_cli(["step", "--device", "cpu", "--model", "toy-moe", "--reps", "2", "--json", str(path),
                    "--only", "adamw (fused)", "torch.optim.Muon", "matrixopt muon"]) == 0
    rec = json.loads(path.read_text())
    assert all(r["status"] == "ok" for r in rec["results"].values()), rec["results"]
    q, kv = spec.n_head * spec.head_dim, spec.n_kv_head * spec.head_dim
    assert rec["limit"]["muon_params"] == 2 * q * spec.d + 2 * kv * spec.d + 3 * spec.experts * spec.expert_ffn * spec.d
    assert rec["shape"]["experts"] == spec.experts
    assert run_cli(["step", "--device", "cpu", "--model", "toy-moe", "--ep", "2", "--reps", "1", "--json", str(path),
                    "--only", "matrixopt muon"]) == 0  # one rank's share under expert parallelism 2
    rec = json.loads(path.read_text())
    assert rec["ep"] == 2 and rec["shape"]["experts"] == spec.experts // 2
    experts = 3 * spec.experts // 2 * spec.expert_ffn * spec.d
    assert rec["limit"]["muon_params"] == 2 * q * spec.d + 2 * kv * spec.d + experts
    for model, ep in (("toy", 2), ("toy-moe", 3)):
        with pytest.raises(ValueError, match="--ep"):
            param_set(model, torch.device("cpu"), ep)
    qwen = MODELS["qwen3-30b-a3b"]  # the published shapes, from the planner's preset
    assert (qwen.d, qwen.n_head, qwen.n_kv_head, qwen.head_dim, qwen.experts, qwen.expert_ffn, qwen.gated) == (
        2048, 32, 4, 128, 128, 768, True)
