"""`matrixopt sweep` and `matrixopt compare-sweeps` end to end at toy size."""

import json

from matrixopt.cli import main

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--steps", "6", "--eval-every", "3", "--eval-iters", "2", "--log-every", "3", "--no-progress"]


def test_sweep_then_compare_best(tmp_path):
    for opt, lrs in (("adamw", "1e-4,3e-3,1e-2"), ("muon", "3e-3,1e-2")):
        assert main(["sweep", "--optimizer", opt, "--lrs", lrs, "--out", str(tmp_path / opt), *TINY]) == 0
    s = json.loads((tmp_path / "adamw" / "sweep.json").read_text())
    assert [p["lr"] for p in s["points"]] == [1e-4, 3e-3, 1e-2]
    best = min(s["points"], key=lambda p: p["final_val_loss"])
    assert s["best"] == best
    assert s["best_lr_at_edge"] == (best["lr"] in (1e-4, 1e-2))
    for p in s["points"]:  # each point is a real run whose metrics end with its final val loss
        lines = (tmp_path / "adamw" / p["dir"] / "metrics.jsonl").read_text().splitlines()
        assert json.loads(lines[-1])["val_loss"] == p["final_val_loss"]
    assert (tmp_path / "adamw" / "sweep.png").stat().st_size > 0

    sweeps = [str(tmp_path / "adamw"), str(tmp_path / "muon")]
    assert main(["compare-sweeps", *sweeps, "--out", str(tmp_path / "cmp")]) == 0
    summary = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert summary["optimizers"]["adamw"]["lr"] == best["lr"]
    assert summary["target_val_loss"] == best["final_val_loss"]
    assert set(summary["sweeps"]) == {"adamw", "muon"}
    assert "Learning-rate sweeps" in (tmp_path / "cmp" / "report.md").read_text()


def test_sweep_bad_grid(tmp_path, capsys):
    assert main(["sweep", "--optimizer", "muon", "--lrs", "1e-3", "--out", str(tmp_path / "s"), *TINY]) == 2
    assert "at least 2 learning rates" in capsys.readouterr().err
    assert main(["sweep", "--optimizer", "muon", "--lrs", "1e-3,abc", "--out", str(tmp_path / "s"), *TINY]) == 2


def test_resume_of_a_run_saved_before_a_config_field_existed(tmp_path):
    """A field added to TrainConfig later (with a default) must not make an older run folder 'a different run'."""
    out = tmp_path / "run"
    assert main(["train", "--optimizer", "muon", "--out", str(out), *TINY]) == 0
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("parallel")  # as written before `parallel` existed
    (out / "config.json").write_text(json.dumps(cfg))
    assert main(["train", "--optimizer", "muon", "--out", str(out), "--resume", *TINY]) == 0
    cfg["steps"] = 7  # a real difference is still refused
    (out / "config.json").write_text(json.dumps(cfg))
    assert main(["train", "--optimizer", "muon", "--out", str(out), "--resume", *TINY]) == 2


def test_report_target_best_uses_the_baselines_lowest_val_loss(tmp_path):
    out = tmp_path / "cmp"
    assert main(["compare", "--optimizers", "adamw,muon", "--out", str(out), *TINY]) == 0
    adamw = [json.loads(line) for line in (out / "adamw" / "metrics.jsonl").read_text().splitlines()]
    vals = [m["val_loss"] for m in adamw if m.get("val_loss") is not None]
    assert main(["report", str(out), "--target", "best"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["target"] == "best" and summary["target_val_loss"] == min(vals)
    first = next(m["step"] for m in adamw if m.get("val_loss") is not None and m["val_loss"] <= min(vals))
    assert summary["optimizers"]["adamw"]["steps_to_target"] == first
    assert main(["report", str(out), "--target", "median"]) == 2


def test_resumed_sweep_keeps_points_whose_checkpoints_are_gone(tmp_path):
    """Results kept without checkpoints (as in docs/results): a resumed sweep reuses finished points, trains
    only the new lr, and lists all of them."""
    out = tmp_path / "s"
    assert main(["sweep", "--optimizer", "adamw", "--lrs", "1e-3,3e-3", "--out", str(out), *TINY]) == 0
    for ck in out.glob("*/ckpt.pt"):
        ck.unlink()
    kept = {p: (p / "metrics.jsonl").read_text() for p in out.glob("lr=*")}
    assert main(["sweep", "--optimizer", "adamw", "--lrs", "1e-3,3e-3,1e-2", "--out", str(out), "--resume",
                 *TINY]) == 0
    assert {p: (p / "metrics.jsonl").read_text() for p in kept} == kept  # not retrained
    s = json.loads((out / "sweep.json").read_text())
    assert [p["lr"] for p in s["points"]] == [1e-3, 3e-3, 1e-2]
    assert not (out / "lr=0.001,wd=0.1" / "ckpt.pt").exists()
