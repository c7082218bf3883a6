"""Checkpoints: one file for a state every rank holds whole, and torch.distributed.checkpoint (DCP) folders for a
state the ranks shard.

**One file** (one process, DDP): :func:`save_checkpoint` writes a ``torch.save`` payload behind a magic number and
its sha256, atomically; :func:`load_checkpoint` refuses a truncated or corrupt file (:class:`CheckpointError`).

**A layer-wise run** (:func:`save`, :func:`load`, :func:`export`): one set of files, written by N ranks, readable
by any number M of ranks, and exportable to one plain ``torch.save`` file.

Each rank writes what it owns, keyed by parameter name, so no tensor is written twice and nothing in the files
depends on the number of ranks that wrote them::

    model/<name>         the parameter, from its owner (the fp32 master for a bf16 parameter)
    optim/<name>/<key>   its optimizer state, from its owner (tensors as tensors, anything else pickled)
    buffer/<key>         model.state_dict() entries that are not trainable parameters, from rank 0
    meta                 optimizer name, param-group hyperparameters, tied-weight aliases and ``extra``, from rank 0

:func:`load` at any world size reads the ownership the new ranks computed: each rank reads the parameters and
state it now owns, then the owners broadcast the parameters.

Block parameters (expert parallelism's slices of the expert stacks, :class:`~.layerwise.Blocks`) are saved whole, as
one process holds them: the owners of a tensor's blocks (one block group) write theirs as the shards of a DTensor,
and so do its optimizer state tensors that stack per block row (dim 0 of the block's size); its other state comes
from the first block's owner. Each owner loads back the rows of its new block, so a checkpoint resumes at any
expert-parallel degree and in one process. From the start of a load until that broadcast has
finished on every rank, ``opt.step()`` and the model's forward raise, so a run whose load was interrupted cannot
train on stale parameters. DCP writes its metadata file last, so an interrupted save is not loadable either.

**A DTensor run** (FSDP2, tensor parallelism: :func:`save_dtensor`, :func:`load_dtensor`): the state dicts of
``torch.distributed.checkpoint.state_dict.get_state_dict``, each rank writing its shards, and what those leave out of
the optimizer's own state dict (matrixopt's class name, checked on load, and compact state's rounding counter, so
that a resumed run rounds as the uninterrupted one). Expert stacks that expert
parallelism keeps out of FSDP2 (plain ``(E/ep, out, in)`` blocks) are written and read whole, as block parameters
are above (:func:`block_shard`), so these checkpoints too resume at any expert-parallel degree.

:func:`replace_folder` writes a folder checkpoint beside the previous one and swaps it in, so a crash during the
write leaves the previous one whole; :func:`recover_folder` finishes a swap a crash interrupted.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from matrixopt.distributed.layerwise import LayerwiseOptimizer

CKPT_MAGIC = b"MXOPTCK1"  # 8 bytes, then the sha256 (32 bytes) of the torch.save payload, then the payload


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used (truncated, corrupt, or from another run)."""


# ----------------------------------------------------------------------------------------------------------
# one file


def save_checkpoint(path: Path, payload: dict) -> None:
    """Write ``payload`` atomically: to ``path.tmp``, fsync, then ``os.replace`` onto ``path``. A crash at any
    point leaves either the previous checkpoint or the new one at ``path``, never a mix."""
    data = _pickled(payload)
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
# folders


def replace_folder(path: Path, write: Callable[[Path], None]) -> None:
    """Write the folder checkpoint ``path`` on every rank (collective): ``write(path.tmp)``, then rank 0 swaps it
    in, so a crash during the write leaves the previous checkpoint (``path``, or ``path.old`` during the swap)
    whole."""
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    write(tmp)
    if dist.get_rank() == 0:
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def recover_folder(path: Path) -> None:
    """Finish a :func:`replace_folder` swap that a crash interrupted between its two renames: ``path.old`` back to
    ``path``."""
    old = path.with_name(path.name + ".old")
    if not path.exists() and old.is_dir():
        old.rename(path)


# ----------------------------------------------------------------------------------------------------------
# a layer-wise run


def _aliases(model: nn.Module, opt: LayerwiseOptimizer) -> dict[str, str]:
    """state_dict keys that name a trainable parameter under another name (tied weights) -> the parameter's name."""
    return {k: opt.names[id(t)] for k, t in model.state_dict(keep_vars=True).items()
            if id(t) in opt.names and opt.names[id(t)] != k}


def _buffers(model: nn.Module, opt: LayerwiseOptimizer) -> dict[str, torch.Tensor]:
    return {k: t for k, t in model.state_dict(keep_vars=True).items() if id(t) not in opt.names}


def _pickled(obj: Any) -> bytes:
    """A non-tensor value as one opaque blob (DCP would otherwise flatten containers into many keys)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpickled(value: Any) -> Any:
    return value if isinstance(value, torch.Tensor) else torch.load(io.BytesIO(value), weights_only=False)


def block_shard(t: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """This rank's block ``t`` ``(n, ...)`` of a whole tensor ``(n * mesh.size(), ...)`` whose blocks the ranks of
    the 1-D ``mesh`` hold in rank order, as a DTensor sharded along dim 0 (no copy): what a checkpoint writes for a
    block, and the target it reads one into, so that it holds the whole tensor and loads at any block count."""
    return DTensor.from_local(t, mesh, [Shard(0)], run_check=False)


def stacks_per_block(t: Any, n: int) -> bool:
    """Whether ``t`` (a block parameter of ``n`` rows, or one of its optimizer state values) stacks per row of the
    block (dim 0 of size ``n``, e.g. a momentum), and is held in blocks with it; else it is one value for the whole
    tensor (e.g. a step count)."""
    return isinstance(t, torch.Tensor) and t.ndim > 0 and t.shape[0] == n


class _Whole:
    """How the owned parameters and their state are written and read: as they are, or for a block parameter as
    this rank's block of the whole tensor (a DTensor sharded over its block group, dim 0)."""

    def __init__(self, opt: LayerwiseOptimizer) -> None:
        self.opt = opt
        blocks = opt.blocks
        self.n = 1 if blocks is None else dist.get_world_size(blocks.block_group)
        self.first = blocks is None or dist.get_rank(blocks.block_group) == 0
        device = opt.params[0].device.type if opt.params else "cpu"
        self.mesh = None if blocks is None else DeviceMesh.from_group(blocks.block_group, device)

    def is_block(self, name: str) -> bool:
        return id(self.opt.param_by_name(name)) in self.opt.local

    def shape(self, name: str) -> tuple[int, ...]:
        """The whole shape of parameter ``name``, as the checkpoint holds it."""
        shape = tuple(self.opt.param_by_name(name).shape)
        return (shape[0] * self.n, *shape[1:]) if self.is_block(name) else shape

    def stacks(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether a tensor of ``name`` (the parameter or its state) of whole ``shape`` is split into blocks."""
        return self.is_block(name) and len(shape) > 0 and shape[0] == self.shape(name)[0]

    def saved(self, name: str, t: Any) -> Any:
        """What this rank writes for ``t`` (the parameter ``name``'s value or state): a block's DTensor shard, or
        ``t``; None where the first block's owner writes it."""
        if not self.is_block(name):
            return t
        if stacks_per_block(t, self.opt.param_by_name(name).shape[0]):
            return block_shard(t, self.mesh)
        return t if self.first else None

    def target(self, name: str, entry: TensorStorageMetadata, device: torch.device) -> torch.Tensor:
        """The tensor DCP reads an entry of ``name`` into: this rank's rows of a block's, else the whole."""
        size = tuple(entry.size)
        if not self.stacks(name, size):
            return torch.empty(size, dtype=entry.properties.dtype, device=device)
        return block_shard(torch.empty((size[0] // self.n, *size[1:]), dtype=entry.properties.dtype, device=device),
                           self.mesh)


def save(path: str | os.PathLike, model: nn.Module, opt: LayerwiseOptimizer, extra: Any = None) -> None:
    """Write a checkpoint of ``model`` and ``opt`` to the directory ``path``. Collective: call on every rank.
    ``extra``: any picklable object (step count, scheduler and RNG state, ...) saved from rank 0."""
    opt.wait_params()
    sd: dict[str, Any] = {}
    if opt.rank == 0:
        sd["meta"] = _pickled({"optimizer": opt.name, "param_groups": opt.state_dict()["param_groups"],
                               "aliases": _aliases(model, opt), "world_size": opt.world_size, "extra": extra})
        sd.update({f"buffer/{k}": t.detach() for k, t in _buffers(model, opt).items()})
    state, whole = opt.state_dict()["state"], _Whole(opt)
    for name in opt.owned_names():
        sd[f"model/{name}"] = whole.saved(name, opt.trained(opt.param_by_name(name)).detach())
        for k, v in state.get(name, {}).items():
            if (v := whole.saved(name, v)) is not None:
                sd[f"optim/{name}/{k}"] = v if isinstance(v, torch.Tensor) else _pickled(v)
    dcp.save(sd, checkpoint_id=path, process_group=opt.group,
             planner=DefaultSavePlanner(flatten_state_dict=False))


def load(path: str | os.PathLike, model: nn.Module, opt: LayerwiseOptimizer) -> Any:
    """Load a checkpoint written by :func:`save` at any world size into ``model`` and ``opt`` (built as for the
    run that saved it) and synchronise the parameters. Returns the saved ``extra``. Collective."""
    try:
        md = FileSystemReader(path).read_metadata().state_dict_metadata
    except FileNotFoundError:
        raise FileNotFoundError(f"no complete checkpoint at {os.fspath(path)!r} (its .metadata file is missing: the "
                                f"path is wrong or the save was interrupted); load an earlier checkpoint") from None
    problems, whole = [], _Whole(opt)
    for p in opt.params:
        name = opt.names[id(p)]
        entry = md.get(f"model/{name}")
        if not isinstance(entry, TensorStorageMetadata):
            problems.append(f"`{name}` is missing")
        elif tuple(entry.size) != whole.shape(name):
            problems.append(f"`{name}` has shape {tuple(entry.size)}, the model's {whole.shape(name)}")
    if problems:
        raise ValueError(f"checkpoint {os.fspath(path)!r} does not match the model: {'; '.join(problems[:8])}. Build "
                         f"the model the checkpoint was saved from.")

    target: dict[str, Any] = {"meta": None}
    target.update({k: None for k in md if k.startswith("buffer/")})
    owned = {}  # key -> the parameter it belongs to
    for name in opt.owned_names():
        owned[f"model/{name}"] = name
        owned.update({k: name for k in md if k.startswith(f"optim/{name}/")})
    target.update(dict.fromkeys(owned))
    device = opt.params[0].device if opt.params else torch.device("cpu")
    for k in target:
        entry = md[k]
        if isinstance(entry, TensorStorageMetadata):
            target[k] = whole.target(owned[k], entry, device) if k in owned else \
                torch.empty(entry.size, dtype=entry.properties.dtype, device=device)

    opt.mark_stale()
    dcp.load(target, checkpoint_id=path, process_group=opt.group,
             planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
    target = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in target.items()}
    meta = _unpickled(target["meta"])
    state: dict[str, dict[str, Any]] = {}
    for k, v in target.items():
        if k.startswith("optim/"):
            name, key = k[len("optim/"):].split("/", 1)
            state.setdefault(name, {})[key] = _unpickled(v)
    opt.load_state_dict({"optimizer": meta["optimizer"], "state": state, "param_groups": meta["param_groups"]})
    for name in opt.owned_names():
        opt.load_master_(name, target[f"model/{name}"])
    buffers = _buffers(model, opt)
    with torch.no_grad():
        for k, t in buffers.items():
            t.copy_(target[f"buffer/{k}"])
    opt.sync_params()
    return meta["extra"]


def export(path: str | os.PathLike, out: str | os.PathLike | None = None) -> dict[str, Any]:
    """Read the checkpoint at ``path`` in one process (no process group) into a plain state dict::

        {"model": model.state_dict()-style {key: tensor} (tied keys included),
         "optimizer": {"optimizer": name, "state": {param name: {key: value}}, "param_groups": [...]},
         "extra": ...}

    and, when ``out`` is given, ``torch.save`` it there as one file. ``model.load_state_dict(sd["model"])`` works
    on a single-process model; ``sd["optimizer"]`` loads into a :class:`LayerwiseOptimizer` at any world size."""
    buf = io.BytesIO()
    dcp_to_torch_save(path, buf)
    buf.seek(0)
    flat = torch.load(buf, weights_only=False)
    meta = _unpickled(flat["meta"])
    model = {k[len("model/"):]: v for k, v in flat.items() if k.startswith("model/")}
    model.update({k[len("buffer/"):]: v for k, v in flat.items() if k.startswith("buffer/")})
    model.update({alias: model[name] for alias, name in meta["aliases"].items()})
    state: dict[str, dict[str, Any]] = {}
    for k, v in flat.items():
        if k.startswith("optim/"):
            name, key = k[len("optim/"):].split("/", 1)
            state.setdefault(name, {})[key] = _unpickled(v)
    sd = {"model": model, "optimizer": {"optimizer": meta["optimizer"], "state": state,
                                        "param_groups": meta["param_groups"]}, "extra": meta["extra"]}
    if out is not None:
        torch.save(sd, out)
    return sd


# ----------------------------------------------------------------------------------------------------------
# a DTensor run

# reorder(model_sd, optim_sd, to_canonical=bool): converts the state dicts between the layout the sharded model
# trains in and the one on disk, in place (e.g. fused QKV rows under tensor parallelism)
Reorder = Callable[..., None]


_OPTIMIZER_META = "optimizer_meta"


def _optimizer_meta(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What ``optimizer.state_dict()`` holds besides its state and param groups, which ``get_state_dict`` leaves
    out: matrixopt's optimizers' class name (checked on load) and, with compact state, the stochastic rounding's
    step counter (so that a resumed run rounds as the uninterrupted one)."""
    return {k: v for k, v in optimizer.state_dict().items() if k not in ("state", "param_groups")}


def save_dtensor(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, extra: Any,
                 reorder: Reorder | None = None, blocks: Sequence[str] = (), block_mesh: DeviceMesh | None = None
                 ) -> None:
    """Write ``model`` and ``optimizer`` (DTensor parameters and state, e.g. FSDP2's) and ``extra`` (pickled) to
    the folder ``path``, each rank its shards. ``blocks``: names of plain parameters of which each rank of the 1-D
    ``block_mesh`` holds one block along dim 0 (expert stacks under expert parallelism), written whole with their
    per-row state (:func:`block_shard`); ranks holding the same block (replicas) write it once. Collective."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if reorder is not None:
        reorder(model_sd, optim_sd, to_canonical=True)
    _blocks_whole(model_sd, optim_sd, blocks, block_mesh)
    dcp.save({"model": model_sd, "optim": optim_sd, "trainer": _pickled(extra),
              _OPTIMIZER_META: _pickled(_optimizer_meta(optimizer))}, checkpoint_id=path)


def load_dtensor(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                 reorder: Reorder | None = None, blocks: Sequence[str] = (), block_mesh: DeviceMesh | None = None
                 ) -> Any:
    """Load a checkpoint written by :func:`save_dtensor` into ``model`` and ``optimizer`` (sharded as for the run
    that saved it, or on another mesh; ``blocks`` over ``block_mesh`` as at :func:`save_dtensor`, each rank
    reading the rows of its block); returns ``extra``. Collective."""
    meta = {}
    if _OPTIMIZER_META in dcp.FileSystemReader(path).read_metadata().state_dict_metadata:  # older ones have none
        read = {_OPTIMIZER_META: b""}
        dcp.load(read, checkpoint_id=path)
        meta = torch.load(io.BytesIO(read[_OPTIMIZER_META]), weights_only=True)
    if meta.get("optimizer", type(optimizer).__name__) != type(optimizer).__name__:
        raise ValueError(f"the checkpoint at {path} was saved by {meta['optimizer']}, not "
                         f"{type(optimizer).__name__}; build the same optimizer it came from to load it")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    _blocks_whole(model_sd, optim_sd, blocks, block_mesh)
    sd = {"model": model_sd, "optim": optim_sd, "trainer": b""}
    dcp.load(sd, checkpoint_id=path)
    for name in blocks:  # back to this rank's blocks
        sd["model"][name] = sd["model"][name].to_local()
        if name in sd["optim"]["state"]:
            sd["optim"]["state"][name] = {k: v.to_local() if isinstance(v, DTensor) else v
                                          for k, v in sd["optim"]["state"][name].items()}
    if reorder is not None:
        reorder(sd["model"], sd["optim"], to_canonical=False)
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    if "rounding_step" in meta:
        optimizer.rounding_step = meta["rounding_step"]
    return torch.load(io.BytesIO(sd["trainer"]), weights_only=True)


def _blocks_whole(model_sd: dict, optim_sd: dict, blocks: Sequence[str], mesh: DeviceMesh | None) -> None:
    """In the state dicts of ``get_state_dict``, in place: each block parameter in ``blocks`` and its per-row
    optimizer state as the block of its whole tensor over ``mesh`` (:func:`block_shard`)."""
    for name in blocks:
        n = model_sd[name].shape[0]
        model_sd[name] = block_shard(model_sd[name], mesh)
        if name in optim_sd["state"]:  # a new dict: state_dict() shares the live optimizer's per-parameter dicts
            optim_sd["state"][name] = {k: block_shard(v, mesh) if stacks_per_block(v, n) else v
                                       for k, v in optim_sd["state"][name].items()}
