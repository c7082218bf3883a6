"""Train a torchtitan model with a matrixopt optimizer.

torchtitan builds the optimizer from its trainer config, ``config.optimizer.build(model_parts=...)``, after it has
parallelized the model. Point that field at this module's container, in a config function:

    from matrixopt.integrations.torchtitan import MatrixoptOptimizersContainer
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    def llama3_muon():                       # torchrun -m torchtitan.train --module <this file> --config llama3_muon
        config = llama3_debugmodel()
        config.optimizer = MatrixoptOptimizersContainer.Config(name="muon", lr=3e-3, weight_decay=0.1)
        config.parallelism.spmd_backend = "partial_dtensor"    # with torch 2.13, see below
        return config

:class:`MatrixoptOptimizersContainer` is a torchtitan ``OptimizersContainer``: one matrixopt optimizer per model
part (pipeline stage), routed by :func:`matrixopt.param_groups`. Everything else stays torchtitan's: its lr schedule
(a ``LambdaLR`` per optimizer, scaling every group's lr, the AdamW groups' too), gradient clipping
(``training.max_norm``, applied to the gradients before ``step()``) and its DCP checkpoints, which hold the
optimizer state in torchtitan's flat layout (``state.<fqn>.<key>``, ``param_groups.<fqn>.<key>``); resuming
continues exactly.

Routing of torchtitan's Llama: ``tok_embeddings`` and ``lm_head`` go to AdamW with weight decay, the norms to AdamW
without, and the attention and feed-forward matrices to the matrix optimizer. torchtitan's fused ``wqkv`` stores
its rows as ``(n_kv_heads, n_heads // n_kv_heads + 2, head_dim)``: the query heads of each KV group, then that
group's key and value head. Q, K and V are interleaved, not contiguous blocks, so no ``splits=`` sizes separate
them and matrixopt orthogonalizes ``wqkv`` as one matrix. A model built with ``fuse_qkv=False`` has separate
``wq``, ``wk``, ``wv``, each orthogonalized on its own, as matrixopt does for Hugging Face models.

torchtitan applies FSDP2 ``fully_shard`` even on one GPU, so the parameters are DTensors. There ``muon``,
``normuon`` and ``adamuon`` run as :class:`~matrixopt.distributed.sharded.ShardedMuon`, ``ShardedNorMuon`` and
``ShardedAdaMuon`` (tensor parallelism included: Newton–Schulz runs over the ``"tp"`` mesh dim), ``shampoo`` and
``soap`` as :class:`~matrixopt.distributed.sharded_precond.ShardedShampoo` and ``ShardedSOAP`` (FSDP2 only: they
raise ValueError under tensor parallelism), and ``adamw`` as torch AdamW. ``mop`` has no sharded form and raises
ValueError on DTensor parameters.
With torch 2.13, ``fully_shard`` does not read the annotations of torchtitan's default ``spmd_backend="spmd_types"``
("When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh"); set
``parallelism.spmd_backend = "partial_dtensor"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.utils import (
    get_flat_optim_state_dict,
    init_optim_state,
    load_flat_optim_state_dict,
)
from torchtitan.tools.logging import logger

from matrixopt.distributed.parallelism import SHARDED
from matrixopt.integrations.hf import create_optimizer
from matrixopt.optim.registry import OPTIMIZERS
from matrixopt.optim.routing import param_groups, routing_summary

SHARDED_NAMES = tuple(sorted([*SHARDED, "adamw"]))  # the optimizers that step torchtitan's DTensor parameters


class MatrixoptOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizers container holding matrixopt optimizers, one per model part.

    ``step()``, ``zero_grad()``, step hooks and the lr schedulers work as with torchtitan's own container;
    ``state_dict()`` is torchtitan's flat, FQN-keyed layout, which DCP saves and reshards.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """torchtitan's optimizer config (so ``--optimizer.<field>`` overrides work on the command line) with
        matrixopt's fields. Of the inherited ones, ``param_groups`` and ``optimizer_factory_kwargs_by_name`` must
        stay empty (matrixopt routes the parameters), and ``implementation`` is not read: the optimizers choose
        their own kernels (torch AdamW runs fused on CUDA)."""

        name: str = "muon"
        """A registered matrixopt optimizer (``matrixopt.OPTIMIZERS``). On torchtitan's FSDP2 parameters: muon,
        normuon, adamuon, shampoo, soap or adamw (under tensor parallelism not shampoo and soap); mop only on a
        model left unsharded."""

        lr: float | None = None
        """Learning rate of every group, the AdamW groups' too unless ``hparams`` sets ``adamw_lr``. None: the
        optimizer's default."""

        weight_decay: float | None = None
        """Weight decay of the matrices (and, unless ``hparams`` sets ``adamw_weight_decay``, of the embedding
        and output head); norms and biases never decay. None: the optimizer's default."""

        hparams: dict[str, Any] = field(default_factory=dict)
        """Further keyword arguments of the optimizer, e.g. ``{"momentum": 0.95, "adamw_betas": (0.9, 0.95)}``."""

        adamw: list[str] = field(default_factory=list)
        """Regular expressions of parameter names routed to AdamW, e.g. ``[r"feed_forward\\.w2"]``."""

        matrix: list[str] = field(default_factory=list)
        """Regular expressions of parameter names routed to the matrix optimizer."""

        splits: dict[str, int | list[int]] = field(default_factory=dict)
        """``{pattern: sizes}``: fused weights whose contiguous row blocks are orthogonalized separately."""

        experts: list[str] = field(default_factory=list)
        """Regular expressions of ``(E, out, in)`` expert stacks, orthogonalized per expert."""

        verbose: bool = False
        """Log where each parameter went (:func:`matrixopt.routing_summary`), per model part."""

        def __post_init__(self) -> None:
            if self.param_groups or self.optimizer_factory_kwargs_by_name:
                raise ValueError("param_groups and optimizer_factory_kwargs_by_name are torchtitan's routing; "
                                 "matrixopt routes the parameters itself: force some to AdamW or to the matrix "
                                 "optimizer with the adamw=[...] and matrix=[...] patterns, and pass optimizer "
                                 "arguments in hparams")
            if self.name not in OPTIMIZERS:
                raise ValueError(f"unknown matrixopt optimizer {self.name!r}; valid names: "
                                 f"{', '.join(sorted(OPTIMIZERS))} (matrixopt.register_optimizer adds one)")
            for key in ("lr", "weight_decay"):
                value = getattr(self, key)
                if value is not None and not value >= 0:
                    raise ValueError(f"Invalid {key}: {value!r} (must be >= 0, or None for the optimizer's default)")
                if key in self.hparams:
                    raise ValueError(f"{key} is set twice: as the field {key}={value!r} and in hparams; set it once, "
                                     "as the field")

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        hparams = dict(config.hparams)
        hparams.update({k: v for k, v in (("lr", config.lr), ("weight_decay", config.weight_decay)) if v is not None})
        routing = dict(adamw=tuple(config.adamw), matrix=tuple(config.matrix), splits=config.splits or None,
                       experts=tuple(config.experts))
        self.model_parts = model_parts
        self.optimizers = [self._build(part, i, config.name, routing, hparams, config.verbose)
                           for i, part in enumerate(model_parts)]
        all_params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]
        self._validate_params(all_params)
        self._post_init(all_params)

    @staticmethod
    def _build(part: nn.Module, index: int, name: str, routing: dict[str, Any], hparams: dict[str, Any],
               verbose: bool) -> torch.optim.Optimizer:
        """The optimizer of one model part, each group carrying ``param_names`` (canonical FQNs, without the
        activation-checkpoint wrapper's segment) for torchtitan's checkpoint layout."""
        if name not in SHARDED_NAMES and any(isinstance(p, DTensor) for p in part.parameters()):
            raise ValueError(f"{name!r} does not run on torchtitan's FSDP2 (DTensor) parameters, and torchtitan "
                             f"shards every model with fully_shard, even on one GPU; use one of "
                             f"{', '.join(SHARDED_NAMES)}")
        if verbose:
            flag = getattr(OPTIMIZERS[name], "matrix_flag", "use_muon")
            logger.info(f"matrixopt routing of model part {index}:\n"
                        f"{routing_summary(param_groups(part, matrix_flag=flag, **routing), flag)}")
        opt = create_optimizer(part, name=name, **routing, **hparams)
        fqn = {id(p): canonical_fqn(n) for n, p in part.named_parameters()}
        for group in opt.param_groups:
            group["param_names"] = [fqn[id(p)] for p in group["params"]]
        return opt

    def state_dict(self) -> dict[str, Any]:
        """torchtitan's flat layout of every optimizer's ``state_dict()``: ``state.<fqn>.<key>`` and
        ``param_groups.<fqn>.<key>``, without matrixopt's ``names`` (the FQNs are the keys). Before the first
        step this materializes the state with one zero-gradient, zero-lr step, as torchtitan does."""
        out: dict[str, Any] = {}
        for opt in self.optimizers:
            init_optim_state(opt)
            flat = get_flat_optim_state_dict(opt)
            out.update({k: v for k, v in flat.items() if not (k.startswith("param_groups.") and k.endswith(".names"))})
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s layout; each optimizer takes the keys of its own parameters."""
        for opt in self.optimizers:
            init_optim_state(opt)
            names = {f"param_groups.{fqn}.names": g["names"] for g in opt.param_groups if "names" in g
                     for fqn in g["param_names"][:1]}
            load_flat_optim_state_dict(opt, state_dict | names)
