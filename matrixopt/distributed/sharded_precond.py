r"""Shampoo and SOAP for FSDP2-sharded parameters: each matrix preconditioned whole, on one owner rank.

Under FSDP2 ``fully_shard`` every rank holds a slice of rows of every matrix (a DTensor ``Shard(0)`` over a 1-D
mesh). Shampoo's and SOAP's factors are :math:`G G^\top` and :math:`G^\top G` of the whole gradient, so each
matrix parameter has one owner rank, chosen by LPT on the optimizer's cost of its blocks
(:mod:`matrixopt.distributed.balance`), which holds all of its matrix state and runs the single-process math on
the whole matrix (:meth:`matrixopt.optim.shampoo.KroneckerOptimizer._matrix_updates`). One step of a param
group, per process group::

    G = gather_rows(local gradient rows, owners)    # each matrix's whole gradient on its owner
    U = _matrix_updates(group, owned, G)            # Shampoo's or SOAP's update of each matrix owned here
    u = scatter_rows(U, owners)                     # this rank's rows of every update
    w = (1 - lr wd) w - lr u                        # on the local shards, as the single-process optimizer applies U

The updates are sent as soon as they are issued: SOAP's refresh, which follows its update, runs beside the
exchange.

The update is the single-process one (up to the order of FSDP's fp32 gradient reduction). The factors, the roots
or eigenbases and the moments of a matrix live on its owner only, so the state is spread over the ranks, and so
is the work of each refresh (every ``precondition_frequency`` steps each owner refreshes the matrices it owns,
about ``1 / world`` of the single-process refresh). With ``stagger_refresh`` the refreshes are spread over the steps
as well (:mod:`matrixopt.optim.shampoo`), and the owners are packed one refresh phase after another, so that each
step refreshes about ``1 / (world * precondition_frequency)`` of the matrices on every rank and no rank's refresh
holds up the others at the next exchange. AdamW groups run AdamW on the DTensors.

State. The owner of a matrix holds the single-process state of the whole matrix as plain tensors (``step``,
momentum or moments, factors, roots or eigenbases); every other rank holds its ``step`` only. ``state_dict()`` is
each rank's share, and torch.distributed.checkpoint (:func:`matrixopt.distributed.checkpoint.save_dtensor`)
writes each matrix's state once, from its owner. A load at any world size
(:func:`~matrixopt.distributed.checkpoint.load_dtensor`) reads each matrix's state into its new owner:
``get_state_dict`` gives a fresh optimizer its state (one zero-gradient step at lr 0), and so its owners' keys.
:meth:`load_state_dict` keeps on each rank the state of the matrices it owns, so a state dict holding every
matrix's state (one rank's, at world size 1) loads at any world size too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Shard

from matrixopt.distributed import comm
from matrixopt.distributed.balance import lpt, shampoo_cost, soap_cost
from matrixopt.distributed.sharded import OnLocalShards
from matrixopt.optim.base import MatrixOptimizer, param_label
from matrixopt.optim.layout import copy_marks
from matrixopt.optim.shampoo import Block, Shampoo
from matrixopt.optim.soap import SOAP


def _standin(p: DTensor) -> Tensor:
    """A meta tensor of ``p``'s global shape carrying its matrix layout marks: what a block plan reads."""
    return copy_marks(p, torch.empty(p.shape, device="meta"))


class _OwnerSharded(OnLocalShards):
    """What :class:`ShardedShampoo` and :class:`ShardedSOAP` add to Shampoo and SOAP (see the module docstring):
    owners, the row exchange, and state kept on owners. ``cost(m, n)``: the optimizer's cost of one block."""

    cost: Callable[[int, int], float]

    def __init__(self, params: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        self._owners: dict[int, tuple[ProcessGroup, int]] = {}  # id(param) -> (its FSDP group, owner rank there)
        self._loads: dict[ProcessGroup, list[float]] = {}  # per FSDP group: the cost each rank owns
        super().__init__(params, *args, **kwargs)
        if self.state_dtype is not None or self.offload is not None:
            raise ValueError(f"{type(self).__name__} keeps its state in float32 on the owner ranks; state_dtype "
                             f"({self.state_dtype}) and offload ({self.offload}) handle plain tensors: leave them "
                             f"unset")

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Owners are keyed by parameter identity: an unpickled optimizer assigns them again, as at construction."""
        super().__setstate__(state)
        if "_owners" not in self.__dict__:
            self._owners, self._loads = {}, {}
            for group in self.param_groups:
                if group[self.matrix_flag]:
                    self._assign(group)

    # ----------------------------------------------------------------------------------- owners
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group[self.matrix_flag]:
            self._assign(group)

    def _check_matrices(self, group: dict[str, Any]) -> None:
        super()._check_matrices(group)
        name = type(self).__name__
        base = next(c.__name__ for c in type(self).__mro__  # Shampoo, SOAP
                    if issubclass(c, MatrixOptimizer) and not issubclass(c, _OwnerSharded))
        for i, p in enumerate(group["params"]):
            what = param_label(group, i, p)
            if not isinstance(p, DTensor):
                raise ValueError(f"{name} handles the DTensor matrices of an FSDP2 model; {what} is a plain "
                                 f"{type(p).__name__}. Shard the model with fully_shard first "
                                 f"(matrixopt.distributed.fsdp.apply_fsdp), or use matrixopt.{base} unsharded.")
            if p.device_mesh.ndim != 1 or p.placements != (Shard(0),):
                raise ValueError(f"{name} handles matrices that FSDP2 fully_shard shards along dim 0 over a 1-D "
                                 f"mesh (placements (Shard(0),)); {what} has placements {p.placements} on a mesh "
                                 f"of shape {tuple(p.device_mesh.shape)}. Tensor parallelism and HSDP are not "
                                 f"supported: train {base} with --tp 1, or layer-wise (--parallel layerwise).")

    def _assign(self, group: dict[str, Any]) -> None:
        """Owners of the group's matrices, per FSDP group: LPT on their cost, from the load earlier groups left;
        with ``stagger_refresh`` one refresh phase after another (:meth:`_phase`), so that each step's refreshes
        are spread over the ranks as well as the whole step's work."""
        by_group: dict[ProcessGroup, list[DTensor]] = {}
        for p in group["params"]:
            by_group.setdefault(p.device_mesh.get_group(0), []).append(p)
        for pg, ps in by_group.items():
            costs = [sum(self.cost(b.r1 - b.r0, b.c1 - b.c0) for b in self._block_plan(group, p)) for p in ps]
            phases = [self._phase(group, p) for p in ps]
            loads = self._loads.get(pg)
            for phase in sorted(set(phases)):
                idx = [i for i, f in enumerate(phases) if f == phase]
                owners, loads = lpt([costs[i] for i in idx], comm.world_size(pg), loads)
                for i, r in zip(idx, owners):
                    self._owners[id(ps[i])] = (pg, r)
            self._loads[pg] = loads

    def owner(self, p: DTensor) -> int:
        """The rank (in ``p``'s FSDP group) that owns the matrix parameter ``p`` and holds its state."""
        return self._owners[id(p)][1]

    def _owns(self, p: Tensor) -> bool:
        pg, r = self._owners[id(p)]
        return comm.rank(pg) == r

    def _block_plan(self, group: dict[str, Any], p: Tensor) -> list[Block]:
        return super()._block_plan(group, _standin(p) if isinstance(p, DTensor) else p)

    # ----------------------------------------------------------------------------------- step
    def _matrix_update(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                       skip: Tensor | None = None) -> None:
        skip = self._device_skip(group, params, skip)  # every rank counts the steps: they decide alike
        if skip is False:
            return
        by_group: dict[ProcessGroup, list[int]] = {}
        for i, p in enumerate(params):
            by_group.setdefault(self._owners[id(p)][0], []).append(i)
        for pg, idx in by_group.items():
            self._owner_step(group, pg, [params[i] for i in idx], [grads[i] for i in idx], skip)

    def _owner_step(self, group: dict[str, Any], pg: ProcessGroup, params: list[DTensor], grads: list[DTensor],
                    skip: Tensor | None) -> None:
        """One step of DTensor matrices sharded over ``pg``: whole gradients to the owners, the single-process
        update there, its rows back, and the update applied to the local shards. Collective over ``pg``.
        ``skip``: a deferred check's device flag, agreed over the ranks (:meth:`_matrix_updates`). The updates
        are sent as soon as they are issued: a refresh that follows them (SOAP's) runs beside the exchange."""
        me, world = comm.rank(pg), comm.world_size(pg)
        owners = [self._owners[id(p)][1] for p in params]
        sizes = [comm.chunk_sizes(p.shape[0], world) for p in params]  # every rank's rows, as fully_shard splits
        widths = [math.prod(p.shape[1:]) for p in params]
        rows = [g.to_local().reshape(s[me], n) for g, s, n in zip(grads, sizes, widths)]  # (rows, n)
        whole = comm.gather_rows(rows, owners, sizes, pg, self._gradient_dtype(group)).wait()  # (m, n) per owned
        mine = [i for i, r in enumerate(owners) if r == me]
        self._advance([self.state[p] for i, p in enumerate(params) if owners[i] != me], skip)  # owners count theirs
        moved: list[int] = []  # the steps are alike on every rank, so is this
        back: list[comm.InFlight] = []

        def send(updates: list[Tensor | None]) -> None:
            owned = dict(zip(mine, updates))
            moved.extend(i for i, p in enumerate(params) if self.first_step_moves or self.state[p]["step"] > 1)
            if moved:
                back.append(comm.scatter_rows([owned[i].view(sum(sizes[i]), widths[i]) for i in moved
                                               if owners[i] == me], [owners[i] for i in moved],
                                              [sizes[i] for i in moved], [widths[i] for i in moved], pg))

        if mine:
            self._matrix_updates(group, [params[i] for i in mine],
                                 [G.view(params[i].shape) for i, G in zip(mine, whole)], skip, then=send)
        else:
            send([])
        if back:
            local = [params[i].to_local() for i in moved]
            self._apply(group, local, [u.view(w.shape) for u, w in zip(back[0].wait(), local)], skip)

    # ----------------------------------------------------------------------------------- state
    def _check_factors(self, group: dict[str, Any], p: Tensor, st: dict[str, Any]) -> None:
        if not self._owns(p):  # kept: its step only
            return
        if "step" in st and len(st) == 1:
            raise ValueError(f"the state dict holds only the step of a {tuple(p.shape)} matrix that this rank owns: "
                             f"it is one rank's share, saved at another world size; load sharded state through "
                             f"torch.distributed.checkpoint (matrixopt.distributed.checkpoint.load_dtensor), which "
                             f"reads each matrix's state into its owner")
        super()._check_factors(group, p, st)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As the single-process optimizer's, then each rank keeps the whole state of the matrices it owns and the
        ``step`` of the others (see the module docstring)."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            if group[self.matrix_flag]:
                for p in group["params"]:
                    if p in self.state and not self._owns(p):
                        self.state[p] = {"step": self.state[p]["step"]}


class ShardedShampoo(_OwnerSharded, Shampoo):
    """:class:`matrixopt.Shampoo` over FSDP2-sharded parameters (DTensor ``Shard(0)`` on a 1-D mesh), each matrix
    preconditioned whole on its owner rank (module docstring). Takes Shampoo's arguments but ``state_dtype`` and
    ``offload``. Every rank must call ``step()``: the updates are collective.

    State of a matrix parameter: Shampoo's (whole, plain tensors) on its owner (:meth:`owner`), ``step`` on the
    other ranks; AdamW's DTensor state for the other groups."""

    cost = staticmethod(shampoo_cost)

    @staticmethod
    def _first_basis(group: dict[str, Any], st: dict[str, Any], step: int) -> bool:
        """Whether the eigenbasis root at the ``step``-th step starts from eigh (and so reads the host): at
        ``start_preconditioning_step`` only, decided alike on every rank from the step count, which is all a
        non-owner holds of a matrix's state (Shampoo's rule, which also asks whether the state holds bases, would
        read the flag on the host at every refresh of a matrix another rank owns). An owner's state without bases
        (Newton roots before) takes its first power step from the identity."""
        return step == group["start_preconditioning_step"]


class ShardedSOAP(_OwnerSharded, SOAP):
    """:class:`matrixopt.SOAP` over FSDP2-sharded parameters (DTensor ``Shard(0)`` on a 1-D mesh), each matrix
    preconditioned whole on its owner rank (module docstring). Takes SOAP's arguments but ``state_dtype`` and
    ``offload``. Every rank must call ``step()``: the updates are collective.

    State of a matrix parameter: SOAP's (whole, plain tensors) on its owner (:meth:`owner`), ``step`` on the other
    ranks; AdamW's DTensor state for the other groups."""

    cost = staticmethod(soap_cost)
