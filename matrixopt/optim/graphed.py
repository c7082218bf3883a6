"""Muon's matrix step captured in one CUDA graph: the host launches one graph instead of ~20 kernels per bucket.

On small models the step is bound by the host: each Newton–Schulz iteration is three short kernels, and issuing
them costs more than running them (on an H100, a 2-layer GPT's step went from 3.2 to 0.9 ms; GPT-2-small, whose
step is mostly GPU time, from 6.45 to 6.19 ms). :class:`CapturedMuonStep` captures, for a fixed set of
parameters, every bucket's fused momentum pass, Newton–Schulz and fused update into one graph. What changes from
step to step is read at run time, so one capture serves every step:

- addresses (new gradient tensors after ``zero_grad(set_to_none=True)``, momentum buffers replaced by
  ``load_state_dict``): the fused kernels read them from int64 tables, and the graph reads static copies of those
  tables, refreshed before each replay when they changed;
- the learning rate (a scheduler's): the update kernel reads it from a 0-d device tensor;
- whether to skip the step (the optimizer's deferred non-finite check): both fused kernels read a 0-d device flag;
- the gradient clipping coefficient deferred into the step: the momentum pass reads it (1 without clipping).

Everything else (shapes, dtypes, momentum, Nesterov, weight decay and its mode, the Newton–Schulz schedule and
update scaling) is part of the graph; :class:`matrixopt.Muon` keys its graphs on them and captures anew when one
changes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from matrixopt.kernels.ns_step import for_cuda_graphs
from matrixopt.optim.layout import Bucket


class CapturedMuonStep:
    """One capture of :func:`matrixopt.optim.layout.orthogonalized_momentum_step` over ``buckets`` (CUDA,
    Triton kernels only). ``fn`` (Newton–Schulz) must be capturable and must already have run once on each
    bucket's shape outside capture, so that its kernels are compiled, tuned and dispatched. ``adapt`` (NorMuon's,
    AdaMuon's second moments) is captured too: its state must stay where it was at capture (the optimizer keys
    its graphs on those addresses) and it must honour the skip flag."""

    def __init__(self, buckets: list[Bucket], *, momentum: float, nesterov: bool,
                 fn: Callable[[Tensor, Tensor | None], Tensor], dtype: torch.dtype, scale: Callable[[int, int], float],
                 weight_decay: float, decay_mode: str = "decoupled", sign: bool = False,
                 adapt: Callable[[Bucket, Tensor, Tensor | None], tuple[Tensor, Tensor | None]] | None = None
                 ) -> None:
        from matrixopt.kernels import muon_fused

        self._fused = muon_fused
        device = buckets[0].device
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        self.skip = torch.zeros((), dtype=torch.float32, device=device)
        self.grad_scale = torch.ones((), dtype=torch.float32, device=device)
        self._layouts = [self._layout(bk) for bk in buckets]
        self._tables = [tuple([muon_fused.table_rows(runs).to(device) for _, runs in part] for part in layout)
                        for layout in self._layouts]
        # Before capture, on a side stream as torch.cuda.graph's documentation asks: the momentum pass with the
        # skip flag set (it writes nothing), fn once more (zero stacks; fn is pure), and the update kernel in its
        # device-lr variant with lr = 0 and no decay, which leaves every parameter as it is: every kernel variant
        # the graph launches is compiled here rather than during capture.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        skip_all = torch.ones((), dtype=torch.float32, device=device)
        with torch.cuda.stream(side), for_cuda_graphs():  # Newton–Schulz paths chosen by their GPU time
            for bk, (pack_tables, apply_tables) in zip(buckets, self._tables):
                X = torch.zeros((bk.count, bk.s, bk.l), dtype=dtype, device=device)
                parts = torch.zeros((bk.count, muon_fused.pack_tiles(bk.s, bk.l)), dtype=torch.float64,
                                    device=device)
                muon_fused.momentum_pack_triton(bk.grads, bk.bufs, X, momentum, nesterov, tables=pack_tables,
                                                skip=skip_all, parts=parts, grad_scale=self.grad_scale, sign=sign)
                Y, row_scale = fn(X, parts), None
                if adapt is not None:
                    Y, row_scale = adapt(bk, Y, skip_all)  # writes the state it read back unchanged
                muon_fused.apply_update_triton(bk.params, Y, scale, self.lr, 0.0, tables=apply_tables,
                                               skip=self.skip, decay_mode=decay_mode, row_scale=row_scale)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for bk, (pack_tables, apply_tables) in zip(buckets, self._tables):
                X = torch.empty((bk.count, bk.s, bk.l), dtype=dtype, device=device)
                parts = torch.empty((bk.count, muon_fused.pack_tiles(bk.s, bk.l)), dtype=torch.float64,
                                    device=device)
                muon_fused.momentum_pack_triton(bk.grads, bk.bufs, X, momentum, nesterov, tables=pack_tables,
                                                skip=self.skip, parts=parts, grad_scale=self.grad_scale, sign=sign)
                Y, row_scale = fn(X, parts), None
                if adapt is not None:
                    Y, row_scale = adapt(bk, Y, self.skip)
                muon_fused.apply_update_triton(bk.params, Y, scale, self.lr, weight_decay, tables=apply_tables,
                                               skip=self.skip, decay_mode=decay_mode, row_scale=row_scale)

    def _layout(self, bk: Bucket) -> tuple[list, list]:
        """The pack and update tables' runs for this step's tensors."""
        k = bk.count
        return (self._fused.pack_runs(bk.grads, bk.bufs, k, bk.s, bk.l),
                self._fused.apply_runs(bk.params, k, bk.s, bk.l))

    def replay(self, buckets: list[Bucket] | None, lr: float | Tensor, skip: Tensor | None = None,
               grad_scale: Tensor | None = None) -> None:
        """One step on ``buckets`` (the same parameters, shapes and dtypes as at capture, any addresses), or None:
        on the tensors of the last replay (the caller knows they lie where they did). Where ``skip`` (a 0-d float32
        device flag) is nonzero at run time, nothing is written; the gradients are read multiplied by
        ``grad_scale`` (a 0-d float32 tensor) where given."""
        for i, bk in enumerate(buckets or ()):
            layout = self._layout(bk)
            if layout != self._layouts[i]:
                for tables, part in zip(self._tables[i], layout):
                    for table, (_, runs) in zip(tables, part):
                        table.copy_(self._fused.table_rows(runs), non_blocking=True)
                self._layouts[i] = layout
        if isinstance(lr, Tensor):
            self.lr.copy_(lr, non_blocking=True)
        else:
            self.lr.fill_(lr)
        if skip is None:
            self.skip.zero_()
        else:
            self.skip.copy_(skip)
        if grad_scale is None:
            self.grad_scale.fill_(1.0)
        else:
            self.grad_scale.copy_(grad_scale)
        self.graph.replay()
