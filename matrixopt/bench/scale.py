"""``matrixopt bench scale``: training throughput of the parallel modes on N GPUs, one process per GPU.

    torchrun --standalone --nproc-per-node 4 -m matrixopt bench scale --json scale.json         # N GPUs, NCCL
    torchrun --standalone --nproc-per-node 2 -m matrixopt bench scale --toy --json scale.json   # CPU, gloo, tiny GPT
    torchrun --standalone --nproc-per-node 2 -m matrixopt bench scale --presets moe-2b --ep 2 \
        --configs ddp:adamw ddp:muon layerwise:muon --tokens-per-gpu 16384 --micro-batch 2    # mixture of experts

Each configuration ``PARALLEL:OPTIMIZER[:tpN[:MODE]]`` (default ``ddp:adamw fsdp:adamw layerwise:muon
fsdp:muon``; ``fsdp:muon:tp2:distributed`` is tensor parallelism 2 with Newton–Schulz mode distributed) builds the
model and optimizer as ``matrixopt train --parallel PARALLEL --optimizer OPTIMIZER --tp N --tp-mode MODE`` does,
through :func:`matrixopt.distributed.parallelism.make_parallelism` with the trainer's hyperparameters and Q/K/V
split (on a GPU: bf16 autocast over fp32 parameters, or FSDP2's bf16 parameters with fp32 reduction), then times
the trainer's step on random tokens: ``--tokens-per-gpu`` tokens per GPU in micro-batches of ``--micro-batch``
rows (gradient accumulation: only the last backward communicates), global-norm clipping at 1.0 and
``optimizer.step()``, at learning rate 0: each step does all its work (the learning rate only scales the update),
and the parameters stay at their initialization, so every configuration computes the same forward and backward. A
mixture of experts then routes the same tokens to the same experts under every optimizer: with a learning rate,
AdamW's router and Muon's drifted apart within a few steps on the random tokens (the busiest expert took 8 to 16
times the mean load under AdamW, 5 under Muon), which changed the work of the expert layers. The model is a
preset with an untied head and vocab 50304 (``--toy``: 2 layers of tiny-cpu, or of moe-tiny for a
mixture-of-experts preset, vocab 512).

A mixture of experts (``--presets moe-small moe-2b ...``) routes the random tokens with the load-balancing loss
on and, after each step, gathers the routing statistics, as the trainer does (the record keeps
``expert_max_load``, the busiest expert over the mean). ``--ep N`` splits every layer's experts over groups of N
ranks in every configuration (``make_parallelism(..., ep=N)``, the trainer's ``--ep``; the parallel mode must take
it), and the last backward of each step also reduces the expert gradients over their replicas. The record states
``ep``, the parameters (``params``) and those a token uses (``active_params``: all but the expert stacks, plus
topk of each layer's experts). Per configuration, the slowest rank's figures:

- tokens/s of all GPUs together and per GPU, from the wall time of ``--iters`` back-to-back steps that sync only
  as the trainer does (it reads no loss between logs), so communication left running on other streams (layer-wise
  broadcasts, FSDP prefetches) overlaps the next step;
- model TFLOP/s per GPU: model FLOPs per token (``GPT.estimate_flops_per_token``: 6 per weight a token multiplies
  by, topk experts of each layer, plus 12 L T d for attention, as Megatron-LM counts them; no recomputation, no
  optimizer, no expert dispatch) times the tokens/s per GPU;
- the optimizer step: the median time ``optimizer.step()`` occupies the compute stream (slowest and fastest
  rank), and each rank's optimizer state (MiB) and peak memory (``held_before_mb``: what was still allocated
  before the configuration built its model, which the peak includes; each configuration's model and optimizer
  are released before the next is built, so it stays near zero);
- the caching allocator's calls to the driver during the timed steps (``allocator``: cudaMalloc, cudaFree and
  retries, most on any rank): in a steady state there are none, and each one can stall the host;
- Python's garbage collections during the timed steps (per rank ``gc``: collections by generation and their ms per step;
  ``gc_ms_per_step_max``), and each rank's timed window in Unix seconds (``window_unix``), to line it up with
  outside samples such as ``nvidia-smi``'s clocks and power;
- exposed communication (CUDA, with ``--exposed-comm`` or ``--trace DIR``): from a profiler trace of ``--iters``
  more steps, the time NCCL kernels run while no compute kernel does, as a share of those steps' wall time
  (``--trace DIR`` also writes each rank's trace, host activity included). Off by default: reading the trace of a
  1.3B model's steps takes minutes per configuration;
- ``--phases``: the step's timeline, per phase (forward, backward, clip, step): the device time (events on the
  compute stream, so waits on other streams count) and the host's time issuing it;
- layer-wise: the same optimizer stepping the whole model on one GPU (every GPU at once, gradients random), the
  layer-wise step's and optimizer state's ratios to it, and per rank its owned share of the matrix cost and the
  time of its own chunks' steps.

A configuration listed more than once (``--configs ddp:adamw ddp:muon ddp:adamw ddp:muon``) is timed that many times,
in the order given, each a line of its own; ratios are against the median of the DDP AdamW lines of the preset.
Alternating repeats is how to compare configurations whose step varies from run to run by more than they differ
(a host-bound mixture-of-experts forward).

Rank 0 prints the tables; ``--json`` writes every rank's figures and the summary, after each configuration
(``"complete": false`` until the last), so a run stopped by a time limit keeps what it measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import statistics
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from matrixopt.bench.common import environment, exposed_comm, table, write_json
from matrixopt.device import StreamTimer, allocator_calls, frozen_heap, peak_mem_mb, sync, time_ms
from matrixopt.distributed import comm
from matrixopt.distributed.layerwise import LayerwiseOptimizer
from matrixopt.distributed.parallelism import (
    PARALLELISMS,
    Layerwise,
    MultiProcess,
    Parallelism,
    make_parallelism,
    parallelism_class,
)
from matrixopt.distributed.sharded import local_shards
from matrixopt.optim.registry import OPTIMIZERS, accepted, build_optimizer
from matrixopt.train.config import ModelConfig, OptimConfig
from matrixopt.train.model import GPT, QKV_SPLITS
from matrixopt.train.model import PRESETS as MODEL_PRESETS
from matrixopt.train.parallelize import GPT_TP
from matrixopt.train.trainer import MoEStats

CONFIGS = ("ddp:adamw", "fsdp:adamw", "layerwise:muon", "fsdp:muon")
PRESETS = ("gpt2-medium", "1.3b")
PHASES = ("forward", "backward", "clip", "step")
LR = 6e-4  # the trainer's kwargs are built with it; the timed steps run at lr 0 (run_config)
VOCAB, TOY_VOCAB = 50304, 512


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What every configuration is timed with."""

    toy: bool = False
    """On the CPU with gloo, each preset's 2-layer stand-in (:func:`toy_preset`, vocab 512)."""
    ep: int = 1
    """Expert-parallel degree of every configuration (1: none; > 1 needs mixture-of-experts presets)."""
    tokens_per_gpu: int = 4096
    """Tokens each GPU carries per step (a tensor-parallel group shares its rows)."""
    micro_batch: int | None = None
    """Rows per micro-batch (gradient accumulation over a step's rows); None: one micro-batch."""
    iters: int = 10
    """Timed steps, and as many profiled (``exposed_comm``)."""
    warmup: int = 3
    """Untimed steps first."""
    exposed_comm: bool = False
    """Profile ``iters`` more steps (CUDA) for the exposed-communication share."""
    trace: str | None = None
    """A folder for each rank's profiler trace (CUDA), or None; implies ``exposed_comm``."""
    fsdp_gather_once: bool = False
    """FSDP2 configurations gather parameters once per step under accumulation (the trainer's
    ``--fsdp-gather-once``)."""
    hparams: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Per optimizer name, hyperparameters over the trainer's (``--opt muon.cuda_graph=true``)."""

    def __post_init__(self) -> None:
        if self.ep < 1:
            raise ValueError(f"--ep must be a positive integer (1: no expert parallelism), got {self.ep}")
        if self.tokens_per_gpu < 1:
            raise ValueError(f"--tokens-per-gpu must be a positive number of tokens, got {self.tokens_per_gpu}")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise ValueError(f"--micro-batch must be a positive number of rows, got {self.micro_batch}; leave it out "
                             f"for one micro-batch per step")
        unknown = sorted(set(self.hparams) - set(OPTIMIZERS))
        if unknown:
            raise ValueError(f"--opt names unknown optimizers {unknown}; write NAME.KEY=VALUE with NAME one of "
                             f"{', '.join(sorted(OPTIMIZERS))}")
        if self.iters < 2 or self.warmup < 0:
            raise ValueError(f"--iters must be >= 2 (quantiles need two steps) and --warmup >= 0, got --iters "
                             f"{self.iters} --warmup {self.warmup}")


@dataclass(frozen=True)
class ScaleConfig:
    """One configuration, ``PARALLEL:OPTIMIZER[:tpN[:MODE]]``: see :func:`parse_config`."""

    parallel: str
    optimizer: str
    tp: int = 1
    tp_mode: str = "auto"

    def __str__(self) -> str:
        tp = f":tp{self.tp}" if self.tp > 1 else ""
        return f"{self.parallel}:{self.optimizer}{tp}{f':{self.tp_mode}' * (self.tp_mode != 'auto')}"


def parse_config(text: str) -> ScaleConfig:
    """``"fsdp:muon:tp2:distributed"`` -> ScaleConfig("fsdp", "muon", 2, "distributed"); checked as the trainer
    checks ``--parallel``, ``--tp`` and ``--tp-mode``."""
    parts = text.split(":")
    tp = parts[2][2:] if len(parts) > 2 else "1"
    if not 2 <= len(parts) <= 4 or (len(parts) > 2 and not (parts[2].startswith("tp") and tp.isdigit())):
        raise ValueError(f"configuration {text!r}: write PARALLEL:OPTIMIZER[:tpN[:MODE]] with PARALLEL one of "
                         f"{', '.join(p for p in PARALLELISMS if p != 'none')}, e.g. ddp:adamw or "
                         f"fsdp:muon:tp2:distributed")
    config = ScaleConfig(parts[0], parts[1], int(tp), parts[3] if len(parts) > 3 else "auto")
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"configuration {text!r}: unknown optimizer {config.optimizer!r}; choose from "
                         f"{', '.join(sorted(OPTIMIZERS))}")
    try:
        cls = parallelism_class(config.parallel, tp=config.tp, tp_mode=config.tp_mode)
    except ValueError as e:
        raise ValueError(f"configuration {text!r}: {e}") from None
    if not issubclass(cls, MultiProcess):
        raise ValueError(f"configuration {text!r}: bench scale times the multi-process modes; the single-GPU step "
                         f"is `matrixopt bench train`")
    return config


def toy_preset(preset: str) -> str:
    """The preset ``--toy`` runs for ``preset``: moe-tiny for a mixture of experts, else tiny-cpu."""
    return "moe-tiny" if MODEL_PRESETS[preset].get("n_expert") else "tiny-cpu"


def model_config(preset: str, toy: bool) -> ModelConfig:
    if toy:
        return ModelConfig(preset=preset, n_layer=2, tie_embeddings=False)
    return ModelConfig(preset=preset, tie_embeddings=False)


def active_experts(model: GPT) -> tuple[int, int]:
    """``(in the expert stacks, of those a token uses)``: the stacks' parameters and topk / n_expert of them."""
    c = model.config
    stacks = sum(p.numel() for m in model.moe_layers() for p in m.experts.parameters())
    return stacks, stacks // c.n_expert * c.topk if c.n_expert else 0


def active_params(model: GPT) -> int:
    """Parameters a token uses: all but the expert stacks, plus topk of each layer's n_expert experts; every
    parameter for a dense GPT. Call before expert parallelism shards the stacks."""
    stacks, active = active_experts(model)
    return model.num_params() - stacks + active


def check_ep(configs: Sequence[ScaleConfig], presets: Sequence[str], settings: Settings) -> None:
    """ValueError unless every configuration's parallel mode takes ``settings.ep`` and it divides every preset's
    expert count (checked before any rank builds a model)."""
    for config in configs:
        try:
            parallelism_class(config.parallel, tp=config.tp, tp_mode=config.tp_mode, ep=settings.ep)
        except ValueError as e:
            raise ValueError(f"configuration {config}: {e}; drop it from --configs or run without --ep") from None
    if settings.ep == 1:
        return
    for preset in presets:
        n_expert = MODEL_PRESETS[preset].get("n_expert", 0)
        if not n_expert or n_expert % settings.ep:
            raise ValueError(f"--ep {settings.ep} splits each layer's experts over {settings.ep} ranks, but preset "
                             f"{preset!r} has {n_expert} experts per layer; pick mixture-of-experts presets "
                             f"(moe-small, moe-2b, ...) whose expert count --ep divides")


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def state_mb(optimizer: torch.optim.Optimizer) -> float:
    """MiB of optimizer state this rank holds (its shards of DTensor state; under layer-wise, what it owns)."""
    tensors = [v for s in optimizer.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)]
    local = local_shards(tensors)
    return sum(t.numel() * t.element_size() for t in local) / 2**20


class Timeline:
    """Each phase of a training step timed twice: on the device (a :class:`StreamTimer`: events on the compute
    stream, no sync) and on the host (``perf_counter`` while the host issues it). ``with timeline("forward"):``."""

    def __init__(self, device: torch.device) -> None:
        self.device = {p: StreamTimer(device) for p in PHASES}
        self.host: dict[str, list[float]] = {p: [] for p in PHASES}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        self.device[phase].start()
        yield
        self.device[phase].stop()
        self.host[phase].append(time.perf_counter() - t0)

    def per_step_ms(self, steps: slice, laps_per_step: dict[str, int]) -> dict[str, dict[str, Any]]:
        """Median ms per step of each phase over ``steps``: ``{phase: {"device": ms, "host": ms}}``; a phase run
        ``laps_per_step[phase]`` times a step (forward and backward: once per micro-batch) is summed per step, and
        its device time of each micro-batch is kept too (``"device_per_micro_batch"``, medians over ``steps``:
        where a step's time goes, e.g. a first forward that waits for the last step's parameters)."""
        out = {}
        for p in PHASES:
            n = laps_per_step.get(p, 1)
            per: dict[str, Any] = {}
            for where, laps in (("device", self.device[p].resolve()), ("host", self.host[p])):
                sums = [1e3 * sum(laps[i * n:(i + 1) * n]) for i in range(len(laps) // n)][steps]
                per[where] = statistics.median(sums)
            if n > 1:
                laps = self.device[p].resolve()
                per["device_per_micro_batch"] = [
                    statistics.median([1e3 * laps[i * n + k] for i in range(len(laps) // n)][steps]) for k in range(n)]
            out[p] = per
        return out


class GcTimer:
    """Python's garbage collections while entered (``gc.callbacks``): ``collections`` by generation and ``ms``, the
    host time they took. A collection stalls the host that issues the GPU's work; the record keeps them so a step
    whose host time grows can be told apart from one whose device work does."""

    def __init__(self) -> None:
        self.collections, self.ms, self._t0 = [0, 0, 0], 0.0, 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.collections[info["generation"]] += 1
            self.ms += (time.perf_counter() - self._t0) * 1e3

    def __enter__(self) -> GcTimer:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def time_owner_steps(opt: torch.optim.Optimizer, device: torch.device) -> list[StreamTimer]:
    """For a layer-wise optimizer: a timer around each of this rank's chunks' inner ``step()`` (its own compute,
    without the communication); none otherwise."""
    if not isinstance(opt, LayerwiseOptimizer):
        return []
    timers = []
    for chunk in opt.chunks:
        timer, inner_step = StreamTimer(device), chunk.optimizer.step

        def timed_step(*args: Any, _timer: StreamTimer = timer, _step: Any = inner_step, **kwargs: Any) -> Any:
            _timer.start()
            out = _step(*args, **kwargs)
            _timer.stop()
            return out

        chunk.optimizer.step = timed_step
        timers.append(timer)
    return timers


def owner_summary(opt: torch.optim.Optimizer, timers: list[StreamTimer], iters: int) -> dict[str, Any]:
    """This rank's share of the layer-wise matrix cost, its number of owned parameters, the median ms per step of
    its chunks' compute and the dtype its matrices are kept in (``param_dtype``, "None": their own); nothing for
    other optimizers."""
    if not isinstance(opt, LayerwiseOptimizer):
        return {}
    laps = [t.resolve()[:iters] for t in timers]
    per_step = [1e3 * sum(chunk[i] for chunk in laps) for i in range(min(map(len, laps)))] if laps else [0.0]
    compute = opt.assignment.compute
    return dict(owned_cost_share=compute[opt.rank] / max(sum(compute), 1e-30),
                owned_params=opt.assignment.owner.count(opt.rank), inner_step_ms=statistics.median(per_step),
                param_dtype=str(opt.param_dtype))


def step_rows(tokens_per_gpu: int, tp: int, context: int, micro_batch: int | None) -> tuple[int, int]:
    """``(rows, rows per micro-batch)`` one data-parallel rank takes per step: ``tokens_per_gpu`` on each GPU, a TP
    group of ``tp`` GPUs sharing its rows, in rows of ``context`` tokens; ``micro_batch`` None: one micro-batch.
    ValueError when the tokens do not make whole rows or the micro-batch does not divide them."""
    if tokens_per_gpu * tp % context:
        unit = context // math.gcd(context, tp)
        raise ValueError(f"--tokens-per-gpu {tokens_per_gpu} does not make whole rows of {context} tokens (the "
                         f"model's context" + (f", shared by a TP group of {tp}" if tp > 1 else "")
                         + f"); use a multiple of {unit}")
    rows = tokens_per_gpu * tp // context
    micro = micro_batch or rows
    if rows % micro:
        raise ValueError(f"--micro-batch {micro} must divide the {rows} rows of {context} tokens each data-parallel "
                         f"rank takes per step (--tokens-per-gpu {tokens_per_gpu}, tp {tp}); pick a divisor")
    return rows, micro


def run_config(par: Parallelism, config: ScaleConfig, preset: str, settings: Settings) -> dict[str, Any]:
    """Time one configuration on this rank, built through ``par``; returns its measurements. Collective."""
    device = par.device
    gpt = model_config(preset, settings.toy).gpt_config(TOY_VOCAB if settings.toy else VOCAB)
    T = gpt.block_size
    rows, micro = step_rows(settings.tokens_per_gpu, config.tp, T, settings.micro_batch)
    held_mb = torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0  # earlier configs' left
    torch.manual_seed(0)
    with device:  # initialized where it trains: a 1.3B model takes tens of seconds to initialize on one CPU thread
        model = GPT(gpt)
    flops_per_token = model.estimate_flops_per_token()  # the whole model's (Megatron-LM's model FLOPs)
    params, active = model.num_params(), active_params(model)
    module = par.wrap(model)
    hparams = (OptimConfig(name=config.optimizer, lr=LR).optimizer_kwargs()  # the trainer's, then --opt's
               | settings.hparams.get(config.optimizer, {}))
    opt = par.build_optimizer(model, config.optimizer, splits=QKV_SPLITS, **hparams)
    for group in opt.param_groups:  # lr 0: every step does all its work and the parameters stay where they started
        group["lr"] = 0.0
    n_global = rows * par.world // config.tp
    g = torch.Generator(device).manual_seed(1)  # the same global batch on every rank; each takes its rows
    x = torch.randint(0, gpt.vocab_size, (n_global, T + 1), device=device, generator=g)[par.batch_rows(n_global)]
    batches = [(xb[:, :-1], xb[:, 1:]) for xb in x.split(micro)]
    timeline = Timeline(device)
    moe = MoEStats(model, par) if gpt.n_expert else None

    def step() -> None:
        for i, (xb, yb) in enumerate(batches):
            last = i == len(batches) - 1
            with par.no_sync() if not last else contextlib.nullcontext():
                with timeline("forward"), par.autocast():
                    _, loss = module(xb, yb)
                with timeline("backward"):
                    (loss / len(batches)).backward()
                    if last:
                        par.sync_grads()  # expert gradients under expert parallelism
        with timeline("clip"):
            par.clip_grad_norm_(1.0)
        with timeline("step"):
            opt.step()
        opt.zero_grad(set_to_none=True)  # no loss.item(): the trainer reads losses only where it logs
        if moe is not None:
            moe.step()

    for _ in range(settings.warmup):
        step()
    if moe is not None:
        moe.metrics()  # forget the warm-up's routing
    owner_timers = time_owner_steps(opt, device)  # after warm-up: the first step builds the chunks
    par.barrier()
    sync(device)
    calls = allocator_calls(device)
    with frozen_heap():  # as the trainer's loop runs
        window = [time.time()]
        t0 = time.perf_counter()
        with GcTimer() as gc_timer:
            for _ in range(settings.iters):
                step()
            sync(device)
        step_ms = (time.perf_counter() - t0) * 1e3 / settings.iters
        window.append(time.time())
    allocator = {k: v - calls[k] for k, v in allocator_calls(device).items()}
    routing = moe.metrics() if moe is not None else None
    timed = slice(settings.warmup, settings.warmup + settings.iters)
    phases = timeline.per_step_ms(timed, {"forward": len(batches), "backward": len(batches)})
    out = dict(config=str(config), preset=preset, rank=par.rank, ep=par.ep, params=params, active_params=active,
               flops_per_token=flops_per_token, expert_max_load=routing["expert_max_load"] if routing else None,
               tokens_per_rank=rows * T // config.tp, micro_batches=len(batches),
               step_ms=step_ms, opt_step_ms=phases["step"]["device"], phases=phases, state_mb=state_mb(opt),
               peak_mem_mb=peak_mem_mb(device), held_before_mb=held_mb, allocator=allocator, comm_s=None,
               exposed_comm_s=None, profiled_wall_s=None, window_unix=window,
               gc=dict(collections=gc_timer.collections, ms_per_step=gc_timer.ms / settings.iters),
               **owner_summary(opt, owner_timers, settings.iters))
    if device.type == "cuda" and (settings.exposed_comm or settings.trace):
        acts = [torch.profiler.ProfilerActivity.CUDA]  # NCCL and compute kernels are all the share needs
        if settings.trace:
            acts.append(torch.profiler.ProfilerActivity.CPU)
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(settings.iters):
                step()
            sync(device)
            out["profiled_wall_s"] = time.perf_counter() - t0
        out["comm_s"], out["exposed_comm_s"] = exposed_comm(prof)
        if settings.trace:
            Path(settings.trace).mkdir(parents=True, exist_ok=True)
            name = f"{preset}_{config}_rank{par.rank}.json".replace(":", "_")
            prof.export_chrome_trace(str(Path(settings.trace) / name))
    if isinstance(opt, LayerwiseOptimizer):
        opt.wait_params()  # the last step's broadcasts are in flight: finish them before dropping the optimizer
    return out  # the model and optimizer go with this frame; the caller frees the cache


def single_gpu_step(preset: str, optimizer: str, settings: Settings, device: torch.device) -> dict[str, float]:
    """Median ms of ``optimizer``'s step over the whole model on this one device (random gradients, the trainer's
    hyperparameters), and its state in MiB: what layer-wise parallelism divides among the ranks."""
    torch.manual_seed(0)
    with device:
        model = GPT(model_config(preset, settings.toy).gpt_config(TOY_VOCAB if settings.toy else VOCAB))
    # the options the optimizer itself takes: --opt may also set the layer-wise wrapper's own (muon.step_chunks=1)
    hparams = accepted(optimizer, **OptimConfig(name=optimizer, lr=LR).optimizer_kwargs()
                       | settings.hparams.get(optimizer, {}))
    opt = build_optimizer(model, optimizer, splits=QKV_SPLITS, **hparams)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    try:
        t = time_ms(opt.step, device, reps=settings.iters, warmup=settings.warmup)
    except torch.OutOfMemoryError:  # the whole model's state need not fit one device: only the ratios are lost
        print(f"{preset} {optimizer}: the single-device reference step ran out of memory; its ratios are left "
              f"out", flush=True)
        return {"step_ms": None, "state_mb": None}
    return {"step_ms": t["median"], "state_mb": state_mb(opt)}  # the caller frees the cache


def window_warning(ranks: list[dict[str, Any]], settings: Settings) -> str | None:
    """A note when the caching allocator called cudaMalloc more often than once per timed step on some rank: one-time
    work, such as a CUDA graph's capture with its pool and its dispatcher's measurements, then ran inside the timed
    window and the mean step pays it (the graphed Muon step captures on its second or third call, so moe-2b timed
    after 2 warm-up steps showed 150-190 cudaMallocs per Muon window and 0-1 per AdamW window). None otherwise."""
    allocs = max(r["allocator"]["device_allocs"] for r in ranks)
    if allocs <= settings.iters:
        return None
    return (f"{allocs} cudaMalloc calls in the {settings.iters} timed steps: one-time work (a CUDA graph's capture) "
            f"ran in the window; time it again with --warmup {settings.warmup + 2} or more")


def gc_warning(ranks: list[dict[str, Any]]) -> str | None:
    """A note when Python's garbage collector took more than 1% of a timed step on some rank (a full collection of a
    large heap stalls that rank's host, and the others wait for it at the next collective). None otherwise."""
    worst = max(ranks, key=lambda r: r["gc"]["ms_per_step"] / r["step_ms"])
    if worst["gc"]["ms_per_step"] <= 0.01 * worst["step_ms"]:
        return None
    return (f"garbage collection took {worst['gc']['ms_per_step']:.1f} ms per timed step on rank {worst['rank']} "
            f"({worst['gc']['collections'][2]} full collections in the window): the step varies by that between runs")


def _slowest(values: Iterable[Any]) -> Any:
    """The largest of the ranks' values, element by element for lists (per micro-batch times)."""
    values = list(values)
    if isinstance(values[0], list):
        return [max(v) for v in zip(*values)]
    return max(values)


def summarize(per_config: list[list[dict[str, Any]]], singles: list[dict[tuple[str, str], dict]],
              world: int) -> list[dict[str, Any]]:
    """One line per (preset, configuration) from every rank's figures: the slowest rank's times."""
    out = []
    for ranks in per_config:
        r0 = ranks[0]
        step_ms = max(r["step_ms"] for r in ranks)
        tokens_per_s = sum(r["tokens_per_rank"] for r in ranks) / step_ms * 1e3
        shares = [r["exposed_comm_s"] / r["profiled_wall_s"] for r in ranks if r["profiled_wall_s"]]
        line = dict(preset=r0["preset"], config=r0["config"], gpus=world, ep=r0["ep"], params=r0["params"],
                    active_params=r0["active_params"], micro_batches=r0["micro_batches"],
                    step_ms=step_ms, tokens_per_s=tokens_per_s, tokens_per_s_per_gpu=tokens_per_s / world,
                    model_tflops_per_gpu=r0["flops_per_token"] * tokens_per_s / world / 1e12,
                    opt_step_ms_max=max(r["opt_step_ms"] for r in ranks),
                    opt_step_ms_min=min(r["opt_step_ms"] for r in ranks),
                    state_mb_max=max(r["state_mb"] for r in ranks),
                    peak_mem_mb_max=max(r["peak_mem_mb"] for r in ranks),
                    allocator={k: max(r["allocator"][k] for r in ranks) for k in r0["allocator"]},
                    gc_ms_per_step_max=max(r["gc"]["ms_per_step"] for r in ranks),
                    exposed_comm_share=max(shares) if shares else None,
                    expert_max_load=r0["expert_max_load"],  # averaged over the data-parallel ranks: alike on all
                    phases={p: {w: _slowest(r["phases"][p][w] for r in ranks) for w in r0["phases"][p]}
                            for p in PHASES})
        if "inner_step_ms" in r0:
            key = (r0["preset"], parse_config(r0["config"]).optimizer)
            single = {k: [s[key][k] for s in singles if s[key][k] is not None] for k in ("step_ms", "state_mb")}
            single = {k: statistics.median(v) if v else None for k, v in single.items()}
            line |= dict(inner_step_ms_max=max(r["inner_step_ms"] for r in ranks), param_dtype=r0.get("param_dtype"),
                         single_gpu_step_ms=single["step_ms"],
                         opt_step_vs_single_gpu=single["step_ms"] and line["opt_step_ms_max"] / single["step_ms"],
                         state_vs_single_gpu=single["state_mb"] and line["state_mb_max"] / single["state_mb"])
        out.append(line)
    for line in out:  # throughput against AdamW under DDP at the same preset (the median of its runs)
        base = [b["tokens_per_s"] for b in out if b["preset"] == line["preset"] and b["config"] == "ddp:adamw"]
        line["vs_ddp_adamw"] = line["tokens_per_s"] / statistics.median(base) if base else None
    return out


def run(configs: Sequence[ScaleConfig] = tuple(map(parse_config, CONFIGS)), presets: Sequence[str] = PRESETS,
        settings: Settings = Settings(), json_path: str | Path | None = None) -> dict[str, Any]:
    """Time every configuration at every preset on the ranks torchrun started; returns the JSON record (complete
    on rank 0). With ``json_path``, rank 0 also writes the record there after each configuration, marked
    ``"complete": false`` until the last, so a run stopped early keeps what it measured. Collective."""
    if "RANK" not in os.environ:
        raise ValueError("matrixopt bench scale runs one process per GPU: launch it with `torchrun --nproc-per-node N "
                         "-m matrixopt bench scale ...` (--toy: 2 ranks on the CPU)")
    device_name, bf16 = ("cpu", False) if settings.toy else ("auto", torch.cuda.is_available())
    presets = list(dict.fromkeys(map(toy_preset, presets))) if settings.toy else presets
    check_ep(configs, presets, settings)
    per_config, singles, record, env = [], {}, {}, None
    todo = [(preset, config) for preset in presets for config in configs]
    for n, (preset, config) in enumerate(todo, 1):
        t_config = time.perf_counter()
        par = make_parallelism(config.parallel, device=device_name, tp=config.tp, tp_mode=config.tp_mode,
                               bf16=bf16, tp_plan=GPT_TP, ep=settings.ep,
                               gather_once=settings.fsdp_gather_once and config.parallel == "fsdp")
        if isinstance(par, Layerwise) and (preset, config.optimizer) not in singles:
            singles[preset, config.optimizer] = single_gpu_step(preset, config.optimizer, settings, par.device)
            free(par.device)
        ranks = comm.all_gather_object(run_config(par, config, preset, settings), None)
        device, world, rank = par.device, par.world, par.rank
        del par  # the wrapped model with it, before the next configuration is built and its peak memory measured
        free(device)
        per_config.append(ranks)
        env = env or environment(device)  # once: it asks git and the device
        record = dict(benchmark="scale", env=env, world_size=world,
                      backend=dist.get_backend(), **dataclasses.asdict(settings), complete=n == len(todo),
                      summary=summarize(per_config, comm.all_gather_object(singles, None), world),
                      per_rank=per_config)
        if rank == 0:
            print(f"{preset} {config}: step {max(r['step_ms'] for r in ranks):.1f} ms, optimizer step "
                  f"{max(r['opt_step_ms'] for r in ranks):.2f} ms, garbage collection "
                  f"{max(r['gc']['ms_per_step'] for r in ranks):.2f} ms per step ({time.perf_counter() - t_config:.0f} "
                  f"s to build and time)", flush=True)
            for warning in (window_warning(ranks, settings), gc_warning(ranks)):
                if warning:
                    print(f"{preset} {config}: {warning}", flush=True)
            write_json(json_path, record)
    return record


COLUMNS = {  # summary key -> table header
    "preset": "preset", "config": "config", "tokens_per_s_per_gpu": "tokens/s per GPU",
    "model_tflops_per_gpu": "TFLOP/s per GPU", "vs_ddp_adamw": "vs DDP AdamW", "step_ms": "step ms",
    "opt_step_ms_max": "opt step ms", "opt_step_ms_min": "fastest rank", "inner_step_ms_max": "owner compute ms",
    "opt_step_vs_single_gpu": "vs 1 GPU", "state_mb_max": "state MiB", "state_vs_single_gpu": "state vs 1 GPU",
    "peak_mem_mb_max": "peak MiB", "exposed_comm_share": "exposed comm",
}


def format_tables(record: dict[str, Any], phases: bool = False) -> str:
    """The summary table; with ``phases`` also each configuration's step timeline (slowest rank per phase)."""
    env = record["env"]
    whole = ("tokens_per_s_per_gpu", "state_mb_max", "peak_mem_mb_max")  # printed as integers
    rows = [{COLUMNS[k]: round(s[k]) if k in whole else s.get(k) for k in COLUMNS} for s in record["summary"]]
    sizes = ""
    for preset, s in {s["preset"]: s for s in record["summary"]}.items():
        sizes += f"\n{preset}: {s['params'] / 1e6:.4g}M parameters, {s['active_params'] / 1e6:.4g}M active per token"
        sizes += f", expert parallelism {s['ep']}" if s["ep"] > 1 else ""
    text = (f"{record['world_size']} x {env['device']} ({record['backend']}), {record['tokens_per_gpu']} tokens per "
            f"GPU per step; slowest rank. TFLOP/s: model FLOPs (matmuls, topk experts; Megatron-LM's count); opt "
            f"step: ms on the compute stream; vs 1 GPU: against the same optimizer over the whole model on one GPU"
            f"{sizes}\n" + table(rows, list(COLUMNS.values())))
    if phases:
        heads = [f"{p} ms ({where})" for p in PHASES for where in ("device", "host")]
        rows = [{"preset": s["preset"], "config": s["config"],
                 **{f"{p} ms ({where})": s["phases"][p][where] for p in PHASES for where in ("device", "host")}}
                for s in record["summary"]]
        text += ("\n\nStep timeline, median ms per step (device: compute-stream time; host: time issuing it)\n"
                 + table(rows, ["preset", "config", *heads]))
        micro = [{"preset": s["preset"], "config": s["config"],
                  **{f"{p} ms": " ".join(f"{t:.4g}" for t in s["phases"][p]["device_per_micro_batch"])
                     for p in ("forward", "backward")}}
                 for s in record["summary"] if "device_per_micro_batch" in s["phases"]["forward"]]
        if micro:
            text += ("\n\nEach micro-batch's device time, median ms\n"
                     + table(micro, ["preset", "config", "forward ms", "backward ms"]))
    return text
