"""QK-clip in the trainer: :class:`matrixopt.QKClip` over every attention of the reference GPT.

    qk = GPTQKClip(model, par, tau)     # after par.wrap and par.build_optimizer; turns the model's trackers on
    ...                                 # forward and backward of the step's micro-batches
    optimizer.step()
    qk.step()                           # clip the heads whose max logit exceeded tau, reset the trackers
    qk.metrics()                        # at logged steps only: reads the last step's stats on the host

Each block's ``attn.c_attn`` is a :class:`~matrixopt.FusedQKV` (rows ``[Q; K; V]``, heads contiguous). The max
logits are MAX-reduced over every rank (data-parallel ranks saw different rows), so the replicated (DDP,
layer-wise) or row-sharded (FSDP2) weights are scaled alike everywhere. Not under tensor parallelism yet: FSDP2
over TP shards ``c_attn`` with a strided placement that QKClip does not scale (TrainConfig refuses it).
"""

from __future__ import annotations

import torch.distributed as dist

from matrixopt.distributed.layerwise import LayerwiseOptimizer
from matrixopt.distributed.parallelism import Parallelism
from matrixopt.distributed.qk_clip import FusedQKV, QKClip, QKClipStats
from matrixopt.train.model import GPT


class GPTQKClip:
    """QK-clip with threshold ``tau`` of every attention of ``model`` (the :class:`GPT` given to ``par.wrap``),
    run by :meth:`step` after each optimizer step. Construction turns the model's max-logit trackers on."""

    def __init__(self, model: GPT, par: Parallelism, tau: float):
        attentions = [FusedQKV(weight=block.attn.c_attn.weight, bias=block.attn.c_attn.bias,
                               n_head=model.config.n_head, name=f"transformer.h.{i}.attn.c_attn")
                      for i, block in enumerate(model.transformer.h)]  # the parameters as par.wrap left them
        self.clip = QKClip(tau, attentions, process_group=dist.group.WORLD if par.world > 1 else None)
        self.model, self.optimizer = model, par.optimizer
        self.stats: QKClipStats | None = None
        model.track_max_logits(True)

    def step(self) -> None:
        """Clip with the max logits the model recorded since the last call (the step's micro-batches), then reset
        its trackers. Collective; no host sync."""
        if isinstance(self.optimizer, LayerwiseOptimizer):
            self.optimizer.wait_params()  # the owners' broadcasts land before every rank scales its copy
        self.stats = self.clip.step(self.model.max_logits())
        self.model.reset_max_logits()

    def metrics(self) -> dict[str, float | int]:
        """The last step's ``qk_clipped_heads`` (heads clipped, over all layers) and ``max_logit`` (the largest
        max logit, before clipping), read on the host."""
        return dict(qk_clipped_heads=int(self.stats.clipped.item()), max_logit=self.stats.max_logit.item())
