"""Tensor parallelism for the reference GPT: Megatron's layout through ``parallelize_module``.

In every block, ``attn.c_attn`` and ``mlp.c_fc`` are column-parallel (each TP rank computes its output features:
whole heads, a slice of the MLP), ``attn.c_proj`` and ``mlp.c_proj`` row-parallel (each rank contracts its slice
and the outputs are summed); one all-reduce per sublayer in forward and one in backward. Embeddings, norms and
``lm_head`` stay replicated over TP. The model itself does not change: attention takes its head count from the
width of its q, k and v.

The fused QKV weight ``(3d, d)`` is stored rank-major under TP so that column parallelism gives TP rank p whole
heads of Q, K and V: rows ``[q_p; k_p; v_p]`` for ``p = 0..tp-1``, where ``q_p`` is rank p's ``d / tp`` rows of Q.
Its ``mark_split`` into Q, K, V then holds per TP shard (:class:`matrixopt.distributed.sharded.ShardedMuon`
splits each rank's shard into three pieces of ``d / tp`` rows). :func:`rank_major_qkv` gives the row order;
``W[order]`` converts a single-process weight and ``W[order.argsort()]`` converts back. Checkpoints hold the
single-process order (:func:`reorder_qkv_state`), so they load into a plain GPT and resume at any TP size.
:data:`GPT_TP` hands both to :class:`matrixopt.distributed.FSDP`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from matrixopt.distributed.parallelism import TPPlan
from matrixopt.train.model import GPT

BLOCK_PLAN = {
    "attn.c_attn": ColwiseParallel(),
    "attn.c_proj": RowwiseParallel(),
    "mlp.c_fc": ColwiseParallel(),
    "mlp.c_proj": RowwiseParallel(),
}


def rank_major_qkv(n_embd: int, tp: int) -> Tensor:
    """Row order ``(3 * n_embd,)`` int64 taking a fused ``[Q; K; V]`` weight (or bias) to the rank-major
    ``[q_0; k_0; v_0; q_1; ...]`` that column parallelism over ``tp`` ranks shards into whole heads."""
    return torch.arange(3 * n_embd).view(3, tp, n_embd // tp).transpose(0, 1).reshape(-1)  # (tp, 3, d/tp) flat


@torch.no_grad()
def apply_tp(model: GPT, tp_mesh: DeviceMesh) -> GPT:
    """Shard every block of ``model`` over the 1-D ``tp_mesh`` in place (see the module docstring); returns it.
    The mesh size must divide ``n_head``."""
    tp, c = tp_mesh.size(), model.config
    if c.n_head % tp:
        raise ValueError(f"tensor parallelism over {tp} ranks needs n_head divisible by {tp}, got n_head={c.n_head}; "
                         f"pick a --tp that divides the head count")
    order = rank_major_qkv(c.n_embd, tp).to(next(model.parameters()).device)
    for block in model.transformer.h:
        for p in block.attn.c_attn.parameters():  # weight (3d, d) and bias (3d,)
            p.copy_(p[order])
        parallelize_module(block, tp_mesh, BLOCK_PLAN)
    return model


def _tp_size(t: Tensor) -> int:
    if not isinstance(t, DTensor):
        return 1
    names = t.device_mesh.mesh_dim_names or ()
    return t.device_mesh.size(names.index("tp")) if "tp" in names else 1


@torch.no_grad()
def reorder_qkv_state(model: GPT, model_sd: dict[str, Any], optim_sd: dict[str, Any], *,
                      to_canonical: bool) -> None:
    """Reorder, in place, the rows of every fused QKV weight and bias under TP, and of their optimizer state
    (momentum, Adam moments: tensors of the same first dim), between the rank-major layout the TP model trains
    in and the single-process ``[Q; K; V]`` order its checkpoints hold. ``model_sd``/``optim_sd``: as
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` returns them (DTensor values, optimizer state
    keyed by parameter name). Collective over the TP and FSDP groups of those tensors."""
    n_embd = model.config.n_embd
    for name in [n for n in model_sd if n.endswith(("attn.c_attn.weight", "attn.c_attn.bias"))]:
        tp = _tp_size(model_sd[name])
        if tp == 1:
            continue
        order = rank_major_qkv(n_embd, tp)
        if to_canonical:
            order = order.argsort()
        tensors = {None: model_sd[name]} | optim_sd.get("state", {}).get(name, {})
        for key, t in tensors.items():
            if not isinstance(t, DTensor) or t.shape[0] != 3 * n_embd:
                continue  # e.g. the step count
            full = t.full_tensor()
            moved = distribute_tensor(full[order.to(full.device)], t.device_mesh, t.placements)
            if key is None:
                model_sd[name] = moved
            else:
                optim_sd["state"][name][key] = moved


GPT_TP = TPPlan(shard=apply_tp, reorder_state=reorder_qkv_state)
