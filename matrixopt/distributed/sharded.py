"""Muon for sharded parameters: FSDP2 ``fully_shard``, tensor parallelism, or both on a 2-D mesh.

:class:`ShardedMuon` is :class:`matrixopt.optim.muon.Muon` with the step of DTensor matrices changed: per group of
same-shape, same-placement parameters (a bucket), Muon's fused momentum pass packs the local shards into one
stack, the stack goes to the ranks that orthogonalize each matrix, and Muon's fused update applies what comes
back to the local shards. Momentum buffers stay DTensors in ``self.state`` (so ``state_dict`` and DCP see ordinary
sharded state). The buckets are pipelined: all gathers are launched first, so each bucket's communication
overlaps the other buckets' Newton–Schulz.

Placements of an ``(m, n)`` matrix, one per mesh dim:

- ``Replicate()``: data parallel (DDP, or HSDP's replicate dim); every replica computes the same update.
- ``Shard(0)`` on a mesh dim other than the TP one: FSDP. Each matrix goes to one owner rank of that mesh dim
  (:mod:`matrixopt.distributed.fsdp`), is orthogonalized there and comes back.
- ``Shard(0)`` or ``Shard(1)`` on the mesh dim named ``tp_mesh_dim``: tensor-parallel Newton–Schulz
  (:mod:`matrixopt.distributed.tp`); on a 2-D mesh it runs among the owners of the FSDP gather.
- ``_StridedShard(0)`` on the FSDP mesh dim with ``Shard(0)`` on the TP one: FSDP2 ``fully_shard`` on top of a
  column-parallel (row-sharded) weight. FSDP splits the rows of each TP shard, so the FSDP gather yields exactly
  the TP shard and TP Newton–Schulz runs on it.

Fused weights marked with :func:`matrixopt.mark_split` are split into their pieces after the FSDP gather, so
Q, K and V are orthogonalized separately, as in single-process Muon. When TP shards the split dim the weight must
be stored rank-major: each TP rank's shard holds its ``1/tp`` of every piece (rows ``[q_p; k_p; v_p]`` for a
QKV weight, see :func:`matrixopt.train.parallelize.rank_major_qkv`), so the shard splits into pieces of
``size / tp`` and each piece is a TP shard of the whole Q, K or V.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from matrixopt.distributed import comm
from matrixopt.distributed.balance import lpt, muon_cost
from matrixopt.distributed.comm import InFlight, gather_to_owners, scatter_from_owners
from matrixopt.distributed.cost import TP_GRAM_CHUNKS
from matrixopt.distributed.tp import MODES, CostModel, tp_newton_schulz
from matrixopt.kernels.muon_elementwise import apply_update, momentum_pack, row_sums_of_squares, skips_on_device
from matrixopt.optim.adaptive import AdaMuon, NorMuon
from matrixopt.optim.base import param_label
from matrixopt.optim.layout import _SPLIT
from matrixopt.optim.muon import Muon, ns_config, update_scale
from matrixopt.optim.nonfinite import nonfinite_flags
from matrixopt.optim.offload import Shards, StagedStep


@dataclass(frozen=True)
class Sharding:
    """How an ``(m, n)`` DTensor matrix is laid out: the FSDP mesh dim (rows), the TP mesh dim and which matrix
    dim it shards, and the ``mark_split`` pieces ``(dim, sizes)`` if any."""

    shape: tuple[int, int]
    local_shape: tuple[int, int]  # this rank's shard
    fsdp_group: ProcessGroup | None
    fsdp_rows: tuple[int, ...]  # rows held by each rank of the FSDP group (of the TP shard, under FSDP x TP rows)
    tp_group: ProcessGroup | None
    tp_dim: int  # the matrix dim TP shards (0 or 1); unused without TP
    tp_sizes: tuple[int, ...]
    split: tuple[int, tuple[int, ...]] | None  # sizes per TP shard when TP shards the split dim (rank-major)

    @property
    def rank_major(self) -> bool:
        """Whether TP shards the split dim, each TP shard holding ``1/tp`` of every piece."""
        return self.tp_group is not None and self.split is not None and self.split[0] == self.tp_dim


@dataclass(frozen=True)
class _Bucket:
    """One bucket of a group's DTensor matrices (same shape, dtype, mesh, placements and split), laid out as every
    step lays it out: the indices of its parameters in the step's parameter list, in stack order (each owner's
    matrices together, owners ascending), its sharding, the owner counts of its FSDP exchange (None without FSDP)
    and whether its stack holds the local shards transposed."""

    order: tuple[int, ...]
    sharding: Sharding
    counts: tuple[int, ...] | None
    transposed: bool


@dataclass(frozen=True)
class _Plan:
    """How a step updates one list of parameters: the parameters it was made for (checked by identity), the
    indices of the plain tensors and the buckets of the DTensors."""

    params: tuple[Tensor, ...]
    plain: tuple[int, ...]
    buckets: tuple[_Bucket, ...]


@dataclass(eq=False)
class _Flight:
    """One bucket of DTensor matrices on its way through a step: the bucket, its DTensor parameters and their
    local shards (in stack order; no shards for an empty shard), the stack ``Y`` held locally, and the exchange in
    flight."""

    bucket: _Bucket
    dtensors: list[DTensor]
    params: list[Tensor]
    Y: Tensor | None
    exchange: InFlight | None


def local_shards(tensors: Iterable[Tensor]) -> list[Tensor]:
    """Each DTensor's local shard; plain tensors as they are."""
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def agreed_nonfinite_flags(grads: list[Tensor]) -> Tensor:
    """``(len(grads),)`` float32: 1 where a gradient holds NaN/Inf on any rank (DTensors checked on their local
    shards), agreed over all ranks so that every rank skips or stops the same parameters. Collective."""
    local = local_shards(grads)
    return comm.all_reduce_max(nonfinite_flags(local, local[0].device), None)


class OnLocalShards:
    """What an optimizer over DTensor parameters computes on their local shards (a mixin before the optimizer's
    class): the non-finite flags, agreed over all ranks; what a deferred check's device flag applies to; and the
    element-wise (AdamW) math."""

    def _nonfinite_flags(self, grads: list[Tensor]) -> Tensor:
        """The non-finite flags of the local shards, agreed over all ranks (a NaN in one shard skips or stops the
        whole matrix everywhere, and every rank's collectives stay matched)."""
        if not any(isinstance(g, DTensor) for g in grads):
            return super()._nonfinite_flags(grads)
        return agreed_nonfinite_flags(grads)

    def _local_grads(self, grads: list[Tensor]) -> list[Tensor]:
        return local_shards(grads)

    def _elementwise_operands(self, params: list[Tensor], *lists: list[Tensor]) -> tuple[list[Tensor], ...]:
        """The local shards, where every parameter is a DTensor and its gradient and state are laid out as it is:
        element-wise math on DTensors is that on their shards, and DTensor's dispatch of a foreach op over a
        model's norms and embeddings costs the host about a millisecond. Otherwise the tensors as they are (a
        gradient laid out otherwise is redistributed by DTensor's op)."""
        if all(isinstance(p, DTensor) for p in params) and all(
                isinstance(t, DTensor) and t.device_mesh == p.device_mesh and t.placements == p.placements
                for ts in lists for p, t in zip(params, ts)):
            return tuple([t.to_local() for t in ts] for ts in (params, *lists))
        return (params, *lists)


class DTensorShards(Shards):
    """A staged step over DTensors (:class:`matrixopt.optim.offload.Shards`): it moves, decodes and encodes their
    local shards, and lays the stored state back out as DTensors of the same mesh, placements and shape, whose
    local tensors are compact (bfloat16) or in host memory (offloaded) as the plain tensors of a single-process
    optimizer are. State dicts and distributed checkpoints then see ordinary sharded state, as FSDP2's own CPU
    offload keeps its parameters."""

    def local(self, t: Tensor) -> Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def layout(self, t: Tensor) -> Any:
        return (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None

    def placed(self, local: Tensor, layout: Any) -> Tensor:
        if layout is None:
            return local
        mesh, placements, shape, stride = layout
        # not DTensor.from_local, which moves a local tensor to the mesh's device type: offloaded state stays in
        # host memory, as FSDP2's CPU offload keeps its sharded parameters
        spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, local.dtype))
        return DTensor(local, spec, requires_grad=False)

    def offset(self, p: Tensor) -> int:
        if not isinstance(p, DTensor):
            return 0
        _, start = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return sum(i * stride for i, stride in zip(start, torch.empty(p.shape, device="meta").stride()))


class ShardedMuon(OnLocalShards, Muon):
    """Muon over DTensor parameters (FSDP2, TP, FSDP x TP, HSDP). Takes Muon's arguments plus:

    Args:
        tp_mode: TP Newton–Schulz mode, one of ``"auto"`` (default), ``"duplicated"``, ``"distributed"``,
            ``"blockwise"`` (see :mod:`matrixopt.distributed.tp`).
        tp_mesh_dim: name of the tensor-parallel mesh dim (default ``"tp"``); shards on other mesh dims are FSDP.
        tp_chunks: Gram row blocks whose all-reduce overlaps compute in distributed mode (default 1:
            :data:`matrixopt.distributed.cost.TP_GRAM_CHUNKS`).
        tp_cost_model: a fixed :class:`CostModel` for ``auto``; None measures one at the first TP step.

    Every rank must call ``step()``: the updates are collective. Plain-tensor parameters are updated exactly as
    by Muon, so a model can mix sharded and unsharded matrices. DTensor matrices must be 2-D. The non-finite check
    reads the local shards' flags, agreed over all ranks; with ``deferred_nonfinite`` no rank waits for them on the
    host (the fused kernels skip the step on the agreed device flag; updates off them read it on the host).
    A clip coefficient given by :meth:`scale_grads_` (the trainer's FSDP2 clip) is applied as the gradients are
    read, on DTensor gradients laid out as their parameters too.

    ``state_dtype`` and ``offload`` work as in :class:`~matrixopt.optim.muon.Muon`, on each rank's local shards:
    the momentum (and NorMuon's and AdaMuon's second moments, and the AdamW groups' moments) stay DTensors laid out
    as the parameters, their local tensors compact or in host memory (:class:`DTensorShards`). The step runs the
    same pipeline over the buckets, with each bucket's state brought to the device and decoded to float32 for its
    momentum pass, then encoded and stored back (NorMuon, AdaMuon: after the second moments' step, which follows
    Newton–Schulz). With float32 state an offloaded step is bit for bit the step without offload; offloaded, it is
    all or nothing on every rank that fails. An AdamW parameter's local shard moves whole. ``state_dtype="int8"``
    stores the matrix groups' state in bfloat16, as everywhere, and refuses DTensors in AdamW groups: its blocks
    of each local shard can't be laid out for another number of ranks by a distributed checkpoint.
    """

    def __init__(self, params: Iterable[Any], *args: Any, tp_mode: str = "auto", tp_mesh_dim: str = "tp",
                 tp_chunks: int = TP_GRAM_CHUNKS, tp_cost_model: CostModel | None = None, **kwargs: Any) -> None:
        if tp_mode not in MODES:
            raise ValueError(f"Unknown tp_mode {tp_mode!r}; use one of {MODES}")
        if not isinstance(tp_chunks, int) or tp_chunks < 1:
            raise ValueError(f"Invalid tp_chunks: {tp_chunks!r} (must be an int >= 1)")
        self.tp_mode, self.tp_mesh_dim = tp_mode, tp_mesh_dim
        self.tp_chunks, self.tp_cost_model = tp_chunks, tp_cost_model
        super().__init__(params, *args, **kwargs)

    shards = DTensorShards()

    def _validate_adamw_group(self, group: dict[str, Any]) -> None:
        super()._validate_adamw_group(group)
        if self.state_dtype == "int8":
            for i, p in enumerate(group["params"]):
                if isinstance(p, DTensor):
                    raise NotImplementedError(
                        f"{type(self).__name__} with state_dtype='int8' quantizes the AdamW groups' moments in "
                        f"blocks of each local shard, which a distributed checkpoint can't lay out for another "
                        f"number of ranks; {param_label(group, i, p)} is a DTensor in an AdamW group. Use "
                        f"state_dtype='bf16', or the layer-wise optimizer (--parallel layerwise), whose owners "
                        f"take 'int8'.")

    def _holds_clip(self, grads: list[Tensor], coef: Tensor, flags: Tensor | None) -> bool | None:
        """A clip coefficient is applied as the gradients are read, DTensors too (their local shards, in the
        momentum pass and in AdamW's kernel), where every gradient is on one device, each DTensor gradient is laid
        out as its parameter, and the coefficient and flags are plain tensors (not a DTensor norm's)."""
        if not grads or type(coef) is not Tensor or (flags is not None and type(flags) is not Tensor):
            return None
        device = grads[0].device
        pairs = [(p, p.grad) for g in self.param_groups for p in g["params"] if p.grad is not None]
        return all(g.device == device and (type(g) is Tensor or (
            isinstance(g, DTensor) and isinstance(p, DTensor) and g.device_mesh == p.device_mesh
            and g.placements == p.placements)) for p, g in pairs)

    def _matrix_update(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                       skip: Tensor | None = None) -> None:
        """Muon's update, once for the plain tensors and once per (shape, placements) bucket of DTensors on local
        shards, pipelined over the buckets: every bucket's momentum pass and owner gather are launched first,
        then each is orthogonalized as its gather lands and scattered back while the next one computes, and the
        updates are applied last. ``skip``: the deferred check's agreed device flag; the DTensor buckets skip on it
        in the fused kernels (the owners' collectives and Newton–Schulz still run, on every rank alike), or read it
        on the host where their local shards don't take the fused kernels."""
        self._pipelined(group, params, grads, skip, None)

    def _state_chunks(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor]) -> list[list[int]]:
        """As Muon's for the plain tensors; a matrix group's DTensors make one chunk, stepped by one pipeline as
        without staged state, each bucket's state staged in turn (:meth:`_stream_units`)."""
        sharded = [i for i, p in enumerate(params) if isinstance(p, DTensor)]
        if not group[self.matrix_flag] or not sharded:
            return super()._state_chunks(group, params, grads)
        plain = [i for i, p in enumerate(params) if not isinstance(p, DTensor)]
        chunks = super()._state_chunks(group, [params[i] for i in plain], [grads[i] for i in plain]) if plain else []
        return [[plain[j] for j in c] for c in chunks] + [sharded]

    def _stream_units(self, group: dict[str, Any], params: list[Tensor]) -> list[list[int]] | None:
        """For a matrix group's chunk of DTensors: its buckets (indices of ``params`` in stack order), whose state
        the pipeline stages one at a time (:meth:`_streamed_update`), offloaded or compact. As Muon's otherwise."""
        if not group[self.matrix_flag] or not isinstance(params[0], DTensor):
            return super()._stream_units(group, params)
        return [list(b.order) for b in self._plan(params).buckets]

    def _streamed_update(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                         units: list[list[int]], staged: StagedStep) -> None:
        """The staged step of a matrix group's DTensors (``units``: their buckets): the pipeline of
        :meth:`_matrix_update`, each bucket's state staged for its momentum pass (and, NorMuon and AdaMuon, kept
        staged until its second moments have stepped). As Muon's for a chunk of plain tensors."""
        if not isinstance(params[0], DTensor):
            super()._streamed_update(group, params, grads, units, staged)
            return
        self._pipelined(group, params, grads, None, staged)

    def _pipelined(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor], skip: Tensor | None,
                   staged: StagedStep | None) -> None:
        """:meth:`_matrix_update`'s pipeline; ``staged``: the staged step (compact or offloaded state) whose units
        are this chunk's buckets, which then holds DTensors only."""
        plan = self._plan(params)
        if plan.plain:
            assert staged is None, "a staged chunk of DTensors holds no plain tensors"
            super()._matrix_update(group, [params[i] for i in plan.plain], [grads[i] for i in plan.plain], skip)
        shards = [(local_shards(params[i] for i in b.order), local_shards(grads[i] for i in b.order))
                  for b in plan.buckets]
        if skip is not None and shards and not skips_on_device(*(ts for pair in shards for ts in pair)):
            if self.nonfinite.on_host(skip):  # agreed over ranks: every rank returns (or raises) here
                return
            skip = None
        flights = [self._launch(group, b, [params[i] for i in b.order], *local, skip, staged)
                   for b, local in zip(plan.buckets, shards)]
        for f in flights:
            self._orthogonalize_owned(group, f)
        lr = self._device_lr(group, flights[0].dtensors[0].device) if flights else None
        for f in flights:
            Y = f.exchange.wait() if f.exchange is not None else f.Y
            Y, row_scale = self._shard_update(group, f, Y, skip)  # collective for NorMuon and AdaMuon
            if staged is not None and not self.streams_state:
                staged.unstage(f.dtensors)
            if f.params:  # Y (times row_scale) and the unsplit matrices' scale: each matrix's full update scale
                scale = self._owner_scale(group, *f.bucket.sharding.shape) if f.bucket.sharding.split is None else 1.0
                apply_update(f.params, Y, lambda m, n, s=scale: s, lr, group["weight_decay"], f.bucket.transposed,
                             skip=skip, decay_mode=group["weight_decay_mode"], row_scale=row_scale)

    def _plan(self, params: list[Tensor]) -> _Plan:
        """The buckets of a step over ``params``, made once per list of parameters and kept (one plan per param
        group): they depend only on the parameters' identity, shapes, placements and ``mark_split`` pieces, which
        the key holds, so a step reads no DTensor metadata and balances no owners again."""
        key = tuple((id(p), getattr(p, _SPLIT, None)) for p in params)
        plans: dict[tuple, _Plan] = self.__dict__.setdefault("_plans", {})
        plan = plans.get(key)
        if plan is not None and all(a is b for a, b in zip(plan.params, params)):
            return plan
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            if isinstance(p, DTensor):
                groups.setdefault((tuple(p.shape), p.dtype, p.device_mesh, p.placements, key[i][1]), []).append(i)
        loads: dict[Any, list[float]] = {}  # per FSDP group: the matrix cost each rank owns so far
        buckets = tuple(self._bucket([params[i] for i in idx], idx, loads) for idx in groups.values())
        plan = _Plan(tuple(params), tuple(i for i, p in enumerate(params) if not isinstance(p, DTensor)), buckets)
        if len(plans) >= len(self.param_groups):  # a group's parameters changed: forget the oldest plan
            del plans[next(iter(plans))]
        plans[key] = plan
        return plan

    def _bucket(self, ps: list[DTensor], idx: list[int], loads: dict[Any, list[float]]) -> _Bucket:
        """A bucket of same-layout DTensor matrices ``ps`` (``idx``: their indices in the step's list): owners by LPT
        on their cost, from the ``loads`` earlier buckets of the same FSDP group left (updated here)."""
        sh = self._layout(ps[0])
        order, counts = tuple(idx), None
        if sh.fsdp_group is not None:  # stack each owner's matrices together, owners ascending
            m, n = sh.shape
            world = len(sh.fsdp_rows)
            owners, loads[sh.fsdp_group] = lpt([muon_cost(m, n)] * len(ps), world, loads.get(sh.fsdp_group))
            order = tuple(idx[i] for i in sorted(range(len(ps)), key=owners.__getitem__))
            counts = tuple(owners.count(r) for r in range(world))
        rows, cols = sh.local_shape
        # Every rank of the FSDP group must lay its rows out alike: transposed when the first (largest) shard is tall
        transposed = (sh.fsdp_rows[0] if sh.fsdp_rows else rows) > cols
        return _Bucket(order, sh, counts, transposed)

    def _shard_update(self, group: dict[str, Any], f: _Flight, Y: Tensor,
                      skip: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """What to apply to a bucket's local shards from what the owners sent back, ``Y`` (laid out as the packed
        stack): ``(update, row_scale)`` for the update kernel; state it steps is left as it was where ``skip`` (a
        0-d device flag) is nonzero. Muon applies Y as it is."""
        return Y, None

    def _owner_scale(self, group: dict[str, Any], m: int, n: int) -> float:
        """The factor owners multiply an orthogonalized ``(m, n)`` piece by before sending it back: Muon's update
        scale."""
        return update_scale(group["scaling"], m, n)

    def _launch(self, group: dict[str, Any], b: _Bucket, ps: list[DTensor], local_ps: list[Tensor],
                local_gs: list[Tensor], skip: Tensor | None, staged: StagedStep | None) -> _Flight:
        """Momentum step and packing of one bucket's local shards (``local_ps``, ``local_gs`` of the DTensors ``ps``,
        in stack order; the momentum left as it was where ``skip`` is nonzero), and the launch of their owner
        gather. ``staged``: the staged step, which brings the bucket's state for the momentum pass (and stores it
        back after it, unless the update reads it again: ``streams_state``)."""
        if staged is not None:
            staged.stage(ps)
        for p in ps:
            if not self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        rows, cols = b.sharding.local_shape
        X = torch.empty((len(ps), cols, rows) if b.transposed else (len(ps), rows, cols),
                        dtype=self._stack_dtype(group, ps[0].device), device=ps[0].device)
        params = local_ps if rows * cols else []  # an empty shard only serves the collectives
        if params:
            momentum_pack(local_gs, [self.state[p]["momentum_buffer"].to_local() for p in ps], X,
                          group["momentum"], group["nesterov"], b.transposed, skip=skip,
                          grad_scale=self._step_grad_scale, sign=self._pack_sign(group))
        if staged is not None and self.streams_state:
            staged.unstage(ps)
        exchange = gather_to_owners(X, b.counts, b.sharding.fsdp_rows, 2 if b.transposed else 1,
                                    b.sharding.fsdp_group) if b.counts is not None else None
        return _Flight(b, ps, params, X, exchange)

    def _orthogonalize_owned(self, group: dict[str, Any], f: _Flight) -> None:
        """Wait for a bucket's gather, orthogonalize the matrices this rank owns, launch the scatter back."""
        b = f.bucket
        owned = f.exchange.wait() if f.exchange is not None else f.Y
        if owned.size(0):  # every rank of a TP group has the same k, so TP collectives stay matched
            owned = self._orthogonalize_stack(group, owned, b.sharding, b.transposed)
        if b.counts is None:
            f.Y = owned
        else:
            f.exchange = scatter_from_owners(owned, b.counts, b.sharding.fsdp_rows, 2 if b.transposed else 1,
                                             b.sharding.fsdp_group)
            f.Y = None

    def _orthogonalize_stack(self, group: dict[str, Any], S: Tensor, sh: Sharding, transposed: bool) -> Tensor:
        """S: ``(k, m_p, n_q)``, or ``(k, n_q, m_p)`` when ``transposed``: whole matrices except for the TP split.
        Returns each split piece's polar factor times the update scale of its full shape, laid out as S (pieces of
        one shape orthogonalized in one batch); an unsplit matrix's polar factor alone, whose scale the update
        kernel applies where the rows land (one pass fewer over the owned matrices)."""
        if sh.split is None:
            return self._orthogonalize_piece(group, S, sh, 1.0, sh.tp_sizes, transposed)
        dim, sizes = sh.split
        stack_dim = 2 - dim if transposed else 1 + dim
        tp = len(sh.tp_sizes)
        pieces = S.split(list(sizes), dim=stack_dim)
        out: list[Tensor | None] = [None] * len(pieces)
        for size in dict.fromkeys(sizes):
            idx = [i for i, s in enumerate(sizes) if s == size]
            whole, tp_sizes = (size * tp, (size,) * tp) if sh.rank_major else (size, sh.tp_sizes)
            pm, pn = (whole, sh.shape[1]) if dim == 0 else (sh.shape[0], whole)
            Y = self._orthogonalize_piece(group, torch.cat([pieces[i] for i in idx]), sh,
                                          self._owner_scale(group, pm, pn), tp_sizes, transposed)
            for i, y in zip(idx, Y.split(S.size(0))):
                out[i] = y
        return torch.cat(out, dim=stack_dim)

    def _orthogonalize_piece(self, group: dict[str, Any], Y: Tensor, sh: Sharding, scale: float,
                             tp_sizes: tuple[int, ...], transposed: bool) -> Tensor:
        """``(k, m', n')`` pieces, or ``(k, n', m')`` when ``transposed`` (column- or row-sharded over TP if any,
        ``tp_sizes`` along the TP dim) -> ``scale * polar``, same layout (no multiply for a scale of 1)."""
        if sh.tp_group is not None:
            M = Y.mT if transposed else Y
            M = tp_newton_schulz(M, sh.tp_dim, sh.tp_group, config=ns_config(group), mode=self.tp_mode,
                                 chunks=self.tp_chunks, sizes=tp_sizes, cost_model=self.tp_cost_model)
            M = M if scale == 1.0 else scale * M
            return M.mT if transposed else M
        # polar(A^T) = polar(A)^T, so the layout does not matter; Newton–Schulz takes the short side first,
        # row-major (the Triton SYRK path takes row-major stacks; a transposed view would be copied every iteration)
        if Y.size(-2) > Y.size(-1):
            O = self._orthogonalize(group, Y.mT.contiguous()).mT
        else:
            O = self._orthogonalize(group, Y.contiguous())
        return O if scale == 1.0 else O * scale

    def _layout(self, p: DTensor) -> Sharding:
        """Check a DTensor matrix's placements and describe them; raise ValueError naming what is unsupported."""
        mesh, names = p.device_mesh, p.device_mesh.mesh_dim_names or ()
        if p.ndim != 2:
            raise ValueError(f"{type(self).__name__} handles 2-D DTensor matrices; got shape {tuple(p.shape)} with "
                             f"placements {p.placements}. Reshape it to 2-D or put it in an AdamW group.")
        fsdp_dim = tp_dim = None
        strided = False  # FSDP over the rows of a TP row shard (fully_shard on top of column-parallel TP)
        for i, pl in enumerate(p.placements):
            if isinstance(pl, Replicate):
                continue
            is_tp = i < len(names) and names[i] == self.tp_mesh_dim
            if isinstance(pl, _StridedShard) and not is_tp and pl.dim == 0 and fsdp_dim is None:
                fsdp_dim, strided = i, True
            elif type(pl) is Shard and is_tp:
                tp_dim = i
            elif type(pl) is Shard and pl.dim == 0 and fsdp_dim is None:
                fsdp_dim = i
            else:
                raise ValueError(
                    f"{type(self).__name__} supports matrices that are replicated, FSDP-sharded along dim 0 on one "
                    f"mesh dim, and/or TP-sharded along dim 0 or 1 on the mesh dim named {self.tp_mesh_dim!r}; "
                    f"got placements {p.placements} on mesh dims {names or '(unnamed)'} for shape "
                    f"{tuple(p.shape)}. Name the TP mesh dim with tp_mesh_dim, or put FSDP on top of row-wise "
                    f"(Shard(1)) TP.")
        tp_mat_dim = p.placements[tp_dim].dim if tp_dim is not None else -1
        if fsdp_dim is not None and tp_mat_dim == 0 and not strided:
            raise ValueError(f"FSDP and TP both shard the rows of a {tuple(p.shape)} matrix (placements "
                             f"{p.placements}), FSDP first, so gathering over FSDP does not give a TP shard; apply "
                             f"TP first and FSDP2 fully_shard on top (placements (_StridedShard(0), Shard(0))), or "
                             f"shard the columns with TP (row-wise parallel)")
        if strided and (tp_mat_dim != 0 or fsdp_dim > tp_dim
                        or p.placements[fsdp_dim].split_factor != mesh.size(tp_dim)):
            raise ValueError(f"{type(self).__name__} handles _StridedShard(0) only as FSDP2 lays it over a TP row "
                             f"shard: placements (_StridedShard(0, sf=tp), Shard(0) on {self.tp_mesh_dim!r}); got "
                             f"{p.placements} on mesh dims {names or '(unnamed)'} for shape {tuple(p.shape)}")
        rows = p.shape[0]  # the rows FSDP splits: the TP shard's under FSDP x TP rows
        if strided:
            rows = comm.chunk_sizes(rows, mesh.size(tp_dim))[mesh.get_local_rank(tp_dim)]
        split = getattr(p, _SPLIT, None)
        if split is not None and split[0] == tp_mat_dim:  # rank-major: each TP shard holds 1/tp of every piece
            dim, sizes = split
            tp = mesh.size(tp_dim)
            if any(size % tp for size in sizes):
                raise ValueError(f"a {tuple(p.shape)} matrix is split into pieces {sizes} along dim {dim}, which "
                                 f"TP shards over {tp} ranks (placements {p.placements}); every piece must be "
                                 f"divisible by {tp}: pick a TP size that divides them, or do not split it")
            split = (dim, tuple(size // tp for size in sizes))
        return Sharding(
            shape=(p.shape[0], p.shape[1]),
            local_shape=tuple(p.to_local().shape),
            fsdp_group=mesh.get_group(fsdp_dim) if fsdp_dim is not None else None,
            fsdp_rows=tuple(comm.chunk_sizes(rows, mesh.size(fsdp_dim))) if fsdp_dim is not None else (),
            tp_group=mesh.get_group(tp_dim) if tp_dim is not None else None,
            tp_dim=max(tp_mat_dim, 0),
            tp_sizes=tuple(comm.chunk_sizes(p.shape[tp_mat_dim], mesh.size(tp_dim))) if tp_dim is not None else (),
            split=split)


class _ShardedSecondMoment(ShardedMuon):
    """NorMuon's and AdaMuon's second moments on sharded matrices: FSDP2 row shards, tensor parallelism over rows
    or columns, or both (not on weights split along their columns). Owners send back the bare orthogonalized
    pieces; each rank steps the second moments of its shard (NorMuon's row statistics summed over the TP group
    where TP splits the rows' columns), the Frobenius norms of each (matrix, piece) are summed over the FSDP and TP
    groups, and the update kernel applies each row's normalization, RMS alignment and update scale. The second
    moments are DTensors sharded as the weights, so state dicts and distributed checkpoints see ordinary sharded
    state."""

    def _owner_scale(self, group: dict[str, Any], m: int, n: int) -> float:
        return 1.0

    def _sharded_state(self, p: DTensor) -> DTensor:
        """A new zero second moment for the DTensor parameter ``p``, sharded as its rows."""
        raise NotImplementedError

    def _shard_moments(self, group: dict[str, Any], O: Tensor, state: list[Tensor], row_group: ProcessGroup | None,
                       cols: int, skip: Tensor | None) -> tuple[Tensor | None, Tensor | None, Tensor]:
        """``_moments`` on this rank's shard ``O (k, rows, c)`` of k matrices with ``cols`` columns in all,
        ``row_group`` the ranks holding the rest of each row (None: whole rows here), ``state`` left as it was
        where ``skip`` is nonzero. ``row_sq`` is this rank's part of each row's squared norm."""
        return self._moments(group, O, state, skip)  # element-wise: nothing to gather

    def _pieces(self, sh: Sharding, scaling: str, device: torch.device) -> tuple[Tensor, tuple[int, ...], Tensor]:
        """For a bucket of matrices laid out as ``sh``: ``piece``, ``(rows,)`` int64, the ``mark_split`` piece each
        of this rank's rows falls in; ``counts``, how many of this rank's rows each piece has (the rows of a piece
        are consecutive); and ``target``, ``(pieces,)`` float32, each piece's RMS-aligned Frobenius norm times its
        update scale under ``scaling``. Made once per (layout, scaling, device) and kept: the tensors are blocking
        copies to the device."""
        cache: dict[tuple, tuple[Tensor, tuple[int, ...], Tensor]] = self.__dict__.setdefault("_piece_cache", {})
        key = (sh, scaling, device)
        if key not in cache:
            sizes = sh.split[1] if sh.split is not None else (sh.shape[0],)  # pieces along the rows (of the TP shard)
            start = sum(sh.fsdp_rows[:comm.rank(sh.fsdp_group)]) if sh.fsdp_group is not None else 0
            rows = sh.local_shape[0]
            bounds = [sum(sizes[:i + 1]) for i in range(len(sizes))]
            owned = [min(b, start + rows) - max(b - m, start) for b, m in zip(bounds, sizes)]
            counts = tuple(max(0, c) for c in owned)
            piece = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(counts)).to(device)
            tp = len(sh.tp_sizes) if sh.rank_major else 1  # a rank-major piece is 1/tp of the whole piece
            target = torch.tensor([min(m * tp, sh.shape[1]) ** 0.5 * update_scale(scaling, m * tp, sh.shape[1])
                                   for m in sizes], device=device)
            cache[key] = piece, counts, target
        return cache[key]

    def _shard_update(self, group: dict[str, Any], f: _Flight, Y: Tensor,
                      skip: Tensor | None) -> tuple[Tensor, Tensor | None]:
        sh = f.bucket.sharding
        if sh.split is not None and sh.split[0] != 0:
            raise ValueError(f"{type(self).__name__} does not take weights split along their columns (a {sh.shape} "
                             f"matrix split {sh.split}); use --parallel layerwise, or ShardedMuon")
        rows, cols = sh.local_shape
        tp_cols = sh.tp_group is not None and sh.tp_dim == 1
        Yr = Y.mT if f.bucket.transposed else Y  # (k, rows, cols): this rank's rows of each matrix
        for p in f.dtensors:
            if self._state_key not in self.state[p]:
                self.state[p][self._state_key] = self._sharded_state(p)
        if f.params:
            state = [self.state[p][self._state_key].to_local() for p in f.dtensors]
            out, factor, row_sq = self._shard_moments(group, Yr, state, sh.tp_group if tp_cols else None, sh.shape[1],
                                                      skip)
        else:  # an empty shard: no rows, but the norms' all-reduce still needs this rank
            out, factor, row_sq = None, None, Yr.new_zeros(Yr.shape[:2], dtype=torch.float32)
        piece, counts, target = self._pieces(sh, group["scaling"], Y.device)
        # (k, pieces): each piece's rows summed by a reduction, in the same order run after run (index_add_ on the
        # GPU adds in whatever order its atomics land, and NorMuon's row normalization can amplify that)
        normsq = torch.stack([part.sum(1) for part in row_sq.split(counts, dim=1)], dim=1)
        for g in (sh.fsdp_group, sh.tp_group):
            if g is not None:
                comm.all_reduce_sum(normsq, g)
        align = torch.where(normsq > 0, target / normsq.sqrt(), 0.0)[:, piece]  # (k, rows)
        scale = align if factor is None else factor * align
        update = Yr if out is None else out
        if f.bucket.transposed:
            return update.mT, scale.contiguous()
        return update, torch.nn.functional.pad(scale, (0, cols - rows)).contiguous()  # the stack's (k, cols)


class ShardedNorMuon(_ShardedSecondMoment, NorMuon):
    """:class:`matrixopt.NorMuon` over DTensor parameters (see :class:`ShardedMuon` for the arguments and the
    layouts it takes). ``row_second_moment`` is a DTensor sharded as the rows (replicated over a TP group that
    shards the columns)."""

    def _sharded_state(self, p: DTensor) -> DTensor:
        local = torch.zeros(p.to_local().shape[0], dtype=torch.float32, device=p.device)
        rows = [pl if isinstance(pl, (Shard, _StridedShard)) and pl.dim == 0 else Replicate()
                for pl in p.placements]  # a column shard holds every row
        return DTensor.from_local(local, p.device_mesh, rows, shape=(p.shape[0],), stride=(1,))

    def _shard_moments(self, group: dict[str, Any], O: Tensor, state: list[Tensor], row_group: ProcessGroup | None,
                       cols: int, skip: Tensor | None) -> tuple[None, Tensor, Tensor]:
        sumsq = row_sums_of_squares(O, [O], transpose=False)[:, :O.shape[1]]  # this rank's columns
        full = sumsq
        if row_group is not None:
            full = sumsq.clone()
            comm.all_reduce_sum(full, row_group)
        inv, _ = self._row_step(group, full, cols, state, skip)
        return None, inv, inv.square() * sumsq


class ShardedAdaMuon(_ShardedSecondMoment, AdaMuon):
    """:class:`matrixopt.AdaMuon` over DTensor parameters (see :class:`ShardedMuon` for the arguments and the
    layouts it takes). ``exp_avg_sq`` is a DTensor sharded as the parameter."""

    def _sharded_state(self, p: DTensor) -> DTensor:
        return torch.zeros_like(p, dtype=torch.float32)
