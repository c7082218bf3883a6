"""Train a Hugging Face ``transformers`` model with a matrixopt optimizer through ``Trainer``.

    from matrixopt.integrations import hf

    opt = hf.create_optimizer(model, args, name="muon")              # lr, weight decay, Adam betas/eps from args
    trainer = Trainer(model=model, args=args, train_dataset=ds, optimizers=(opt, None))

or let ``Trainer`` build it when it is ready (needed under Accelerate's FSDP2, where the optimizer must see the
sharded parameters):

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      optimizer_cls_and_kwargs=hf.optimizer_cls_and_kwargs(args, name="muon"))

Everything else stays ``Trainer``'s: its lr scheduler (it scales every group's lr, the matrix and the AdamW groups
alike), gradient accumulation, gradient clipping (``max_grad_norm``: Trainer clips the gradients in place before
``step()``), bf16 autocast, and checkpoints (``optimizer.pt`` holds the optimizer's ``state_dict``, and
``resume_from_checkpoint`` continues exactly). The model is routed by :func:`matrixopt.param_groups`: hidden
matrices to the matrix optimizer; embeddings, the head, norms and biases to AdamW inside the same optimizer.

Non-finite gradients: by default a NaN/Inf gradient raises :class:`matrixopt.NonFiniteGradientError` at
``step()`` and stops the run, naming the parameter. Pass ``skip_nonfinite=True`` to skip that update instead (the
step is counted in ``opt.skipped_updates``). Under FSDP2 (DTensor parameters) the sharded variant of the optimizer
is used (:class:`matrixopt.distributed.sharded.ShardedMuon`, NorMuon, AdaMuon, Shampoo, SOAP), whose update
equals one process's.

``transformers`` is imported by nothing here: this module works with whatever version the ``Trainer`` comes from
(``optimizer_cls_and_kwargs`` with a factory needs transformers >= 5).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from matrixopt.optim.registry import OPTIMIZERS, build_optimizer
from matrixopt.optim.routing import param_groups


def _check_name(name: str) -> None:
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown matrixopt optimizer {name!r}; valid names: {', '.join(sorted(OPTIMIZERS))} "
                         "(matrixopt.register_optimizer adds one)")


def trainer_hparams(args: Any, name: str) -> dict[str, Any]:
    """The optimizer hyperparameters a ``transformers.TrainingArguments`` sets: ``learning_rate``,
    ``weight_decay`` and, for the AdamW groups, ``adam_beta1``, ``adam_beta2``, ``adam_epsilon``."""
    _check_name(name)
    betas = (args.adam_beta1, args.adam_beta2)
    if getattr(OPTIMIZERS[name], "matrix_flag", "use_muon") is None:  # plain AdamW
        return dict(lr=args.learning_rate, weight_decay=args.weight_decay, betas=betas, eps=args.adam_epsilon)
    return dict(lr=args.learning_rate, weight_decay=args.weight_decay, adamw_betas=betas,
                adamw_eps=args.adam_epsilon)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers: the parameters are the
    same, and routing sees the ``transformers`` model's own names and config."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def _sharded(model: nn.Module, name: str, routing: dict[str, Any], hparams: dict[str, Any]) -> torch.optim.Optimizer:
    """The optimizer over DTensor parameters (FSDP2): the sharded matrix optimizer, or AdamW per device mesh."""
    from matrixopt.distributed.parallelism import SHARDED, by_mesh

    if name in SHARDED:
        flag = getattr(SHARDED[name], "matrix_flag", "use_muon")  # use_shampoo, use_soap for Shampoo, SOAP
        return SHARDED[name](param_groups(model, matrix_flag=flag, **routing), **hparams)
    if name != "adamw":
        raise ValueError(f"{name!r} does not run on FSDP2's sharded (DTensor) parameters; use one of "
                         f"{', '.join(sorted(SHARDED))} or adamw, or train without FSDP")
    groups = []  # DTensor foreach kernels take one mesh per call
    for g in param_groups(model, matrix_flag=None, **routing):
        g.pop("names")
        groups += [g | {"params": ps} for ps in by_mesh(g["params"])]
    return OPTIMIZERS["adamw"](groups, **hparams)


def create_optimizer(model: nn.Module, args: Any = None, name: str = "muon", *, adamw: tuple[str, ...] = (),
                     matrix: tuple[str, ...] = (), splits: dict[str, Any] | None = None,
                     experts: tuple[str, ...] = (), verbose: bool = False, **hparams: Any) -> torch.optim.Optimizer:
    """The matrixopt optimizer registered as ``name`` over ``model``, for ``Trainer(optimizers=(opt, None))``.

    Args:
        model: the ``transformers`` model (any ``nn.Module``), on its training device; under FSDP2 after
            sharding (then the sharded variant is built).
        args: a ``TrainingArguments`` (or None): its ``learning_rate``, ``weight_decay`` and Adam betas and
            epsilon become the optimizer's defaults (:func:`trainer_hparams`).
        name: a registered optimizer: ``muon`` (default), ``normuon``, ``adamuon``, ``mop``, ``shampoo``,
            ``soap``, ``adamw``. An unknown name raises ValueError listing the valid ones.
        adamw, matrix, splits, experts: routing overrides, as in :func:`matrixopt.build_optimizer`.
        verbose: print where each parameter went (:func:`matrixopt.routing_summary`).
        **hparams: the optimizer's own arguments; they override those taken from ``args``.
    """
    _check_name(name)
    model = unwrap(model)
    hparams = (trainer_hparams(args, name) if args is not None else {}) | hparams
    routing = dict(adamw=adamw, matrix=matrix, splits=splits, experts=experts)
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return _sharded(model, name, routing, hparams)
    return build_optimizer(model, name, verbose=verbose, **routing, **hparams)


class OptimizerFactory:
    """What ``Trainer(optimizer_cls_and_kwargs=(OptimizerFactory, kwargs))`` instantiates and calls with the model
    once it is prepared (transformers >= 5 calls ``OptimizerFactory()(model, **kwargs)``); kwargs are
    :func:`create_optimizer`'s."""

    def __call__(self, model: nn.Module, **kwargs: Any) -> torch.optim.Optimizer:
        return create_optimizer(model, **kwargs)


def optimizer_cls_and_kwargs(args: Any = None, name: str = "muon", **kwargs: Any) -> tuple[type, dict[str, Any]]:
    """``(OptimizerFactory, kwargs)`` for ``Trainer(optimizer_cls_and_kwargs=...)``: Trainer builds the optimizer
    itself, after wrapping the model (FSDP2 included). Arguments as :func:`create_optimizer`'s."""
    _check_name(name)
    return OptimizerFactory, dict(args=args, name=name, **kwargs)
