"""The planner: model shapes, deterministic plans, the constraints it checks, the CLI and the validation."""

import dataclasses
import json

import pytest

from matrixopt import cli
from matrixopt.distributed.cost import shipped_profile
from matrixopt.plan import planner, validate
from matrixopt.plan.models import PRESETS, Architecture, gpt, load_model

H100 = shipped_profile("h100")
DEVICE_ONLY = dataclasses.replace(H100, host_launch=0.0)  # device time alone: the host issues for free


def test_presets_have_the_published_sizes():
    assert PRESETS["1.3b"].total_params() == 1418842112  # bench step's 1.3B parameter set
    assert PRESETS["gpt2-small"].total_params() == 163109376
    assert PRESETS["qwen3-30b-a3b"].total_params() == pytest.approx(30.5e9, rel=0.01)  # "30B-A3B"
    assert PRESETS["qwen3-30b-a3b"].active_matmul_params() == pytest.approx(3.0e9, rel=0.1)
    assert PRESETS["kimi-k2-like"].total_params() == pytest.approx(1.03e12, rel=0.02)  # "1T total"


def test_gpt_keeps_a_mixture_of_experts_preset():
    moe = gpt("moe-2b")
    assert (moe.n_experts, moe.top_k, moe.expert_ffn) == (128, 8, 384)
    # bench scale's record counts 2,624,898,048 without biases; gpt() adds the attention, router and norm biases
    assert moe.total_params() == 2624898048 + 24 * (4 * 1024 + 128) + 49 * 1024


def test_plan_is_deterministic_and_marks_the_best():
    cfg = planner.PlanConfig(model=PRESETS["1.3b"], gpus=16, tokens_per_gpu=4096)
    a, b = planner.plan(cfg, H100), planner.plan(cfg, H100)
    assert planner.to_dict(a) == planner.to_dict(b)
    text = planner.format_plan(a)
    assert text == planner.format_plan(b)
    assert sum(line.startswith("*  ") for line in text.splitlines()) == 1
    labels = [p.layout.label for p in a.predictions]
    assert labels[:2] == ["layerwise", "fsdp"] and "fsdp tp2 distributed" in labels
    assert a.best.fits and a.best.layout.tp_mode != "blockwise"
    assert all(p.step_s > p.fwd_bwd_s > 0 and p.memory.total > 0 for p in a.predictions)


def test_moe_layouts_split_experts():
    cfg = planner.PlanConfig(model=PRESETS["qwen3-30b-a3b"], gpus=8, tokens_per_gpu=4096, recompute=True, tp=1)
    p = planner.plan(cfg, H100)
    assert {q.layout.ep for q in p.predictions} == {2, 4, 8}
    by_ep = {q.layout.ep: q for q in p.predictions}
    assert by_ep[8].memory.params < by_ep[2].memory.params * 1.5  # FSDP spreads the rest over expert-DP ranks
    assert 0 < p.best.ratio < 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(gpus=16, tp=3), "not divisible by tp x ep = 3 x 1 = 3"),
    (dict(gpus=32, tp=32, gpus_per_node=32), "tp 32 must divide the model's 16 query"),
    (dict(gpus=8, tp=2, dp=8), "tp x dp = 2 x 8 = 16 must equal gpus 8"),
    (dict(gpus=12), "not a whole number of nodes of 8"),
    (dict(gpus=8, ep=2), "needs a mixture-of-experts model"),
    (dict(gpus=8, optimizer="lion"), "optimizer must be one of"),
    (dict(gpus=8, tokens_per_gpu=0), "tokens_per_gpu must be an int >= 1"),
    (dict(gpus=8, tokens_per_gpu=4096, grad_accum=3), "must split into grad_accum 3 equal micro-batches"),
    (dict(gpus=8, fsdp_gather_once=1), "fsdp_gather_once must be True or False, got 1"),
    (dict(gpus=8, optimizer="shampoo", root_method="svd"), "Unknown root_method 'svd'; use one of"),
])
def test_bad_configs_name_the_constraint(kwargs, message):
    with pytest.raises(ValueError, match=message):
        planner.PlanConfig(model=PRESETS["1.3b"], **kwargs)


def test_accumulation_amortizes_the_step():
    base = dict(model=PRESETS["qwen3-30b-a3b"], gpus=8, recompute=True, tp=1, ep=8)
    one = planner.plan(planner.PlanConfig(tokens_per_gpu=8192, **base), H100).best
    many = planner.plan(planner.PlanConfig(tokens_per_gpu=8192 * 16, grad_accum=16, **base), H100).best
    assert many.opt_step_s == pytest.approx(one.opt_step_s)  # one optimizer step either way
    assert many.memory.activations == pytest.approx(one.memory.activations)  # one micro-batch at a time
    assert one.ratio < many.ratio < 1


def test_expert_degree_must_divide_the_experts():
    with pytest.raises(ValueError, match="ep 3 must divide the model's 128 experts"):
        planner.PlanConfig(model=PRESETS["qwen3-30b-a3b"], gpus=12, gpus_per_node=12, ep=3)


def test_a_model_that_fits_nowhere_says_what_it_needs():
    gb = H100.memory_bytes / 1e9
    with pytest.raises(ValueError, match=rf"fits no layout on 8 GPUs of {gb:.0f} GB.*needs [0-9.]+ GB per GPU"):
        planner.plan(planner.PlanConfig(model=PRESETS["kimi-k2-like"], gpus=8, ep=8), H100)


def test_shapes_file(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"name": "tiny", "n_layer": 2, "d_model": 256, "n_head": 4, "vocab": 1000,
                                "context": 128}))
    assert isinstance(load_model(str(path)), Architecture)
    explicit = tmp_path / "explicit.json"
    explicit.write_text(json.dumps({"name": "mats", "n_layer": 2, "d_model": 256, "n_head": 4,
                                    "matrices": [{"name": "w", "shape": [256, 1024], "count": 4}],
                                    "adamw_params": 1000, "flops_per_token": 6e6,
                                    "activation_bytes_per_token_layer": 4096}))
    p = planner.plan(planner.PlanConfig(model=load_model(str(explicit)), gpus=8, tp=1), H100)
    assert p.best.layout.label in ("layerwise", "fsdp")
    for bad, says in (({"name": "mats", "matrices": [{"shape": [1, 2]}]}, r"matrices\[0\] must be an object"),
                      ({"name": "mats", "matrices": [[1, 2]]}, r"matrices\[0\] must be an object"),
                      ({"name": "mats", "matrices": [{"name": "w", "shape": [256, 1024]}]},
                       "lacks the field 'adamw_params'"),
                      ({"n_layer": 2, "widht": 3}, "unexpected keyword argument 'widht'"),
                      ([1, 2], "must hold one JSON object")):
        explicit.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=f"model file {explicit}.*{says}"):
            load_model(str(explicit))
    with pytest.raises(ValueError, match="unknown model 'gpt5'"):
        load_model("gpt5")


def test_cli_prints_the_table_and_writes_json_and_plot(tmp_path, capsys):
    out = tmp_path / "plan"
    assert cli.main(["plan", "--model", "gpt2-medium", "--gpus", "8", "--tokens-per-gpu", "2048",
                     "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "* best:" in text and "MFU 0.4" in text
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["profile"]["name"] == H100.name and record["profile"]["source"] == "measured" and record["best"]
    assert [r["gpus"] for r in record["curve"]][:2] == [8, 16] and record["curve"][-1]["gpus"] == 4096
    pytest.importorskip("matplotlib")
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize("argv, message", [
    (["--model", "1.3b", "--gpus", "12", "--gpus-per-node", "4", "--tp", "8"], "not divisible by tp x ep"),
    (["--model", "1.3b", "--gpus", "8", "--network", "carrier-pigeon"], "--network 'carrier-pigeon'"),
    (["--model", "1.3b"], "needs --model and --gpus"),
])
def test_cli_errors_are_one_line(argv, message, capsys):
    assert cli.main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_an_unreadable_profile(tmp_path, capsys):
    bad = tmp_path / "profile.json"
    bad.write_text('{"format": "matrixopt-profile/1", "name": ')
    assert cli.main(["plan", "--model", "1.3b", "--gpus", "8", "--profile", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    other = tmp_path / "profile.txt"  # a file by any other name is read as a profile too, not taken for a name
    other.write_text("h100")
    assert cli.main(["plan", "--model", "1.3b", "--gpus", "8", "--profile", str(other)]) == 2
    err = capsys.readouterr().err
    assert str(other) in err and "not valid JSON" in err


def test_cli_calibrates_into_a_loadable_profile(tmp_path, capsys):
    from matrixopt.distributed.cost import DeviceProfile

    assert cli.main(["plan", "--calibrate", "--out", str(tmp_path / "cpu.json")]) == 0
    assert DeviceProfile.load(tmp_path / "cpu.json").source == "measured"
    assert cli.main(["plan", "--model", "1.3b", "--gpus", "8", "--profile", str(tmp_path / "cpu.json")]) == 0
    assert "(measured)" in capsys.readouterr().out


def test_validation_reads_the_committed_results():
    sections = validate.validate()
    rows = [r for rs in sections.values() for r in rs]
    assert len(rows) > 50 and all(r["source"].endswith(".json") for r in rows)
    assert all("H100" in r["what"] and r["source"].endswith("2xh100.json") for r in sections["scaling, 2 H100"])
    assert "| measurement |" in validate.format_validation(sections)
    once = [r for r in sections["scaling, 2 H100"] if r["source"] == "scale_1.3b_16k_fsdp_gather_once_2xh100.json"]
    assert len(once) == 15 and all("fsdp gathered once:" in r["what"] for r in once)  # 5 rows x 3 profiles


@pytest.mark.parametrize("record, device", [
    ({"env": {"device": "NVIDIA H100 80GB HBM3"}}, "h100"),
    ({"env": {"device": "NVIDIA H200"}}, "h200"),
    ({"device": "NVIDIA H200"}, "h200"),  # the older layer-wise record keeps it at the top
])
def test_validation_reads_the_device_of_a_record(record, device):
    assert validate.device_of(record) == device
    assert next(iter(validate.profiles_for(record).values())).device == validate.shipped_profile(device).device


def test_validation_rejects_an_unprofiled_device():
    with pytest.raises(ValueError, match="'NVIDIA A100-SXM4-80GB' names none of the profiled GPUs"):
        validate.device_of({"env": {"device": "NVIDIA A100-SXM4-80GB"}})


def test_validation_reads_peak_memory_in_gb_or_mib():
    assert validate._peak_gb({"peak_mem_gb_max": 35.5}) == 35.5
    assert validate._peak_gb({"peak_mem_mb_max": 1000.0}) == pytest.approx(1.048576)  # MiB


def test_repeated_configurations_take_medians_and_the_least_peak_memory():
    line = {"preset": "1.3b", "config": "fsdp:muon", "micro_batches": 4, "gpus": 2}
    rec = {"summary": [line | {"step_ms": 400.0, "peak_mem_mb_max": 900.0},
                       {"preset": "1.3b", "config": "fsdp:adamw", "micro_batches": 4, "step_ms": 380.0},
                       line | {"step_ms": 420.0, "peak_mem_mb_max": 1200.0},
                       line | {"step_ms": 500.0, "peak_mem_mb_max": 1000.0}]}
    by = validate._summaries(rec)
    muon = by[("1.3b", "fsdp:muon")]
    assert muon["step_ms"] == 420.0 and muon["peak_mem_mb_max"] == 900.0
    assert muon["micro_batches"] == 4 and isinstance(muon["micro_batches"], int)  # equal ints stay ints
    assert by[("1.3b", "fsdp:adamw")]["step_ms"] == 380.0


def test_ns_method_reaches_the_step():
    """``ns_method="standard"`` prices every stack in the standard form: the layer-wise owner's step on 1 GPU is
    the standard-form Newton–Schulz of each shape plus the elementwise passes, and slower than the Gram form's."""
    model = gpt("gpt2-small")
    auto, std = (planner.predict(planner.Layout(kind="layerwise"), planner.PlanConfig(
        model=model, gpus=1, gpus_per_node=8, ns_method=m), DEVICE_ONLY) for m in ("auto", "standard"))
    from matrixopt.distributed.cost import newton_schulz_time
    ns = {m: sum(newton_schulz_time(DEVICE_ONLY, x.count, x.m, x.n, 5, m) for x in model.matrices()) for m in
          ("auto", "standard")}
    assert std.opt_step_s - auto.opt_step_s == pytest.approx(ns["standard"] - ns["auto"])
    assert ns["standard"] > ns["auto"]
    with pytest.raises(ValueError, match="Unknown Newton–Schulz method 'fast'"):
        planner.PlanConfig(model=model, gpus=8, ns_method="fast")


def test_fsdp_accumulation_keeps_fp32_unsharded_gradients_and_reduces_once():
    """Under gradient accumulation FSDP2 holds every gradient unsharded in fp32 between micro-batches (4 bytes per
    parameter of the rank before sharding) and reduce-scatters once, after the last micro-batch; it gathers in
    every micro-batch's forward and backward. Hand-computed on a slow link, where every collective is exposed."""
    from matrixopt.distributed.cost import Link, collective_time
    slow = H100.with_network(Link(latency=1e-3, bandwidth=1e8))
    model = gpt("gpt2-small")
    base = dict(model=model, gpus=16, gpus_per_node=8)
    one = planner.predict(planner.Layout(kind="fsdp"), planner.PlanConfig(tokens_per_gpu=2048, **base), slow)
    four = planner.predict(planner.Layout(kind="fsdp"), planner.PlanConfig(tokens_per_gpu=8192, grad_accum=4,
                                                                           **base), slow)
    params = model.total_params()
    transient = 2 * 2 * params / model.n_layer
    assert one.memory.grads == pytest.approx(transient)  # the last step's sharded gradients were freed
    assert four.memory.grads == pytest.approx(4 * params + transient)
    assert one.memory.step_grads == four.memory.step_grads == pytest.approx(4 * params / 16)
    link = slow.link(16, 1, 8)
    gather = collective_time("all_gather", 2 * params, 16, link)
    rs = collective_time("reduce_scatter", 4 * params, 16, link)
    fwd, bwd = four.fwd_bwd_s / 3 / 4, 2 * four.fwd_bwd_s / 3 / 4
    assert gather > fwd and gather > bwd  # everything exposed: the hand sum below holds
    sync = 4 * (gather - fwd) + 3 * (gather - bwd) + (gather + rs - bwd)
    assert four.adamw_step_s - four.fwd_bwd_s - four.adamw_opt_step_s == pytest.approx(sync)


def test_layerwise_accumulation_holds_the_gradients_beside_the_reduce_buffers():
    """Layer-wise: the owners' reduce buffers take 4 bytes per parameter; under accumulation the micro-batches'
    gradients of fp32 weights gather in .grad until the last backward's hooks copy them into those buffers, so 8
    at its start; bf16 matrices' gradients go into the buffers as backward makes them, so only the rest's
    gather in .grad. bf16 matrices take 2 bytes on every rank, their fp32 masters 4 on their owners."""
    model = gpt("gpt2-small")
    base = dict(model=model, gpus=2, gpus_per_node=8, bf16_weights=False)
    one = planner.predict(planner.Layout(kind="layerwise"), planner.PlanConfig(tokens_per_gpu=2048, **base), H100)
    four = planner.predict(planner.Layout(kind="layerwise"),
                           planner.PlanConfig(tokens_per_gpu=8192, grad_accum=4, **base), H100)
    params = model.total_params()
    assert one.memory.grads == pytest.approx(4 * params) and four.memory.grads == pytest.approx(8 * params)
    assert four.memory.activations == pytest.approx(one.memory.activations)  # the same micro-batch
    lowered = planner.predict(planner.Layout(kind="layerwise"),
                              planner.PlanConfig(tokens_per_gpu=8192, grad_accum=4, **base | {"bf16_weights": True}),
                              H100)
    mats = sum(m.numel for m in model.matrices())
    rest = params - mats
    assert lowered.memory.grads == pytest.approx(4 * params + 4 * rest)
    assert lowered.memory.params == pytest.approx(2 * mats + 4 * rest)
    assert lowered.memory.optimizer_state == pytest.approx(four.memory.optimizer_state + 4 * mats / 2)
    # autocast's casts of every fp32 matrix and its gradient, and the fp32 accumulation in .grad, skipped in each of
    # the 4 micro-batches (14 bytes an element)
    assert four.step_s - lowered.step_s == pytest.approx(4 * H100.seconds("elementwise", 14 * mats))


def test_validation_prices_records_before_the_gram_form_in_the_standard_form():
    before, after = ({"env": {"git_commit": c}} for c in (next(iter(validate.BEFORE_GRAM)), "fb53580"))
    assert validate.ns_method(before) == "standard" and validate.ns_method(after) == "auto"


def test_excluded_rows_are_listed_but_not_counted():
    rows = [validate._row("a", "scale_4gpu.json", "nominal", 2.0, 1.0, "ms"),
            validate._row("b", "scale_4gpu.json", "nominal", 2.0, 1.0, "GB"),  # memory rows still count
            validate._row("c", "other.json", "nominal", 1.0, 1.0, "ms")]
    assert rows[0]["excluded"] and not rows[1]["excluded"] and not rows[2]["excluded"]
    text = validate.format_validation({"s": rows})
    assert "(+100.0%, excluded)" in text and "1 of 2 rows within 15%" in text and "1 shipped-profile rows" in text


def test_stale_time_rows_are_listed_but_not_counted():
    files, parts, why = validate.STALE[0]
    what = "1.3b, 2 H100, 16k tokens per GPU, fsdp: Muon optimizer step"
    assert all(p in what for p in parts)
    assert validate._row(what, files[0], "measured", 2.0, 1.0, "ms")["excluded"] == why
    assert validate._row(what.replace("optimizer step", "peak memory per GPU"), files[0], "measured", 2.0, 1.0,
                         "GB")["excluded"] is None  # memory rows still count
    layerwise = "1.3b, 2 H100, 16k tokens per GPU, layerwise: Muon optimizer step"
    assert validate._row(layerwise, files[0], "measured", 2.0, 1.0, "ms")["excluded"] is None
    assert validate._row(what, "scale_1.3b_4k_fsdp_2xh100.json", "measured", 2.0, 1.0, "ms")["excluded"] is None


def test_layerwise_step_on_one_gpu_is_the_cost_models_step_with_adamw_beside_it():
    """One owner steps every matrix (one stack per matrix entry) with its AdamW groups on a side stream; the
    non-finite agreement takes the clip's norms, so nothing reads the gradients before the step."""
    from matrixopt.distributed.cost import Shapes, matrix_step_time

    model = gpt("gpt2-small")
    p = planner.predict(planner.Layout(kind="layerwise"), planner.PlanConfig(model=model, gpus=1), DEVICE_ONLY)
    groups = [Shapes(m.m, m.n, m.count) for m in model.matrices()]
    rest = model.table_params() + model.vector_params()
    assert p.opt_step_s == pytest.approx(matrix_step_time(DEVICE_ONLY, "muon", groups, adamw_numel=rest))


def test_fsdp_gather_once_gathers_twice_per_step_and_holds_the_gathered_model():
    """Gathering once per step (the trainer's ``--fsdp-gather-once``): the first micro-batch's forward and the
    last one's backward gather the whole model, the last backward reduce-scatters, the micro-batches between
    gather nothing; the whole model's bf16 parameters (2 bytes per parameter of the rank before sharding) replace
    two gathered layers, and the fp32 unsharded gradients stay. Hand-computed on a slow link, where every
    collective is exposed; at one micro-batch the option changes nothing."""
    from matrixopt.distributed.cost import Link, collective_time
    slow = H100.with_network(Link(latency=1e-3, bandwidth=1e8))
    model = gpt("gpt2-small")
    base = dict(model=model, gpus=16, gpus_per_node=8, tokens_per_gpu=8192, grad_accum=4)
    fsdp = planner.Layout(kind="fsdp")
    each = planner.predict(fsdp, planner.PlanConfig(**base), slow)
    once = planner.predict(fsdp, planner.PlanConfig(fsdp_gather_once=True, **base), slow)
    params = model.total_params()
    link = slow.link(16, 1, 8)
    gather = collective_time("all_gather", 2 * params, 16, link)
    rs = collective_time("reduce_scatter", 4 * params, 16, link)
    fwd, bwd = once.fwd_bwd_s / 3 / 4, 2 * once.fwd_bwd_s / 3 / 4
    assert gather > fwd and gather > bwd  # everything exposed: the hand sums below hold
    sync = (gather - fwd) + (gather + rs - bwd)  # 2 gathers and 1 reduce-scatter per step
    assert once.adamw_step_s - once.fwd_bwd_s - once.adamw_opt_step_s == pytest.approx(sync)
    assert once.step_s - once.fwd_bwd_s - once.opt_step_s == pytest.approx(sync)
    assert each.step_s - once.step_s == pytest.approx(3 * (gather - fwd) + 3 * (gather - bwd))  # 6 gathers fewer
    transient = 2 * 2 * params / model.n_layer  # two layers' bf16 parameters (or gradients)
    assert once.memory.params == pytest.approx(4 * params / 16 + 2 * params)
    assert each.memory.params == pytest.approx(4 * params / 16 + transient)
    assert once.memory.grads == each.memory.grads == pytest.approx(4 * params + transient)
    assert once.adamw_memory.total - each.adamw_memory.total == pytest.approx(2 * params - transient)
    assert once.notes == ("parameters gathered once per step",) and each.notes == ()
    single = dict(base, tokens_per_gpu=2048, grad_accum=1)
    assert (planner.predict(fsdp, planner.PlanConfig(fsdp_gather_once=True, **single), slow)
            == planner.predict(fsdp, planner.PlanConfig(**single), slow))
    layerwise = planner.Layout(kind="layerwise")
    assert (planner.predict(layerwise, planner.PlanConfig(fsdp_gather_once=True, **base), slow)
            == planner.predict(layerwise, planner.PlanConfig(**base), slow))


def test_fsdp_gather_once_plan_is_deterministic_and_reaches_the_cli(capsys):
    cfg = planner.PlanConfig(model=PRESETS["1.3b"], gpus=16, tokens_per_gpu=16384, grad_accum=4,
                             fsdp_gather_once=True)
    a, b = planner.plan(cfg, H100), planner.plan(cfg, H100)
    assert planner.to_dict(a) == planner.to_dict(b) and planner.to_dict(a)["fsdp_gather_once"] is True
    assert planner.format_plan(a) == planner.format_plan(b)
    argv = ["plan", "--model", "1.3b", "--gpus", "16", "--tokens-per-gpu", "16384", "--grad-accum", "4", "--tp", "1"]
    assert cli.main(argv + ["--fsdp-gather-once"]) == 0
    assert "FSDP: parameters gathered once per step" in capsys.readouterr().out
    assert cli.main(argv) == 0
    assert "gathered once" not in capsys.readouterr().out


def _scale_record(path, gather_once, step_ms, peak_mib):
    """A minimal ``bench scale`` record: 1.3B FSDP2 on 2 H100s, 16k tokens per GPU in 4 micro-batches."""
    line = dict(preset="1.3b", micro_batches=4, opt_step_ms_max=10.0, peak_mem_mb_max=peak_mib)
    path.write_text(json.dumps({
        "env": {"device": "NVIDIA H100 80GB HBM3", "git_commit": "d559a09"}, "world_size": 2,
        "tokens_per_gpu": 16384, "fsdp_gather_once": gather_once,
        "summary": [dict(line, config="fsdp:adamw", step_ms=step_ms),
                    dict(line, config="fsdp:muon", step_ms=step_ms + 30)]}))
    return path


def test_validation_reads_gather_once_from_the_record(tmp_path):
    fsdp = planner.Layout(kind="fsdp")
    pairs = [("fsdp:muon", "fsdp:adamw", fsdp)]
    each = validate._scale_rows(_scale_record(tmp_path / "each.json", False, 600.0, 23000.0), pairs)
    once = validate._scale_rows(_scale_record(tmp_path / "once.json", True, 400.0, 25000.0), pairs)
    assert all(", fsdp:" in r["what"] for r in each) and all("fsdp gathered once:" in r["what"] for r in once)
    cfg = planner.PlanConfig(model=gpt("1.3b"), gpus=2, tokens_per_gpu=16384, grad_accum=4)
    for rows, flag in ((each, False), (once, True)):
        (mem,) = [r for r in rows if r["what"].endswith("AdamW peak memory per GPU") and r["profile"] == "measured"]
        p = planner.predict(fsdp, dataclasses.replace(cfg, fsdp_gather_once=flag), H100)
        assert mem["predicted"] == pytest.approx(p.adamw_memory.total / 1e9)
    # the per-micro-batch step from the gathered-once run: its measured step, less its modelled communication, plus
    # the per-micro-batch layout's
    (row, *_) = validate._gather_rows(tmp_path / "each.json", tmp_path / "once.json")
    p_each, p_once = (planner.predict(fsdp, dataclasses.replace(cfg, fsdp_gather_once=f), H100) for f in (False, True))
    assert row["measured"] == 600.0 and row["profile"] == "measured"
    assert row["predicted"] == pytest.approx(400.0 + (p_each.adamw_step_s - p_once.adamw_step_s) * 1e3)
    with pytest.raises(ValueError, match="once.json must gather per micro-batch and each.json once per step"):
        validate._gather_rows(tmp_path / "once.json", tmp_path / "each.json")


def test_soap_and_shampoo_scale_rows_take_the_records_hyperparameters():
    """A bench scale record's SOAP and Shampoo lines are predicted with their --opt hyperparameters (TF32
    products, Shampoo's eigenbasis roots), their optimizer step measured as the training step less the other
    phases (it holds the refreshes), and the peak memories of configurations that ran after a layer-wise one
    listed but not counted."""
    rows = validate.validate()["scaling, 2 H100"]
    name = "scale_1.3b_16k_precond_refresh_2xh100.json"
    mine = [r for r in rows if r["source"] == name and r["profile"] == "measured"]
    assert len(mine) == 4 * 5  # layer-wise and FSDP2 SOAP and Shampoo, five rows each
    rec = json.loads((validate.ROOT / "distributed" / name).read_text())
    (line,) = [s for s in rec["summary"] if s["config"] == "fsdp:shampoo"]
    (step,) = [r for r in mine if r["what"].endswith("fsdp gathered once: Shampoo optimizer step, refreshes amortized")]
    assert step["measured"] == pytest.approx(
        line["step_ms"] - sum(line["phases"][p]["device"] for p in ("forward", "backward", "clip")))
    cfg = planner.PlanConfig(model=gpt("1.3b"), gpus=2, tokens_per_gpu=16384, grad_accum=4, optimizer="shampoo",
                             root_method="eigenbasis", matmul_precision="tf32", fsdp_gather_once=True)
    p = planner.predict(planner.Layout(kind="fsdp"), cfg, H100)
    assert step["predicted"] == pytest.approx(p.opt_step_s * 1e3)
    newton = planner.predict(planner.Layout(kind="fsdp"), dataclasses.replace(cfg, root_method="newton"), H100)
    assert newton.opt_step_s > 2 * p.opt_step_s  # Newton's roots cost more than the eigenbasis refresh
    peaks = {r["what"].split(": ", 1)[0].rsplit(", ", 1)[1] + ": " + r["what"].split(": ", 1)[1]: r["excluded"]
             for r in mine if r["unit"] == "GB"}
    # ddp:adamw, then layerwise:soap ran first in the process: their peaks count; every later configuration's held
    # layer-wise SOAP's leftovers
    assert {k for k, why in peaks.items() if why is None} == {"layerwise: SOAP peak memory per GPU",
                                                             "layerwise: AdamW peak memory per GPU"}
    assert sum(why == validate.LEFTOVER_PEAK for why in peaks.values()) == len(peaks) - 2


def test_leftover_peaks_are_those_after_a_layerwise_configuration():
    """In a record from before configurations were released between runs, every configuration whose runs all came
    after a layer-wise one is flagged; none in a record that states what each run found allocated."""
    runs = ["ddp:adamw", "fsdp:adamw", "layerwise:muon", "fsdp:muon", "fsdp:adamw", "ddp:adamw", "layerwise:soap"]
    rec = {"summary": [{"preset": "1.3b", "config": c} for c in runs],
           "per_rank": [[{"config": c}] for c in runs]}
    assert validate._leftover_configs(rec) == {("1.3b", "fsdp:muon"), ("1.3b", "layerwise:soap")}
    for ranks in rec["per_rank"]:
        ranks[0]["held_before_mb"] = 0.0
    assert validate._leftover_configs(rec) == set()


def test_fsdp_muon_owner_pays_its_passes_on_the_gathered_matrices(monkeypatch):
    """ShardedMuon's owner concatenates the gathered rows, reads the norm apart and packs the send buffer
    (:data:`~matrixopt.distributed.cost.SHARDED_OWNER_BYTES` per gathered element), and scales the pieces of the
    split QKV weight (:data:`~matrixopt.distributed.cost.SHARDED_SPLIT_BYTES` per element of those, a quarter of
    GPT-2-medium's matrices): the FSDP Muon step counts them, Shampoo's (another sharded step) does not."""
    cfg = planner.PlanConfig(model=gpt("gpt2-medium"), gpus=2)
    fsdp = planner.Layout(kind="fsdp")
    with_passes = planner.predict(fsdp, cfg, DEVICE_ONLY).opt_step_s
    shampoo = planner.predict(fsdp, dataclasses.replace(cfg, optimizer="shampoo"), DEVICE_ONLY).opt_step_s
    monkeypatch.setattr(planner, "SHARDED_SPLIT_BYTES", 0)
    without_split = planner.predict(fsdp, cfg, DEVICE_ONLY).opt_step_s
    monkeypatch.setattr(planner, "SHARDED_OWNER_BYTES", 0)
    without_passes = planner.predict(fsdp, cfg, DEVICE_ONLY).opt_step_s
    # GPT-2-medium's layers: Q, K and V are 3 of its 12 d x d blocks
    assert with_passes - without_split == pytest.approx(0.25 * 4 / 10 * (without_split - without_passes), rel=0.02)
    assert without_passes < without_split < with_passes
    assert shampoo == planner.predict(fsdp, dataclasses.replace(cfg, optimizer="shampoo"), DEVICE_ONLY).opt_step_s


def test_fsdp_soap_and_shampoo_exchange_rows_blocking_but_soaps_updates_beside_its_refresh():
    """Shampoo's and SOAP's FSDP2 owners gather the gradients, blocking (not hidden behind the owners' work as Muon's
    pipelined all-to-alls are), in fp32, or bf16 for SOAP with bf16 products; the fp32 updates go back blocking
    for Shampoo, and for SOAP beside its refresh, which follows its update: with a refresh every step longer than
    the scatter only the gather is exposed, with one in 10^9 steps the whole scatter."""
    from matrixopt.distributed.cost import collective_time

    model = gpt("gpt2-medium")
    cfg = planner.PlanConfig(model=model, gpus=2, optimizer="soap")
    fsdp = planner.Layout(kind="fsdp")
    shard = sum(m.numel for m in model.matrices()) / 2
    link = H100.link(2, 1, cfg.gpus_per_node)

    def a2a(per_el: int) -> float:
        return collective_time("all_to_all", per_el * shard, 2, link)

    for optimizer, precision, freq, want in (("shampoo", "bf16", 1, a2a(4) + a2a(4)),
                                             ("soap", "fp32", 10**9, a2a(4) + a2a(4)),
                                             ("soap", "bf16", 10**9, a2a(2) + a2a(4)),
                                             ("soap", "fp32", 1, a2a(4)), ("soap", "bf16", 1, a2a(2))):
        c = dataclasses.replace(cfg, optimizer=optimizer, matmul_precision=precision, precondition_frequency=freq)
        assert planner.predict(fsdp, c, H100).opt_comm_s == pytest.approx(want, rel=1e-6), (optimizer, freq)


def test_peak_memory_is_backwards_start_or_the_step_whichever_is_larger():
    """The activations are freed before the optimizer step allocates its Newton–Schulz stacks: the peak is the
    larger of backward's start (activations and the gradients held through forward) and the step (its gradients and
    workspace), both beside the parameters and the state."""
    from matrixopt.distributed.cost import Memory

    m = Memory(params=10.0, grads=1.0, optimizer_state=5.0, buffers=4.0, activations=8.0, step_grads=3.0)
    assert m.total == 10 + 5 + max(1 + 8, 3 + 4)
    assert dataclasses.replace(m, buffers=20.0).total == 10 + 5 + 3 + 20


def test_moe_layerwise_keeps_bf16_casts_of_its_experts_for_backward():
    """Layer-wise with fp32 weights under bf16 autocast keeps each MoE layer's bf16 cast of its expert stacks for
    the grouped GEMM's backward: 2 bytes per expert parameter on the rank; FSDP2 computes on its gathered bf16
    copy, and so does layer-wise with its matrices kept in bf16 (no cast)."""
    model = gpt("moe-2b")
    cfg = planner.PlanConfig(model=model, gpus=2, ep=2, bf16_weights=False)
    lw = planner.predict(planner.Layout(kind="layerwise", ep=2), cfg, H100)
    fsdp = planner.predict(planner.Layout(kind="fsdp", ep=2), cfg, H100)
    experts = sum(m.numel for m in model.matrices() if m.expert) / 2
    assert lw.memory.activations - fsdp.memory.activations == pytest.approx(2 * experts)
    lowered = planner.predict(planner.Layout(kind="layerwise", ep=2), dataclasses.replace(cfg, bf16_weights=True),
                              H100)
    assert lowered.memory.activations == pytest.approx(fsdp.memory.activations)


def test_the_plan_says_when_its_profile_was_timed_in_bursts():
    """A measured profile without ``env.heat_s`` (the shipped H100's) was timed in bursts, at the boost clock: the
    plan's assumptions say so; the H200's, timed after heating each call, and a nominal one do not."""
    cfg = planner.PlanConfig(model=gpt("1.3b"), gpus=8)

    def warns(profile):
        return any("timed in bursts" in a for a in planner.assumptions(cfg, profile))

    h100, h200 = shipped_profile("h100"), shipped_profile("h200")
    assert h200.env["heat_s"] > 0 and not h100.env.get("heat_s")
    assert warns(h100) and not warns(h200)
    assert not warns(dataclasses.replace(h100, source="nominal"))
    assert not warns(dataclasses.replace(h100, env={**h100.env, "heat_s": 0.5}))


def test_a_plan_for_shampoo_or_soap_says_their_host_time_is_not_priced():
    """The host term covers Muon's eager step only; a Shampoo or SOAP plan lists that among its assumptions."""
    def says(optimizer):
        cfg = planner.PlanConfig(model=gpt("1.3b"), gpus=8, optimizer=optimizer)
        return any("host" in a and "not modelled" in a for a in planner.assumptions(cfg, shipped_profile("h200")))

    assert says("soap") and says("shampoo") and not says("muon")


def test_the_plan_names_the_layouts_whose_optimizer_step_the_host_binds():
    """At 64 GPUs an owner's share of the 1.3B takes its host longer to issue than its H100 to run, under TP too
    (each TP rank launches its share's Newton–Schulz); at 8 GPUs the layer-wise and FSDP2 owners' shares keep
    their devices the longer. The printed plan lists exactly the bound ones; a host free of cost binds none."""
    p = planner.plan(planner.PlanConfig(model=gpt("1.3b"), gpus=64), shipped_profile("h100"))
    bound = [q.layout.label for q in p.predictions if planner.HOST_BOUND in q.notes]
    assert {"layerwise", "fsdp", "fsdp tp2 duplicated", "fsdp tp2 distributed"} <= set(bound)
    tp2 = next(q for q in p.predictions if q.layout.label == "fsdp tp2 duplicated")
    assert tp2.opt_step_s > tp2.opt_comm_s  # the host's time, not only communication, sets its step
    line = next(x for x in planner.format_plan(p).splitlines() if x.startswith(planner.HOST_BOUND))
    assert line.split(": ", 1)[1].startswith(", ".join(bound) + ".")
    eight = planner.plan(planner.PlanConfig(model=gpt("1.3b"), gpus=8), shipped_profile("h100"))
    assert not any(planner.HOST_BOUND in q.notes for q in eight.predictions if q.layout.label in ("layerwise", "fsdp"))
    cfg = planner.PlanConfig(model=gpt("1.3b"), gpus=64)
    free = planner.plan(cfg, dataclasses.replace(shipped_profile("h100"), host_launch=0.0))
    assert not any(planner.HOST_BOUND in q.notes for q in free.predictions)
    assert planner.HOST_BOUND not in planner.format_plan(free)

