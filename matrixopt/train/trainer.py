"""The training loop: one run of one optimizer, from a TrainConfig to a folder of results.

``train(cfg, out)`` writes

* ``out/config.json``: the config (a folder that holds a different run is refused: :mod:`matrixopt.train.rundir`);
* ``out/metrics.jsonl``: one JSON object per logged step with ``step`` (optimizer steps done), ``loss`` (mean
  train loss since the previous line), ``lr`` (the peak lr times the schedule), ``tokens_per_s`` (since the
  previous line), ``elapsed_s`` (training seconds so far; evaluation and checkpointing excluded),
  ``opt_s`` (of which inside ``optimizer.step()``; on CUDA the time the step occupies the compute stream, so
  communication it leaves running on other streams is not counted), ``peak_mem_mb``, ``val_loss`` on
  evaluation steps (step 0, every ``eval_every`` steps, and the last step), and with ``qk_clip`` the logged
  step's ``qk_clipped_heads`` (heads QK-clip scaled, over all layers) and ``max_logit`` (the largest pre-softmax
  logit of any head in that step, before clipping), and for a mixture of experts ``expert_load`` (each expert's
  share of the routed tokens), ``expert_max_load`` (busiest expert over mean, worst layer) and ``aux_loss``
  (:class:`MoEStats`; the logged ``loss`` of a mixture of experts includes ``aux_loss_coef`` times it);
* ``out/run.json``: facts about the run (parameters, optimizer state size, device, versions) and its result;
* the checkpoint (``out/ckpt.pt``, or the folder ``out/ckpt/`` where the ranks shard the state): model,
  optimizer, step, timers and RNG state, written atomically at ``ckpt_every``, at the end and on Ctrl-C.
  ``train(cfg, out, resume=True)`` continues from it and logs exactly what an uninterrupted run would (on CPU;
  bitwise up to nondeterministic kernels elsewhere).

The loop per step: accumulate ``grad_accum`` micro-batch gradients (bf16 on CUDA), clip, step, QK-clip (with
``qk_clip``: :mod:`matrixopt.train.qk_clip`), advance the lr schedule (:class:`~matrixopt.train.schedule.LRSchedule`),
log, evaluate, checkpoint. The step losses (and QK-clip's stats) stay on the device; the host reads them (and
checks the losses are finite) only at the steps it logs, evaluates, checkpoints or stops at, so between those it
queues the next step's work without waiting for the GPU.

``cfg.parallel`` picks a :class:`~matrixopt.distributed.Parallelism` (one process, or torchrun's ranks under
DDP, layer-wise or FSDP2 with ``cfg.tp``-way tensor parallelism: :mod:`matrixopt.distributed.parallelism`),
which wraps the model, builds the optimizer, splits every global micro-batch into the ranks' rows, reduces
losses and clips over the ranks, and writes the checkpoint. N ranks log the losses one process would (within
fp32 reduction order); the logged losses are means over ranks; rank 0 alone writes config.json, metrics.jsonl
and run.json and shows progress; every step the ranks agree on a Ctrl-C through a host-side group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from matrixopt.device import StreamTimer, describe, frozen_heap, peak_mem_mb, resolve_device
from matrixopt.distributed.parallelism import Parallelism, make_parallelism
from matrixopt.train.config import TrainConfig
from matrixopt.train.data import Dataset, load_dataset, train_batch, val_offsets, windows
from matrixopt.train.model import GPT, QKV_SPLITS
from matrixopt.train.parallelize import GPT_TP
from matrixopt.train.qk_clip import GPTQKClip
from matrixopt.train.rundir import finished_run, prepare_out_dir, truncate_metrics
from matrixopt.train.schedule import LRSchedule, lr_multiplier


@dataclasses.dataclass
class Tally:
    """The loop's counters, saved in every checkpoint (with the RNG states)."""

    step: int = 0
    """Optimizer steps done."""
    elapsed_s: float = 0.0
    """Training seconds (evaluation and checkpointing excluded)."""
    opt_s: float = 0.0
    """Seconds inside ``optimizer.step()``, as of the last checkpoint (a StreamTimer counts on from it)."""
    loss_sum: float = 0.0
    loss_count: int = 0
    """Sum and number of the step losses read since the last metrics line."""


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


class MetricsLog:
    """Appends lines to metrics.jsonl on rank 0 (``path`` None: on the other ranks, writes nothing)."""

    def __init__(self, path: Path | None):
        self.file = open(path, "a") if path is not None else None

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.file is not None:
            self.file.close()


def train(
    cfg: TrainConfig, out: str | Path, *, resume: bool = False, overwrite: bool = False, progress: bool = True
) -> dict:
    """Run ``cfg`` into folder ``out`` (see the module docstring); returns the contents of run.json."""
    out = Path(out)
    ds = load_dataset(cfg.data)
    gpt_config = cfg.model.gpt_config(ds.vocab_size)
    check_lengths(ds, gpt_config.block_size, cfg.data.data)
    par = make_parallelism(cfg.parallel, device=cfg.device, tp=cfg.tp, tp_mode=cfg.tp_mode,
                           bf16=uses_bf16(cfg.dtype, cfg.device), tp_plan=GPT_TP, ep=cfg.ep,
                           gather_once=cfg.fsdp_gather_once)
    rows = par.batch_rows(cfg.batch_size)  # this rank's rows of every global micro-batch
    prepare_device(par.device, cfg.threads)
    torch.manual_seed(cfg.seed)
    model = GPT(gpt_config).to(par.device)
    module = par.wrap(model)  # before resuming: bad settings fail fast
    optimizer = par.build_optimizer(model, cfg.optim.name, splits=QKV_SPLITS, **cfg.optim.optimizer_kwargs())
    qk_clip = GPTQKClip(model, par, cfg.qk_clip) if cfg.qk_clip is not None else None
    moe = MoEStats(model, par) if gpt_config.n_expert else None
    schedule = LRSchedule(optimizer, cfg.steps, cfg.schedule)
    ckpt_path, metrics_path = out / par.checkpoint_name, out / "metrics.jsonl"
    resuming = par.from_rank_zero(
        lambda: prepare_out_dir(out, cfg, par.checkpoint_name, resume=resume, overwrite=overwrite))
    if resume and not resuming and (finished := finished_run(out, cfg.steps)) is not None:
        return finished  # e.g. a sweep point kept without its checkpoint
    tally, val_loss = Tally(), float("nan")
    if resuming:
        tally = load_checkpoint(par, ckpt_path, schedule)
        if tally.step == cfg.steps and (finished := finished_run(out, cfg.steps)) is not None:
            return finished
        if par.rank == 0:
            val_loss = truncate_metrics(metrics_path, tally.step)  # drop lines past the checkpoint
    elif par.rank == 0:
        metrics_path.write_text("")

    fwd = torch.compile(module) if cfg.compile else module
    offsets = val_offsets(ds.val, cfg.eval_iters * cfg.batch_size, gpt_config.block_size, cfg.seed)
    evaluate_now = functools.partial(evaluate, fwd, par, ds.val, offsets, cfg.batch_size, gpt_config.block_size,
                                     rows)
    batches = functools.partial(rows_of_batch, rows, ds.train, cfg.batch_size, gpt_config.block_size, cfg.seed)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * gpt_config.block_size
    opt_timer = StreamTimer(par.device, tally.opt_s)
    metrics = MetricsLog(metrics_path if par.rank == 0 else None)
    if tally.step == 0:
        val_loss = evaluate_now()
        metrics.write(dict(step=0, loss=None, lr=0.0, tokens_per_s=0.0, elapsed_s=0.0, opt_s=0.0,
                           peak_mem_mb=round(peak_mem_mb(par.device), 1), val_loss=val_loss))  # fmt: skip

    bar = _progress(cfg.steps, tally.step, progress and par.rank == 0, cfg.optim.name)
    window_t0, window_step = time.perf_counter(), tally.step
    # The step losses add up on the device and the host reads them only where it logs, evaluates, checkpoints or
    # stops, so it does not wait for the GPU every step and can queue the next step's work behind this one's.
    pending, pending_steps = torch.zeros((), device=par.device), 0
    with StopRequest() as stop, metrics, frozen_heap():  # the setup's objects out of the collector's walks
        while tally.step < cfg.steps:
            t0 = time.perf_counter()
            pending += train_step(fwd, par, optimizer, functools.partial(batches, tally.step), cfg.grad_accum,
                                  cfg.grad_clip, opt_timer, qk_clip)
            if moe is not None:
                moe.step()
            schedule.step()
            stopping = par.any(stop.requested)
            step = tally.step = tally.step + 1
            pending_steps += 1
            is_log, is_eval = step % cfg.log_every == 0, step % cfg.eval_every == 0 or step == cfg.steps
            is_ckpt = bool(cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.steps
            if is_log or is_eval or is_ckpt or stopping:  # the same steps on every rank
                tally.loss_sum += par.mean(pending).item()
                tally.loss_count += pending_steps
                pending.zero_()
                pending_steps = 0
                if not math.isfinite(tally.loss_sum):
                    raise ValueError(f"train loss is {tally.loss_sum} by step {step}; lower --lr (now {cfg.optim.lr})")
            tally.elapsed_s += time.perf_counter() - t0

            if is_log or is_eval:
                now = time.perf_counter()
                record = dict(
                    step=step, loss=tally.loss_sum / tally.loss_count,
                    lr=cfg.optim.lr * lr_multiplier(step - 1, cfg.steps, cfg.schedule),
                    tokens_per_s=tokens_per_step * (step - window_step) / max(now - window_t0, 1e-9),
                    elapsed_s=tally.elapsed_s, opt_s=opt_timer.total(), peak_mem_mb=round(peak_mem_mb(par.device), 1),
                    **(qk_clip.metrics() if qk_clip is not None else {}),
                    **(moe.metrics() if moe is not None else {}),
                )  # fmt: skip
                tally.loss_sum, tally.loss_count = 0.0, 0
                if is_eval:
                    val_loss = record["val_loss"] = evaluate_now()
                metrics.write(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", val=f"{val_loss:.3f}",
                                tok_s=f"{record['tokens_per_s']:.0f}")
                window_t0, window_step = time.perf_counter(), step
            bar.update(1)
            if is_ckpt or stopping:
                save_checkpoint(par, ckpt_path, tally, opt_timer, schedule)
                window_t0 = time.perf_counter()
            if stopping:
                bar.close()
                raise Interrupted(step, ckpt_path)
    bar.close()

    opt_s = opt_timer.total()
    run = dict(
        optimizer=cfg.optim.name, lr=cfg.optim.lr, steps=tally.step, final_val_loss=val_loss,
        elapsed_s=tally.elapsed_s, opt_s=opt_s, opt_share=opt_s / max(tally.elapsed_s, 1e-9),
        tokens_per_s=tokens_per_step * tally.step / max(tally.elapsed_s, 1e-9),
        peak_mem_mb=round(peak_mem_mb(par.device), 1), state_mb=round(state_mb(model, optimizer), 2),
        num_params=model.num_params(), tokens_per_step=tokens_per_step, data=ds.description,
        device=describe(par.device), **par.describe(), torch=torch.__version__,
    )  # fmt: skip
    if par.rank == 0:
        (out / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    return run


# ----------------------------------------------------------------------------------------------------------
# the pieces of a run


def uses_bf16(dtype: str, device: str) -> bool:
    """Whether a run computes in bf16: asked for, or by default on CUDA."""
    return dtype == "bf16" or (dtype == "auto" and resolve_device(device).type == "cuda")


def prepare_device(device: torch.device, threads: int) -> None:
    """CPU threads (0: torch's default); on CUDA, TF32 matmuls and a fresh peak-memory count."""
    if threads:
        torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.cuda.reset_peak_memory_stats(device)


def check_lengths(ds: Dataset, block_size: int, data: str) -> None:
    for name, tokens in (("train", ds.train), ("val", ds.val)):
        if len(tokens) <= block_size + 1:
            raise ValueError(
                f"the {name} split of {data} has {len(tokens)} tokens, too few for context {block_size}; use "
                f"more data or a smaller --block-size"
            )


def rows_of_batch(rows: slice, tokens: np.ndarray, batch_size: int, block_size: int, seed: int, step: int,
                  micro: int) -> tuple[Tensor, Tensor]:
    """This rank's ``rows`` of global micro-batch ``micro`` of ``step``: ``x, y`` of ``(rows, block_size)`` int64.
    The global batch depends on the seed only, so the data order does not depend on the number of ranks."""
    x, y = train_batch(tokens, batch_size, block_size, seed, step, micro)
    return x[rows], y[rows]


def train_step(model: nn.Module, par: Parallelism, optimizer: torch.optim.Optimizer,
               batch: Callable[[int], tuple[Tensor, Tensor]], grad_accum: int, grad_clip: float,
               opt_timer: StreamTimer, qk_clip: GPTQKClip | None = None) -> Tensor:
    """One optimizer step over ``grad_accum`` micro-batches ``batch(micro)``, clipping the global gradient norm to
    ``grad_clip`` (0: no clipping), then QK-clip when given; returns the step's mean loss, a 0-d tensor on the
    device (not read)."""
    step_loss = torch.zeros((), device=par.device)
    for micro in range(grad_accum):
        x, y = batch(micro)
        with par.no_sync() if micro < grad_accum - 1 else contextlib.nullcontext():
            with par.autocast():
                _, loss = model(x.to(par.device, non_blocking=True), y.to(par.device, non_blocking=True))
            (loss / grad_accum).backward()
        step_loss += loss.detach() / grad_accum
    par.sync_grads()
    if grad_clip > 0:
        par.clip_grad_norm_(grad_clip)
    opt_timer.start()
    optimizer.step()
    opt_timer.stop()
    if qk_clip is not None:
        qk_clip.step()
    optimizer.zero_grad(set_to_none=True)
    return step_loss


@torch.no_grad()
def evaluate(model: nn.Module, par: Parallelism, tokens: np.ndarray, offsets: np.ndarray, batch_size: int,
             block_size: int, rows: slice) -> float:
    """Mean loss over the fixed val windows at ``offsets``, in batches of ``batch_size``: each rank evaluates its
    ``rows`` of every batch and the result is the mean over ranks (collective)."""
    model.eval()
    losses = []
    for i in range(0, len(offsets), batch_size):
        x, y = windows(tokens, offsets[i : i + batch_size][rows], block_size)
        with par.autocast():
            _, loss = model(x.to(par.device), y.to(par.device))
        losses.append(loss.item())
    model.train()
    return par.mean(torch.tensor(np.mean(losses), device=par.device)).item()


class MoEStats:
    """Routing statistics of a mixture-of-experts GPT and its auxiliary-loss-free balancing: after every
    optimizer step, :meth:`step` averages the step's routed copies per expert over the data-parallel ranks (one
    small all-reduce), moves the router biases by them (when the model's ``router_bias_rate`` > 0) and adds them
    up, with the load-balancing loss, for :meth:`metrics`."""

    def __init__(self, model: GPT, par: Parallelism):
        self.model, self.par = model, par
        self.counts = torch.zeros(len(model.moe_layers()), model.config.n_expert, device=par.device)
        self.aux = torch.zeros((), device=par.device)
        self.steps = 0

    def step(self) -> None:
        counts = self.par.mean(self.model.pop_moe_stats())  # (L, E), every rank alike
        self.model.update_router_bias(counts)
        self.counts += counts
        self.aux += self.model.aux_loss().detach()
        self.steps += 1

    def metrics(self) -> dict:
        """Since the last call: ``expert_load`` (each expert's share of the routed copies, averaged over layers),
        ``expert_max_load`` (the largest over layers of the busiest expert's load over the mean load; 1 is
        balanced) and ``aux_loss`` (the load-balancing loss averaged over layers, steps and ranks; its last
        micro-batch per step). No token is dropped."""
        load = self.counts / self.counts.sum(dim=-1, keepdim=True).clamp_min(1)  # (L, E)
        worst = (self.counts.max(dim=-1).values / self.counts.mean(dim=-1).clamp_min(1e-9)).max()
        aux = self.par.mean(self.aux / max(self.steps, 1))
        record = dict(expert_load=[round(v, 5) for v in load.mean(dim=0).tolist()],
                      expert_max_load=round(worst.item(), 4), aux_loss=aux.item())
        self.counts.zero_()
        self.aux.zero_()
        self.steps = 0
        return record


def save_checkpoint(par: Parallelism, path: Path, tally: Tally, opt_timer: StreamTimer,
                    schedule: LRSchedule) -> None:
    """The model, the optimizer, ``tally``, the lr schedule and the RNG states to ``path`` (collective)."""
    cuda = par.device.type == "cuda"
    rng = dict(rng_cpu=torch.get_rng_state(), rng_cuda=torch.cuda.get_rng_state_all() if cuda else [])
    state = dict(opt_s=opt_timer.total(), lr_schedule=schedule.state_dict())
    par.save(path, dataclasses.asdict(tally) | state | rng)


def load_checkpoint(par: Parallelism, path: Path, schedule: LRSchedule) -> Tally:
    """Load ``path`` into the model, the optimizer and ``schedule`` and restore the RNG states; returns the saved
    tally."""
    ck = par.load(path)
    schedule.load_state_dict(ck["lr_schedule"])
    torch.set_rng_state(ck["rng_cpu"])  # rank 0's; every rank draws the same random numbers
    if par.device.type == "cuda" and ck["rng_cuda"]:
        torch.cuda.set_rng_state_all(ck["rng_cuda"])
    return Tally(**{f.name: ck[f.name] for f in dataclasses.fields(Tally)})


def state_mb(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """Parameters and optimizer state held by this process, in MiB (shared tensors counted once). Under
    layerwise that is this rank's share of the state, under fsdp also its parameter shards."""
    seen, total = set(), 0
    state = [v for s in optimizer.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)]
    for t in [*model.parameters(), *state]:
        t = t.to_local() if isinstance(t, DTensor) else t
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total / 2**20


def _progress(total: int, initial: int, enabled: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, dynamic_ncols=True, leave=True)
