"""The matrixopt CLI end to end: train, compare, report, bench delegation, and one-line errors for bad input."""

import json
import sys
import types

import numpy as np
import pytest

from matrixopt.cli import main


def run_cli(args, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def expect_error(args, capsys, message: str) -> None:
    code, _, err = run_cli(args, capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line, no traceback
    assert message in lines[0], lines[0]


def test_train_writes_config_metrics_and_checkpoint(tmp_path, tiny, capsys):
    out = tmp_path / "run"
    code, stdout, _ = run_cli(["train", "--optimizer", "muon", "--steps", 6, "--eval-every", 3, "--out", out, *tiny],
                              capsys)
    assert code == 0
    assert "muon: val loss" in stdout
    config = json.loads((out / "config.json").read_text())
    assert config["optim"]["name"] == "muon" and config["steps"] == 6 and config["model"]["n_embd"] == 32
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3, 4, 5, 6]
    assert [m["step"] for m in lines if "val_loss" in m] == [0, 3, 6]
    for m in lines[1:]:
        assert {"step", "loss", "lr", "tokens_per_s", "elapsed_s", "opt_s", "peak_mem_mb"} <= m.keys()
        assert m["tokens_per_s"] > 0 and 0 < m["opt_s"] < m["elapsed_s"]
    assert lines[-1]["val_loss"] < lines[0]["val_loss"]  # it learns something in 6 steps
    assert lines[-1]["lr"] == pytest.approx(1e-4)  # cosine ends at min_lr_ratio * lr
    run = json.loads((out / "run.json").read_text())
    assert run["final_val_loss"] == lines[-1]["val_loss"] and 0 < run["opt_share"] < 1
    assert (out / "ckpt.pt").is_file()


def test_train_with_token_file_and_config_file(tmp_path, tiny, capsys):
    tokens = tmp_path / "train.bin"
    (np.arange(3000) % 97).astype("<u2").tofile(tokens)
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"data": {"data": str(tokens), "vocab_size": 100}, "optim": {"lr": 3e-3}}))
    code, _, err = run_cli(["train", "--config", config, "--steps", 2, "--out", tmp_path / "o", *tiny], capsys)
    assert code == 0, err
    saved = json.loads((tmp_path / "o" / "config.json").read_text())
    assert saved["data"]["vocab_size"] == 100 and saved["optim"]["lr"] == 3e-3


def test_compare_writes_summary_report_and_plots(tmp_path, tiny, capsys):
    out = tmp_path / "cmp"
    code, stdout, err = run_cli(["compare", "--optimizers", "adamw,muon", "--lr", "adamw=2e-3,muon=4e-3",
                                 "--steps", 6, "--eval-every", 2, "--out", out, *tiny], capsys)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    adamw = [json.loads(line) for line in (out / "adamw" / "metrics.jsonl").read_text().splitlines()]
    muon = [json.loads(line) for line in (out / "muon" / "metrics.jsonl").read_text().splitlines()]
    assert summary["target_val_loss"] == adamw[-1]["val_loss"]
    assert list(summary["optimizers"]) == ["adamw", "muon"]
    for name, metrics in (("adamw", adamw), ("muon", muon)):
        row = summary["optimizers"][name]
        hit = next((m for m in metrics if m.get("val_loss", 9e9) <= summary["target_val_loss"]), None)
        assert row["steps_to_target"] == (hit and hit["step"])
        assert row["seconds_to_target"] == (hit and round(hit["elapsed_s"], 2))
        assert row["final_val_loss"] == metrics[-1]["val_loss"]
        assert {"tokens_per_s", "peak_mem_mb", "lr", "opt_share"} <= row.keys()
    assert summary["optimizers"]["muon"]["lr"] == 4e-3
    report = (out / "report.md").read_text()
    assert "| adamw | 0.002 |" in report and "| muon | 0.004 |" in report
    assert "<table>" in (out / "report.html").read_text()
    for png in ("loss_vs_steps.png", "loss_vs_seconds.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "expert_load.png").exists()  # a dense model logs no routing
    assert "report.md" in stdout

    # `report DIR` rebuilds everything from the metrics alone.
    for name in ("summary.json", "report.md", "report.html", "loss_vs_steps.png"):
        (out / name).unlink()
    code, _, _ = run_cli(["report", out], capsys)
    assert code == 0
    assert json.loads((out / "summary.json").read_text()) == summary
    assert (out / "report.md").read_text() == report and (out / "loss_vs_steps.png").is_file()


def test_compare_of_a_mixture_of_experts_plots_the_expert_load(tmp_path, capsys):
    out = tmp_path / "cmp"
    code, _, err = run_cli(["compare", "--model", "moe-tiny", "--optimizers", "adamw,muon", "--steps", 4,
                            "--batch-size", 4, "--eval-every", 2, "--eval-iters", 1, "--log-every", 1,
                            "--threads", 1, "--no-progress", "--out", out], capsys)
    assert code == 0, err
    assert (out / "expert_load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![expert_load.png](expert_load.png)" in (out / "report.md").read_text()


def test_not_reached_is_reported(tmp_path, tiny, capsys):
    out = tmp_path / "cmp"
    # A tiny lr cannot reach AdamW's loss in 4 steps.
    code, _, _ = run_cli(["compare", "--optimizers", "adamw,muon", "--lr", "adamw=3e-3,muon=1e-6", "--steps", 4,
                          "--eval-every", 2, "--out", out, *tiny], capsys)
    assert code == 0
    row = json.loads((out / "summary.json").read_text())["optimizers"]["muon"]
    assert row["steps_to_target"] is None and row["seconds_to_target"] is None
    assert "| muon | 1e-06 |" in (out / "report.md").read_text()
    assert "not reached" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--optimizer", "adamm"], "unknown optimizer 'adamm'; choose from adamuon, adamw"),
        (["compare", "--optimizers", "adamw,sgd"], "unknown optimizer 'sgd'"),
        (["train", "--model", "gpt5"], "unknown model preset 'gpt5'; choose one of tiny-cpu"),
        (["train", "--stpes", "3"], "unrecognized arguments: --stpes 3 (did you mean --steps?)"),
        (["train", "--steps", "0"], "steps must be a positive integer, got 0"),
        (["train", "--lr", "-1"], "lr must be positive, got -1.0"),
        (["train", "--data", "/nonexistent/input.txt"], "data path /nonexistent/input.txt does not exist"),
        (["train", "--device", "tpu"], "device must be one of auto, cpu, cuda"),
        (["train", "--opt", "momentum"], "--opt 'momentum' is not KEY=VALUE"),
        (["train", "--optimizer", "muon", "--opt", "momentumm=0.9"], "rejected its hyperparameters"),
        (["compare", "--lr", "sgd=1e-3"], "names optimizer 'sgd', which is not in --optimizers adamw,muon"),
        (["report", "/nonexistent/dir"], "report folder /nonexistent/dir does not exist"),
        (["train", "--fsdp-gather-once"], "--fsdp-gather-once) is FSDP2's; --parallel none does not shard them"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(tmp_path, tiny, capsys, args, message):
    expect_error([*args, *(["--out", tmp_path / "o", *tiny] if args[0] != "report" else [])], capsys, message)


@pytest.mark.parametrize("flag, field", [("--shared-expert", "model.shared_expert"), ("--bias", "model.bias"),
                                         ("--untied", "model.tie_embeddings"),
                                         ("--fsdp-gather-once", "fsdp_gather_once")])
def test_switches_reach_the_config(flag, field):
    """Every on/off flag sets its config field, hyphenated names included."""
    from matrixopt.cli import build_parser, run_config

    cfg = run_config(build_parser().parse_args(["train", "--model", "moe-tiny", "--parallel", "fsdp", flag]))
    obj = cfg
    for part in field.split("."):
        obj = getattr(obj, part)
    assert obj is (flag != "--untied")


def test_bad_data_files_exit_2(tmp_path, tiny, capsys):
    (tmp_path / "empty.txt").write_text("")
    expect_error(["train", "--data", tmp_path / "empty.txt", "--out", tmp_path / "o", *tiny], capsys, "holds no text")
    np.array([5, 70000 % 65536, 50300], dtype="<u2").tofile(tmp_path / "ids.bin")
    expect_error(["train", "--data", tmp_path / "ids.bin", "--out", tmp_path / "o", *tiny], capsys,
                 "holds id 50300, beyond the vocab of 50257 ids")
    np.arange(10, dtype="<u2").tofile(tmp_path / "short.bin")
    expect_error(["train", "--data", tmp_path / "short.bin", "--out", tmp_path / "o", *tiny], capsys,
                 "has 9 tokens, too few for context 16")


def test_config_file_typo_exit_2(tmp_path, tiny, capsys):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"optim": {"lrr": 0.1}}))
    expect_error(["train", "--config", config, "--out", tmp_path / "o", *tiny], capsys,
                 "unknown key 'lrr' in " + str(config) + ".optim; did you mean 'lr'?")
    config.write_text(json.dumps({"stpes": 10}))
    expect_error(["train", "--config", config, *tiny], capsys, "unknown key 'stpes'")
    config.write_text("{not json")
    expect_error(["train", "--config", config, *tiny], capsys, "is not valid JSON")


def test_out_dir_holding_a_different_run_exit_2(tmp_path, tiny, capsys):
    out = tmp_path / "o"
    assert run_cli(["train", "--steps", 2, "--out", out, *tiny], capsys)[0] == 0
    expect_error(["train", "--steps", 3, "--out", out, *tiny], capsys,
                 f"out dir {out} holds a different run (steps: 2 -> 3)")
    expect_error(["train", "--steps", 2, "--out", out, *tiny], capsys, "pass --resume to continue it or --overwrite")
    assert run_cli(["train", "--steps", 3, "--out", out, "--overwrite", *tiny], capsys)[0] == 0
    assert json.loads((out / "config.json").read_text())["steps"] == 3


def test_bench_is_delegated(monkeypatch, capsys):
    fake = types.ModuleType("matrixopt.bench.cli")
    fake.add_arguments = lambda p: p.add_argument("--size", type=int, required=True)
    fake.run = lambda args: 7 if args.size == 3 else 1
    monkeypatch.setitem(sys.modules, "matrixopt.bench.cli", fake)
    assert main(["bench", "--size", "3"]) == 7
    assert main(["bench"]) == 2  # its own argparse error


def test_bench_bad_input_exit_2_with_one_line(capsys):
    expect_error(["bench", "scale", "--presets", "tiny-cpu", "--iters", "0", "--configs", "ddp:adamw"], capsys,
                 "matrixopt bench: error: --iters must be >= 2")
    expect_error(["bench", "scale", "--presets", "tiny-cpu", "--configs", "ddp:adamw"], capsys,
                 "launch it with `torchrun --nproc-per-node N")


def test_bench_missing_exit_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matrixopt.bench.cli", None)  # makes the import fail
    expect_error(["bench", "ns"], capsys, "the benchmark CLI is unavailable")
