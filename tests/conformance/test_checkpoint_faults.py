"""(4) Checkpoint faults through the trainer (matrixopt.train.trainer.train, the entry point behind
``matrixopt train --out DIR [--resume]``): a SIGKILL while writing a checkpoint leaves the previous one loadable,
a truncated or corrupted checkpoint is detected and named, and resuming reproduces the uninterrupted run's losses
exactly on CPU, for every registered optimizer."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from matrixopt.distributed import checkpoint
from matrixopt.distributed.checkpoint import CheckpointError, load_checkpoint
from matrixopt.train.config import ModelConfig, OptimConfig, ScheduleConfig, TrainConfig
from matrixopt.train.rundir import read_metrics
from matrixopt.train.trainer import train

from .common import NAMES, child_env

CHILD = Path(__file__).with_name("_ckpt_child.py")


def tiny_cfg(name: str = "muon", **kw) -> TrainConfig:
    """A one-layer GPT on the built-in Shakespeare, a few steps, a checkpoint every 2 steps."""
    return TrainConfig(model=ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16),
                       optim=OptimConfig(name=name, lr=3e-3), schedule=ScheduleConfig(warmup_steps=2),
                       **(dict(steps=6, batch_size=2, eval_every=3, eval_iters=1, log_every=1, ckpt_every=2,
                               device="cpu", threads=1) | kw))


def losses(out: Path) -> list[tuple]:
    """What must be reproduced exactly: per logged step, the train loss, the lr and the val loss."""
    return [(m["step"], m["loss"], m["lr"], m.get("val_loss")) for m in read_metrics(out / "metrics.jsonl")]


class Crash(Exception):
    pass


@pytest.mark.parametrize("name", NAMES)
def test_resume_reproduces_the_uninterrupted_losses_exactly(name, tmp_path, monkeypatch):
    cfg = tiny_cfg(name)
    train(cfg, tmp_path / "whole", progress=False)
    real_save = checkpoint.save_checkpoint

    def save_then_crash(path, payload):
        real_save(path, payload)
        if payload["step"] == 4:  # the process dies right after its second checkpoint
            raise Crash

    monkeypatch.setattr(checkpoint, "save_checkpoint", save_then_crash)
    with pytest.raises(Crash):
        train(cfg, tmp_path / "cut", progress=False)
    monkeypatch.setattr(checkpoint, "save_checkpoint", real_save)
    train(cfg, tmp_path / "cut", resume=True, progress=False)
    assert losses(tmp_path / "cut") == losses(tmp_path / "whole")
    assert len(losses(tmp_path / "whole")) == cfg.steps + 1  # step 0's evaluation, then every step


@pytest.mark.parametrize("where", ["open", "fsync"])
def test_sigkill_while_writing_a_checkpoint_leaves_the_previous_one(where, tmp_path):
    cfg = tiny_cfg()
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(CHILD), json.dumps(cfg.to_dict()), str(out), "3", where],
                          capture_output=True, text=True, timeout=240, env=child_env())
    assert proc.returncode == -9, proc.stderr[-2000:]  # SIGKILL, inside the third checkpoint write
    assert load_checkpoint(out / "ckpt.pt")["step"] == 4  # the second checkpoint, whole
    train(cfg, out, resume=True, progress=False)  # a leftover ckpt.pt.tmp does not get in the way
    train(cfg, tmp_path / "whole", progress=False)
    assert losses(out) == losses(tmp_path / "whole")


def _truncate(raw: bytes) -> bytes:
    return raw[: len(raw) // 2]


def _flip(raw: bytes) -> bytes:
    i = len(raw) * 2 // 3
    return raw[:i] + bytes([raw[i] ^ 0x01]) + raw[i + 1:]


@pytest.mark.parametrize("damage", [_truncate, _flip, lambda raw: b"", lambda raw: raw[:20]],
                         ids=["truncated", "one_bit_flipped", "empty", "header_only"])
def test_damaged_checkpoint_is_detected_and_named(damage, tmp_path):
    cfg = tiny_cfg(steps=2)
    train(cfg, tmp_path, progress=False)
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(damage(ckpt.read_bytes()))
    with pytest.raises(CheckpointError, match=str(ckpt).replace("\\", "\\\\")):
        train(cfg, tmp_path, resume=True, progress=False)
