"""A run's folder: which run it holds, whether to resume it, and its metrics.

A folder holds one run: ``config.json`` (the config), ``metrics.jsonl``, ``run.json`` and the checkpoint
(``ckpt.pt``, or the folder ``ckpt/`` where the ranks shard the state). :func:`prepare_out_dir` refuses a folder
that holds a different run, and one that holds this run's checkpoint unless asked to resume or overwrite.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from matrixopt.distributed.checkpoint import recover_folder
from matrixopt.train.config import TrainConfig, from_dict

# Config fields a run may change between resumes: no effect on results (tp, ep: as the number of ranks, the same
# losses within fp32 reduction order; checkpoints hold the fused QKV rows and whole expert stacks in
# single-process order; optim.offload: where the state lives, the same steps bit for bit; fsdp_gather_once: when
# FSDP2 gathers parameters, the same steps).
FREE_TO_CHANGE = ("ckpt_every", "threads", "tp", "ep", "optim.offload", "fsdp_gather_once")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and k != "hparams":
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def prepare_out_dir(out: Path, cfg: TrainConfig, ckpt_name: str, *, resume: bool, overwrite: bool) -> bool:
    """Check ``out`` against ``cfg`` and write config.json. Returns whether to resume from the checkpoint
    ``out / ckpt_name``."""
    out.mkdir(parents=True, exist_ok=True)
    config_path, ckpt = out / "config.json", out / ckpt_name
    recover_folder(ckpt)
    new = json.loads(json.dumps(cfg.to_dict()))
    if config_path.exists() and not overwrite:
        try:
            old = json.loads(config_path.read_text())
        except json.JSONDecodeError:
            raise ValueError(f"{config_path} is not valid JSON; pass --overwrite to start a new run in {out}") from None
        try:  # a run saved before a config field existed holds that field's default
            old = json.loads(json.dumps(from_dict(TrainConfig, old, where=str(config_path)).to_dict()))
        except (ValueError, TypeError):
            pass  # not a config this version can read: compare it as it is
        a, b = _flat(old), _flat(new)
        changed = [k for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k) and k not in FREE_TO_CHANGE]
        if changed:
            diff = ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in changed)
            raise ValueError(
                f"out dir {out} holds a different run ({diff}); choose another --out, or pass --overwrite to "
                f"replace it"
            )
        if ckpt.exists() and not resume:
            raise ValueError(
                f"out dir {out} already holds this run with a checkpoint; pass --resume to continue it or "
                f"--overwrite to start over"
            )
    if overwrite or not config_path.exists():
        for name in ("metrics.jsonl", "run.json", "ckpt.pt", "ckpt.pt.tmp"):
            (out / name).unlink(missing_ok=True)
        for name in ("ckpt", "ckpt.tmp", "ckpt.old"):
            shutil.rmtree(out / name, ignore_errors=True)
    config_path.write_text(json.dumps(new, indent=2) + "\n")
    return resume and ckpt.exists()


def finished_run(out: Path, steps: int) -> dict | None:
    """run.json of ``out`` if it records all ``steps`` steps of this (already checked) run, else None."""
    try:
        run = json.loads((out / "run.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return run if isinstance(run, dict) and run.get("steps") == steps else None


def read_metrics(path: Path) -> list[dict]:
    """The metrics lines of ``path`` (a metrics.jsonl), in order."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(path: Path, step: int) -> float:
    """Drop the lines of ``path`` logged after ``step`` (a resumed checkpoint's); returns the last val loss kept
    (nan if none)."""
    kept = [m for m in read_metrics(path) if m["step"] <= step]
    path.write_text("".join(json.dumps(m) + "\n" for m in kept))
    return next((m["val_loss"] for m in reversed(kept) if "val_loss" in m), float("nan"))
