"""FSDP2 for the matrix optimizers: :func:`apply_fsdp` shards a model the way the tests and benchmarks do.

With ``fully_shard`` every rank holds a slice of rows (DTensor ``Shard(0)``) of every matrix. The sharded
optimizer (:mod:`matrixopt.distributed.sharded`) gathers each whole matrix to one owner rank, orthogonalizes it
there and scatters it back, through :func:`matrixopt.distributed.comm.gather_to_owners` and
:func:`matrixopt.distributed.comm.scatter_from_owners`.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy | None = None,
               reshard_after_forward: bool = True, ignored_params: set[nn.Parameter] | None = None) -> nn.Module:
    """``fully_shard`` every module held in an ``nn.ModuleList`` (transformer blocks), then the root, as
    torchtitan does. Parameters become DTensors with ``Shard(0)`` on ``mesh``, except ``ignored_params`` (e.g.
    expert stacks under expert parallelism), which stay plain tensors that FSDP2 neither gathers nor reduces.
    mp_policy: FSDP2's mixed precision (e.g. bf16 parameters in forward/backward, fp32 gradient reduction); None
    keeps fp32. Returns ``model``."""
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy or MixedPrecisionPolicy(),
              ignored_params=ignored_params or None)
    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for block in module:
                fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model
