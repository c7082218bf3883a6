"""Data-parallel and tensor-parallel training (CPU, gloo, launched by torchrun): the same flags on 1 process and
on 2 ranks log the same losses and val losses, under layerwise (Muon), DDP (AdamW) and FSDP2 (Muon); so do TP 2
alone and TP 2 x DP 2 (AdamW; Muon in the duplicated and distributed modes); an interrupted layer-wise, FSDP or
TP run resumes to the uninterrupted losses (layer-wise at another world size)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from matrixopt.cli import main
from matrixopt.distributed import FSDP
from matrixopt.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("step", "loss", "lr", "val_loss")
# 2 ranks sum gradients and losses in another order than one process (gloo reduce, per-rank means); the
# differences measured over these few steps are about 1e-7 relative (fp32 rounding).
RTOL = 1e-4
# Under TP, AdamW sees the same gradients up to the order of fp32 sums (row-parallel all-reduce): measured <= 1e-7.
# Muon's TP Newton–Schulz computes the same polar factor in another fp32 order (all-gather, or a Gram all-reduce).
TP_RTOL = {"adamw": 1e-5, "muon": 1e-4, "normuon": 1e-4}
# Two micro-batches per step (no_sync on the first), clipping at 1.0 (the default), two evaluations.
FLAGS = [
    "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "4",
    "--grad-accum", "2", "--steps", "4", "--eval-every", "2", "--eval-iters", "2", "--warmup", "2",
    "--log-every", "1", "--threads", "1", "--no-progress",
]  # fmt: skip
LR = {"muon": "0.01", "adamw": "0.003", "normuon": "0.01"}

# Ctrl-C in rank 0 only, during step 2: the ranks agree to stop after it, checkpoint and exit 130.
CTRL_C_ON_RANK_0 = """
import os, signal, sys
import matrixopt.train.trainer as trainer
real = trainer.train_batch
def batch(tokens, batch_size, block_size, seed, step, micro):
    if step == 1 and micro == 0 and os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGINT)
    return real(tokens, batch_size, block_size, seed, step, micro)
trainer.train_batch = batch
from matrixopt.cli import main
sys.exit(main(sys.argv[1:]))
"""


def metrics(out: Path) -> list[dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: m[k] for k in FIELDS if k in m} for m in lines]


def assert_same_losses(got: list[dict], want: list[dict], rtol: float = RTOL) -> None:
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for g, w in zip(got, want):
        assert g.keys() == w.keys(), (g, w)
        for k in ("loss", "val_loss"):
            if w.get(k) is not None:
                np.testing.assert_allclose(g[k], w[k], rtol=rtol, err_msg=f"{k} at step {w['step']}")


def train_args(optimizer: str, out: Path, *extra: str) -> list[str]:
    return ["train", "--optimizer", optimizer, "--lr", LR[optimizer], "--out", str(out), *FLAGS, *extra]


def torchrun(ranks: int, args: list[str], script: Path | None = None) -> subprocess.CompletedProcess:
    target = [str(script)] if script else ["-m", "matrixopt"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           *target, *args]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One-process runs (parallel none), by optimizer."""
    runs = {}
    for optimizer in LR:
        out = tmp_path_factory.mktemp(f"single-{optimizer}")
        assert main(train_args(optimizer, out)) == 0
        runs[optimizer] = metrics(out)
    return runs


@pytest.mark.parametrize("parallel, optimizer", [("layerwise", "muon"), ("ddp", "adamw"), ("fsdp", "muon"),
                                                 ("fsdp", "normuon")])
def test_two_ranks_log_single_process_losses(tmp_path, single, parallel, optimizer):
    proc = torchrun(2, train_args(optimizer, tmp_path, "--parallel", parallel))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("val loss") == 1  # rank 0 alone prints
    assert_same_losses(metrics(tmp_path), single[optimizer])
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["parallel"] == parallel and run["world_size"] == 2
    assert (tmp_path / ("ckpt.pt" if parallel == "ddp" else "ckpt")).exists()


@pytest.mark.parametrize("ranks, optimizer, tp_mode", [
    (2, "adamw", None), (4, "adamw", None), (2, "muon", "duplicated"), (2, "muon", "distributed"),
    (2, "normuon", "distributed"),
])  # fmt: skip
def test_tensor_parallel_logs_single_process_losses(tmp_path, single, ranks, optimizer, tp_mode):
    mode = ["--tp-mode", tp_mode] if tp_mode else []
    proc = torchrun(ranks, train_args(optimizer, tmp_path, "--parallel", "fsdp", "--tp", "2", *mode))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_losses(metrics(tmp_path), single[optimizer], TP_RTOL[optimizer])
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["tp"] == 2 and run["world_size"] == ranks


def test_tensor_parallel_with_biases_logs_single_process_losses(tmp_path):
    """Linear biases follow their weights' TP layout (the QKV bias rank-major, as its weight)."""
    assert main(train_args("muon", tmp_path / "single", "--bias")) == 0
    proc = torchrun(2, train_args("muon", tmp_path / "tp", "--bias", "--parallel", "fsdp", "--tp", "2",
                                  "--tp-mode", "distributed"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_losses(metrics(tmp_path / "tp"), metrics(tmp_path / "single"), TP_RTOL["muon"])


def test_blockwise_tensor_parallel_muon_trains(tmp_path, single):
    """Blockwise orthogonalizes each TP shard on its own: a different update by design, so other losses."""
    proc = torchrun(2, train_args("muon", tmp_path, "--parallel", "fsdp", "--tp", "2", "--tp-mode", "blockwise"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = metrics(tmp_path), single["muon"]
    assert got[-1]["val_loss"] < got[0]["val_loss"] - 0.2
    assert got[-1]["loss"] != pytest.approx(want[-1]["loss"], rel=1e-4)


@pytest.mark.parametrize("parallel, resume_ranks, tp, resume_tp, optimizer", [
    ("layerwise", 1, "1", "1", "muon"), ("fsdp", 2, "1", "1", "muon"), ("fsdp", 2, "2", "2", "muon"),
    ("fsdp", 2, "2", "1", "muon"), ("fsdp", 2, "1", "2", "muon"), ("fsdp", 1, "1", "1", "normuon"),
])  # fmt: skip
def test_interrupted_run_resumes_to_uninterrupted_losses(tmp_path, single, parallel, resume_ranks, tp, resume_tp,
                                                         optimizer):
    """Also across TP sizes: checkpoints hold the fused QKV rows (and their momentum) in single-process order; and
    NorMuon's row-sharded second moments resume at one rank."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_ON_RANK_0)
    out = tmp_path / "run"
    args = train_args(optimizer, out, "--parallel", parallel)
    proc = torchrun(2, [*args, "--tp", tp], script)
    assert proc.returncode != 0 and "interrupted at step 2" in proc.stderr, proc.stderr[-3000:]
    assert [m["step"] for m in metrics(out)] == [0, 1, 2]
    assert (out / "ckpt" / ".metadata").is_file() and not (out / "ckpt.tmp").exists()

    proc = torchrun(resume_ranks, [*args, "--tp", resume_tp, "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_losses(metrics(out), single[optimizer])


@pytest.mark.parametrize("flags, message", [
    (["--tp", "2"], "tp=2 needs --parallel fsdp"),
    (["--tp", "2", "--parallel", "ddp"], "tp=2 needs --parallel fsdp (tensor parallelism runs under FSDP2"),
    (["--tp", "4", "--parallel", "fsdp"], "tp=4 must divide the model's n_head=2"),
    (["--tp-mode", "distributed", "--parallel", "fsdp"], "has tp=1; use it with --tp N (N > 1)"),
])  # fmt: skip
def test_bad_tensor_parallel_settings_say_what_to_do(tmp_path, capsys, flags, message):
    assert main(train_args("muon", tmp_path, *flags)) == 2
    assert message in capsys.readouterr().err


def test_tp_must_divide_the_ranks():
    cfg = TrainConfig(parallel="fsdp", tp=2)
    with pytest.raises(ValueError, match=r"--tp 2 must divide the number of ranks, 3; launch a multiple of 2"):
        FSDP.mesh_dims(3, tp=cfg.tp)


def test_parallel_without_torchrun_says_how_to_launch(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert main(train_args("muon", tmp_path, "--parallel", "layerwise")) == 2
    assert "launch it with `torchrun --nproc-per-node N -m matrixopt train" in capsys.readouterr().err
