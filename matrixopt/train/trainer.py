"""The training loop: one run of one optimizer, from a TrainConfig to a folder of results.

``train(cfg, out)`` writes

* ``out/config.json``: the config (a folder that holds a different run is refused);
* ``out/metrics.jsonl``: one JSON object per logged step with ``step`` (optimizer steps done), ``loss`` (mean
  train loss since the previous line), ``lr`` (the peak lr times the schedule), ``tokens_per_s`` (since the
  previous line), ``elapsed_s`` (training seconds so far; evaluation and checkpointing excluded),
  ``opt_s`` (of which inside ``optimizer.step()``; on CUDA the time the step occupies the compute stream, so
  communication it leaves running on other streams is not counted), ``peak_mem_mb``, and ``val_loss`` on
  evaluation steps (step 0, every ``eval_every`` steps, and the last step);
* ``out/run.json``: facts about the run (parameters, optimizer state size, device, versions) and its result;
* ``out/ckpt.pt``: model, optimizer, step, timers and RNG state, written atomically at ``ckpt_every``, at the
  end and on Ctrl-C. ``train(cfg, out, resume=True)`` continues from it and logs exactly what an
  uninterrupted run would (on CPU; bitwise up to nondeterministic kernels elsewhere).

The loop per step: set each group's lr to its initial lr times the schedule, accumulate ``grad_accum``
micro-batch gradients (bf16 autocast on CUDA), clip, step, log, evaluate, checkpoint. The step losses add up
on the device; the host reads them (and checks they are finite) only at the steps it logs, evaluates,
checkpoints or stops at, so between those it queues the next step's work without waiting for the GPU. Under
data parallelism the ranks agree every step on a Ctrl-C through a host-side (gloo) group, for the same reason.

Data parallel (``cfg.parallel`` other than "none", launched by torchrun, one process per rank): ``train``
initializes the default process group if it is not yet (NCCL on CUDA, device ``cuda:LOCAL_RANK``; gloo on
CPU) and leaves it to the caller. Every rank draws the same global micro-batch from the seed and takes its
rows (``batch_slice``), so the data order depends only on the seed and N ranks log the losses one process
would (within fp32 reduction order). The logged loss and val loss are means over ranks; rank 0 alone writes
config.json, metrics.jsonl and run.json and shows progress. Checkpoints: 'ddp' writes ``ckpt.pt`` from
rank 0 (every rank loads it); 'layerwise' and 'fsdp' write the folder ``ckpt/`` with
torch.distributed.checkpoint on every rank (layerwise: resumable at any number of ranks).

Tensor parallelism (``cfg.tp > 1``, with 'fsdp'): the ranks form a ``("dp", "tp")`` mesh of world / tp by tp.
Every block is sharded over "tp" (:func:`matrixopt.train.parallelize.apply_tp`), then FSDP2 shards over "dp";
the ranks of one TP group take the same batch rows (``batch_slice`` over the dp group). Muon runs as
ShardedMuon with tensor-parallel Newton–Schulz in ``cfg.tp_mode``; AdamW as torch AdamW.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import platform
import resource
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from matrixopt.optim.base import MatrixOptimizer
from matrixopt.train.config import TrainConfig, from_dict, lr_multiplier
from matrixopt.train.data import Dataset, load_dataset, train_batch, val_offsets, windows
from matrixopt.train.model import GPT

CKPT_MAGIC = b"MXOPTCK1"  # 8 bytes, then the sha256 (32 bytes) of the torch.save payload, then the payload
# Config fields a run may change between resumes: no effect on results (tp: as the number of ranks, the same
# losses within fp32 reduction order; checkpoints hold the fused QKV rows in single-process order).
FREE_TO_CHANGE = ("ckpt_every", "threads", "tp")
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
    config_path, ckpt = out / "config.json", out / checkpoint_name(cfg)
    if not ckpt.exists() and (out / "ckpt.old").is_dir():  # a crash between save_sharded's two renames
        (out / "ckpt.old").rename(ckpt)
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


def finished_run(out: Path, cfg: TrainConfig) -> dict | None:
    """run.json of ``out`` if it records all ``cfg.steps`` steps of this (already checked) config, else None."""
    try:
        run = json.loads((out / "run.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return run if isinstance(run, dict) and run.get("steps") == cfg.steps else None


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
def evaluate(model: nn.Module, tokens: np.ndarray, offsets: np.ndarray, cfg: TrainConfig, block_size: int, device,
             autocast, rows: slice) -> float:
    """Mean loss over the fixed val windows, in batches of ``cfg.batch_size``. Under data parallelism each rank
    evaluates its ``rows`` of every batch and the result is the mean over ranks (collective)."""
    model.eval()
    losses = []
    for i in range(0, len(offsets), cfg.batch_size):
        x, y = windows(tokens, offsets[i : i + cfg.batch_size][rows], block_size)
        with autocast():
            _, loss = model(x.to(device), y.to(device))
        losses.append(loss.item())
    model.train()
    if cfg.parallel == "none":
        return float(np.mean(losses))
    from matrixopt.distributed import mean_over_ranks

    return mean_over_ranks(torch.tensor(np.mean(losses), device=device)).item()


def optimizer_kwargs(cfg: TrainConfig) -> dict:
    """The config's hyperparameters for the registered optimizer. ``betas`` go to its AdamW: as ``betas`` where
    it takes them, else as ``adamw_betas`` (Muon, MOP). Where the optimizer has it, ``deferred_nonfinite=True``
    (unless the config asks for ``skip_nonfinite``): no host sync per step, which would let the GPU run dry while
    the host queues the next forward; a NaN/Inf gradient still stops the run, one step later, and never reaches a
    checkpoint (``state_dict()`` raises it first)."""
    from matrixopt.optim.registry import OPTIMIZERS, accepted  # late: train/ sits above optim/

    o = cfg.optim
    if o.name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {o.name!r}; choose from {', '.join(sorted(OPTIMIZERS))}")
    betas_key = "adamw_betas" if accepted(o.name, adamw_betas=None) else "betas"
    deferred = {} if o.hparams.get("skip_nonfinite") else accepted(o.name, deferred_nonfinite=True)
    return {"lr": o.lr, "weight_decay": o.weight_decay, betas_key: o.betas} | deferred | o.hparams


# ----------------------------------------------------------------------------------------------------------
# data parallelism


def init_parallel(cfg: TrainConfig) -> tuple[torch.device, int, int]:
    """This process's device, rank and world size. A parallel run joins the default process group (created here
    from torchrun's environment unless the caller already did: NCCL on CUDA, gloo on CPU)."""
    device = resolve_device(cfg.device)
    if cfg.parallel == "none":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:
            raise ValueError(f"this process is one of {world} ranks (WORLD_SIZE={world}) but --parallel is none, so "
                             f"every rank would train the whole run into the same folder; pass --parallel ddp, "
                             f"layerwise or fsdp")
        return device, 0, 1
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise ValueError(f"--parallel {cfg.parallel} runs one process per rank: launch it with `torchrun "
                             f"--nproc-per-node N -m matrixopt train ...` (or `python -m torch.distributed.run`)")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return device, dist.get_rank(), dist.get_world_size()


def device_mesh(cfg: TrainConfig, device: torch.device, world: int) -> DeviceMesh | None:
    """The mesh of an 'fsdp' run: ``("dp",)`` over all ranks, or ``("dp", "tp")`` of world / tp by tp under
    tensor parallelism (TP groups are consecutive ranks, within a node). None for the other modes."""
    if cfg.parallel != "fsdp":
        return None
    if world % cfg.tp:
        raise ValueError(f"--tp {cfg.tp} must divide the number of ranks, {world}; launch a multiple of {cfg.tp} "
                         f"ranks (torchrun --nproc-per-node) or pick a --tp that divides {world}")
    if cfg.tp == 1:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    return init_device_mesh(device.type, (world // cfg.tp, cfg.tp), mesh_dim_names=("dp", "tp"))


def parallelize(model: GPT, cfg: TrainConfig, mesh: DeviceMesh | None,
                use_bf16: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``(module to call, optimizer)`` for ``cfg.parallel``: the model itself (none; layerwise adds hooks; fsdp
    shards it in place over ``mesh``) or its DDP wrapper, and the optimizer with each group's ``initial_lr``
    set."""
    from matrixopt.distributed import setup  # late: train/ sits above distributed/
    from matrixopt.optim.registry import accepted, build_optimizer

    name, kwargs = cfg.optim.name, optimizer_kwargs(cfg)
    try:
        match cfg.parallel:
            case "none":
                # one GPU: the matrix step replayed from a CUDA graph where the optimizer offers it (--opt
                # cuda_graph=false turns it off). Small models are bound by kernel launches: on an H100, 300 steps
                # of the shakespeare-char preset took 7.4 s with it and 10.8 s without; GPT-2-small gains 2%,
                # medium is within 1% (docs/results/bench).
                graph = accepted(name, cuda_graph=True) if next(model.parameters()).is_cuda else {}
                module, optimizer = model, build_optimizer(model, name, splits=QKV_SPLITS, **(graph | kwargs))
            case "ddp":
                module, optimizer = setup(model, name, cfg.parallel, splits=QKV_SPLITS, **kwargs)
            case "layerwise":
                # under bf16 autocast the GPT's matrices feed only bf16 products: broadcasting them in bf16 after
                # the step halves that traffic and changes no result (the owner keeps the exact value)
                wire = {"broadcast_dtype": torch.bfloat16} if use_bf16 else {}
                module, optimizer = setup(model, name, cfg.parallel, splits=QKV_SPLITS, **(wire | kwargs))
            case "fsdp":
                module, optimizer = model, fsdp_optimizer(model, name, kwargs, mesh, use_bf16, cfg.tp_mode)
            case _:
                raise NotImplementedError(f"parallel mode {cfg.parallel!r}")
    except TypeError as e:
        raise ValueError(f"optimizer {name!r} rejected its hyperparameters ({e}); check --opt") from None
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])  # the schedule multiplies each group's own base lr
    return module, optimizer


def fsdp_optimizer(model: GPT, name: str, kwargs: dict, mesh: DeviceMesh, use_bf16: bool,
                   tp_mode: str) -> torch.optim.Optimizer:
    """Shard ``model`` with tensor parallelism over ``mesh["tp"]`` if the mesh has that dim, then FSDP2 over
    ``mesh["dp"]`` (bf16 parameters and fp32 gradient reduction when ``use_bf16``), and build its optimizer:
    Muon as ShardedMuon (TP Newton–Schulz in ``tp_mode``), AdamW as torch AdamW over the DTensor parameters,
    one param group per mesh (foreach kernels take DTensors of one mesh)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from matrixopt.distributed.fsdp import apply_fsdp
    from matrixopt.distributed.sharded import ShardedMuon
    from matrixopt.optim.registry import OPTIMIZERS
    from matrixopt.optim.routing import param_groups
    from matrixopt.train.parallelize import apply_tp

    if name not in ("muon", "adamw"):
        raise ValueError(f"--parallel fsdp supports the optimizers muon and adamw, not {name!r}; use --parallel "
                         f"layerwise for {name}")
    if "tp" in mesh.mesh_dim_names:
        apply_tp(model, mesh["tp"])
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if use_bf16 else None
    apply_fsdp(model, mesh["dp"], mp_policy=policy)
    if name == "muon":
        return ShardedMuon(param_groups(model, splits=QKV_SPLITS), tp_mode=tp_mode, **kwargs)
    groups = []
    for g in param_groups(model, matrix_flag=None, splits=QKV_SPLITS):
        g.pop("names")
        groups += [g | {"params": ps} for ps in by_mesh(g["params"])]
    return OPTIMIZERS["adamw"](groups, **kwargs)


def by_mesh(params) -> list[list[nn.Parameter]]:
    """DTensor parameters grouped by device mesh, in order: under TP, block matrices live on the 2-D mesh and the
    rest on "dp", and DTensor foreach kernels take one mesh per call."""
    groups: dict[DeviceMesh, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.device_mesh, []).append(p)
    return list(groups.values())


def no_sync(parallel: str, module: nn.Module, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
    """Context for the forward and backward of every micro-batch but the last: accumulate local gradients
    without communicating; the last backward reduces the sums."""
    match parallel:
        case "layerwise":
            return optimizer.no_sync()
        case "ddp":
            return module.no_sync()
        case "fsdp":
            return _fsdp_no_sync(module)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(module: nn.Module):
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def clip_gradients(parallel: str, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    """Clip the global gradient norm (over all ranks' parameters) to ``max_norm``."""
    match parallel:
        case "layerwise":  # the owners hold the reduced gradients; model parameters have none
            optimizer.clip_grad_norm_(max_norm)
        case "fsdp":  # DTensor gradient norms are partial: finish each mesh's across its ranks, then combine
            meshes = by_mesh(p for p in model.parameters() if p.grad is not None)
            norms = [nn.utils.get_total_norm([p.grad for p in ps]).full_tensor() for ps in meshes]
            total = torch.linalg.vector_norm(torch.stack(norms))
            for ps in meshes:
                nn.utils.clip_grads_with_norm_(ps, max_norm, total)
        case _ if isinstance(optimizer, MatrixOptimizer):  # every parameter; the step applies the coefficient
            optimizer.clip_grad_norm_(max_norm)
        case _:
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def from_rank_zero(fn, cfg: TrainConfig, rank: int):
    """``fn()`` run on rank 0 only (e.g. file-system work), its result or ValueError/OSError given to every rank."""
    if cfg.parallel == "none":
        return fn()
    box = [None]
    if rank == 0:
        try:
            box[0] = (True, fn())
        except (ValueError, OSError) as e:
            box[0] = (False, e)
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value


# ----------------------------------------------------------------------------------------------------------
# checkpoints of a parallel run


def checkpoint_name(cfg: TrainConfig) -> str:
    """The checkpoint in the output folder: one file, or a torch.distributed.checkpoint folder when every rank
    holds only part of the state."""
    return "ckpt" if cfg.parallel in ("layerwise", "fsdp") else "ckpt.pt"


def save_sharded(out: Path, cfg: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict,
                 rank: int) -> None:
    """Write ``out/ckpt`` on every rank (collective): into ``ckpt.tmp``, then rank 0 swaps it in, so a crash
    during the write leaves the previous checkpoint (``ckpt``, or ``ckpt.old`` during the swap) whole."""
    tmp, final, old = out / "ckpt.tmp", out / "ckpt", out / "ckpt.old"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    if cfg.parallel == "layerwise":
        from matrixopt.distributed import checkpoint

        checkpoint.save(tmp, model, optimizer, extra=trainer_state)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from matrixopt.train.parallelize import reorder_qkv_state

        model_sd, optim_sd = get_state_dict(model, optimizer)
        if cfg.tp > 1:  # fused QKV rows in single-process order on disk: loadable at any TP size
            reorder_qkv_state(model_sd, optim_sd, model.config.n_embd, to_canonical=True)
        dcp.save({"model": model_sd, "optim": optim_sd, "trainer": _pickled(trainer_state)}, checkpoint_id=tmp)
    if rank == 0:
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load_sharded(path: Path, cfg: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load ``out/ckpt`` into ``model`` and ``optimizer`` on every rank (collective); returns the trainer state."""
    if cfg.parallel == "layerwise":
        from matrixopt.distributed import checkpoint

        return checkpoint.load(path, model, optimizer)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from matrixopt.train.parallelize import reorder_qkv_state

    model_sd, optim_sd = get_state_dict(model, optimizer)
    sd = {"model": model_sd, "optim": optim_sd, "trainer": b""}
    dcp.load(sd, checkpoint_id=path)
    if cfg.tp > 1:
        reorder_qkv_state(sd["model"], sd["optim"], model.config.n_embd, to_canonical=False)
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return torch.load(io.BytesIO(sd["trainer"]), weights_only=True)


def _pickled(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


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
    device, rank, world = init_parallel(cfg)
    mesh = device_mesh(cfg, device, world)
    rows = slice(None)  # this rank's rows of every global micro-batch
    control = None  # the ranks agree each step on whether to stop through this host-side group
    if cfg.parallel != "none":
        from matrixopt.distributed import any_rank, batch_slice, comm, mean_over_ranks

        rows = batch_slice(cfg.batch_size, mesh.get_group("dp") if mesh is not None else None)
        control = comm.host_group()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.cuda.reset_peak_memory_stats(device)
    use_bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda")

    def autocast():
        if use_bf16 and cfg.parallel != "fsdp":  # FSDP2 casts the parameters itself (its mixed precision policy)
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    torch.manual_seed(cfg.seed)
    model = GPT(gpt_config).to(device)
    module, optimizer = parallelize(model, cfg, mesh, use_bf16)  # before resuming: bad settings fail fast
    resuming = from_rank_zero(lambda: prepare_out_dir(out, cfg, resume, overwrite), cfg, rank)
    metrics_path, ckpt_path = out / "metrics.jsonl", out / checkpoint_name(cfg)
    if resume and not resuming and (finished := finished_run(out, cfg)) is not None:
        return finished  # e.g. a sweep point kept without its checkpoint

    step, elapsed, opt_s, loss_sum, loss_count, val_loss = 0, 0.0, 0.0, 0.0, 0, float("nan")
    if resuming:
        if cfg.parallel in ("layerwise", "fsdp"):
            ck = load_sharded(ckpt_path, cfg, model, optimizer)
        else:
            ck = load_checkpoint(ckpt_path)
            model.load_state_dict(ck["model"])
            optimizer.load_state_dict(ck["optimizer"])
        if ck["step"] == cfg.steps and (out / "run.json").is_file():
            return json.loads((out / "run.json").read_text())  # finished already
        step, elapsed, opt_s = ck["step"], ck["elapsed_s"], ck["opt_s"]
        loss_sum, loss_count = ck["loss_sum"], ck["loss_count"]
        torch.set_rng_state(ck["rng_cpu"])  # rank 0's; every rank draws the same random numbers
        if device.type == "cuda" and ck["rng_cuda"]:
            torch.cuda.set_rng_state_all(ck["rng_cuda"])
        if rank == 0:
            kept = [m for m in read_metrics(metrics_path) if m["step"] <= step]  # drop lines past the checkpoint
            metrics_path.write_text("".join(json.dumps(m) + "\n" for m in kept))
            val_loss = next((m["val_loss"] for m in reversed(kept) if "val_loss" in m), float("nan"))
    elif rank == 0:
        metrics_path.write_text("")

    def checkpoint():
        state = dict(
            step=step, elapsed_s=elapsed, opt_s=opt_timer.total(), loss_sum=loss_sum, loss_count=loss_count,
            rng_cpu=torch.get_rng_state(), rng_cuda=torch.cuda.get_rng_state_all() if device.type == "cuda" else [],
        )  # fmt: skip
        match cfg.parallel:
            case "layerwise" | "fsdp":
                save_sharded(out, cfg, model, optimizer, state, rank)
            case _:
                if rank == 0:  # under DDP every rank holds the same model and optimizer state
                    save_checkpoint(ckpt_path, state | dict(model=model.state_dict(), optimizer=optimizer.state_dict()))
                if cfg.parallel == "ddp":
                    dist.barrier()

    fwd = torch.compile(module) if cfg.compile else module
    offsets = val_offsets(ds.val, cfg.eval_iters * cfg.batch_size, gpt_config.block_size, cfg.seed)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * gpt_config.block_size
    opt_timer = StreamTimer(device, opt_s)
    metrics_file = open(metrics_path, "a") if rank == 0 else contextlib.nullcontext()

    def evaluate_now() -> float:
        return evaluate(fwd, ds.val, offsets, cfg, gpt_config.block_size, device, autocast, rows)

    def log(record: dict) -> None:
        if rank == 0:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()

    if step == 0:
        val_loss = evaluate_now()
        log(dict(step=0, loss=None, lr=0.0, tokens_per_s=0.0, elapsed_s=0.0, opt_s=0.0,
                 peak_mem_mb=round(peak_mem_mb(device), 1), val_loss=val_loss))  # fmt: skip

    bar = _progress(cfg.steps, step, progress and rank == 0, cfg.optim.name)
    window_t0, window_step = time.perf_counter(), step
    # The step losses add up on the device and the host reads them only where it logs, evaluates, checkpoints or
    # stops, so it does not wait for the GPU every step and can queue the next step's work behind this one's.
    pending, pending_steps = torch.zeros((), device=device), 0
    with StopRequest() as stop, metrics_file:
        while step < cfg.steps:
            mult = lr_multiplier(step, cfg.steps, cfg.schedule)
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"] * mult
            t0 = time.perf_counter()
            step_loss = torch.zeros((), device=device)
            for micro in range(cfg.grad_accum):
                x, y = train_batch(ds.train, cfg.batch_size, gpt_config.block_size, cfg.seed, step, micro)
                x, y = x[rows], y[rows]  # the global batch depends on the seed only; each rank takes its rows
                last = micro == cfg.grad_accum - 1
                with contextlib.nullcontext() if last else no_sync(cfg.parallel, module, optimizer):
                    with autocast():
                        _, loss = fwd(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
                    (loss / cfg.grad_accum).backward()
                step_loss += loss.detach() / cfg.grad_accum
            if cfg.grad_clip > 0:
                clip_gradients(cfg.parallel, model, optimizer, cfg.grad_clip)
            opt_timer.start()
            optimizer.step()
            opt_timer.stop()
            optimizer.zero_grad(set_to_none=True)
            stopping = stop.requested if control is None else any_rank(stop.requested, control)
            step += 1
            pending += step_loss
            pending_steps += 1
            is_eval = step % cfg.eval_every == 0 or step == cfg.steps
            is_ckpt = bool(cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.steps
            if step % cfg.log_every == 0 or is_eval or is_ckpt or stopping:  # the same steps on every rank
                loss_sum += (pending if control is None else mean_over_ranks(pending)).item()
                loss_count += pending_steps
                pending.zero_()
                pending_steps = 0
                if not math.isfinite(loss_sum):
                    raise ValueError(f"train loss is {loss_sum} by step {step}; lower --lr (now {cfg.optim.lr})")
            elapsed += time.perf_counter() - t0

            if step % cfg.log_every == 0 or is_eval:
                now = time.perf_counter()
                record = dict(
                    step=step, loss=loss_sum / loss_count, lr=cfg.optim.lr * mult,
                    tokens_per_s=tokens_per_step * (step - window_step) / max(now - window_t0, 1e-9),
                    elapsed_s=elapsed, opt_s=opt_timer.total(), peak_mem_mb=round(peak_mem_mb(device), 1),
                )  # fmt: skip
                loss_sum, loss_count = 0.0, 0
                if is_eval:
                    val_loss = record["val_loss"] = evaluate_now()
                log(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", val=f"{val_loss:.3f}",
                                tok_s=f"{record['tokens_per_s']:.0f}")
                window_t0, window_step = time.perf_counter(), step
            bar.update(1)
            if is_ckpt:
                checkpoint()
                window_t0 = time.perf_counter()
            if stopping:
                checkpoint()
                bar.close()
                raise Interrupted(step, ckpt_path)
    bar.close()

    opt_s = opt_timer.total()
    run = dict(
        optimizer=cfg.optim.name, lr=cfg.optim.lr, steps=step, final_val_loss=val_loss, elapsed_s=elapsed,
        opt_s=opt_s, opt_share=opt_s / max(elapsed, 1e-9), tokens_per_s=tokens_per_step * step / max(elapsed, 1e-9),
        peak_mem_mb=round(peak_mem_mb(device), 1), state_mb=round(state_mb(model, optimizer), 2),
        num_params=model.num_params(), tokens_per_step=tokens_per_step, data=ds.description,
        device=describe(device), parallel=cfg.parallel, world_size=world, tp=cfg.tp,
        torch=torch.__version__,
    )  # fmt: skip
    if rank == 0:
        (out / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    return run


class StreamTimer:
    """Seconds spent between ``start()`` and ``stop()``, plus ``offset``. On CUDA, events on the current stream:
    no device-wide sync, so communication left running on other streams (e.g. the layer-wise parameter
    broadcasts) keeps overlapping what follows; laps are read when asked for. Elsewhere ``perf_counter``."""

    def __init__(self, device: torch.device, offset: float = 0.0) -> None:
        self.cuda, self.offset = device.type == "cuda", offset
        self.laps: list[float] = []
        self._pending: list[tuple[Any, Any]] = []
        self._t0: Any = None

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._t0 = self._now()

    def stop(self) -> None:
        end = self._now()
        if self.cuda:
            self._pending.append((self._t0, end))
        else:
            self.laps.append(end - self._t0)

    def resolve(self) -> list[float]:
        """Every finished lap in seconds (waits for the recorded events)."""
        for start, end in self._pending:
            end.synchronize()
            self.laps.append(start.elapsed_time(end) / 1e3)
        self._pending.clear()
        return self.laps

    def total(self) -> float:
        return self.offset + sum(self.resolve())


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def _progress(total: int, initial: int, enabled: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, dynamic_ncols=True, leave=True)
