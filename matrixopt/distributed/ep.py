"""Expert parallelism: each mixture-of-experts layer's experts split over the ranks of an EP group.

With ``world`` ranks and degree ``ep``, the ranks form ``world / ep`` EP groups of ``ep`` consecutive ranks; rank r
holds experts ``[i E/ep, (i+1) E/ep)`` of every layer, i = r mod ep, as ``(E/ep, out, in)`` stacks (still marked
experts, so a matrix optimizer orthogonalizes each expert's matrix on its own). The ranks holding the same
experts (``r mod ep`` equal) are that shard's data-parallel replicas: the expert gradients are summed over them
(:func:`reduce_expert_grads`), the dense ones over every rank as usual.

Token dispatch, per layer and micro-batch (:class:`ExpertDispatch`), on rows already sorted by global expert::

    counts (E,) --all_to_all--> received counts (ep, E/ep): rows each rank sends for each of my experts
    rows  --all_to_all (variable splits)--> rows for my experts, by source rank  --sort by local expert-->
    compute on my stacks  --unsort--> --all_to_all back--> rows in the sender's order

The row all-to-alls are :class:`AllToAll`, whose backward is the reverse all-to-all. A rank that receives no rows
still computes (on empty blocks) and takes part in every collective, forward and backward, so it gets zero
gradients for its experts and nothing waits on it.

Checkpoints hold whole stacks: :func:`gather_experts` gathers a shard's stacks over the EP group,
:func:`local_experts` takes a rank's slice of a whole one, so any ep (and one process) can load them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from matrixopt.optim.layout import _EXPERTS, mark_experts


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with autograd: rows ``x`` ``(sum(send), ...)`` go out in blocks of ``send[j]`` rows to
    rank j of ``group``; the result ``(sum(recv), ...)`` stacks the ``recv[j]`` rows from each rank j. The
    gradient goes back by the reverse all-to-all (``recv`` and ``send`` swapped)."""

    @staticmethod
    def forward(ctx, x: Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def all_to_all(x: Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> Tensor:
    """:class:`AllToAll` as a function. Collective over ``group``."""
    return AllToAll.apply(x, recv, send, group)


class ExpertDispatch:
    """The ``dispatch`` of an :class:`~matrixopt.train.model.Experts`-like module under expert parallelism:
    ``dispatch(compute, x, counts)`` with ``x`` ``(M, d)`` rows sorted by global expert and ``counts`` ``(E,)``
    int64 rows per global expert; ``compute(rows, local_counts)`` runs this rank's ``E/ep`` experts on rows sorted
    by local expert. Returns ``(M, d)``, the expert outputs in the order of ``x``. Under autocast the rows travel
    in the autocast dtype (bf16), which the experts would cast them to anyway. Collective over ``group``."""

    def __init__(self, group: dist.ProcessGroup, n_expert: int):
        self.group, self.ep = group, dist.get_world_size(group)
        self.n_local = n_expert // self.ep

    def __call__(self, compute: Callable[[Tensor, Tensor], Tensor], x: Tensor, counts: Tensor) -> Tensor:
        ep, El = self.ep, self.n_local
        if torch.is_autocast_enabled(x.device.type):  # the experts compute in the autocast dtype: send that
            x = x.to(torch.get_autocast_dtype(x.device.type))
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # (ep E/ep,): [source rank, local expert]
        host = torch.stack([counts.view(ep, El).sum(1), recv_counts.view(ep, El).sum(1)]).tolist()
        send, recv = host  # rows to and from each rank of the group
        rows = all_to_all(x, recv, send, self.group)  # (R, d), by source rank then local expert
        local = torch.arange(ep * El, device=x.device) % El  # local expert of each (source, expert) block
        expert = torch.repeat_interleave(local, recv_counts, output_size=rows.size(0))  # (R,)
        order = expert.argsort(stable=True)  # rows sorted by local expert
        y = compute(rows[order], recv_counts.view(ep, El).sum(0))  # (R, d)
        y = torch.empty_like(y).index_copy(0, order, y)  # back to the received order
        return all_to_all(y, send, recv, self.group)  # (M, d)


def expert_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` of every module with a ``dispatch`` attribute that holds expert stacks (3-D parameters
    marked with :func:`matrixopt.mark_experts`)."""
    for name, mod in model.named_modules():
        if hasattr(mod, "dispatch") and any(getattr(p, _EXPERTS, False) for p in mod.parameters(recurse=False)):
            yield name, mod


def expert_param_names(model: nn.Module) -> list[str]:
    """Qualified names of the expert stacks of :func:`expert_modules`, in ``named_parameters`` order."""
    names = {f"{m}.{n}" if m else n for m, mod in expert_modules(model) for n, _ in mod.named_parameters(recurse=False)}
    return [n for n, _ in model.named_parameters() if n in names]


def shard_experts(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Keep this rank's slice of every expert stack, in place, and route the expert modules' rows over ``group``
    (:class:`ExpertDispatch`). Call on the whole model, built alike on every rank, before building the
    optimizer. ValueError when a stack's expert count is not divisible by the group's size."""
    ep, i = dist.get_world_size(group), dist.get_rank(group)
    for name, mod in expert_modules(model):
        n_expert = None
        for pname, p in list(mod.named_parameters(recurse=False)):
            if not getattr(p, _EXPERTS, False):
                continue
            if n_expert is not None and p.shape[0] != n_expert:
                raise ValueError(f"{name}.{pname} stacks {p.shape[0]} experts but its module's other stacks "
                                 f"{n_expert}; every stack of one module needs the same expert count")
            n_expert = p.shape[0]
            if n_expert % ep:
                raise ValueError(f"{name}.{pname} stacks {n_expert} experts, not divisible by ep={ep}; pick an "
                                 f"--ep that divides {n_expert}")
            setattr(mod, pname, mark_experts(nn.Parameter(local_experts(p.detach(), ep, i).clone())))
        mod.dispatch = ExpertDispatch(group, n_expert)


def local_experts(t: Tensor, ep: int, index: int) -> Tensor:
    """Rank ``index``'s block of ``ep`` equal blocks of a whole stack ``t`` ``(E, ...)``: ``(E/ep, ...)``, a view."""
    n = t.shape[0] // ep
    return t[index * n : (index + 1) * n]


def gather_experts(t: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The whole stack ``(ep E_local, ...)`` from every rank's block ``t`` ``(E_local, ...)``, in rank order.
    Collective over ``group``."""
    blocks = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(blocks, t.contiguous(), group=group)
    return torch.cat(blocks)


def expert_groups(world: int, ep: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's EP group (``ep`` consecutive ranks) and replica group (the ``world / ep`` ranks holding the
    same experts). Creates every group, so every rank must call it. ValueError unless ep divides world."""
    if ep < 1 or world % ep:
        raise ValueError(f"--ep {ep} must divide the number of ranks, {world}; launch a multiple of {ep} ranks "
                         f"(torchrun --nproc-per-node) or pick an --ep that divides {world}")
    rank, mine = dist.get_rank(), {}
    for g in range(world // ep):  # EP groups: consecutive ranks
        ranks = list(range(g * ep, (g + 1) * ep))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["ep"] = group
    for i in range(ep):  # replica groups: ranks i, i + ep, ...
        ranks = list(range(i, world, ep))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["replica"] = group
    return mine["ep"], mine["replica"]


def reduce_expert_grads(params: list[Tensor], replica_group: dist.ProcessGroup, world: int) -> None:
    """Finish the gradients of this rank's expert stacks: sum over the replica group and divide by ``world``,
    which makes them the gradient of the mean of every rank's loss (each rank's stacks receive the rows of its
    whole EP group). A stack that received no rows (no gradient) gets zeros, so it still steps. Collective."""
    replicas = dist.get_world_size(replica_group)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if replicas > 1:
            dist.all_reduce(p.grad, group=replica_group)
        p.grad.div_(world)
