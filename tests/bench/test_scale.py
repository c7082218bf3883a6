"""``matrixopt bench scale``: the configurations parse and validate, the step timeline sums micro-batches, and the
whole command runs at toy size on CPU (torchrun, 2 gloo ranks) and writes its JSON, for a dense GPT and for a
mixture of experts under expert parallelism 2."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from matrixopt.bench.scale import (
    CONFIGS,
    GcTimer,
    ScaleConfig,
    Settings,
    Timeline,
    active_params,
    check_ep,
    gc_warning,
    parse_config,
    run,
    single_gpu_step,
    step_rows,
    summarize,
    toy_preset,
    window_warning,
)
from matrixopt.train.model import GPT, PRESETS, GPTConfig
from tests.bench.test_bench import run_cli

ROOT = Path(__file__).resolve().parents[2]


def torchrun_bench(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``matrixopt bench ARGV`` on 2 gloo ranks under torchrun; the test fails with the output if it does."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "matrixopt", "bench", *argv]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("text, config", [
    ("ddp:adamw", ScaleConfig("ddp", "adamw")),
    ("layerwise:shampoo", ScaleConfig("layerwise", "shampoo")),
    ("fsdp:muon:tp2", ScaleConfig("fsdp", "muon", 2)),
    ("fsdp:muon:tp4:distributed", ScaleConfig("fsdp", "muon", 4, "distributed")),
])
def test_parse_config_round_trips(text, config):
    assert parse_config(text) == config and str(config) == text


@pytest.mark.parametrize("text, message", [
    ("ddp", "write PARALLEL:OPTIMIZER"), ("fsdp:muon:2", "write PARALLEL:OPTIMIZER"),
    ("fsdp:muon:tpx", "write PARALLEL:OPTIMIZER"), ("none:muon", "bench train"),
    ("zero:muon", "parallel must be one of"), ("ddp:adamx", "unknown optimizer 'adamx'"),
    ("ddp:muon:tp2", "tp=2 needs --parallel fsdp"),
    ("fsdp:muon:tp2:sideways", "tp_mode must be one of"),
])
def test_parse_config_explains_bad_input(text, message):
    with pytest.raises(ValueError, match=message):
        parse_config(text)


def test_bad_config_is_an_argument_error(capsys):
    with pytest.raises(SystemExit):
        run_cli(["scale", "--configs", "ddp"])
    assert "PARALLEL:OPTIMIZER[:tpN[:MODE]]" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, message", [
    (dict(tokens_per_gpu=0), "--tokens-per-gpu"), (dict(micro_batch=0), "--micro-batch"),
    (dict(iters=1), "--iters must be >= 2"), (dict(warmup=-1), "--warmup >= 0"), (dict(ep=0), "--ep must be"),
    (dict(hparams={"muom": {"momentum": 0.9}}), r"--opt names unknown optimizers \['muom'\]"),
])
def test_settings_check_themselves(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Settings(**kwargs)


def test_step_rows_take_whole_rows_and_micro_batches_that_divide_them():
    assert step_rows(16384, 1, 2048, 2) == (8, 2)  # the 1.3B at 16k tokens per GPU, micro-batches of 2 rows
    assert step_rows(4096, 2, 2048, None) == (4, 4)  # a TP pair shares its rows; one micro-batch
    with pytest.raises(ValueError, match="--tokens-per-gpu 100 does not make whole rows of 64 tokens.*multiple of 64"):
        step_rows(100, 1, 64, None)
    with pytest.raises(ValueError, match="--tokens-per-gpu 24 .* shared by a TP group of 4.*multiple of 16"):
        step_rows(24, 4, 64, None)
    with pytest.raises(ValueError, match="--micro-batch 3 must divide the 8 rows"):
        step_rows(16384, 1, 2048, 3)


def test_scale_outside_torchrun_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node N -m matrixopt bench scale"):
        run(settings=Settings(toy=True))


def test_timeline_sums_micro_batches_per_step():
    timeline = Timeline(torch.device("cpu"))
    # three steps of two micro-batches: forward laps (s) 1+2, 3+4, 5+6; one clip and one step lap per step
    timeline.device["forward"].laps = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    timeline.host["forward"] = [0.5] * 6
    for phase in ("backward", "clip", "step"):
        timeline.device[phase].laps = [0.1, 0.2, 0.4] * (2 if phase == "backward" else 1)
        timeline.host[phase] = [0.01] * (6 if phase == "backward" else 3)
    ms = timeline.per_step_ms(slice(1, 3), {"forward": 2, "backward": 2})
    assert ms["forward"]["device"] == pytest.approx(1e3 * (7 + 11) / 2)  # the median of steps 1 and 2: 7 s, 11 s
    assert ms["forward"]["device_per_micro_batch"] == pytest.approx([1e3 * (3 + 5) / 2, 1e3 * (4 + 6) / 2])
    assert "device_per_micro_batch" not in ms["step"]
    assert ms["forward"]["host"] == pytest.approx(1e3)
    assert ms["step"]["device"] == pytest.approx(1e3 * (0.2 + 0.4) / 2)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """One toy run of the default configurations and tensor parallelism 2: 256 tokens per GPU (4 rows of 64) in 2
    micro-batches."""
    path = tmp_path_factory.mktemp("scale") / "scale.json"
    proc = torchrun_bench(["scale", "--toy", "--iters", "2", "--warmup", "1", "--tokens-per-gpu", "256",
                           "--micro-batch", "2", "--phases", "--json", str(path), "--opt", "muon.momentum=0.9",
                           "--configs", *CONFIGS, "fsdp:muon:tp2"], timeout=300)
    return json.loads(path.read_text()), proc.stdout


def test_scale_toy_throughput(toy):
    result, _ = toy
    assert result["benchmark"] == "scale" and result["world_size"] == 2 and result["backend"] == "gloo"
    assert result["complete"] and result["hparams"] == {"muon": {"momentum": 0.9}}
    lines = {line["config"]: line for line in result["summary"]}
    assert set(lines) == {"ddp:adamw", "fsdp:adamw", "layerwise:muon", "fsdp:muon", "fsdp:muon:tp2"}
    for line in lines.values():
        assert line["tokens_per_s"] > 0 and line["opt_step_ms_max"] >= line["opt_step_ms_min"] > 0
        assert line["tokens_per_s_per_gpu"] == pytest.approx(line["tokens_per_s"] / 2)
        assert line["micro_batches"] == (4 if line["config"].endswith("tp2") else 2)  # a TP group shares 8 rows
        assert line["state_mb_max"] > 0
    for ranks in result["per_rank"]:
        assert len(ranks) == 2 and all(r["tokens_per_rank"] == 256 for r in ranks)
        flops = ranks[0]["flops_per_token"]
        line = lines[ranks[0]["config"]]
        assert line["model_tflops_per_gpu"] == pytest.approx(flops * line["tokens_per_s_per_gpu"] / 1e12)
    assert lines["ddp:adamw"]["vs_ddp_adamw"] == 1.0
    assert lines["fsdp:muon"]["vs_ddp_adamw"] > 0 and lines["fsdp:adamw"]["vs_ddp_adamw"] > 0


def test_a_run_stopped_early_keeps_the_configurations_it_measured(tmp_path):
    """The record is written after each configuration: the second one here fails (8-row micro-batches do not divide
    the 4 rows of a data-parallel rank without TP), and the first one's figures are on disk, marked incomplete."""
    path = tmp_path / "scale.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "matrixopt",
           "bench", "scale", "--toy", "--iters", "2", "--warmup", "1", "--tokens-per-gpu", "256", "--micro-batch",
           "8", "--json", str(path), "--configs", "fsdp:muon:tp2", "ddp:adamw"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode != 0 and "--micro-batch 8 must divide" in proc.stdout + proc.stderr
    record = json.loads(path.read_text())
    assert not record["complete"] and [s["config"] for s in record["summary"]] == ["fsdp:muon:tp2"]
    assert record["summary"][0]["step_ms"] > 0


def test_opt_reaches_the_optimizer(tmp_path):
    """``--opt NAME.KEY=VALUE`` is passed to that optimizer's constructor: an unknown keyword is refused there."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "matrixopt",
           "bench", "scale", "--toy", "--iters", "2", "--warmup", "1", "--tokens-per-gpu", "128",
           "--opt", "muon.not_a_setting=1", "--configs", "ddp:muon"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode != 0 and "not_a_setting" in proc.stdout + proc.stderr


def test_scale_toy_layerwise_against_one_gpu(toy):
    result, stdout = toy
    line = next(s for s in result["summary"] if s["config"] == "layerwise:muon")
    assert line["single_gpu_step_ms"] > 0
    assert line["allocator"] == {"device_allocs": 0, "device_frees": 0, "alloc_retries": 0}  # no CUDA allocator
    for key in ("opt_step_vs_single_gpu", "vs_ddp_adamw", "state_vs_single_gpu"):
        assert line[key] > 0, key
    # two ranks each hold about half of the single-process optimizer state
    assert 0.4 < line["state_vs_single_gpu"] < 0.6
    layerwise = next(ranks for ranks in result["per_rank"] if ranks[0]["config"] == "layerwise:muon")
    assert sum(r["owned_cost_share"] for r in layerwise) == pytest.approx(1.0)  # every matrix has one owner
    assert all(r["inner_step_ms"] > 0 for r in layerwise)
    assert "optimizer step" in stdout


def test_scale_toy_phases(toy):
    result, stdout = toy
    for line in result["summary"]:
        assert set(line["phases"]) == {"forward", "backward", "clip", "step"}
        assert all(t["device"] > 0 and t["host"] > 0 for t in line["phases"].values()), line["config"]
        assert line["phases"]["step"]["device"] == line["opt_step_ms_max"]
        assert len(line["phases"]["forward"]["device_per_micro_batch"]) == line["micro_batches"] > 1
    assert "Step timeline" in stdout and "Each micro-batch's device time" in stdout


def meta_gpt(preset: str, vocab_size: int = 50304, **overrides) -> GPT:
    """``preset`` as bench scale builds it (untied head), on the meta device."""
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=vocab_size, tie_embeddings=False, **(PRESETS[preset] | overrides)))


def megatron_flops_per_token(L: int, d: int, T: int, ffn: int, topk: int, V: int) -> float:
    """Megatron-LM's ``num_floating_point_operations`` per token for multi-head attention and a non-gated MLP of
    width ``ffn`` (each of ``topk`` experts): ``12 L d^2 (2 + T / d + topk ffn / d) + 6 d V``."""
    return 12 * L * d * d * (2 + T / d + topk * ffn / d) + 6 * d * V


@pytest.mark.parametrize("preset", ["gpt2-medium", "1.3b", "moe-small", "moe-2b", "qwen3-30b-a3b"])
def test_model_flops_are_megatrons(preset):
    model = meta_gpt(preset)
    c = model.config
    ffn, topk = (c.expert_ffn, c.topk) if c.n_expert else (4 * c.n_embd, 1)
    router = 6 * c.n_layer * c.n_embd * c.n_expert  # counted here, left out by Megatron-LM
    expected = megatron_flops_per_token(c.n_layer, c.n_embd, c.block_size, ffn, topk, c.vocab_size) + router
    assert model.estimate_flops_per_token() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("preset", ["gpt2-medium", "moe-small", "moe-2b"])
def test_active_params_are_the_gpts_own_count(preset):
    model = meta_gpt(preset)
    c = model.config
    stacks = sum(p.numel() for m in model.moe_layers() for p in m.experts.parameters())
    assert active_params(model) == model.num_params() - stacks + (stacks // c.n_expert * c.topk if stacks else 0)
    assert (active_params(model) == model.num_params()) == (c.n_expert == 0)
    matmuls = (model.estimate_flops_per_token() - 12 * c.n_layer * c.block_size * c.n_embd) / 6
    assert matmuls < active_params(model)  # the embedding lookups and norms are parameters used, not matmuls


def test_toy_keeps_the_kind_of_model():
    assert [toy_preset(p) for p in ("gpt2-medium", "1.3b", "moe-small", "moe-2b")] == ["tiny-cpu", "tiny-cpu",
                                                                                       "moe-tiny", "moe-tiny"]


@pytest.mark.parametrize("presets, message", [
    (["gpt2-medium"], "preset 'gpt2-medium' has 0 experts"), (["moe-tiny"], "preset 'moe-tiny' has 4 experts"),
])
def test_ep_needs_experts_it_divides(presets, message):
    check_ep([parse_config("ddp:muon")], ["moe-small"], Settings(ep=8))  # 16 experts over 8 ranks
    with pytest.raises(ValueError, match=message):
        check_ep([parse_config("ddp:muon")], presets, Settings(ep=8))


def test_scale_toy_mixture_of_experts_over_two_ranks(tmp_path):
    """moe-small's toy stand-in (moe-tiny: 4 experts, top-2) with expert parallelism 2 under DDP AdamW, DDP Muon
    and layer-wise Muon: 256 tokens per GPU (16 rows of 16) in 2 micro-batches."""
    path = tmp_path / "scale_moe.json"
    proc = torchrun_bench(["scale", "--toy", "--presets", "moe-small", "--ep", "2", "--iters", "2", "--warmup", "1",
                           "--tokens-per-gpu", "256", "--micro-batch", "8", "--json", str(path),
                           "--configs", "ddp:adamw", "ddp:muon", "layerwise:muon"], timeout=120)
    result = json.loads(path.read_text())
    assert result["ep"] == 2 and result["world_size"] == 2
    lines = {line["config"]: line for line in result["summary"]}
    assert set(lines) == {"ddp:adamw", "ddp:muon", "layerwise:muon"}
    model = meta_gpt("moe-tiny", vocab_size=512, n_layer=2)
    cfg = model.config
    stacks = cfg.n_layer * 2 * cfg.n_expert * cfg.expert_ffn * cfg.n_embd
    for line in lines.values():
        assert line["preset"] == "moe-tiny" and line["ep"] == 2 and line["micro_batches"] == 2
        assert line["params"] == model.num_params()  # every rank's: the whole model, not its share of the experts
        assert line["active_params"] == line["params"] - stacks + stacks * cfg.topk // cfg.n_expert
        assert line["tokens_per_s"] > 0 and line["model_tflops_per_gpu"] > 0 and line["vs_ddp_adamw"] > 0
        assert line["expert_max_load"] >= 1  # the busiest expert over the mean: the router ran on random tokens
    # steps at lr 0: the parameters stay put, so every optimizer routes the same tokens to the same experts
    assert len({line["expert_max_load"] for line in lines.values()}) == 1, lines
    for ranks in result["per_rank"]:
        flops = ranks[0]["flops_per_token"]
        assert flops == model.estimate_flops_per_token()  # the whole model's, not one rank's share of the experts
        line = lines[ranks[0]["config"]]
        assert line["model_tflops_per_gpu"] == pytest.approx(flops * line["tokens_per_s_per_gpu"] / 1e12)
        assert all(r["ep"] == 2 and r["tokens_per_rank"] == 256 for r in ranks)
    assert "active per token, expert parallelism 2" in proc.stdout


def test_single_gpu_reference_ignores_the_layerwise_options():
    """``--opt muon.step_chunks=1`` sets the layer-wise wrapper's option; the one-GPU reference step, a plain
    optimizer, is built without it instead of failing on it."""
    settings = Settings(toy=True, iters=2, warmup=0, hparams={"muon": {"step_chunks": 1, "momentum": 0.9}})
    out = single_gpu_step("tiny-cpu", "muon", settings, torch.device("cpu"))
    assert out["step_ms"] > 0 and out["state_mb"] > 0


def _rank_figures(config: str, step_ms: float) -> dict:
    """One rank's figures as run_config returns them, for a dense preset without layer-wise."""
    phases = {p: {"device": 1.0, "host": 1.0} for p in ("forward", "backward", "clip", "step")}
    return dict(config=config, preset="1.3b", rank=0, ep=1, params=10, active_params=10, flops_per_token=60,
                expert_max_load=None, tokens_per_rank=4096, micro_batches=1, step_ms=step_ms, opt_step_ms=1.0,
                phases=phases, state_mb=1.0, peak_mem_mb=1.0, held_before_mb=0.0,
                allocator={"device_allocs": 0, "device_frees": 0, "alloc_retries": 0},
                comm_s=None, exposed_comm_s=None, profiled_wall_s=None, window_unix=[0.0, 1.0],
                gc={"collections": [0, 0, 0], "ms_per_step": 0.0})


def test_repeated_configurations_are_compared_with_the_median_adamw_run():
    """Alternating repeats: each run is a line, and every ratio is against the median of DDP AdamW's runs."""
    runs = [("ddp:adamw", 100.0), ("ddp:muon", 110.0), ("ddp:adamw", 80.0), ("ddp:muon", 90.0), ("ddp:adamw", 90.0)]
    lines = summarize([[_rank_figures(c, ms)] for c, ms in runs], [{}], world=1)
    assert [line["config"] for line in lines] == [c for c, _ in runs]
    assert [line["vs_ddp_adamw"] for line in lines] == pytest.approx([90 / 100, 90 / 110, 90 / 80, 1.0, 1.0])


def test_a_single_gpu_reference_out_of_memory_leaves_its_ratios_out(monkeypatch, capsys):
    """The whole model's state on one device (layer-wise's reference) need not fit: the run goes on without the
    ratios to it instead of failing."""
    import matrixopt.bench.scale as scale

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(scale, "time_ms", oom)
    out = single_gpu_step("tiny-cpu", "muon", Settings(toy=True, iters=2, warmup=0), torch.device("cpu"))
    assert out == {"step_ms": None, "state_mb": None} and "ran out of memory" in capsys.readouterr().out
    rank = _rank_figures("layerwise:muon", 100.0) | dict(inner_step_ms=1.0)
    (line,) = summarize([[rank]], [{("1.3b", "muon"): out}], world=1)
    assert line["single_gpu_step_ms"] is None and line["opt_step_vs_single_gpu"] is None
    assert line["state_vs_single_gpu"] is None and line["step_ms"] == 100.0


def test_one_time_work_in_the_timed_window_is_flagged():
    """More cudaMallocs than timed steps on any rank (a CUDA graph's capture in the window) earns a note that says
    how to time it again; a clean window or one allocation per step does not."""
    settings = Settings(iters=6, warmup=2)
    ranks = [{"allocator": {"device_allocs": n, "device_frees": 0, "alloc_retries": 0}} for n in (0, 173)]
    note = window_warning(ranks, settings)
    assert note is not None and "173 cudaMalloc calls in the 6 timed steps" in note and "--warmup 4" in note
    assert window_warning(ranks[:1], settings) is None
    assert window_warning([{"allocator": {"device_allocs": 6}}], settings) is None


def test_gc_timer_counts_the_collections_it_sees():
    """Collections while entered are counted by generation and timed; none after leaving; the callback is removed."""
    before = len(gc.callbacks)
    with GcTimer() as timer:
        for _ in range(3):
            a: list = []
            a.append(a)  # a cycle only the collector frees
            gc.collect(1)
        gc.collect()
    assert timer.collections == [0, 3, 1] and timer.ms > 0 and len(gc.callbacks) == before
    gc.collect()
    assert timer.collections == [0, 3, 1]


def test_long_garbage_collections_in_the_timed_window_are_flagged():
    """More than 1% of a step in the collector on some rank earns a note naming the rank and the full collections;
    the usual young collections do not."""
    def rank(r: int, ms: float, full: int) -> dict:
        return {"rank": r, "step_ms": 400.0, "gc": {"collections": [70, 7, full], "ms_per_step": ms}}

    note = gc_warning([rank(0, 21.4, 1), rank(1, 2.2, 0)])
    assert note is not None and "21.4 ms per timed step on rank 0" in note and "1 full collections" in note
    assert gc_warning([rank(0, 2.2, 0), rank(1, 3.9, 0)]) is None
