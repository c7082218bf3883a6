"""The training loop: one run of one optimizer, from a TrainConfig to a folder of results.

``train(cfg, out)`` writes

* ``out/config.json``: the config (a folder that holds a different run is refused);
* ``out/metrics.jsonl``: one JSON object per logged step with ``step`` (optimizer steps done), ``loss`` (mean
  train loss since the previous line), ``lr`` (the peak lr times the schedule), ``tokens_per_s`` (since the
  previous line), ``elapsed_s`` (training seconds so far; evaluation and checkpointing excluded),
  ``opt_s`` (of which inside ``optimizer.step()``), ``peak_mem_mb``, and ``val_loss`` on evaluation steps
  (step 0, every ``eval_every`` steps, and the last step);
* ``out/run.json``: facts about the run (parameters, optimizer state size, device, versions) and its result;
* ``out/ckpt.pt``: model, optimizer, step, timers and RNG state, written atomically at ``ckpt_every``, at the
  end and on Ctrl-C. ``train(cfg, out, resume=True)`` continues from it and logs exactly what an
  uninterrupted run would (on CPU; bitwise up to nondeterministic kernels elsewhere).

The loop per step: set each group's lr to its initial lr times the schedule, accumulate ``grad_accum``
micro-batch gradients (bf16 autocast on CUDA), clip, step, log, evaluate, checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import json
import math
import os
import platform
import resource
import signal
import threading
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from matrixopt.train.config import TrainConfig, lr_multiplier
from matrixopt.train.data import Dataset, load_dataset, train_batch, val_offsets, windows
from matrixopt.train.model import GPT

CKPT_MAGIC = b"MXOPTCK1"  # 8 bytes, then the sha256 (32 bytes) of the torch.save payload, then the payload
FREE_TO_CHANGE = ("ckpt_every", "threads")  # config fields a run may change between resumes: no effect on results
QKV_SPLITS = {r"attn\.c_attn\.weight$": 3}  # orthogonalize the fused (3d, d) QKV weight as Q, K, V


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used (truncated, corrupt, or from another run)."""


# ----------------------------------------------------------------------------------------------------------
# checkpoints


def save_checkpoint(path: Path, payload: dict) -> None:
    """Write ``payload`` atomically: to ``path.tmp``, fsync, then ``os.replace`` onto ``path``. A crash at any
    point leaves either the previous checkpoint or the new one at ``path``, never a mix."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(CKPT_MAGIC + hashlib.sha256(data).digest())
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict:
    """Read a checkpoint written by ``save_checkpoint``; a truncated or corrupt file raises CheckpointError."""
    raw = path.read_bytes()
    fix = f"delete {path} to start over, or restore a good copy"
    if len(raw) < 40 or raw[:8] != CKPT_MAGIC:
        raise CheckpointError(f"checkpoint {path} is truncated or not a matrixopt checkpoint; {fix}")
    if hashlib.sha256(raw[40:]).digest() != raw[8:40]:
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt (checksum mismatch); {fix}")
    return torch.load(io.BytesIO(raw[40:]), map_location="cpu", weights_only=True)


# ----------------------------------------------------------------------------------------------------------
# the output folder


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and k != "hparams":
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def prepare_out_dir(out: Path, cfg: TrainConfig, resume: bool, overwrite: bool) -> bool:
    """Check ``out`` against ``cfg`` and write config.json. Returns whether to resume from a checkpoint."""
    out.mkdir(parents=True, exist_ok=True)
    config_path, ckpt = out / "config.json", out / "ckpt.pt"
    new = json.loads(json.dumps(cfg.to_dict()))
    if config_path.exists() and not overwrite:
        try:
            old = json.loads(config_path.read_text())
        except json.JSONDecodeError:
            raise ValueError(f"{config_path} is not valid JSON; pass --overwrite to start a new run in {out}") from None
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
    config_path.write_text(json.dumps(new, indent=2) + "\n")
    return resume and ckpt.exists()


def read_metrics(path: Path) -> list[dict]:
    """The metrics lines of ``path`` (a metrics.jsonl), in order."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------------------------
# the run


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA GPU; use --device cpu")
    return torch.device(name)


def peak_mem_mb(device: torch.device) -> float:
    """Peak CUDA memory allocated by tensors, or on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def state_mb(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """Parameters and optimizer state, in MiB (shared tensors counted once)."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total / 2**20


class StopRequest:
    """SIGINT handler for the loop: the first Ctrl-C asks to stop at the next step boundary (so the checkpoint
    is consistent); a second one interrupts at once."""

    def __init__(self):
        self.requested = False

    def __enter__(self):
        self.previous = None
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self.previous = signal.signal(signal.SIGINT, self.handle)
        return self

    def handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


class Interrupted(Exception):
    """Raised after Ctrl-C once the checkpoint is saved."""

    def __init__(self, step: int, ckpt: Path):
        super().__init__(f"interrupted at step {step}; checkpoint saved to {ckpt}; rerun with --resume to continue")
        self.step = step


@torch.no_grad()
def evaluate(model: nn.Module, tokens: np.ndarray, offsets: np.ndarray, cfg: TrainConfig, device, autocast) -> float:
    """Mean loss over the fixed val windows, in batches of ``cfg.batch_size``."""
    model.eval()
    losses = []
    for i in range(0, len(offsets), cfg.batch_size):
        x, y = windows(tokens, offsets[i : i + cfg.batch_size], model_block_size(model))
        with autocast():
            _, loss = model(x.to(device), y.to(device))
        losses.append(loss.item())
    model.train()
    return float(np.mean(losses))


def model_block_size(model: nn.Module) -> int:
    return getattr(model, "_orig_mod", model).config.block_size


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """``matrixopt.build_optimizer`` with the config's hyperparameters. ``betas`` go to the optimizer's AdamW:
    as ``betas`` where it takes them, else as ``adamw_betas`` (Muon, MOP)."""
    from matrixopt.optim.registry import OPTIMIZERS, build_optimizer  # late: train/ sits above optim/

    o = cfg.optim
    if o.name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {o.name!r}; choose from {', '.join(sorted(OPTIMIZERS))}")
    accepts = inspect.signature(OPTIMIZERS[o.name]).parameters
    betas_key = "adamw_betas" if "adamw_betas" in accepts else "betas"
    kwargs = {"lr": o.lr, "weight_decay": o.weight_decay, betas_key: o.betas} | o.hparams
    try:
        optimizer = build_optimizer(model, o.name, splits=QKV_SPLITS, **kwargs)
    except TypeError as e:
        raise ValueError(f"optimizer {o.name!r} rejected its hyperparameters ({e}); check --opt") from None
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])  # the schedule multiplies each group's own base lr
    return optimizer


def check_lengths(ds: Dataset, block_size: int, data: str) -> None:
    for name, tokens in (("train", ds.train), ("val", ds.val)):
        if len(tokens) <= block_size + 1:
            raise ValueError(
                f"the {name} split of {data} has {len(tokens)} tokens, too few for context {block_size}; use "
                f"more data or a smaller --block-size"
            )


def train(
    cfg: TrainConfig, out: str | Path, *, resume: bool = False, overwrite: bool = False, progress: bool = True
) -> dict:
    """Run ``cfg`` into folder ``out`` (see the module docstring); returns the contents of run.json."""
    out = Path(out)
    ds = load_dataset(cfg.data)
    gpt_config = cfg.model.gpt_config(ds.vocab_size)
    check_lengths(ds, gpt_config.block_size, cfg.data.data)
    device = resolve_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.cuda.reset_peak_memory_stats(device)
    use_bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda")

    def autocast():
        if use_bf16:
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    torch.manual_seed(cfg.seed)
    model = GPT(gpt_config).to(device)
    optimizer = build_optimizer(model, cfg)  # before resuming, so bad optimizer settings fail fast
    resuming = prepare_out_dir(out, cfg, resume, overwrite)
    metrics_path, ckpt_path = out / "metrics.jsonl", out / "ckpt.pt"

    step, elapsed, opt_s, loss_sum, loss_count, val_loss = 0, 0.0, 0.0, 0.0, 0, float("nan")
    if resuming:
        ck = load_checkpoint(ckpt_path)
        if ck["step"] == cfg.steps and (out / "run.json").is_file():
            return json.loads((out / "run.json").read_text())  # finished already
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        step, elapsed, opt_s = ck["step"], ck["elapsed_s"], ck["opt_s"]
        loss_sum, loss_count = ck["loss_sum"], ck["loss_count"]
        torch.set_rng_state(ck["rng_cpu"])
        if device.type == "cuda" and ck["rng_cuda"]:
            torch.cuda.set_rng_state_all(ck["rng_cuda"])
        kept = [m for m in read_metrics(metrics_path) if m["step"] <= step]  # drop lines past the checkpoint
        metrics_path.write_text("".join(json.dumps(m) + "\n" for m in kept))
        val_loss = next((m["val_loss"] for m in reversed(kept) if "val_loss" in m), float("nan"))
    else:
        metrics_path.write_text("")

    def checkpoint():
        save_checkpoint(
            ckpt_path,
            dict(
                step=step, elapsed_s=elapsed, opt_s=opt_s, loss_sum=loss_sum, loss_count=loss_count,
                model=model.state_dict(), optimizer=optimizer.state_dict(), rng_cpu=torch.get_rng_state(),
                rng_cuda=torch.cuda.get_rng_state_all() if device.type == "cuda" else [],
            ),
        )  # fmt: skip

    fwd = torch.compile(model) if cfg.compile else model
    offsets = val_offsets(ds.val, cfg.eval_iters * cfg.batch_size, gpt_config.block_size, cfg.seed)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * gpt_config.block_size
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    metrics_file = open(metrics_path, "a")

    def log(record: dict) -> None:
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()

    if step == 0:
        val_loss = evaluate(fwd, ds.val, offsets, cfg, device, autocast)
        log(dict(step=0, loss=None, lr=0.0, tokens_per_s=0.0, elapsed_s=0.0, opt_s=0.0,
                 peak_mem_mb=round(peak_mem_mb(device), 1), val_loss=val_loss))  # fmt: skip

    bar = _progress(cfg.steps, step, progress, cfg.optim.name)
    window_t0, window_step = time.perf_counter(), step
    with StopRequest() as stop, metrics_file:
        while step < cfg.steps:
            mult = lr_multiplier(step, cfg.steps, cfg.schedule)
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"] * mult
            t0 = time.perf_counter()
            step_loss = torch.zeros((), device=device)
            for micro in range(cfg.grad_accum):
                x, y = train_batch(ds.train, cfg.batch_size, gpt_config.block_size, cfg.seed, step, micro)
                with autocast():
                    _, loss = fwd(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
                (loss / cfg.grad_accum).backward()
                step_loss += loss.detach() / cfg.grad_accum
            if cfg.grad_clip > 0:
                nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            sync()
            t_opt = time.perf_counter()
            optimizer.step()
            sync()
            opt_s += time.perf_counter() - t_opt
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss_sum += step_loss.item()
            loss_count += 1
            elapsed += time.perf_counter() - t0
            if not math.isfinite(loss_sum):
                raise ValueError(f"train loss is {loss_sum} at step {step}; lower --lr (now {cfg.optim.lr})")

            is_eval = step % cfg.eval_every == 0 or step == cfg.steps
            if step % cfg.log_every == 0 or is_eval:
                now = time.perf_counter()
                record = dict(
                    step=step, loss=loss_sum / loss_count, lr=cfg.optim.lr * mult,
                    tokens_per_s=tokens_per_step * (step - window_step) / max(now - window_t0, 1e-9),
                    elapsed_s=elapsed, opt_s=opt_s, peak_mem_mb=round(peak_mem_mb(device), 1),
                )  # fmt: skip
                loss_sum, loss_count = 0.0, 0
                if is_eval:
                    val_loss = record["val_loss"] = evaluate(fwd, ds.val, offsets, cfg, device, autocast)
                log(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", val=f"{val_loss:.3f}",
                                tok_s=f"{record['tokens_per_s']:.0f}")
                window_t0, window_step = time.perf_counter(), step
            bar.update(1)
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.steps:
                checkpoint()
                window_t0 = time.perf_counter()
            if stop.requested:
                checkpoint()
                bar.close()
                raise Interrupted(step, ckpt_path)
    bar.close()

    run = dict(
        optimizer=cfg.optim.name, lr=cfg.optim.lr, steps=step, final_val_loss=val_loss, elapsed_s=elapsed,
        opt_s=opt_s, opt_share=opt_s / max(elapsed, 1e-9), tokens_per_s=tokens_per_step * step / max(elapsed, 1e-9),
        peak_mem_mb=round(peak_mem_mb(device), 1), state_mb=round(state_mb(model, optimizer), 2),
        num_params=model.num_params(), tokens_per_step=tokens_per_step, data=ds.description,
        device=describe(device),
        torch=torch.__version__,
    )  # fmt: skip
    (out / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    return run


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def _progress(total: int, initial: int, enabled: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, dynamic_ncols=True, leave=True)
