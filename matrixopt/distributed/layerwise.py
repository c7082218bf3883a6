"""Layer-wise distributed optimizer: each data-parallel rank owns whole parameters.

A matrix optimizer (Muon, Shampoo, SOAP) needs the whole matrix, so instead of slicing every tensor across ranks
(ZeRO-1), each rank owns whole parameters, chosen by LPT on the optimizer's cost and then swapped between ranks
to even out optimizer-state memory without raising the largest cost (:mod:`.balance`). One step, per rank:

1. backward: each parameter's gradient hook copies the local gradient into its bucket's flat buffer (a parameter
   alone in its bucket lends its gradient tensor instead, with no copy) and frees ``p.grad``; a full bucket is
   summed into its owner (``reduce``, asynchronous), so the reduction overlaps the rest of backward. Buckets
   hold parameters of one owner and are launched in one order on every rank: the order gradients arrive in.
   Until a backward has shown it, that is guessed as the reverse of registration; at the first step, rank 0's
   observed order replaces the guess (as DDP rebuilds its buckets), so a parameter registered out of the order
   the model uses it in (GPT's position embedding, registered last but used first) does not hold every other
   bucket's reduction back to the end of backward, and the next forward gets its first parameters first.
2. ``step()``: wait for the reductions; the owner holds the mean over ranks (so equal local batches give the
   single-process gradient of the global batch: NCCL averages inside the reduction, on gloo the owner divides the
   sum by the world size) and runs the registered optimizer on its parameters in ``step_chunks`` chunks; after
   each chunk it broadcasts the finished buckets. After :meth:`LayerwiseOptimizer.clip_grad_norm_` the clip's
   per-gradient norms are the step's non-finite check; without it the check reads each owned gradient once.
3. next forward: a pre-forward hook on each module waits for the buckets holding that module's parameters, so
   the broadcasts overlap the rest of the step and the start of the forward. With ``param_dtype`` (bf16 under
   autocast, the trainer's setting) the matrix optimizer's parameters are kept in that dtype on every rank, each
   bucket's as views of one flat buffer that its owner casts its fp32 masters into and broadcasts as it is; with
   ``broadcast_dtype`` fp32 parameters travel in that dtype (half the bytes, the same forward).

AdamW-routed parameters are owned whole too (not ZeRO-1 slices): one rank runs AdamW on them and holds their
moments. Low-precision parameters (bf16) get an fp32 master copy on their owner only; the optimizer updates the
master and the owner broadcasts its bf16 cast. Each rank holds the optimizer state of its parameters only.

After the last step, call :meth:`LayerwiseOptimizer.wait_params` (a checkpoint save does) before reading the
parameters outside a forward or destroying the process group: that step's broadcasts are still in flight.

Expert parallelism (``blocks``, :class:`Blocks`): each rank holds its own block of every expert stack, under the
same names and shapes everywhere. A block is owned among its replicas only (the ranks that hold the same block):
its gradient is summed over them, divided by the world size like every other (each block saw the rows of every
rank of its block group), stepped by its owner and broadcast back to them; with no replicas its rank owns it and
nothing is sent. The blocks are balanced over the replica group first, and those per-rank loads start the dense
parameters' packing over every rank, so each rank's total cost stays even. Clipping and the non-finite agreement
span every rank, with each block counted once.

Gradients: a rank keeps no ``.grad`` for parameters it does not own; ``step()`` consumes the reduced gradients.
Clip with :meth:`LayerwiseOptimizer.clip_grad_norm_` (global norm over all ranks) and accumulate micro-batches
inside :meth:`LayerwiseOptimizer.no_sync`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor, nn

from matrixopt.distributed import comm
from matrixopt.distributed.balance import MATRIX_COSTS, Assignment, assign, muon_cost
from matrixopt.optim.base import MatrixOptimizer
from matrixopt.optim.layout import copy_marks
from matrixopt.optim.nonfinite import (
    NonFiniteGradientError,
    NonFinitePolicy,
    check_clip,
    clip_coefficient,
    grad_norms,
    label,
    nonfinite_flags,
    scale_grads,
)
from matrixopt.optim.registry import OPTIMIZERS
from matrixopt.optim.routing import param_groups, routing_summary

_GROUP_META = ("params", "names")  # group keys that are not hyperparameters


@dataclass(eq=False)
class Bucket:
    """Parameters of one owner and dtype, flattened in order. ``grad`` (the reduce buffer) lives on every rank;
    ``work`` handles are in flight between launch and wait. A ``direct`` bucket (one parameter, reduced in its
    own dtype) has no buffer of its own: ``grad`` is the parameter's gradient, flattened, taken from backward
    and reduced in place, with no copy."""

    index: int
    owner: int  # a rank of ``group``
    group: comm.Group
    owned: bool  # whether this rank is the owner
    params: list[Tensor]
    offsets: list[int]
    numel: int
    grad: Tensor | None
    direct: bool = False
    arrived: int = 0
    grad_work: Any = None
    param_work: Any = None
    param_buffer: Tensor | None = None
    seen: set[int] = field(default_factory=set)
    accumulated: set[int] = field(default_factory=set)  # params whose micro-batch gradients ``grad`` sums so far
    wire: torch.dtype | None = None  # the dtype its parameters are broadcast in (None: their own)
    flat: Tensor | None = None  # the storage its parameters are views of (matrices kept in param_dtype), if any
    mean: bool = False  # its reduction averages over every rank (NCCL), so the owner divides nothing afterwards

    def segment(self, buf: Tensor, k: int) -> Tensor:
        p = self.params[k]
        return buf[self.offsets[k]:self.offsets[k] + p.numel()].view(p.shape)


@dataclass(eq=False)
class Chunk:
    """A slice of the owner's step: an inner optimizer over some of its parameters, after which the buckets with
    index < ``bucket_end`` are complete and can be broadcast."""

    optimizer: torch.optim.Optimizer
    outer_group: list[int]  # inner group index -> outer group index
    params: list[Tensor]  # its model parameters (those with a master take its cast after the step)
    bucket_end: int


@dataclass(frozen=True)
class Blocks:
    """Parameters of which each rank holds one block along dim 0: expert parallelism's ``(E/ep, out, in)``
    slices of the expert stacks (:mod:`matrixopt.distributed.ep`). They have the same names and shapes on every
    rank; the whole tensor is the blocks of ``block_group`` stacked in its rank order, ``(n len(block_group),
    ...)``, which is what checkpoints hold."""

    names: tuple[str, ...]
    """The block parameters, by name."""
    replica_group: comm.Group
    """The ranks holding the same blocks as this one (one rank: no replicas). Each block parameter is owned, and
    its gradient reduced and its value broadcast, among these ranks only."""
    block_group: comm.Group
    """The ranks holding the other blocks, in block order. Its ranks must share their rank in their replica
    groups (as expert parallelism's consecutive EP groups do), so the same ranks own every block of a tensor."""


def _strip(groups: Sequence[dict[str, Any]], keep_names: bool) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if keep_names or k != "names"} for g in groups]


def _weak_hook(method: Callable[..., Any]) -> Callable[..., Any]:
    """The bound ``method`` as a hook that holds its object weakly. A parameter's post-accumulate-grad hook lives in
    autograd's C++ state, which Python's collector does not traverse: a bound method there would keep the optimizer,
    and through it the model and all its state, alive for as long as the parameters, even once nothing else
    refers to either."""
    ref, func = weakref.ref(method.__self__), method.__func__

    def hook(*args: Any) -> Any:
        obj = ref()
        return None if obj is None else func(obj, *args)

    return hook


def _remove_hooks(handles: list[Any]) -> None:
    for h in handles:
        h.remove()


class LayerwiseOptimizer(torch.optim.Optimizer):
    """The optimizer registered as ``name`` (``matrixopt.OPTIMIZERS``), distributed layer-wise over
    ``process_group``. Construct it on every rank with the same model (same parameter names, shapes and dtypes)
    and hyperparameters; that is checked, and a mismatch raises ValueError naming it on every rank.

    Args:
        model: the model, identical on every rank; its parameters are made identical (owner's copy) here.
        name: a registered optimizer: "muon", "mop", "shampoo", "soap", "adamw", ...
        process_group: the data-parallel group; None creates a group over all ranks with ``timeout``.
        timeout: how long a collective waits for a dead or stuck rank before raising (when we create the group).
        bucket_cap_mb: flat bucket size cap; one parameter larger than the cap gets its own bucket.
        step_chunks: the owner runs its step in this many chunks and broadcasts after each (1 = no overlap of
            the broadcasts with the owner's compute, only with the next forward).
        reduce_dtype: dtype of the gradient reduction (None: the parameter dtype, as DDP does).
        param_dtype: dtype the matrix optimizer's parameters are kept in on every rank (None: as they are).
            ``torch.bfloat16`` under bf16 autocast: each owner steps an fp32 master made here from the parameter
            before it is converted, and broadcasts its bf16 cast; every rank sums each micro-batch's gradient of
            those parameters into an fp32 buffer as backward makes it (not in ``p.grad``) and reduces in fp32.
            Training is then the same as with fp32 parameters where the model uses these matrices only in bf16
            autocast products, which round the weights to the same bf16 (a transformer's linear layers), and the
            bf16 weight gradients those products make are summed in fp32 as autocast's casts would: the forward
            skips autocast's cast of every such weight in every micro-batch, the other ranks take the broadcast
            with no conversion, and they hold 2 bytes per parameter instead of 4. The trainer sets it under bf16
            autocast.
        broadcast_dtype: dtype the matrix optimizer's parameters are broadcast in after a step (None: their own).
            ``torch.bfloat16`` halves the broadcast of fp32 matrices: the other ranks then hold the owner's value
            rounded to bf16, while the owner keeps the exact one (what it steps from, and what checkpoints save).
            Training is unchanged where the model uses those matrices only in bf16 autocast products (autocast
            rounds them to the same bf16), as a transformer's linear layers are; the trainer sets it under bf16
            autocast. Elsewhere the other ranks would compute with the rounded values.
        cost: ``cost(m, n)`` of one step on one matrix, for LPT; default ``balance.MATRIX_COSTS[name]``.
        adamw, matrix, splits, experts: routing, as in :func:`matrixopt.build_optimizer`.
        blocks: parameters each rank holds a block of (expert parallelism), owned among their replicas only;
            see :class:`Blocks` and the module docstring.
        hparams: the optimizer's hyperparameters (lr, weight_decay, ...).

    ``param_groups`` are the global groups (every parameter on every rank): LR schedulers work on them and
    changes reach the owners' optimizers at the next step.
    """

    def __init__(self, model: nn.Module, name: str, *, process_group: comm.Group | None = None,
                 timeout: timedelta = timedelta(minutes=10), bucket_cap_mb: float = 25.0, step_chunks: int = 2,
                 reduce_dtype: torch.dtype | None = None, param_dtype: torch.dtype | None = None,
                 broadcast_dtype: torch.dtype | None = None,
                 cost: Callable[[int, int], float] | None = None,
                 adamw: Sequence[str] = (), matrix: Sequence[str] = (),
                 splits: Mapping[str, int | Sequence[int]] | None = None, experts: Sequence[str] = (),
                 blocks: Blocks | None = None, verbose: bool = False, **hparams: Any) -> None:
        if name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {name!r}; registered: {sorted(OPTIMIZERS)}")
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        if not isinstance(step_chunks, int) or step_chunks < 1:
            raise ValueError(f"step_chunks must be an int >= 1, got {step_chunks!r}")
        for what, dtype in (("param_dtype", param_dtype), ("broadcast_dtype", broadcast_dtype)):
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"{what} must be a floating-point torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
        # what decides the buckets and their collectives: the same on every rank (checked below)
        self._settings = dict(bucket_cap_mb=bucket_cap_mb, step_chunks=step_chunks, reduce_dtype=reduce_dtype,
                              param_dtype=param_dtype, broadcast_dtype=broadcast_dtype)
        self.group = process_group if process_group is not None else comm.new_group(timeout)
        self.rank, self.world_size = comm.rank(self.group), comm.world_size(self.group)
        self.name = name
        factory = OPTIMIZERS[name]
        flag = getattr(factory, "matrix_flag", "use_muon")
        groups = param_groups(model, matrix_flag=flag, adamw=adamw, matrix=matrix, splits=splits, experts=experts)
        self.names = {id(p): n for g in groups for p, n in zip(g["params"], g["names"])}
        order = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
        self.params = sorted((p for g in groups for p in g["params"]), key=lambda p: order[id(p)])
        self._position = {id(p): i for i, p in enumerate(self.params)}
        self.blocks = blocks
        self.local = self._block_params(blocks)
        self.replica_rank = comm.rank(blocks.replica_group) if blocks is not None else self.rank
        everyone = self._check_same_everywhere(groups, name, hparams)
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"layerwise needs every trainable parameter on one device, found "
                             f"{sorted(map(str, devices))}; move the model to one device first")

        # Validate the hyperparameters once, on all parameters, and take the filled-in groups as the global ones.
        ref = factory(_strip(groups, keep_names=flag is not None), **hparams)
        outer = [dict(rg, names=g["names"]) for rg, g in zip(ref.param_groups, groups)]
        # An optimizer that raises on NaN/Inf gradients: the ranks agree on finiteness before any owner steps
        # (:meth:`_agree_finite`), and the owners' optimizers leave the check to that agreement. With
        # deferred_nonfinite=True (the trainer's setting) they agree on the device and the owners' updates skip on
        # the agreed flag; the error comes from the next step() or state_dict() (raise_deferred_nonfinite).
        checks = isinstance(ref, MatrixOptimizer) and not ref.skip_nonfinite
        self.nonfinite = NonFinitePolicy(deferred=ref.deferred_nonfinite, ranks=True) if checks else None
        self._labels = [label(self.names[id(p)], p) for p in self.params]
        super().__init__(outer, dict(ref.defaults))
        del ref
        if verbose and self.rank == 0:
            print(routing_summary(groups, flag))

        group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
        is_matrix = [bool(flag is not None and groups[group_of[id(p)]][flag]) for p in self.params]
        # the matrices kept in param_dtype (converted once their fp32 masters exist), summed and reduced in fp32
        self.param_dtype = param_dtype
        self._lowered = {id(p) for p, m in zip(self.params, is_matrix)
                         if m and param_dtype is not None and p.dtype != param_dtype}
        self._assign(is_matrix, cost or MATRIX_COSTS.get(name, muon_cost), [e["replica_rank"] for e in everyone])
        self._owned_index = torch.tensor([i for i, p in enumerate(self.params) if self.owns(p)],
                                         dtype=torch.int64, device=comm.object_device(self.group))
        if verbose and self.rank == 0:
            print(self.assignment.summary())
            if self.block_assignment is not None:
                print(f"blocks: {self.block_assignment.summary()}")

        self._bucket_cap, self._reduce_dtype = int(bucket_cap_mb * 2**20), reduce_dtype
        self._wire = {id(p): broadcast_dtype for p, m in zip(self.params, is_matrix)
                      if m and broadcast_dtype is not None and self._dtype(p) != broadcast_dtype}
        self._modules = [m for m in model.modules() if any(id(p) in self.owner for p in m.parameters(recurse=False))]
        self.masters: dict[int, Tensor] = {}
        self.chunks: list[Chunk] = []
        self._build_chunks = functools.partial(self._make_chunks, groups, group_of, step_chunks, flag, factory,
                                               hparams)
        # Until the first backward shows the order gradients arrive in, guess the reverse of registration.
        self._arrivals: list[int] | None = []
        self._arrange(list(reversed(range(len(self.params)))))
        self._stale = False
        self._syncing_grads = True
        self._clip_coef: Tensor | None = None  # clip_grad_norm_'s coefficient, applied by the next step()
        self._clip_flags: Tensor | None = None  # and its per-gradient non-finite flags, the next step's check
        self._broadcast_buffers(model)
        self.sync_params()

        self.masters = {id(p): copy_marks(p, p.detach().float().clone()) for p in self.params
                        if self.owns(p) and self._dtype(p) != torch.float32}
        with torch.no_grad():
            for p in self.params:
                if id(p) in self._lowered:
                    p.data = p.data.to(param_dtype)
        self._home_lowered()
        self.chunks = self._build_chunks()
        self._hooks = [p.register_post_accumulate_grad_hook(_weak_hook(self._on_grad)) for p in self.params]
        self._hooks += [m.register_forward_pre_hook(_weak_hook(self._pre_forward)) for m in self._modules]
        weakref.finalize(self, _remove_hooks, self._hooks)

    # ------------------------------------------------------------------------------------------- construction
    def _check_same_everywhere(self, groups: list[dict[str, Any]], name: str,
                               hparams: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank must route the same parameters with the same shapes and dtypes, use the same optimizer and
        hold the same block parameters in the same layout: otherwise the collectives would pair different tensors
        (or hang). Returns every rank's description (its ``replica_rank`` places its blocks' loads)."""
        blocks = self.blocks
        mine = {"params": [(self.names[id(p)], tuple(p.shape), str(p.dtype),
                            next(gi for gi, g in enumerate(groups) if any(q is p for q in g["params"])))
                           for p in self.params],
                "optimizer": (name, repr(sorted(hparams.items()))),
                "settings": repr(self._settings),
                "blocks": None if blocks is None else (tuple(blocks.names), comm.world_size(blocks.replica_group),
                                                       comm.world_size(blocks.block_group)),
                "replica_rank": self.replica_rank,
                "block_ranks": () if blocks is None else comm.group_ranks(blocks.block_group)}
        everyone = comm.all_gather_object(mine, self.group)
        ref = everyone[0]
        problems = []
        for r, theirs in enumerate(everyone):
            if theirs["blocks"] != ref["blocks"]:
                problems.append(f"rank 0 holds blocks (names, replicas, blocks) {ref['blocks']}, rank {r} "
                                f"{theirs['blocks']}")
            elif any(everyone[q]["replica_rank"] != theirs["replica_rank"] for q in theirs["block_ranks"]):
                problems.append(f"the block group of rank {r}, ranks {list(theirs['block_ranks'])}, mixes replica "
                                f"ranks {[everyone[q]['replica_rank'] for q in theirs['block_ranks']]}; its ranks "
                                f"must share their rank in their replica groups")
        for r, theirs in enumerate(everyone[1:], start=1):
            if theirs["settings"] != ref["settings"]:
                problems.append(f"rank 0 is built with {ref['settings']}, rank {r} with {theirs['settings']}")
            if theirs["optimizer"] != ref["optimizer"]:
                problems.append(f"rank 0 builds {ref['optimizer'][0]!r} with {ref['optimizer'][1]}, rank {r} builds "
                                f"{theirs['optimizer'][0]!r} with {theirs['optimizer'][1]}")
            a = {e[0]: e[1:] for e in ref["params"]}
            b = {e[0]: e[1:] for e in theirs["params"]}
            for n in a.keys() - b.keys():
                problems.append(f"`{n}` {a[n][0]} exists on rank 0 but not on rank {r}")
            for n in b.keys() - a.keys():
                problems.append(f"`{n}` {b[n][0]} exists on rank {r} but not on rank 0")
            for n in a.keys() & b.keys():
                for what, x, y in zip(("shape", "dtype", "param group"), a[n], b[n]):
                    if x != y:
                        problems.append(f"`{n}` has {what} {x} on rank 0 but {y} on rank {r}")
            if not problems and [e[0] for e in ref["params"]] != [e[0] for e in theirs["params"]]:
                problems.append(f"parameters are registered in a different order on rank {r} than on rank 0")
        if problems:
            shown = "; ".join(sorted(problems)[:8]) + (" ..." if len(problems) > 8 else "")
            raise ValueError(f"ranks disagree on the parameter set or optimizer: {shown}. Build the same model "
                             f"(same config, dtype and routing) and optimizer on every rank before "
                             f"matrixopt.distributed.layerwise.")
        return everyone

    def _block_params(self, blocks: Blocks | None) -> set[int]:
        """The ids of the block parameters, checked against the trainable ones."""
        if blocks is None:
            return set()
        by_name = {n: i for i, n in self.names.items()}
        unknown = [n for n in blocks.names if n not in by_name]
        if unknown or not blocks.names:
            raise ValueError(f"blocks.names must name trainable parameters of this model, got {list(blocks.names)}"
                             f"{f' ({unknown} are not)' if unknown else ''}; known: {sorted(by_name)[:6]} ...")
        return {by_name[n] for n in blocks.names}

    def _assign(self, is_matrix: list[bool], cost: Callable[[int, int], float], replica_ranks: list[int]) -> None:
        """Owners: the block parameters over the replica group (the same on every replica group: same shapes),
        then the others over every rank, starting from the block loads each rank took on. ``self.owner`` holds
        each parameter's owner as a rank of its own group (:meth:`_group`)."""
        local = [i for i, p in enumerate(self.params) if id(p) in self.local]
        dense = [i for i, p in enumerate(self.params) if id(p) not in self.local]
        owner = [0] * len(self.params)
        base: dict[str, list] = {}
        self.block_assignment: Assignment | None = None

        def state_bytes(p: Tensor, is_matrix: bool) -> int:
            return self._state_bytes(p, is_matrix, self._dtype(p))

        if local:
            a = assign([self.params[i] for i in local], [is_matrix[i] for i in local],
                       comm.world_size(self.blocks.replica_group), cost, state_bytes)
            for i, r in zip(local, a.owner):
                owner[i] = r
            base = dict(base_compute=[a.compute[j] for j in replica_ranks],
                        base_state=[a.state_bytes[j] for j in replica_ranks])
            self.block_assignment = a
        self.assignment: Assignment = assign([self.params[i] for i in dense], [is_matrix[i] for i in dense],
                                             self.world_size, cost, state_bytes, **base)
        for i, r in zip(dense, self.assignment.owner):
            owner[i] = r
        self.owner = {id(p): r for p, r in zip(self.params, owner)}

    def _group(self, p: Tensor) -> comm.Group:
        """The group ``p`` is owned, reduced and broadcast in: its replicas for a block parameter, else all."""
        return self.blocks.replica_group if id(p) in self.local else self.group

    def owns(self, p: Tensor) -> bool:
        """Whether this rank owns (steps, and holds the optimizer state of) parameter ``p``."""
        return self.owner[id(p)] == (self.replica_rank if id(p) in self.local else self.rank)

    def _dtype(self, p: Tensor) -> torch.dtype:
        """The dtype ``p`` is kept in during training (``param_dtype`` for a lowered matrix)."""
        return self.param_dtype if id(p) in self._lowered else p.dtype

    @staticmethod
    def _state_bytes(p: Tensor, is_matrix: bool, dtype: torch.dtype | None = None) -> int:
        """Optimizer state bytes an owner holds for ``p`` (kept in ``dtype``, default its own): an fp32 master
        unless it trains in fp32, and the optimizer's moments."""
        master = 0 if (dtype or p.dtype) == torch.float32 else 4 * p.numel()
        return master + (4 if is_matrix else 8) * p.numel()

    def _arrange(self, arrival: list[int]) -> None:
        """Bucket the parameters for gradients arriving in the order ``arrival`` (positions in ``self.params``),
        and, once the owned parameters have their fp32 masters, split the owner's step into chunks to match."""
        self._order = arrival
        self.buckets = self._make_buckets(arrival)
        self._bucket_of = {id(p): (b, k) for b in self.buckets for k, p in enumerate(b.params)}
        self._next_grad = len(self.buckets) - 1  # gradients are reduced from the last bucket to the first
        if self.chunks:
            self._home_lowered()
            self._rechunk()
        self._module_buckets = {
            id(m): list({id(b): b for b in (self._bucket_of[id(p)][0] for p in m.parameters(recurse=False)
                                             if id(p) in self._bucket_of)}.values())
            for m in self._modules}

    @torch.no_grad()
    def _home_lowered(self) -> None:
        """Make the parameters of each bucket of several lowered matrices views of one flat buffer in bucket
        order, so that the owner's cast from its masters writes what it broadcasts and the others receive into
        their parameters: no copy on either side."""
        for b in self.buckets:
            if len(b.params) > 1 and id(b.params[0]) in self._lowered:
                b.flat = torch.empty(b.numel, dtype=b.params[0].dtype, device=b.params[0].device)
                for k, p in enumerate(b.params):
                    seg = b.segment(b.flat, k)
                    seg.copy_(p.data)
                    p.data = seg

    def _make_buckets(self, arrival: list[int]) -> list[Bucket]:
        """Walk the parameters in the order their gradients arrive, filling one open bucket per (group, owner,
        dtype, broadcast dtype), closed at the size cap; then number the buckets so that the last one is complete
        first: by when their last gradient arrives, latest first. That is the order the next forward needs them
        in."""
        when = {id(self.params[i]): t for t, i in enumerate(arrival)}
        open_: dict[tuple[bool, int, torch.dtype, torch.dtype | None], list[Tensor]] = {}
        closed: list[list[Tensor]] = []
        for p in (self.params[i] for i in arrival):
            key = (id(p) in self.local, self.owner[id(p)], self._dtype(p), self._wire.get(id(p)))
            cur = open_.setdefault(key, [])
            cur.append(p)
            if sum(q.numel() for q in cur) * p.element_size() >= self._bucket_cap:
                closed.append(open_.pop(key))
        closed += open_.values()
        closed.sort(key=lambda ps: -max(when[id(p)] for p in ps))
        buckets = []
        for bi, ps in enumerate(closed):
            ps = sorted(ps, key=lambda p: -when[id(p)])
            offsets = [0]
            for p in ps:
                offsets.append(offsets[-1] + p.numel())
            # a lowered matrix's micro-batch gradients are summed in an fp32 buffer and reduced from it
            dtype = torch.float32 if id(ps[0]) in self._lowered else self._reduce_dtype or ps[0].dtype
            direct = len(ps) == 1 and dtype == self._dtype(ps[0])
            grad = None if direct else torch.zeros(offsets[-1], dtype=dtype, device=ps[0].device)
            group = self._group(ps[0])
            # the mean over every rank inside the reduction where the bucket is reduced over every rank and the
            # backend averages (a block reduced among its replicas is still divided by the whole world size)
            mean = comm.world_size(group) == self.world_size and comm.averages_in_reduce(group)
            buckets.append(Bucket(bi, self.owner[id(ps[0])], group, self.owns(ps[0]), ps, offsets[:-1],
                                  offsets[-1], grad, direct, wire=self._wire.get(id(ps[0])), mean=mean))
        return buckets

    def _make_chunks(self, groups: list[dict[str, Any]], group_of: dict[int, int], step_chunks: int,
                     flag: str | None, factory: Callable[..., torch.optim.Optimizer],
                     hparams: dict[str, Any]) -> list[Chunk]:
        """Split this rank's buckets (in forward order) into up to ``step_chunks`` runs of about equal size, each
        stepped by its own inner optimizer built from the global groups' hyperparameters."""
        mine = [b for b in self.buckets if b.owned]
        if not mine:
            return []
        sizes = [sum(p.numel() for p in b.params) for b in mine]
        total, acc, runs, cur = sum(sizes), 0, [], []
        for b, s in zip(mine, sizes):
            cur.append(b)
            acc += s
            if acc >= total * (len(runs) + 1) / step_chunks and len(runs) < step_chunks - 1:
                runs.append(cur)
                cur = []
        if cur:
            runs.append(cur)
        chunks = []
        for run in runs:
            ps = [p for b in run for p in b.params]
            inner_groups, outer_index = [], []
            for gi, g in enumerate(self.param_groups):
                members = [p for p in ps if group_of[id(p)] == gi]
                if not members:
                    continue
                ig = {k: v for k, v in g.items() if k not in _GROUP_META}
                ig["params"] = [self.masters.get(id(p), p) for p in members]
                if flag is not None:
                    ig["names"] = [self.names[id(p)] for p in members]
                inner_groups.append(ig)
                outer_index.append(gi)
            inner = factory(inner_groups, **hparams)
            if self.nonfinite is not None:  # step() agrees on finiteness across ranks first: no second check
                inner.nonfinite.wrapped = True
            chunks.append(Chunk(inner, outer_index, ps, run[-1].index + 1))
        return chunks

    def _rechunk(self) -> None:
        """Chunks for new buckets, each owned parameter's optimizer state moved to its new chunk's optimizer."""
        held = {t: c.optimizer.state[t] for c in self.chunks for t in list(c.optimizer.state)}
        self.chunks = self._build_chunks()
        for c in self.chunks:
            for g in c.optimizer.param_groups:
                for t in g["params"]:
                    if t in held:
                        c.optimizer.state[t] = held[t]

    def _adopt_arrival_order(self) -> None:
        """At the first step after a backward: rank 0's order of gradient arrival (parameters that got no gradient
        last) becomes every rank's, and the buckets and chunks are rebuilt to it if it differs from the guess, so
        that each bucket is reduced as soon as its own gradients exist, not behind a parameter registered out of
        the order the model uses it in, and the next forward gets first what it needs first. Collective."""
        seen = comm.all_gather_object(self._arrivals, self.group)[0]
        if not seen:  # no backward reduced gradients yet: keep watching
            self._arrivals = []
            return
        self._arrivals = None
        seen = list(dict.fromkeys(seen))
        got = set(seen)
        order = seen + [i for i in self._order if i not in got]
        if order != self._order:
            self._arrange(order)

    def trained(self, p: Tensor) -> Tensor:
        """The tensor this rank's optimizer steps for parameter ``p``: its fp32 master where this rank owns ``p``
        and ``p`` is kept in lower precision, else ``p``. A change made to it in place reaches ``p`` through
        :meth:`masters_to_params`."""
        return self.masters.get(id(p), p)

    @torch.no_grad()
    def masters_to_params(self, params: Sequence[Tensor]) -> None:
        """Cast each of ``params`` that this rank keeps a master of from that master (after a step, a load, or a
        change made to the masters in place, as QK-clip scales weights), in one foreach copy. Not collective: the
        other ranks' copies change at the next broadcast, or by their own equal change."""
        held = [p for p in params if id(p) in self.masters]
        if held:
            torch._foreach_copy_(held, [self.masters[id(p)] for p in held])

    def _inner_optimizer(self, p: Tensor) -> torch.optim.Optimizer:
        b, _ = self._bucket_of[id(p)]
        return next(c.optimizer for c in self.chunks if b.index < c.bucket_end)

    # ------------------------------------------------------------------------------------------- gradients
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward accumulates local gradients without communicating (all micro-batches but the last of a
        gradient-accumulation step): in ``p.grad``, and for the matrices kept in ``param_dtype`` in their fp32
        reduce buffers; the backward after it reduces the accumulated sums."""
        prev, self._syncing_grads = self._syncing_grads, False
        try:
            yield
        finally:
            self._syncing_grads = prev

    def _on_grad(self, p: Tensor) -> None:
        self._clip_coef = self._clip_flags = None  # a clip before this backward was for other gradients
        if not self._syncing_grads:
            if id(p) in self._lowered:  # summed in fp32 now, not in p.grad in its own dtype
                self._accumulate(*self._bucket_of[id(p)], p)
            return
        b, k = self._bucket_of[id(p)]
        if k in b.seen:
            raise RuntimeError(f"`{self.names[id(p)]}` received a second gradient before step(): wrap all but the "
                               f"last micro-batch's backward in `with opt.no_sync():` when accumulating gradients")
        if self._arrivals is not None:
            self._arrivals.append(self._position[id(p)])
        self._take_grad(b, k, p)
        self._launch_ready_grads()

    @staticmethod
    def _accumulate(b: Bucket, k: int, p: Tensor) -> None:
        """Add ``p``'s micro-batch gradient to its segment of the bucket's reduce buffer (the first one copied) and
        drop ``p.grad``."""
        if p.grad is None:
            return
        seg = b.segment(b.grad, k)
        seg.add_(p.grad) if k in b.accumulated else seg.copy_(p.grad)
        b.accumulated.add(k)
        p.grad = None

    @staticmethod
    def _take_grad(b: Bucket, k: int, p: Tensor) -> None:
        """Move ``p``'s gradient (zeros if it has none) into its bucket's reduce buffer, added to what earlier
        micro-batches summed there (:meth:`_accumulate`), and drop ``p.grad``."""
        g = p.grad
        if b.direct:
            b.grad = torch.zeros(b.numel, dtype=p.dtype, device=p.device) if g is None else \
                g.detach().contiguous().view(-1)
        elif k in b.accumulated:
            if g is not None:
                b.segment(b.grad, k).add_(g)
        elif g is None:
            b.segment(b.grad, k).zero_()
        else:
            b.segment(b.grad, k).copy_(g)
        p.grad = None
        b.seen.add(k)
        b.arrived += 1

    def _launch_ready_grads(self) -> None:
        while self._next_grad >= 0:
            b = self.buckets[self._next_grad]
            if b.arrived < len(b.params):
                return
            b.grad_work = comm.reduce_to_owner(b.grad, b.owner, b.group, mean=b.mean)
            self._next_grad -= 1

    def _finish_grad_sync(self) -> None:
        """Launch the buckets whose gradients never all arrived (unused parameters count as zero; gradients left
        in ``p.grad`` by a backward under ``no_sync`` are taken as they are), wait for every reduction and hand
        the owner the mean gradient. Idempotent until the next backward."""
        if self._next_grad < 0 and all(b.grad_work is None for b in self.buckets):
            return
        for b in self.buckets:
            for k, p in enumerate(b.params):
                if k not in b.seen:
                    self._take_grad(b, k, p)
        self._launch_ready_grads()
        for b in reversed(self.buckets):
            b.grad_work.wait()
            b.grad_work = None
            if b.direct and not b.owned:
                b.grad = None  # sent: this rank's local gradient is no longer needed
            if b.owned:
                if not b.mean and self.world_size > 1:
                    b.grad.div_(self.world_size)  # every rank's loss counts once, blocks included
                for k, p in enumerate(b.params):
                    seg, t = b.segment(b.grad, k), self.trained(p)
                    t.grad = seg if seg.dtype == t.dtype else seg.to(t.dtype)
            b.arrived, b.seen, b.accumulated = 0, set(), set()
        self._next_grad = -1  # reductions done; reset to the last bucket when the step consumes the gradients

    def _owned_grads(self) -> list[Tensor]:
        """The reduced gradients of the parameters this rank owns, in ``self.params`` order."""
        return [self.trained(p).grad for p in self.params
                if self.owns(p) and self.trained(p).grad is not None]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the mean gradient to a global ``norm_type`` norm of ``max_norm`` over all ranks' parameters, as
        ``torch.nn.utils.clip_grad_norm_`` does in one process. Returns the total norm (before clipping), the
        same fp32 scalar on every rank. Collective: call it on every rank, after backward, before ``step()``. The
        coefficient is applied by ``step()``: each owner's Muon reads its gradients scaled (no pass of its own);
        other optimizers have theirs multiplied just before they step. The per-gradient norms also serve as the
        step's non-finite check (a non-finite norm flags its gradient), so the step reads no gradient again for it."""
        max_norm, norm_type = check_clip(max_norm, norm_type)
        self._finish_grad_sync()
        local, self._clip_flags = grad_norms(self._owned_grads(), norm_type, comm.object_device(self.group))
        if norm_type == math.inf:
            total = comm.all_reduce_max(local, self.group)
        else:
            total = comm.all_reduce_sum(local**norm_type, self.group) ** (1.0 / norm_type)
        # applied by step(), to each owner's optimizer just before it steps (its chunks may be rebuilt before then)
        self._clip_coef = clip_coefficient(total, max_norm)
        return total

    def _apply_clip(self, opt: torch.optim.Optimizer) -> None:
        """This step's clipping coefficient, if any, to one owner's optimizer: deferred into its step where it
        can (``MatrixOptimizer.scale_grads_``), else multiplied into its gradients now."""
        if self._clip_coef is not None:
            scale_grads(opt, self._clip_coef)

    def _agree_finite(self) -> Tensor | None:
        """The ranks agree on finiteness before any owner steps: a flag per parameter (set by its owner where its
        reduced gradient holds NaN/Inf, or, after :meth:`clip_grad_norm_`, where the clip found its norm not finite),
        summed over ranks on the device. Without ``deferred_nonfinite`` the flags
        are read on the host (the step's one sync) and every rank raises NonFiniteGradientError, naming every bad
        parameter, before anything is written. With it, the flags start on their way to the host for
        :meth:`raise_deferred_nonfinite`, and the returned 0-d float32 device flag (nonzero when any rank's
        gradient holds NaN/Inf) makes every owner's updates write nothing."""
        dev = comm.object_device(self.group)
        owned = self._clip_flags if self._clip_flags is not None else nonfinite_flags(self._owned_grads(), dev)
        flags = torch.zeros(len(self.params), device=dev).index_copy_(0, self._owned_index, owned)
        flags = comm.all_reduce_sum(flags, self.group)
        if self.nonfinite.deferred:
            return self.nonfinite.defer(flags, lambda: self._labels)
        try:
            self.nonfinite.check(flags, lambda: self._labels)
        except NonFiniteGradientError:
            self._drop_grads()  # this step's reductions are finished and forgotten
            raise
        return None

    def raise_deferred_nonfinite(self) -> None:
        """With ``deferred_nonfinite=True``: raise ``NonFiniteGradientError`` if some rank's gradients held NaN/Inf
        at the last step, which every rank then skipped (no parameter or state written). Every rank raises,
        naming the same parameters (the flags were agreed). ``step()`` and ``state_dict()`` call it first. Not
        collective."""
        if self.nonfinite is None:
            return
        try:
            self.nonfinite.raise_pending()
        except NonFiniteGradientError:
            for chunk in self.chunks:  # the owners' optimizers put back what they counted on the host
                chunk.optimizer.nonfinite.unwind()
            raise

    def _drop_grads(self) -> None:
        """Forget all gradients: finish reductions in flight (every rank launched the same ones) and reset."""
        self._clip_coef = self._clip_flags = None
        for b in reversed(self.buckets):
            if b.grad_work is not None:
                b.grad_work.wait()
                b.grad_work = None
            if b.direct:
                b.grad = None
            b.arrived, b.seen, b.accumulated = 0, set(), set()
        for p in self.params:
            self.trained(p).grad = None
            p.grad = None
        self._next_grad = len(self.buckets) - 1

    # ------------------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce the gradients (if backward has not finished that), step the owned parameters chunk by chunk and
        broadcast each finished bucket; the next forward waits for the buckets it needs. Collective."""
        self._refuse_if_stale()
        try:
            self.raise_deferred_nonfinite()
        except NonFiniteGradientError:
            self._drop_grads()  # this step's reductions, launched by backward, are finished and forgotten
            raise
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.wait_params()
        self._finish_grad_sync()
        if self._arrivals is not None:
            self._adopt_arrival_order()
        skip = None if self.nonfinite is None else self._agree_finite()
        self._push_hyperparameters()
        launched = 0
        for chunk in self.chunks:
            if skip is not None:
                chunk.optimizer.nonfinite.agreed = skip
            self._apply_clip(chunk.optimizer)
            chunk.optimizer.step()
            # each parameter is its master's cast, so a skipped step (masters as they were) leaves it as it was: no
            # select on the skip flag
            self.masters_to_params(chunk.params)
            launched = self._launch_param_broadcasts(launched, chunk.bucket_end)
        self._launch_param_broadcasts(launched, len(self.buckets))
        self._drop_grads()
        return loss

    def _push_hyperparameters(self) -> None:
        for chunk in self.chunks:
            for ig, gi in zip(chunk.optimizer.param_groups, chunk.outer_group):
                for k, v in self.param_groups[gi].items():
                    if k not in _GROUP_META:
                        ig[k] = v

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient this rank holds (``step()`` already consumes the reduced ones)."""
        if not set_to_none:
            raise ValueError("layerwise keeps no gradient buffers for parameters a rank does not own; call "
                             "zero_grad() with set_to_none=True")
        self._drop_grads()

    # ------------------------------------------------------------------------------------------- parameters
    def _launch_param_broadcasts(self, start: int, end: int) -> int:
        for b in self.buckets[start:end]:
            if b.flat is not None:  # the parameters are views of it
                b.param_buffer = None
                b.param_work = comm.broadcast_from_owner(b.flat, b.owner, b.group)
                continue
            if len(b.params) == 1 and b.params[0].is_contiguous() and b.wire is None:
                b.param_buffer = None
                b.param_work = comm.broadcast_from_owner(b.params[0].data.view(-1), b.owner, b.group)
                continue
            wire = b.wire or b.params[0].dtype
            b.param_buffer = torch.empty(b.numel, dtype=wire, device=b.params[0].device)
            if b.owned:  # each parameter cast as it is copied in: one pass, no intermediate
                torch._foreach_copy_([b.segment(b.param_buffer, k) for k in range(len(b.params))],
                                     [p.detach() for p in b.params])
            b.param_work = comm.broadcast_from_owner(b.param_buffer, b.owner, b.group)
        return max(start, end)

    def _wait_bucket(self, b: Bucket) -> None:
        if b.param_work is None:
            return
        b.param_work.wait()
        b.param_work = None
        if b.param_buffer is not None:
            if not b.owned:
                with torch.no_grad():
                    for k, p in enumerate(b.params):
                        p.copy_(b.segment(b.param_buffer, k))
            b.param_buffer = None

    def wait_params(self) -> None:
        """Wait until every parameter holds its owner's latest value (the forward hooks do this per module)."""
        for b in self.buckets:
            self._wait_bucket(b)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self._refuse_if_stale()
        for b in self._module_buckets[id(module)]:
            self._wait_bucket(b)

    @torch.no_grad()
    def sync_params(self) -> None:
        """Make every rank's parameters equal to their owners' (fp32 masters cast on the owner), blocking; marks
        the parameters current again after a checkpoint load. Collective."""
        self.wait_params()
        self.masters_to_params(self.params)
        self._launch_param_broadcasts(0, len(self.buckets))
        self.wait_params()
        self._stale = False

    @torch.no_grad()
    def _broadcast_buffers(self, model: nn.Module) -> None:
        """Rank 0's buffers (and frozen parameters) to every rank, as DDP does at construction."""
        trainable = {id(p) for p in self.params}
        for t in [*model.buffers(), *(p for p in model.parameters() if id(p) not in trainable)]:
            comm.broadcast_from_owner(t.data, 0, self.group).wait()

    def mark_stale(self) -> None:
        """Mark this rank's parameters as not yet synchronised (a checkpoint load has started): ``step()`` and the
        model's forward raise until :meth:`sync_params` completes."""
        self._stale = True

    def _refuse_if_stale(self) -> None:
        if self._stale:
            raise RuntimeError("parameters are stale: a checkpoint load started but the parameters were not "
                               "synchronised from their owners afterwards (was the load interrupted?). Load the "
                               "checkpoint again, or call opt.sync_params() on every rank.")

    # ------------------------------------------------------------------------------------------- state
    def owned_names(self) -> list[str]:
        return [self.names[id(p)] for p in self.params if self.owns(p)]

    def param_by_name(self, name: str) -> Tensor:
        return next(p for p in self.params if self.names[id(p)] == name)

    def state_dict(self) -> dict[str, Any]:
        """This rank's part, keyed by parameter name: ``{"state": {name: {key: value}}, "param_groups": [...]}``
        with the state of the parameters this rank owns (of a block parameter, its block's) and the global groups'
        hyperparameters. Not collective. For a whole checkpoint use :func:`matrixopt.distributed.checkpoint.save`.
        Raises a deferred non-finite error first (:meth:`raise_deferred_nonfinite`)."""
        self.raise_deferred_nonfinite()
        state = {}
        for p in self.params:
            if not self.owns(p):
                continue
            st = self._inner_optimizer(p).state.get(self.trained(p))
            if st:
                state[self.names[id(p)]] = dict(st)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"optimizer": self.name, "state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a name-keyed state dict (this rank's :meth:`state_dict`, or the whole one that
        :func:`matrixopt.distributed.checkpoint.export` writes): hyperparameters of every group, state of the
        parameters this rank owns (of a block parameter, its block's, as
        :func:`matrixopt.distributed.checkpoint.load` reads it). Not collective."""
        if state_dict.get("optimizer", self.name) != self.name:
            raise ValueError(f"this state dict was saved by {state_dict['optimizer']!r}, not {self.name!r}; build "
                             f"the same optimizer it came from to load it")
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(
                sg.get("names") != g.get("names") for sg, g in zip(saved, self.param_groups)):
            raise ValueError("the state dict's param groups name other parameters than this optimizer's: it comes "
                             "from a different model or routing")
        for sg, g in zip(saved, self.param_groups):
            g.update({k: v for k, v in sg.items() if k not in _GROUP_META})
        known = set(self.names.values())
        unknown = sorted(set(state_dict["state"]) - known)
        if unknown:
            raise ValueError(f"state dict has state for {unknown[:5]}, which this model does not have")
        for name, st in state_dict["state"].items():
            p = self.param_by_name(name)
            if not self.owns(p):
                continue
            t = self.trained(p)
            self._inner_optimizer(p).state[t] = {
                k: (v.to(device=t.device, copy=True) if isinstance(v, Tensor) else v) for k, v in st.items()}
        self._push_hyperparameters()

    def load_master_(self, name: str, value: Tensor) -> None:
        """Set the owned parameter ``name`` (and its fp32 master) to ``value``; :meth:`sync_params` spreads it."""
        p = self.param_by_name(name)
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"checkpoint value of `{name}` has shape {tuple(value.shape)}, the model's parameter "
                             f"has shape {tuple(p.shape)}: the checkpoint comes from a different model")
        with torch.no_grad():
            self.trained(p).copy_(value)
            p.copy_(value)
