"""QK-clip in the trainer: :class:`matrixopt.QKClip` over every attention of the reference GPT.

    qk = GPTQKClip(model, par, tau)     # after par.wrap and par.build_optimizer; turns the model's trackers on
    ...                                 # forward and backward of the step's micro-batches
    optimizer.step()
    qk.step()                           # clip the heads whose max logit exceeded tau, reset the trackers
    qk.metrics()                        # at logged steps only: reads the last step's stats on the host

Each block's ``attn.c_attn`` is a :class:`~matrixopt.FusedQKV` (rows ``[Q; K; V]``, heads contiguous; under
tensor parallelism stored rank-major, :func:`~matrixopt.train.parallelize.rank_major_qkv`). The max logits are
MAX-reduced over every rank (data-parallel ranks saw different rows; a TP rank reports its own heads and -Inf for
the others), so the replicated (DDP, layer-wise) or row-sharded (FSDP2, TP, both) weights are scaled alike
everywhere.
"""

from __future__ import annotations

import math

import torch.distributed as dist

from matrixopt.distributed.layerwise import LayerwiseOptimizer
from matrixopt.distributed.parallelism import Parallelism
from matrixopt.distributed.qk_clip import FusedQKV, QKClip, QKClipStats
from matrixopt.train.model import GPT
from matrixopt.train.parallelize import rank_major_qkv


class GPTQKClip:
    """QK-clip with threshold ``tau`` of every attention of ``model`` (the :class:`GPT` given to ``par.wrap``),
    run by :meth:`step` after each optimizer step. Construction turns the model's max-logit trackers on."""

    def __init__(self, model: GPT, par: Parallelism, tau: float):
        c = model.config
        order = rank_major_qkv(c.n_embd, par.tp) if par.tp > 1 else None
        # the parameters as par.wrap left them; under layer-wise, where a rank steps an fp32 master of a bf16
        # weight, the master (step() then casts it into the weight)
        self._weights = [block.attn.c_attn.weight for block in model.transformer.h]
        trained = par.optimizer.trained if isinstance(par.optimizer, LayerwiseOptimizer) else (lambda t: t)
        attentions = [FusedQKV(weight=trained(block.attn.c_attn.weight),
                               bias=None if block.attn.c_attn.bias is None else trained(block.attn.c_attn.bias),
                               n_head=c.n_head, row_order=order, name=f"transformer.h.{i}.attn.c_attn")
                      for i, block in enumerate(model.transformer.h)]
        self.clip = QKClip(tau, attentions, process_group=dist.group.WORLD if par.world > 1 else None)
        # the query heads this rank computes: all, or its TP rank's n_head / tp
        local = c.n_head // par.tp
        first = par.mesh.get_local_rank("tp") * local if par.tp > 1 else 0
        self._heads = slice(first, first + local)
        self.model, self.optimizer = model, par.optimizer
        self.stats: QKClipStats | None = None
        model.track_max_logits(True)

    def step(self) -> None:
        """Clip with the max logits the model recorded since the last call (the step's micro-batches), then reset
        its trackers. Collective; no host sync."""
        if isinstance(self.optimizer, LayerwiseOptimizer):
            self.optimizer.wait_params()  # the owners' broadcasts land before every rank scales its copy
        local = self.model.max_logits()  # (n_layer, heads computed here)
        logits = local.new_full((local.shape[0], self.model.config.n_head), -math.inf)
        logits[:, self._heads] = local  # -Inf: a head another TP rank holds, filled in by the MAX all-reduce
        self.stats = self.clip.step(logits)
        if isinstance(self.optimizer, LayerwiseOptimizer):
            self.optimizer.masters_to_params(self._weights)
        self.model.reset_max_logits()

    def metrics(self) -> dict[str, float | int]:
        """The last step's ``qk_clipped_heads`` (heads clipped, over all layers) and ``max_logit`` (the largest
        max logit, before clipping), read on the host."""
        return dict(qk_clipped_heads=int(self.stats.clipped.item()), max_logit=self.stats.max_logit.item())
