"""Checkpoints: resume reproduces an uninterrupted run exactly (CPU), Ctrl-C saves one, a kill during a save
leaves the previous one loadable, and a damaged one is detected and named."""

import gc
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import matrixopt.train.trainer as trainer
from matrixopt.cli import main
from matrixopt.distributed.checkpoint import CheckpointError, load_checkpoint
from matrixopt.train.model import GPT

ROOT = Path(__file__).resolve().parents[2]
DETERMINISTIC = ("step", "loss", "lr", "val_loss")  # timing fields differ between runs


def metrics(out: Path) -> list[dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: m[k] for k in DETERMINISTIC if k in m} for m in lines]


def args(out: Path, tiny: list[str], *extra) -> list[str]:
    # Dropout > 0 so the restored RNG state matters; Muon so the optimizer state (momentum) matters.
    return ["train", "--optimizer", "muon", "--steps", "8", "--eval-every", "3", "--dropout", "0.1",
            "--out", str(out), *tiny, *extra]  # fmt: skip


@pytest.fixture
def uninterrupted(tmp_path_factory, tiny):
    out = tmp_path_factory.mktemp("full")
    assert main(args(out, tiny)) == 0
    return metrics(out)


def test_ctrl_c_saves_and_resume_matches_uninterrupted(tmp_path, tiny, monkeypatch, capsys, uninterrupted):
    real_batch = trainer.train_batch
    frozen = []  # objects the garbage collector passes over, seen by each batch of the loop

    def batch_then_ctrl_c(tokens, batch_size, block_size, seed, step, micro):
        frozen.append(gc.get_freeze_count())
        if step == 4 and micro == 0:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of step 5
        return real_batch(tokens, batch_size, block_size, seed, step, micro)

    monkeypatch.setattr(trainer, "train_batch", batch_then_ctrl_c)
    assert main(args(tmp_path, tiny)) == 130
    err = capsys.readouterr().err
    assert "interrupted at step 5" in err and "rerun with --resume" in err
    assert load_checkpoint(tmp_path / "ckpt.pt")["step"] == 5  # the step in flight finished first
    assert [m["step"] for m in metrics(tmp_path)] == [0, 1, 2, 3, 4, 5]
    assert min(frozen) > 0 and gc.get_freeze_count() == 0  # the loop ran with its setup frozen, an interrupt thaws it

    monkeypatch.setattr(trainer, "train_batch", real_batch)
    assert main(args(tmp_path, tiny, "--resume")) == 0
    assert metrics(tmp_path) == uninterrupted  # bitwise: same losses, lrs and val losses


KILL_DURING_SECOND_SAVE = """
import os, signal, sys
real_fsync, calls = os.fsync, []
def fsync_then_die(fd):
    calls.append(fd)
    if len(calls) == 2:  # the second checkpoint: its temp file is written, the rename has not happened
        os.kill(os.getpid(), signal.SIGKILL)
    real_fsync(fd)
os.fsync = fsync_then_die
from matrixopt.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_kill_during_save_leaves_previous_checkpoint(tmp_path, tiny, uninterrupted):
    cmd = [sys.executable, "-c", KILL_DURING_SECOND_SAVE, *args(tmp_path, tiny, "--ckpt-every", "2")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (tmp_path / "ckpt.pt.tmp").is_file()  # the interrupted write
    assert load_checkpoint(tmp_path / "ckpt.pt")["step"] == 2  # the previous checkpoint is intact
    # Resuming drops the metrics logged after step 2 and reproduces the uninterrupted run.
    assert main(args(tmp_path, tiny, "--resume")) == 0
    assert metrics(tmp_path) == uninterrupted


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_damaged_checkpoint_is_detected_and_named(tmp_path, tiny, capsys, damage):
    assert main(args(tmp_path, tiny)) == 0
    ckpt = tmp_path / "ckpt.pt"
    raw = bytearray(ckpt.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip":
        raw[len(raw) // 2] ^= 0xFF
    else:
        raw = bytearray()
    ckpt.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"checkpoint {ckpt} is truncated"):
        load_checkpoint(ckpt)
    capsys.readouterr()
    assert main(args(tmp_path, tiny, "--resume")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(ckpt) in err and "delete" in err


def test_nonfinite_loss_stops_before_it_reaches_a_checkpoint(tmp_path, tiny, monkeypatch, capsys):
    """The host reads the losses only where it logs, evaluates or checkpoints: a NaN loss at step 3 (AdamW does
    not check gradients) is caught at the step-4 checkpoint, before it is written; step 2's stays."""
    real_forward, calls = GPT.forward, []

    def nan_at_step_3(self, idx, targets=None):
        logits, loss = real_forward(self, idx, targets)
        if torch.is_grad_enabled():  # training, not evaluation
            calls.append(1)
            if len(calls) == 3:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", nan_at_step_3)
    cmd = ["train", "--optimizer", "adamw", "--steps", "8", "--eval-every", "100", "--ckpt-every", "2",
           "--out", str(tmp_path), *tiny, "--log-every", "10"]  # fmt: skip
    assert main(cmd) == 2
    assert "train loss is nan by step 4" in capsys.readouterr().err
    assert load_checkpoint(tmp_path / "ckpt.pt")["step"] == 2
