"""One interface for every way a training run spreads over processes: :class:`Parallelism`.

    par = make_parallelism("layerwise", bf16=True)    # "none" | "ddp" | "layerwise" | "fsdp"
    module = par.wrap(model)                          # the module to call
    opt = par.build_optimizer(model, "muon", splits=QKV_SPLITS, lr=0.02)
    rows = par.batch_rows(batch_size)                 # this rank's rows of every global micro-batch
    for micro in range(accum):                        # gradient accumulation
        with par.no_sync() if micro < accum - 1 else contextlib.nullcontext():
            with par.autocast():
                _, loss = module(x[rows], y[rows])
            (loss / accum).backward()
    par.clip_grad_norm_(1.0)                          # the global norm, over every rank's gradients
    opt.step()
    par.save(out / par.checkpoint_name, {"step": step})   # collective where the state is sharded

One subclass per mode, built by :func:`make_parallelism`, the one place a mode's name is looked up:

* :class:`SingleProcess` ("none"): one process; on a GPU the optimizer replays its matrix step from a CUDA
  graph where it offers one.
* :class:`DDP` ("ddp"): torch's DistributedDataParallel; every rank holds and steps the whole optimizer.
* :class:`Layerwise` ("layerwise"): :class:`~matrixopt.distributed.layerwise.LayerwiseOptimizer`; each rank
  owns whole parameters, any registered optimizer.
* :class:`FSDP` ("fsdp"): FSDP2 ``fully_shard`` over a ``"dp"`` mesh dim; Muon as
  :class:`~matrixopt.distributed.sharded.ShardedMuon`, AdamW as torch AdamW over the DTensors. Tensor parallelism
  composes into it (``tp > 1``: a ``("dp", "tp")`` mesh, the model's :class:`TPPlan` applied first, then FSDP2
  over "dp"); another parallel dim (experts) would add a mesh dim and a plan the same way. NorMuon and AdaMuon run
  as their sharded forms (:class:`~matrixopt.distributed.sharded.ShardedNorMuon`, ``ShardedAdaMuon``), without
  tensor parallelism; so do Shampoo and SOAP (:class:`~matrixopt.distributed.sharded_precond.ShardedShampoo`,
  ``ShardedSOAP``: each matrix preconditioned whole on an owner rank).

Expert parallelism composes into DDP, Layerwise and FSDP (``ep > 1``: each mixture-of-experts layer's experts
split over groups of ep ranks, :mod:`matrixopt.distributed.ep`).

The multi-process modes run one process per rank, as torchrun starts them: constructing one joins the default
process group (created from torchrun's environment unless the caller already did: NCCL on CUDA, gloo on CPU)
and leaves it to the caller. Every rank draws the same global batch and takes its rows (:meth:`batch_rows`), so
the data depend only on the seed and N ranks train as one process would (within fp32 reduction order).

A Parallelism holds the model of its last :meth:`wrap` and the optimizer of its last :meth:`build_optimizer`:
``no_sync``, ``clip_grad_norm_``, ``save`` and ``load`` act on those.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from matrixopt.device import resolve_device
from matrixopt.distributed import checkpoint, comm
from matrixopt.distributed import ep as ep_lib
from matrixopt.distributed.fsdp import apply_fsdp
from matrixopt.distributed.layerwise import Blocks, LayerwiseOptimizer
from matrixopt.distributed.sharded import ShardedAdaMuon, ShardedMuon, ShardedNorMuon
from matrixopt.distributed.sharded_precond import ShardedShampoo, ShardedSOAP
from matrixopt.distributed.tp import MODES as TP_MODES
from matrixopt.optim.base import MatrixOptimizer
from matrixopt.optim.nonfinite import clip_coefficient
from matrixopt.optim.registry import OPTIMIZERS, accepted, build_optimizer
from matrixopt.optim.routing import param_groups

T = TypeVar("T")
# matrix optimizers on DTensors
SHARDED = {"muon": ShardedMuon, "normuon": ShardedNorMuon, "adamuon": ShardedAdaMuon, "shampoo": ShardedShampoo,
           "soap": ShardedSOAP}
Splits = Mapping[str, int | Sequence[int]]


@dataclass(frozen=True)
class TPPlan:
    """How one model family shards over a tensor-parallel mesh (the model itself never knows), e.g.
    :data:`matrixopt.train.parallelize.GPT_TP`."""

    shard: Callable[[nn.Module, DeviceMesh], Any]
    """``shard(model, tp_mesh)``: shard the model over the 1-D TP mesh, in place."""
    reorder_state: Callable[..., None] | None = None
    """``reorder_state(model, model_sd, optim_sd, to_canonical=bool)``: convert, in place, the state dicts of
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` between the layout the sharded model trains in and
    the single-process layout checkpoints hold (None: they are the same). Collective."""


class Parallelism:
    """How a run spreads over processes; the base class acts as one process does, and each mode's subclass
    overrides what it changes. Attributes:

    * ``device``: this process's device (``cuda:LOCAL_RANK`` under torchrun);
    * ``rank``, ``world``: this process's rank and the number of processes (0 and 1 for one process);
    * ``checkpoint_name``: the checkpoint in a run's folder, a file (``"ckpt.pt"``) or a
      torch.distributed.checkpoint folder (``"ckpt"``) where each rank holds part of the state;
    * ``tp``: the tensor-parallel degree (1 but under :class:`FSDP`);
    * ``bf16``: whether the run computes in bf16 (see :meth:`autocast`);
    * ``model``, ``module``, ``optimizer``: those of the last :meth:`wrap` and :meth:`build_optimizer` (None
      before).
    """

    name: ClassVar[str]
    checkpoint_name: ClassVar[str] = "ckpt.pt"
    tensor_parallel: ClassVar[bool] = False  # whether tp > 1 composes into this mode
    expert_parallel: ClassVar[bool] = False  # whether ep > 1 composes into this mode

    def __init__(self, device: str | torch.device = "auto", *, bf16: bool = False) -> None:
        self.device = resolve_device(device) if isinstance(device, str) else device
        self.bf16 = bf16
        self.rank, self.world, self.tp, self.ep = 0, 1, 1, 1
        self.model: nn.Module | None = None
        self.module: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    @classmethod
    def check(cls, *, tp: int = 1, tp_mode: str = "auto", ep: int = 1) -> None:
        """Raise ValueError naming a setting this mode does not take."""
        if ep < 1:
            raise ValueError(f"ep must be a positive integer (1: no expert parallelism), got {ep}")
        if ep > 1 and not cls.expert_parallel:
            modes = ", ".join(n for n, c in PARALLELISMS.items() if c.expert_parallel)
            raise ValueError(f"ep={ep} needs --parallel {modes} (expert parallelism shards the experts over groups "
                             f"of ep ranks, data parallel over the rest), got --parallel {cls.name}")
        if tp < 1:
            raise ValueError(f"tp must be a positive integer (1: no tensor parallelism), got {tp}")
        if tp > 1 and not cls.tensor_parallel:
            modes = ", ".join(n for n, c in PARALLELISMS.items() if c.tensor_parallel)
            raise ValueError(f"tp={tp} needs --parallel {modes} (tensor parallelism runs under FSDP2 on a dp x tp "
                             f"mesh; dp may be 1), got --parallel {cls.name}")
        if tp_mode not in TP_MODES:
            raise ValueError(f"tp_mode must be one of {', '.join(TP_MODES)}, got {tp_mode!r}")
        if tp_mode != "auto" and tp == 1:
            raise ValueError(f"tp_mode={tp_mode!r} chooses Muon's tensor-parallel Newton–Schulz, but this run has "
                             f"tp=1; use it with --tp N (N > 1), or drop --tp-mode")

    # ------------------------------------------------------------------------------------------ model, optimizer

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module to call for ``model`` (on ``device``): the model itself, its DDP wrapper, or the model
        sharded in place (FSDP2, tensor parallelism first). Call before :meth:`build_optimizer`."""
        self.model, self.module, self.optimizer = model, self._wrap(model), None
        return self.module

    def _wrap(self, model: nn.Module) -> nn.Module:
        return model

    def release(self) -> None:
        """Forget the model and optimizer, so that their memory can be freed (e.g. between benchmarks)."""
        self.model = self.module = self.optimizer = None

    def build_optimizer(self, model: nn.Module, name: str, *, splits: Splits | None = None,
                        **hparams: Any) -> torch.optim.Optimizer:
        """The registered optimizer ``name`` for the :meth:`wrap`-ped ``model``, with this mode's defaults
        (:meth:`optimizer_defaults`, which ``hparams`` override). ``splits``: fused weights, as in
        :func:`matrixopt.build_optimizer`. An optimizer that rejects a hyperparameter raises ValueError."""
        if model is not self.model:
            raise RuntimeError("call wrap(model) before build_optimizer(model, ...)")
        try:
            self.optimizer = self._build(model, name, splits, self.optimizer_defaults(model, name) | hparams)
        except TypeError as e:
            raise ValueError(f"optimizer {name!r} rejected its hyperparameters ({e}); check --opt") from None
        return self.optimizer

    def optimizer_defaults(self, model: nn.Module, name: str) -> dict[str, Any]:
        """Options this mode gives optimizer ``name`` unless the caller sets them."""
        return {}

    def _build(self, model: nn.Module, name: str, splits: Splits | None, hparams: dict) -> torch.optim.Optimizer:
        return build_optimizer(model, name, splits=splits, **hparams)

    # ------------------------------------------------------------------------------------------------- the step

    def sync_grads(self) -> None:
        """Finish the gradients after the last micro-batch's backward, where the wrapper does not (expert
        gradients under expert parallelism). Collective."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context for the forward and backward of every micro-batch but the last: accumulate local gradients
        without communicating; the last backward reduces the sums."""
        return contextlib.nullcontext()

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clip the gradients to a global 2-norm (over every rank's) of ``max_norm``; returns that norm before
        clipping, a 0-d tensor. Collective. A matrixopt optimizer applies the coefficient inside its next step."""
        if isinstance(self.optimizer, MatrixOptimizer):
            return self.optimizer.clip_grad_norm_(max_norm)
        return nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast when ``bf16``, else nothing."""
        if self.bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ---------------------------------------------------------------------------------------- data, agreement

    def batch_rows(self, batch_size: int) -> slice:
        """This rank's rows of a global batch of ``batch_size`` rows."""
        return slice(None)

    def mean(self, value: Tensor) -> Tensor:
        """The mean of a per-rank scalar over the data-parallel ranks (e.g. a loss to log). Collective."""
        return value

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank, agreed on the host without waiting for queued GPU work (e.g. a
        Ctrl-C seen by one rank). Collective."""
        return flag

    def from_rank_zero(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on rank 0 only (e.g. file-system work); its result, or the ValueError/OSError it raised,
        given to every rank."""
        return fn()

    def barrier(self) -> None:
        """Wait for every rank."""

    # ------------------------------------------------------------------------------------------------ checkpoints

    def save(self, path: Path, extra: dict) -> None:
        """Write the model, the optimizer and ``extra`` (picklable trainer state: step, RNG, ...) to ``path``,
        atomically. Here every rank holds the whole state: rank 0 writes one file
        (:func:`matrixopt.distributed.checkpoint.save_checkpoint`, keys ``model``, ``optimizer`` and those of
        ``extra``). Collective."""
        if self.rank == 0:
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
            checkpoint.save_checkpoint(path, extra | state)
        self.barrier()

    def load(self, path: Path) -> dict:
        """Load a checkpoint written by :meth:`save` into the model and optimizer; returns its ``extra``. A
        damaged file raises :class:`~matrixopt.distributed.checkpoint.CheckpointError`. Collective."""
        ck = checkpoint.load_checkpoint(path)
        self.model.load_state_dict(ck.pop("model"))
        self.optimizer.load_state_dict(ck.pop("optimizer"))
        return ck

    def describe(self) -> dict[str, Any]:
        """The facts run.json records."""
        return {"parallel": self.name, "world_size": self.world, "tp": self.tp} | (
            {"ep": self.ep} if self.ep > 1 else {})


class SingleProcess(Parallelism):
    """One process, the whole model and optimizer."""

    name = "none"

    def __init__(self, device: str | torch.device = "auto", *, bf16: bool = False) -> None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:
            raise ValueError(f"this process is one of {world} ranks (WORLD_SIZE={world}) but --parallel is none, so "
                             f"every rank would train the whole run into the same folder; pass --parallel ddp, "
                             f"layerwise or fsdp")
        super().__init__(device, bf16=bf16)

    def optimizer_defaults(self, model: nn.Module, name: str) -> dict[str, Any]:
        # one GPU: the matrix step replayed from a CUDA graph where the optimizer offers it (cuda_graph=False turns
        # it off). Small models are bound by kernel launches: on an H100, 300 steps of the shakespeare-char preset
        # took 7.4 s with it and 10.8 s without; GPT-2-small gains 2%, medium is within 1% (docs/results/bench).
        return accepted(name, cuda_graph=True) if next(model.parameters()).is_cuda else {}


class MultiProcess(Parallelism):
    """Data parallelism over the ranks of the default process group (joined here), one process per rank. The
    data-parallel ranks are every rank unless a subclass narrows ``dp_group``. With ``ep > 1`` (where the mode
    takes it), the EP groups of ``ep`` consecutive ranks and the replica groups of each expert shard
    (:func:`~matrixopt.distributed.ep.expert_groups`)."""

    def __init__(self, device: str | torch.device = "auto", *, bf16: bool = False, ep: int = 1) -> None:
        super().__init__(device, bf16=bf16)
        if not dist.is_initialized():
            if "RANK" not in os.environ:
                raise ValueError(f"--parallel {self.name} runs one process per rank: launch it with `torchrun "
                                 f"--nproc-per-node N -m matrixopt train ...` (or `python -m torch.distributed.run`)")
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        if self.device.type == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dp_group: dist.ProcessGroup | None = None  # None: every rank
        self.host_group = comm.host_group()
        self.ep = ep
        self.expert_names: list[str] = []
        self.expert_params: list[nn.Parameter] = []
        if ep > 1:
            self.ep_group, self.replica_group = ep_lib.expert_groups(self.world, ep)
            self.ep_rank = dist.get_rank(self.ep_group)

    def _shard_experts(self, model: nn.Module) -> None:
        """Keep this rank's experts of every expert stack (``ep > 1``) and route tokens to them over the EP group;
        ``expert_names`` and ``expert_params`` name the stacks. ValueError for a model without expert stacks or
        with an expert count ep does not divide."""
        ep_lib.shard_experts(model, self.ep_group)
        self._find_experts(model)
        if not self.expert_names:
            raise ValueError(f"ep={self.ep} but the model has no expert stacks; use a mixture-of-experts model")

    def _find_experts(self, model: nn.Module) -> None:
        """Set ``expert_names`` and ``expert_params`` to the model's expert stacks (none for a dense model)."""
        self.expert_names = ep_lib.expert_param_names(model)
        named = dict(model.named_parameters())
        self.expert_params = [named[n] for n in self.expert_names]

    def batch_rows(self, batch_size: int) -> slice:
        """This rank's equal slice of the rows, in data-parallel rank order: with per-rank mean losses and
        mean-reduced gradients that reproduces the single-process gradient."""
        return batch_slice(batch_size, self.dp_group)

    def mean(self, value: Tensor) -> Tensor:
        return mean_over_ranks(value, self.dp_group)

    def any(self, flag: bool) -> bool:
        return any_rank(flag, self.host_group)

    def from_rank_zero(self, fn: Callable[[], T]) -> T:
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = (True, fn())
            except (ValueError, OSError) as e:
                box[0] = (False, e)
        dist.broadcast_object_list(box, src=0)
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def barrier(self) -> None:
        dist.barrier()


class DDP(MultiProcess):
    """DistributedDataParallel: every rank holds the whole model and optimizer; checkpoints are one file, written
    by rank 0 and read by every rank.

    With ``ep > 1``, expert parallelism (:mod:`matrixopt.distributed.ep`): each mixture-of-experts layer's
    experts are split over groups of ``ep`` consecutive ranks, which exchange tokens with all-to-alls; DDP
    reduces the dense gradients over every rank and :meth:`sync_grads` the expert gradients over each shard's
    ``world / ep`` replicas. Each rank's optimizer steps its own dense copy and expert shard (a matrix optimizer
    orthogonalizes each local expert's matrix). Checkpoints hold the whole expert stacks (the single-process
    layout), so they resume at any ep and in one process."""

    name = "ddp"
    expert_parallel = True

    def _wrap(self, model: nn.Module) -> nn.Module:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        if self.ep > 1:
            self._shard_experts(model)
            nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, self.expert_names)
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)

    def optimizer_defaults(self, model: nn.Module, name: str) -> dict[str, Any]:
        # each rank steps its whole replica, as one process does: the matrix step replayed from a CUDA graph. With
        # moe-2b's expert stacks under EP 2 on two H100s it took 41.5 ms of the compute stream (3.9 ms of host)
        # against 53.4 ms (46.9 ms of host) eager (docs/results/moe)
        return accepted(name, cuda_graph=True) if next(model.parameters()).is_cuda else {}

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.module.no_sync()

    def sync_grads(self) -> None:
        if self.ep > 1:
            ep_lib.reduce_expert_grads(self.expert_params, self.replica_group, self.world)

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Under expert parallelism the global norm counts the replicated dense gradients once and every expert
        shard once (their squares summed over the EP group). A matrixopt optimizer clips itself, the expert
        stacks passed as shards (:meth:`~matrixopt.optim.base.MatrixOptimizer.clip_grad_norm_`): its step applies
        the coefficient as it reads the gradients and takes the clip's norms as its non-finite check, and a
        non-finite total, the same on every rank, skips the step on every rank."""
        if self.ep == 1:
            return super().clip_grad_norm_(max_norm)
        if isinstance(self.optimizer, MatrixOptimizer):
            return self.optimizer.clip_grad_norm_(max_norm, sharded=self.expert_params, group=self.ep_group)
        experts = {id(p) for p in self.expert_params}
        params = [p for p in self.model.parameters() if p.grad is not None]
        dense = nn.utils.get_total_norm([p.grad for p in params if id(p) not in experts])
        sq = nn.utils.get_total_norm([p.grad for p in self.expert_params]).square()
        dist.all_reduce(sq, group=self.ep_group)  # the shards' squares: every expert once
        total = (dense.square() + sq).sqrt()
        nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def save(self, path: Path, extra: dict) -> None:
        if self.ep == 1:
            return super().save(path, extra)
        model_sd, optim_sd = self.model.state_dict(), self.optimizer.state_dict()
        self._map_experts(model_sd, optim_sd, lambda t: ep_lib.gather_experts(t, self.ep_group))
        if self.rank == 0:
            checkpoint.save_checkpoint(path, extra | {"model": model_sd, "optimizer": optim_sd})
        self.barrier()

    def load(self, path: Path) -> dict:
        if self.ep == 1:
            return super().load(path)
        ck = checkpoint.load_checkpoint(path)
        model_sd, optim_sd = ck.pop("model"), ck.pop("optimizer")
        self._map_experts(model_sd, optim_sd, lambda t: ep_lib.local_experts(t, self.ep, self.ep_rank).clone(),
                          whole=True)
        self.model.load_state_dict(model_sd)
        self.optimizer.load_state_dict(optim_sd)
        return ck

    def _map_experts(self, model_sd: dict, optim_sd: dict, fn: Callable[[Tensor], Tensor], whole: bool = False):
        """Apply ``fn`` in place to the expert stacks of the state dicts and to their optimizer state tensors
        that stack per expert (dim 0 of the local stack's size, or the whole stack's when ``whole``)."""
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        for name, p in zip(self.expert_names, self.expert_params):
            model_sd[name] = fn(model_sd[name])
            n = p.shape[0] * (self.ep if whole else 1)
            i = index[id(p)]
            if i in optim_sd["state"]:  # a new dict: state_dict() shares the live optimizer's per-parameter dicts
                optim_sd["state"][i] = {k: fn(v) if checkpoint.stacks_per_block(v, n) else v
                                        for k, v in optim_sd["state"][i].items()}


class Layerwise(MultiProcess):
    """Layer-wise data parallelism (:class:`~matrixopt.distributed.layerwise.LayerwiseOptimizer`): each rank
    owns whole parameters and their optimizer state. Checkpoints are a torch.distributed.checkpoint folder,
    resumable at any number of ranks.

    With ``ep > 1``, expert parallelism (:mod:`matrixopt.distributed.ep`): each mixture-of-experts layer's experts
    are split over groups of ``ep`` consecutive ranks, which exchange tokens with all-to-alls. The dense
    parameters are owned over every rank as without it; each rank's expert stacks (its ``(E/ep, out, in)``
    blocks) are owned among the ``world / ep`` replicas of that shard only, which average their gradients (with
    ``world == ep`` each rank owns its own, and nothing is sent for them); the balancer counts both, so every
    rank's total step cost stays even (:class:`~matrixopt.distributed.layerwise.Blocks`). A matrix optimizer
    orthogonalizes each local expert's matrix. Clipping takes the global norm, every expert counted once.
    Checkpoints hold the whole expert stacks (the single-process layout), so they resume at any ep and number of
    ranks."""

    name = "layerwise"
    checkpoint_name = "ckpt"
    expert_parallel = True

    def _wrap(self, model: nn.Module) -> nn.Module:
        if self.ep > 1:
            self._shard_experts(model)
        return model

    def optimizer_defaults(self, model: nn.Module, name: str) -> dict[str, Any]:
        # under bf16 autocast the matrices feed only bf16 products: kept in bf16 (fp32 masters on their owners,
        # gradients summed and reduced in fp32) they train as fp32 weights do, while the forward skips autocast's
        # cast of every weight in every micro-batch and the owners' broadcasts travel in bf16
        return {"param_dtype": torch.bfloat16} if self.bf16 else {}

    def _build(self, model: nn.Module, name: str, splits: Splits | None, hparams: dict) -> torch.optim.Optimizer:
        blocks = Blocks(tuple(self.expert_names), self.replica_group, self.ep_group) if self.ep > 1 else None
        return LayerwiseOptimizer(model, name, splits=splits, blocks=blocks, **hparams)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.optimizer.no_sync()

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        return self.optimizer.clip_grad_norm_(max_norm)  # the owners hold the reduced gradients

    def save(self, path: Path, extra: dict) -> None:
        checkpoint.replace_folder(path, lambda tmp: checkpoint.save(tmp, self.model, self.optimizer, extra=extra))

    def load(self, path: Path) -> dict:
        return checkpoint.load(path, self.model, self.optimizer)


class FSDP(MultiProcess):
    """FSDP2 over the ``"dp"`` dim of ``mesh``, with tensor parallelism over ``"tp"`` when ``tp > 1``: the ranks
    form a ``("dp", "tp")`` mesh of world / tp by tp (TP groups are consecutive ranks, within a node), every
    block is sharded over "tp" by ``tp_plan``, then FSDP2 shards over "dp"; the ranks of one TP group take the
    same batch rows. Under ``bf16`` the parameters compute in bf16 and gradients reduce in fp32 (FSDP2's mixed
    precision policy, so :meth:`autocast` does nothing). Muon runs as ShardedMuon (TP Newton–Schulz in
    ``tp_mode``), Shampoo and SOAP as ShardedShampoo and ShardedSOAP (``tp=1``), AdamW as torch AdamW.
    Checkpoints are a torch.distributed.checkpoint folder holding the single-process layout, resumable at any tp
    (Shampoo's and SOAP's state: each matrix's once, from its owner, resumable at any number of ranks).

    A mixture-of-experts model's expert stacks stay out of FSDP2 (``ignored_params``): plain tensors, handled as
    under :class:`DDP`. With ``ep > 1`` each rank keeps its ``(E/ep, out, in)`` blocks and exchanges tokens over its
    EP group (:mod:`matrixopt.distributed.ep`); with ``ep = 1`` every rank holds every expert. :meth:`sync_grads`
    sums their gradients over each shard's ``world / ep`` replicas, and the optimizer steps them beside the
    DTensors: the Muon family orthogonalizes each local expert's matrix (ShardedMuon's plain-tensor path), AdamW
    takes them as a group of their own. Clipping takes the global norm, every expert counted once. Checkpoints hold
    the whole stacks (:func:`~matrixopt.distributed.checkpoint.block_shard`), so they resume at any ep and number of
    ranks. Experts take the Muon family or AdamW, without tensor parallelism.

    ``gather_once``: under gradient accumulation, gather the parameters once per step: the micro-batches before
    the last (inside :meth:`no_sync`) neither reduce gradients nor reshard parameters, so only the first forward
    and the last backward all-gather (2 gathers of each block per step instead of 2 per micro-batch), the first
    forward's all issued as it starts (from the second step on). Costs the whole model's gathered parameters (bf16
    under ``bf16``) in memory between micro-batches; the same result."""

    name = "fsdp"
    checkpoint_name = "ckpt"
    tensor_parallel = True
    expert_parallel = True
    optimizers: ClassVar[tuple[str, ...]] = ("muon", "normuon", "adamuon", "shampoo", "soap", "adamw")
    expert_optimizers: ClassVar[tuple[str, ...]] = ("muon", "normuon", "adamuon", "adamw")  # step plain stacks

    def __init__(self, device: str | torch.device = "auto", *, bf16: bool = False, tp: int = 1,
                 tp_mode: str = "auto", tp_plan: TPPlan | None = None, ep: int = 1, gather_once: bool = False) -> None:
        self.check(tp=tp, tp_mode=tp_mode, ep=ep)
        self.gather_once = gather_once
        self._forwarded = False  # whether a step's first forward ran (FSDP2 initializes lazily in it)
        if tp > 1 and tp_plan is None:
            raise ValueError(f"tp={tp} needs a tp_plan (how to shard the model over the TP ranks), e.g. "
                             f"matrixopt.train.parallelize.GPT_TP")
        super().__init__(device, bf16=bf16, ep=ep)
        self.tp, self.tp_mode, self.tp_plan = tp, tp_mode, tp_plan
        dims = self.mesh_dims(self.world, tp=tp)
        self.mesh = init_device_mesh(self.device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))
        self.dp_group = self.mesh.get_group("dp")
        # the ranks holding the other blocks of the expert stacks (checkpoints write them whole), and those
        # holding the same block (their gradients sum there; None: every rank)
        self.ep_mesh = DeviceMesh.from_group(self.ep_group, self.device.type) if ep > 1 else None
        if ep == 1:
            self.replica_group = None

    @classmethod
    def check(cls, *, tp: int = 1, tp_mode: str = "auto", ep: int = 1) -> None:
        super().check(tp=tp, tp_mode=tp_mode, ep=ep)
        if tp > 1 and ep > 1:
            raise ValueError(f"tp={tp} and ep={ep} do not compose under --parallel fsdp: the TP plan shards dense "
                             f"MLPs only; use one of them")

    @staticmethod
    def mesh_dims(world: int, *, tp: int = 1) -> dict[str, int]:
        """Mesh dim name -> size for ``world`` ranks: ``{"dp": world}``, or ``{"dp": world // tp, "tp": tp}``."""
        if world % tp:
            raise ValueError(f"--tp {tp} must divide the number of ranks, {world}; launch a multiple of {tp} "
                             f"ranks (torchrun --nproc-per-node) or pick a --tp that divides {world}")
        return {"dp": world // tp} | ({"tp": tp} if tp > 1 else {})

    def _wrap(self, model: nn.Module) -> nn.Module:
        if self.tp > 1:
            self.tp_plan.shard(model, self.mesh["tp"])
        if self.ep > 1:
            self._shard_experts(model)
        else:
            self._find_experts(model)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if self.bf16 else None
        return apply_fsdp(model, self.mesh["dp"], mp_policy=policy, ignored_params=set(self.expert_params))

    def _build(self, model: nn.Module, name: str, splits: Splits | None, hparams: dict) -> torch.optim.Optimizer:
        if name not in self.optimizers:
            raise ValueError(f"--parallel fsdp supports the optimizers {', '.join(self.optimizers)}, not "
                             f"{name!r}; use --parallel layerwise for {name}")
        if self.expert_params and name not in self.expert_optimizers:
            raise ValueError(f"--parallel fsdp steps a mixture of experts' stacks with "
                             f"{' or '.join(self.expert_optimizers)}, not {name!r}; use --parallel ddp or layerwise "
                             f"for {name} on this model")
        if name in SHARDED:
            cls = SHARDED[name]
            tp = {"tp_mode": self.tp_mode} if issubclass(cls, ShardedMuon) else {}  # Muon's TP Newton–Schulz
            return cls(param_groups(model, matrix_flag=cls.matrix_flag, splits=splits), **tp, **hparams)
        groups = []  # DTensor foreach kernels take one mesh per call: one group per (routing group, mesh)
        for g in param_groups(model, matrix_flag=None, splits=splits):
            g.pop("names")
            groups += [g | {"params": ps} for ps in by_mesh(g["params"])]
        return OPTIMIZERS["adamw"](groups, **hparams)

    def no_sync(self) -> contextlib.AbstractContextManager:
        # after the first forward (FSDP2's lazy initialization) every gather of a step is issued up front
        gather_ahead = self.gather_once and self._forwarded
        self._forwarded = True
        return _fsdp_no_sync(self.module, keep_unsharded=self.gather_once, gather_ahead=gather_ahead)

    def sync_grads(self) -> None:
        if self.expert_params:
            ep_lib.reduce_expert_grads(self.expert_params, self.replica_group, self.world)

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        # DTensor gradient norms are partial: finish each mesh's across its ranks; the expert blocks' squares
        # summed over the EP group count every expert once; then combine
        experts = {id(p) for p in self.expert_params}
        meshes = by_mesh(p for p in self.model.parameters() if p.grad is not None and id(p) not in experts)
        norms = [nn.utils.get_total_norm([p.grad for p in ps]).full_tensor() for ps in meshes]
        stacks = [p for p in self.expert_params if p.grad is not None]
        if stacks:
            sq = nn.utils.get_total_norm([p.grad for p in stacks]).square()
            if self.ep > 1:
                dist.all_reduce(sq, group=self.ep_group)
            norms.append(sq.sqrt())
            meshes.append(stacks)
        total = torch.linalg.vector_norm(torch.stack(norms))
        if isinstance(self.optimizer, MatrixOptimizer) and not stacks:
            # held for the step where it reads the gradients (sharded Muon: its momentum pass and AdamW's kernel),
            # which saves a pass over every gradient; scaled here otherwise
            self.optimizer.scale_grads_(clip_coefficient(total, max_norm))
            return total
        for ps in meshes:
            nn.utils.clip_grads_with_norm_(ps, max_norm, total)
        return total

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def save(self, path: Path, extra: dict) -> None:
        checkpoint.replace_folder(path, lambda tmp: checkpoint.save_dtensor(tmp, self.model, self.optimizer, extra,
                                                                            self._reorder(), **self._blocks()))

    def load(self, path: Path) -> dict:
        return checkpoint.load_dtensor(path, self.model, self.optimizer, self._reorder(), **self._blocks())

    def _blocks(self) -> dict[str, Any]:
        """The expert blocks checkpoints write whole: under ``ep > 1``, each EP group's ranks hold one stack."""
        return dict(blocks=self.expert_names, block_mesh=self.ep_mesh) if self.ep > 1 else {}

    def _reorder(self) -> Callable[..., None] | None:
        plan = self.tp_plan if self.tp > 1 else None
        if plan is None or plan.reorder_state is None:
            return None
        return lambda model_sd, optim_sd, *, to_canonical: plan.reorder_state(self.model, model_sd, optim_sd,
                                                                              to_canonical=to_canonical)


def by_mesh(params) -> list[list[nn.Parameter]]:
    """DTensor parameters grouped by device mesh, in order: under TP, block matrices live on the 2-D mesh and the
    rest on "dp", and DTensor foreach kernels take one mesh per call. Plain tensors (expert stacks kept out of
    FSDP2) form a group of their own."""
    groups: dict[DeviceMesh | None, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return list(groups.values())


def batch_slice(batch_size: int, process_group: dist.ProcessGroup | None = None) -> slice:
    """This rank's rows of a global batch of ``batch_size`` rows (equal slices, rank order), so N ranks see the
    same data as one process. With per-rank mean losses and mean-reduced gradients that reproduces the
    single-process gradient."""
    group = process_group or dist.group.WORLD
    rank, world = comm.rank(group), comm.world_size(group)
    if batch_size % world:
        raise ValueError(f"global batch size {batch_size} is not divisible by the {world} data-parallel ranks; "
                         f"use a multiple of {world}")
    per = batch_size // world
    return slice(rank * per, (rank + 1) * per)


def mean_over_ranks(value: Tensor, process_group: dist.ProcessGroup | None = None) -> Tensor:
    """The mean of a per-rank scalar over ranks (e.g. the loss to log). Collective."""
    group = process_group or dist.group.WORLD
    t = value.detach().float().clone()
    return comm.all_reduce_sum(t, group) / comm.world_size(group)


def any_rank(flag: bool, host_group: dist.ProcessGroup) -> bool:
    """Whether ``flag`` is set on any rank of ``host_group`` (from :func:`comm.host_group`): agreed on the host,
    without waiting for queued GPU work. Collective."""
    t = torch.tensor([float(flag)])
    return comm.all_reduce_max(t, host_group).item() > 0


@contextlib.contextmanager
def _fsdp_no_sync(module: nn.Module, keep_unsharded: bool = False, gather_ahead: bool = False):
    """FSDP2 without gradient reduction; with ``keep_unsharded``, also without resharding: parameters gathered by
    the first micro-batch stay gathered until the last, which runs outside (every block as :func:`apply_fsdp`
    shards it, resharding after forward and backward). With ``gather_ahead`` (needs ``keep_unsharded``) every
    block's all-gather is issued on entry, in forward order, behind the work already queued (the optimizer step):
    they run back to back while the forward computes, each block's forward waiting for its own (FSDP2 waits on a
    pending unshard in its pre-forward), instead of each gather being issued by the host as the forward reaches its
    block. Already gathered blocks (a later micro-batch) are left as they are. Left by an exception, the parameters
    are resharded, so no stale gathered copy outlives an optimizer step."""
    blocks = [m for m in module.modules() if isinstance(m, FSDPModule) and m is not module] if keep_unsharded else []
    module.set_requires_gradient_sync(False)
    if keep_unsharded:
        _set_resharding(module, blocks, False)
        if gather_ahead:
            for m in (module, *blocks):
                m.unshard(async_op=True)
    try:
        yield
    except BaseException:
        if keep_unsharded:
            module.reshard()
            for block in blocks:
                block.reshard()
        raise
    finally:
        module.set_requires_gradient_sync(True)
        if keep_unsharded:
            _set_resharding(module, blocks, True)


def _set_resharding(root: nn.Module, blocks: list[nn.Module], on: bool) -> None:
    """Reshard (or keep) every block's parameters after backward and the blocks' after forward; the root's
    resharding after forward is FSDP2's own choice (off) and left alone."""
    root.set_reshard_after_backward(on)
    for block in blocks:
        block.set_reshard_after_forward(on, recurse=False)


PARALLELISMS: dict[str, type[Parallelism]] = {"none": SingleProcess, "ddp": DDP, "layerwise": Layerwise,
                                             "fsdp": FSDP}


def parallelism_class(mode: str, *, tp: int = 1, tp_mode: str = "auto", ep: int = 1,
                      gather_once: bool = False) -> type[Parallelism]:
    """The class of parallel ``mode``, after checking the settings it is given (no process group needed: configs
    call it to validate themselves). ValueError names a bad one."""
    if mode not in PARALLELISMS:
        raise ValueError(f"parallel must be one of {', '.join(PARALLELISMS)}, got {mode!r}")
    cls = PARALLELISMS[mode]
    cls.check(tp=tp, tp_mode=tp_mode, ep=ep)
    if gather_once and cls is not FSDP:
        raise ValueError(f"gathering parameters once per step (--fsdp-gather-once) is FSDP2's; --parallel {mode} "
                         f"does not shard them, so drop it or use --parallel fsdp")
    return cls


def make_parallelism(mode: str, *, device: str | torch.device = "auto", tp: int = 1, tp_mode: str = "auto",
                     bf16: bool = False, tp_plan: TPPlan | None = None, ep: int = 1,
                     gather_once: bool = False) -> Parallelism:
    """The :class:`Parallelism` of ``mode`` ("none", "ddp", "layerwise" or "fsdp"), joined to the process group
    where it has several ranks. ``device``: "auto" (CUDA when available), "cpu", "cuda" or a torch.device.
    ``bf16``: the run computes in bf16 (autocast, or FSDP2's mixed precision). ``tp``, ``tp_mode``, ``tp_plan``:
    tensor parallelism under "fsdp" (see :class:`FSDP`). ``ep``: expert parallelism under "ddp", "layerwise" or
    "fsdp" (see :class:`DDP`, :class:`Layerwise`, :class:`FSDP`); ValueError unless it divides the number of
    ranks. ``gather_once``: FSDP2 keeps gathered parameters between micro-batches (:class:`FSDP`)."""
    cls = parallelism_class(mode, tp=tp, tp_mode=tp_mode, ep=ep, gather_once=gather_once)
    if cls.tensor_parallel:  # FSDP
        return cls(device, bf16=bf16, tp=tp, tp_mode=tp_mode, tp_plan=tp_plan, ep=ep, gather_once=gather_once)
    if cls.expert_parallel:
        return cls(device, bf16=bf16, ep=ep)
    return cls(device, bf16=bf16)
