r"""``matrixopt plan``: predict a matrix optimizer's step, exposed communication, memory and throughput against AdamW
for each candidate layout of a model on a cluster, from the cost model (:mod:`matrixopt.distributed.cost`).

One training step per GPU is, for either optimizer in the same layout,

.. math::
    t = t_\text{fwd+bwd} + t_\text{exposed comm} + t_\text{opt step},\qquad
    t_\text{fwd+bwd} = \frac{\text{FLOPs per token} \cdot T}{\text{MFU} \cdot \text{peak}}

with ``T`` tokens per GPU, FLOPs per token from the model (:meth:`~matrixopt.plan.models.Architecture.
flops_per_token`) and an assumed MFU (forward a third, backward two thirds). The Muon/AdamW throughput ratio is
``t_AdamW / t_Muon``. Layouts and what our implementation overlaps:

- ``layerwise`` (:mod:`matrixopt.distributed.layerwise`; against DDP AdamW): replicated fp32 parameters;
  gradients reduced to their owners during backward (reduce-scatter volume) and updated parameters broadcast in
  bf16 during the next forward (all-gather volume): each exposed only where it outlasts the pass it hides behind.
  Owners are chosen by LPT (:func:`matrixopt.distributed.balance.lpt`) on each matrix's predicted time, so the
  step is the slowest owner's. Gradients take the owners' fp32 reduce buffers (4 bytes per parameter) and, with
  ``grad_accum > 1``, the micro-batches' fp32 ``.grad`` as well, which the last backward's hooks copy into them.
- ``fsdp`` (FSDP2 with ShardedMuon): parameters, gradients and state sharded over the data-parallel ranks;
  FSDP's all-gathers hide behind forward and backward, its reduce-scatter behind backward. With
  ``grad_accum > 1`` the trainer turns gradient sync off for all but the last micro-batch
  (``set_requires_gradient_sync(False)``): every micro-batch gathers the parameters in forward and backward,
  only the last reduce-scatters, and in between FSDP2 keeps each parameter's gradient unsharded, upcast to the
  fp32 reduce dtype (torch's ``FSDPParam.to_accumulated_grad_if_needed``; the trainer's policy is bf16
  parameters, fp32 reduction), so the gradients take 4 bytes per unsharded parameter instead of per shard. With
  ``fsdp_gather_once`` (the trainer's ``--fsdp-gather-once``) the micro-batches before the last also keep the
  parameters gathered (no resharding after forward or backward): the first micro-batch's forward gathers every
  block, hidden behind that one forward, the last micro-batch's backward gathers again and reduce-scatters, hidden
  behind that one backward, and the micro-batches between gather nothing; the whole model's bf16 parameters stay
  gathered between micro-batches (2 bytes per unsharded parameter, in place of two gathered layers), beside the
  fp32 unsharded gradients, which FSDP2 keeps the same way whether or not it reshards (``FSDPParamGroup.
  post_backward`` upcasts them whenever it does not reduce). The
  step gathers each matrix to one owner and scatters the update back (two all-to-alls): Muon's in bf16, pipelined
  over the shape buckets, so they hide behind the owners' Newton–Schulz except for one bucket's share; Shampoo's
  and SOAP's gather blocking, the gradients in fp32 (bf16 for SOAP with bf16 products), and the updates back in
  fp32, Shampoo's blocking, SOAP's beside its refresh (which follows its update; an owner's share of the
  amortized refresh hides as much of the scatter).
- In either, a rank's matrix optimizer steps its AdamW groups (tables, vectors) on a side stream beside its
  matrix groups (:func:`matrixopt.distributed.cost.matrix_step_time`): their pass counts only where it outlasts
  the rank's matrix products.
- In either, the owners' Muon step runs eagerly: it takes at least the time its host needs to issue its kernels
  (:func:`matrixopt.distributed.cost.muon_launches` on the slowest-issuing owner's matrices times the profile's
  ``host_launch``), the longer of that and its device time.
- ``tpK <mode>``: FSDP over world/K with each block's matrices split over K ranks of a node (Megatron layout); the
  per-layer activation all-reduces (two in forward, two in backward, not overlapped) and Muon's TP Newton–Schulz in
  ``duplicated``, ``distributed`` or ``blockwise`` mode (:func:`matrixopt.distributed.cost.tp_ns_times`).
- ``epK`` (mixture of experts): experts split over K ranks, whole, so Muon needs no gather for them beyond FSDP's
  over the remaining expert-data-parallel ranks; the token all-to-alls (dispatch and combine, forward and
  backward) are not overlapped.

A layout fits when its memory per GPU is at most ``memory_fraction`` of the device's (allocator slack, CUDA
context, NCCL buffers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from matrixopt.distributed.balance import lpt
from matrixopt.distributed.cost import (
    ADAMW_BYTES,
    MUON_BYTES,
    SHAMPOO_BYTES,
    SHARDED_OWNER_BYTES,
    SHARDED_SPLIT_BYTES,
    SOAP_BYTES,
    DeviceProfile,
    Memory,
    Shapes,
    batched_newton_schulz_time,
    check_matmul_precision,
    check_root_method,
    collective_time,
    matrix_step_time,
    muon_launches,
    newton_schulz_time,
    preconditioner_state_bytes,
    refresh_time,
    tp_ns_times,
)
from matrixopt.linalg.ortho import check_method
from matrixopt.optim.layout import BUCKET_NUMEL
from matrixopt.optim.soap import gradient_dtype
from matrixopt.plan.models import Architecture, ExplicitModel, Matrix

OPTIMIZERS = ("muon", "shampoo", "soap")
TP_MODES = ("duplicated", "distributed", "blockwise")
ELEMENTWISE_BYTES = {"muon": MUON_BYTES, "shampoo": SHAMPOO_BYTES, "soap": SOAP_BYTES}
WIRE_CAST_BYTES = 6  # a layer-wise owner copies its fp32 matrices into their bf16 broadcast buffer (4 + 2)
GPU_COUNTS = tuple(2**k for k in range(3, 13))  # 8 .. 4096, the curve's x axis
# Column-parallel matrices split their rows (output features) over TP ranks; the rest split their columns.
COLUMN_PARALLEL = ("attn.q", "attn.k", "attn.v", "attn.qkv", "mlp.in", "moe.shared.in")
SPLIT_PIECES = ("attn.q", "attn.k", "attn.v")  # the pieces of the trainer's QKV weight (mark_split)


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """What to plan. Checks itself (ValueError naming the constraint)."""

    model: Architecture | ExplicitModel
    gpus: int
    gpus_per_node: int = 8
    tokens_per_gpu: int = 4096
    """Tokens whose forward and backward one GPU computes per optimizer step (a TP group shares TP times as
    many), over all ``grad_accum`` micro-batches."""
    grad_accum: int = 1
    """Micro-batches per optimizer step: activations hold one micro-batch; FSDP gathers per micro-batch (once
    per step with ``fsdp_gather_once``), FSDP and layer-wise reduce only after the last (``no_sync``)."""
    fsdp_gather_once: bool = False
    """FSDP layouts under ``grad_accum > 1`` keep the parameters gathered from the first micro-batch's forward to
    the last one's backward (2 all-gathers of each block per step instead of 2 per micro-batch), holding the whole
    model's bf16 parameters per GPU between micro-batches. Changes nothing at one micro-batch or for layer-wise."""
    bf16_weights: bool = True
    """Layer-wise keeps the matrices in bf16 with fp32 masters on their owners (the trainer's setting under bf16
    autocast: ``LayerwiseOptimizer(param_dtype=torch.bfloat16)``): it skips autocast's casts of every fp32 weight
    and of its gradient in every micro-batch that DDP AdamW runs, and sums the micro-batch gradients straight into
    the fp32 reduce buffers (14 bytes per matrix element and micro-batch less, :func:`predict`); every rank holds
    the matrices in 2 bytes. False: fp32 weights on every rank. Changes nothing for FSDP."""
    tp: int | None = None
    """Tensor-parallel degree; None tries 1 and each power of two up to a node that divides the heads."""
    ep: int | None = None
    """Expert-parallel degree (mixture of experts); None tries the divisors of the expert count that fit."""
    dp: int | None = None
    """Data-parallel degree; None: gpus / tp. Given, ``tp * dp`` must equal ``gpus``."""
    optimizer: str = "muon"
    mfu: float = 0.4
    """Model FLOPs utilization of forward and backward, against the profile's ``peak_flops``."""
    ns_steps: int = 5
    ns_method: str = "auto"
    """Muon's Newton–Schulz form (:func:`matrixopt.linalg.ortho.newton_schulz`): "auto" (the Gram form for
    matrices at least ``GRAM_MIN_ASPECT`` times longer than wide), "standard" or "gram"."""
    precondition_frequency: int = 10
    root_method: str = "newton"
    """Shampoo's roots: "newton" or "eigenbasis" (:class:`matrixopt.Shampoo`)."""
    matmul_precision: str = "fp32"
    """Shampoo's and SOAP's products: "fp32", "tf32" or "bf16" (their ``matmul_precision``)."""
    memory_fraction: float = 0.9
    recompute: bool = False
    """Activation checkpointing of every layer: only layer inputs are kept, and backward recomputes the forward
    (8 instead of 6 FLOPs per parameter and token)."""

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node", "tokens_per_gpu", "grad_accum", "ns_steps", "precondition_frequency"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.tokens_per_gpu % self.grad_accum:
            raise ValueError(f"tokens_per_gpu {self.tokens_per_gpu} must split into grad_accum {self.grad_accum} "
                             f"equal micro-batches")
        check_method(self.ns_method)
        check_root_method(self.root_method)
        check_matmul_precision(self.matmul_precision)
        for name in ("fsdp_gather_once", "bf16_weights"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {self.mfu}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"gpus {self.gpus} is not a whole number of nodes of {self.gpus_per_node} GPUs")
        tp, ep = self.tp or 1, self.ep or 1
        for name, v in (("tp", self.tp), ("ep", self.ep), ("dp", self.dp)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.gpus % (tp * ep):
            raise ValueError(f"gpus {self.gpus} is not divisible by tp x ep = {tp} x {ep} = {tp * ep}; pick degrees "
                             f"whose product divides the GPU count")
        if tp > self.gpus_per_node:
            raise ValueError(f"tp {tp} spans more than one node of {self.gpus_per_node} GPUs; keep tensor "
                             f"parallelism inside a node")
        if self.dp is not None and tp * self.dp != self.gpus:
            raise ValueError(f"tp x dp = {tp} x {self.dp} = {tp * self.dp} must equal gpus {self.gpus} (expert "
                             f"parallelism is carved out of dp)")
        n_head, kv = self.model.n_head, getattr(self.model, "kv_heads", self.model.n_head)
        if self.tp is not None and (n_head % tp or kv % tp):
            raise ValueError(f"tp {tp} must divide the model's {n_head} query and {kv} key/value heads")
        if self.ep is not None and ep > 1:
            if not self.model.moe:
                raise ValueError(f"ep {ep} needs a mixture-of-experts model; {self.model.name} is dense")
            if self.model.n_experts % ep:
                raise ValueError(f"ep {ep} must divide the model's {self.model.n_experts} experts")


@dataclass(frozen=True, kw_only=True)
class Layout:
    kind: str
    """"layerwise" or "fsdp"."""
    tp: int = 1
    ep: int = 1
    tp_mode: str | None = None

    @property
    def label(self) -> str:
        parts = [self.kind] + ([f"ep{self.ep}"] if self.ep > 1 else [])
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + (f" {self.tp_mode}" if self.tp_mode else ""))
        return " ".join(parts)


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """One layout's predicted step for the matrix optimizer and for AdamW, seconds and bytes per GPU."""

    layout: Layout
    fwd_bwd_s: float
    opt_step_s: float
    """The matrix optimizer's step, including its exposed communication."""
    opt_comm_s: float
    """The part of ``opt_step_s`` that is exposed communication (gathers, scatters, TP Newton–Schulz traffic)."""
    exposed_comm_s: float
    """Exposed communication outside the step (gradient sync, parameter gathers, TP and EP traffic) plus
    ``opt_comm_s``."""
    step_s: float
    adamw_opt_step_s: float
    adamw_step_s: float
    memory: Memory
    adamw_memory: Memory
    capacity_bytes: float
    tokens_per_gpu: int
    notes: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity_bytes

    @property
    def ratio(self) -> float:
        """The matrix optimizer's tokens/s over AdamW's in the same layout."""
        return self.adamw_step_s / self.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_gpu / self.step_s

    def to_dict(self) -> dict[str, Any]:
        ms = {k: getattr(self, k) * 1e3 for k in ("fwd_bwd_s", "opt_step_s", "opt_comm_s", "exposed_comm_s",
                                                    "step_s", "adamw_opt_step_s", "adamw_step_s")}
        return {"layout": self.layout.label, **dataclasses.asdict(self.layout),
                **{k[:-2] + "_ms": v for k, v in ms.items()}, "ratio": self.ratio,
                "tokens_per_s_per_gpu": self.tokens_per_s, "fits": self.fits,
                "memory_gb": {k: v / 1e9 for k, v in self.memory.to_dict().items()},
                "adamw_memory_gb": {k: v / 1e9 for k, v in self.adamw_memory.to_dict().items()},
                "notes": list(self.notes)}


@dataclass(frozen=True)
class Plan:
    config: PlanConfig
    profile: DeviceProfile
    predictions: tuple[Prediction, ...]
    best: Prediction
    adamw_best: str
    """The layout where AdamW is fastest (among those where AdamW fits)."""
    adamw_step_s: float
    assumptions: tuple[str, ...] = field(default=())


# ----------------------------------------------------------------------------------------------------------
# candidates


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: PlanConfig) -> list[Layout]:
    """The layouts to compare: layer-wise (no TP or EP), FSDP, FSDP with each TP degree and Newton–Schulz mode,
    and each expert-parallel degree of a mixture of experts; fixed where ``cfg`` gives ``tp`` or ``ep``."""
    model, n = cfg.model, cfg.gpus
    kv = getattr(model, "kv_heads", model.n_head)
    if cfg.tp is not None:
        tps = [cfg.tp]
    elif cfg.dp is not None:
        tps = [n // cfg.dp]
    else:
        tps = [t for t in (1, 2, 4, 8) if t <= cfg.gpus_per_node and n % t == 0 and model.n_head % t == 0
               and kv % t == 0]
    if not model.moe:
        eps = [1]
    elif cfg.ep is not None:
        eps = [cfg.ep]
    else:
        eps = [e for e in _divisors(model.n_experts) if e > 1 and n % e == 0]
    modes = TP_MODES if cfg.optimizer == "muon" else ("blockwise",)
    out = []
    for tp in tps:
        for ep in eps:
            if n % (tp * ep):
                continue
            if tp == 1 and ep == 1 and cfg.dp in (None, n):
                out.append(Layout(kind="layerwise"))
            for mode in (modes if tp > 1 else (None,)):
                out.append(Layout(kind="fsdp", tp=tp, ep=ep, tp_mode=mode))
    if not out:
        raise ValueError(f"no layout for {n} GPUs with tp={cfg.tp}, ep={cfg.ep}, dp={cfg.dp}: the degrees must "
                         f"divide the GPU count")
    return out


# ----------------------------------------------------------------------------------------------------------
# one layout


def _split_matrix(mat: Matrix, tp: int) -> tuple[int, int]:
    """``(rows, cols)`` of one TP shard's contracted layout: the split dim last (see tp_ns_times)."""
    if not _tp_sharded(mat, tp):
        return mat.m, mat.n
    return (mat.n, mat.m) if mat.name in COLUMN_PARALLEL else (mat.m, mat.n)


def _tp_sharded(mat: Matrix, tp: int) -> bool:
    return tp > 1 and not mat.expert and mat.name != "moe.router"


def _owner_load(profile: DeviceProfile, cfg: PlanConfig, mats: Sequence[Matrix], owners: int, tp: int,
                mode: str | None) -> tuple[float, float, int, int]:
    """``(slowest owner's seconds, its exposed TP communication, the most matrix elements one owner holds, the most
    kernels one owner's eager Muon step launches)`` when ``owners`` ranks share ``mats`` by LPT on each matrix's
    time; each shape goes in stacks of ``count / owners``. The launches are those of Muon's step on an owner's
    whole matrices, batched by ``(short side, long side)`` as Muon batches them, and TP shards by their
    ``(rows, contracted cols)`` in ``mode`` (:func:`~matrixopt.distributed.cost.muon_launches`); 0 for other
    optimizers."""
    items: list[float] = []
    comm: list[float] = []
    sizes: list[int] = []
    # ((sides, TP-sharded), matrices) of an eager Muon chunk: sides (short, long), or a TP shard's (rows, cols)
    batches: list[tuple[tuple[tuple[int, int], bool], int] | None] = []
    for mat in mats:
        k = mat.count
        per = max(1, k // owners)  # the stack an owner runs
        chunks = [per] * (k // per) + ([k % per] if k % per else [])
        split = tp if _tp_sharded(mat, tp) else 1
        for c in chunks:
            t, x = _matrix_time(profile, cfg, mat, c, split, mode)
            items.append(t)
            comm.append(x)
            sizes.append(c * mat.m * mat.n // split)
            if cfg.optimizer != "muon":
                batches.append(None)
            elif split > 1:
                batches.append(((_split_matrix(mat, tp), True), c))
            else:
                batches.append((((min(mat.m, mat.n), max(mat.m, mat.n)), False), c))
    if not items:
        return 0.0, 0.0, 0, 0
    owner, loads = lpt(items, owners)
    worst = max(range(owners), key=lambda r: loads[r])
    comm_w = sum(x for x, r in zip(comm, owner) if r == worst)
    owned = max(sum(s for s, r in zip(sizes, owner) if r == q) for q in range(owners))
    issued = 0
    for q in range(owners):
        stacks: dict[tuple[tuple[int, int], bool], int] = {}
        for b, r in zip(batches, owner):
            if b is not None and r == q:
                stacks[b[0]] = stacks.get(b[0], 0) + b[1]
        plain = [Shapes(*sides, c) for (sides, sharded), c in stacks.items() if not sharded]
        shards = [Shapes(*sides, c) for (sides, sharded), c in stacks.items() if sharded]
        launches = muon_launches(plain, cfg.ns_steps, cfg.ns_method)
        if shards:
            launches += muon_launches(shards, cfg.ns_steps, cfg.ns_method, tp_mode=mode, parts=tp)
        issued = max(issued, launches)
    return loads[worst], comm_w, owned, issued


def _eager_step(device: float, host: float, notes: list[str]) -> float:
    """Seconds of an eager owner step: the longer of its ``device`` time and its ``host``'s to issue it; a step the
    host binds gets the :data:`HOST_BOUND` note."""
    if host > device:
        notes.append(HOST_BOUND)
    return max(device, host)


def _matrix_time(profile: DeviceProfile, cfg: PlanConfig, mat: Matrix, batch: int, tp: int,
                 mode: str | None) -> tuple[float, float]:
    """``(seconds, of which communication)`` of the optimizer's matrix work on ``batch`` matrices of ``mat``'s
    shape (TP shards when ``tp > 1``), the per-parameter elementwise passes excluded (Shampoo's and SOAP's
    per-block stacking and copies, :func:`~matrixopt.distributed.cost.block_pass_bytes`, stay in: they belong to
    the matrix's owner)."""
    rows, cols = _split_matrix(mat, tp)
    if cfg.optimizer != "muon":
        shard = Shapes(rows, -(-cols // tp), batch)
        t = matrix_step_time(profile, cfg.optimizer, [shard], precondition_frequency=cfg.precondition_frequency,
                             root_method=cfg.root_method, matmul_precision=cfg.matmul_precision)
        return t - profile.seconds("elementwise", ELEMENTWISE_BYTES[cfg.optimizer] * shard.numel), 0.0
    def ns(s: int, l: int, b: int) -> float:
        return newton_schulz_time(profile, b, s, l, cfg.ns_steps, cfg.ns_method, eager=True)

    if tp == 1:  # the owner's stack in the optimizer's batches
        return batched_newton_schulz_time(profile, batch, rows, cols, cfg.ns_steps, cfg.ns_method, eager=True), 0.0
    link = profile.link(tp, 1, cfg.gpus_per_node)
    times = tp_ns_times(rows, cols, tp, batch=batch, steps=cfg.ns_steps, link=link, ns=ns,
                        gemm=lambda f: profile.seconds("gemm", f))
    t = times[mode]
    compute = {"duplicated": ns(rows, cols, batch), "blockwise": t, "distributed": None}[mode]
    if compute is None:  # distributed: what the same schedule costs on a free network
        free = tp_ns_times(rows, cols, tp, batch=batch, steps=cfg.ns_steps, link=dataclasses.replace(
            link, latency=0.0, bandwidth=1e300), ns=lambda s, l, b: 0.0, gemm=lambda f: profile.seconds("gemm", f))
        compute = free["distributed"]
    return t, max(0.0, t - compute)


def predict(layout: Layout, cfg: PlanConfig, profile: DeviceProfile) -> Prediction:
    """The step, exposed communication and memory per GPU of ``layout`` (module docstring for the model)."""
    model, n, T = cfg.model, cfg.gpus, cfg.tokens_per_gpu
    tp, ep = layout.tp, layout.ep
    dp = n // tp  # data-parallel ranks (EP is carved out of them)
    edp = dp // ep  # ranks sharing each expert
    gpn = cfg.gpus_per_node
    mats = model.matrices()
    dense = [m for m in mats if not m.expert]
    experts = [dataclasses.replace(m, count=m.count // ep) for m in mats if m.expert]  # on one EP rank
    d = model.d_model

    # elements per GPU before data-parallel sharding
    dense_el = sum(m.numel / (tp if _tp_sharded(m, tp) else 1) for m in dense)
    expert_el = sum(m.numel for m in experts)
    rest_el = model.table_params() / tp + model.vector_params()
    params_el = dense_el + expert_el + rest_el

    # forward and backward
    fwd_bwd = model.flops_per_token() * T / (cfg.mfu * profile.peak_flops) * (4 / 3 if cfg.recompute else 1)
    acc = cfg.grad_accum
    mb = T // acc  # tokens of one micro-batch
    fwd, bwd = fwd_bwd / 3 / acc, 2 * fwd_bwd / 3 / acc  # one micro-batch's passes
    notes: list[str] = []

    # traffic every layout shares between the optimizers: TP activations, EP tokens (not overlapped)
    shared = 0.0
    if tp > 1:
        shared += 4 * model.n_layer * acc * collective_time("all_reduce", tp * mb * d * 2, tp,
                                                            profile.link(tp, 1, gpn))
    if ep > 1:
        moe_layers = model.n_layer - getattr(model, "n_dense_layers", 0)
        tokens = mb * model.top_k * d * 2
        shared += 4 * moe_layers * acc * collective_time("all_to_all", tokens, ep, profile.link(ep, tp, gpn))

    saved = 0.0  # compute the layout saves against AdamW's forward and backward
    dp_link = profile.link(dp, tp, gpn)
    edp_link = profile.link(edp, tp * ep, gpn)
    layer_el = params_el / model.n_layer
    if layout.kind == "layerwise":
        reduce = collective_time("reduce_scatter", 4 * params_el, dp, dp_link)
        bcast = collective_time("all_gather", 2 * (dense_el + expert_el) + 4 * rest_el, dp, dp_link)
        sync = max(0.0, reduce - bwd) + max(0.0, bcast - fwd)
        adamw_sync = max(0.0, collective_time("all_reduce", 4 * params_el, dp, dp_link) - bwd)
        ns, opt_comm, owned, launches = _owner_load(profile, cfg, mats, dp, 1, None)
        # the step's passes and (with other ranks to send to) the owner's cast of its matrices into the bf16
        # broadcast buffers. Nothing more: NCCL averages inside the reductions, and the ranks' non-finite agreement
        # takes the trainer's clip's per-gradient norms (LayerwiseOptimizer._agree_finite)
        wire = WIRE_CAST_BYTES if dp > 1 else 0
        elementwise = profile.seconds("elementwise", (ELEMENTWISE_BYTES[cfg.optimizer] + wire) * owned)
        side = profile.seconds("elementwise", ADAMW_BYTES * rest_el / dp)  # AdamW groups on a side stream
        host = profile.host_seconds(launches)  # the owner's step runs eagerly: no faster than its host issues it
        opt = _eager_step(max(ns, side) + elementwise, host, notes)
        adamw_opt = profile.seconds("fused_adamw", ADAMW_BYTES * params_el)  # torch fused AdamW
        mat_el = dense_el + expert_el
        lowered = cfg.bf16_weights
        if lowered:  # per matrix element, against fp32 weights (DDP AdamW's): each micro-batch's forward casts the
            # weight to bf16 (6 bytes) and its backward casts the bf16 gradient back (6) and, after the first
            # micro-batch, adds it to .grad (12), the last one's hook copying .grad into the reduce buffer (8);
            # bf16 weights instead add each micro-batch's bf16 gradient to the fp32 buffer (10, the first a copy of
            # 6): 14 bytes per micro-batch less
            saved = acc * profile.seconds("elementwise", 14 * mat_el)
        # the owners' fp32 masters of the bf16 matrices count as state
        state_total = _state(cfg, mats, 1) + 8 * rest_el + (4 * mat_el if lowered else 0)
        state = max(state_total / dp, 8.0 * getattr(model, "vocab", 0) * d)  # a whole-owned embedding
        ws = _workspace(mats, dp, 1)
        # the owners' reduce buffers (4 bytes per parameter); under accumulation the micro-batches' gradients of
        # what is not summed in those buffers (every parameter in fp32, or the rest beside bf16 matrices) gather
        # in .grad until the last backward's hooks copy them over, so both are held at its start
        grads = 4 * params_el + (4 * (rest_el if lowered else params_el) if acc > 1 else 0)
        # under autocast each MoE layer's forward casts its fp32 expert stacks to bf16 for the grouped GEMM, which
        # keeps the copies for backward (matrixopt.train.model.grouped_mm); with recomputation one layer's at a time
        # (none where they are kept in bf16)
        casts = 0.0 if lowered else 2 * expert_el / (model.n_layer if cfg.recompute else 1)
        memory = Memory(params=(2 if lowered else 4) * mat_el + 4 * rest_el, grads=grads, optimizer_state=state,
                        buffers=ws,
                        activations=_activations(model, mb, tp, cfg.recompute) + casts, step_grads=4 * params_el)
        adamw_memory = Memory(params=4 * params_el, grads=8 * params_el, optimizer_state=8 * params_el, buffers=0.0,
                              activations=memory.activations, step_grads=8 * params_el)
    else:
        dense_shard = (dense_el + rest_el) / dp
        expert_shard = expert_el / edp
        gather = (collective_time("all_gather", 2 * (dense_el + rest_el), dp, dp_link)
                  + collective_time("all_gather", 2 * expert_el, edp, edp_link))
        rs = (collective_time("reduce_scatter", 4 * (dense_el + rest_el), dp, dp_link)
              + collective_time("reduce_scatter", 4 * expert_el, edp, edp_link))
        once = cfg.fsdp_gather_once and acc > 1
        if once:  # the first forward and the last backward gather; the last backward reduce-scatters
            sync = max(0.0, gather - fwd) + max(0.0, gather + rs - bwd)
        else:  # every micro-batch gathers in forward and again in backward; only the last reduce-scatters
            sync = acc * (max(0.0, gather - fwd) + max(0.0, gather - bwd)) - max(0.0, gather - bwd)
            sync += max(0.0, gather + rs - bwd)
        adamw_sync = sync
        ns_d, comm_d, owned_d, launches_d = _owner_load(profile, cfg, dense, dp, tp, layout.tp_mode)
        ns_e, comm_e, owned_e, launches_e = _owner_load(profile, cfg, experts, edp, 1, None)
        ns = ns_d + ns_e  # dense and expert matrices run one after the other on every rank
        dense_mat_shard = sum(m.numel / (tp if _tp_sharded(m, tp) else 1) for m in dense) / dp
        if cfg.optimizer == "muon":  # bf16 both ways, pipelined over the buckets behind Newton–Schulz
            a2a = 2 * (collective_time("all_to_all", 2 * dense_mat_shard, dp, dp_link)
                       + collective_time("all_to_all", 2 * expert_shard, edp, edp_link))
            exchange = max(0.0, a2a - ns) + a2a / max(1, len(mats))
        else:  # Shampoo's and SOAP's owners gather the gradients (bf16 where SOAP's products take bf16 operands,
            # the dtype its step reads them in, else fp32), blocking, and scatter the fp32 updates back: Shampoo's
            # blocking, SOAP's beside its refresh, which follows its update (an owner's share of it)
            def rows_time(per_el: float) -> float:
                return (collective_time("all_to_all", per_el * dense_mat_shard, dp, dp_link)
                        + collective_time("all_to_all", per_el * expert_shard, edp, edp_link))

            soap = cfg.optimizer == "soap"
            gather = rows_time(gradient_dtype(cfg.matmul_precision).itemsize if soap else 4)
            beside = refresh_time(profile, "soap", [Shapes(m.m, m.n, m.count) for m in mats],
                                  precondition_frequency=cfg.precondition_frequency,
                                  matmul_precision=cfg.matmul_precision) / dp if soap else 0.0
            exchange = gather + max(0.0, rows_time(4) - beside)
        opt_comm = comm_d + comm_e + exchange
        local_mat = dense_mat_shard + expert_shard
        local_rest = rest_el / dp
        # the step's passes on the local shards and, for ShardedMuon, the owner's on the matrices it gathers
        gathered_el = (owned_d if dp > 1 else 0) + (owned_e if edp > 1 else 0)
        split = sum(m.numel for m in dense if m.name in SPLIT_PIECES) / max(1, sum(m.numel for m in dense))
        owner_bytes = (SHARDED_OWNER_BYTES * gathered_el + SHARDED_SPLIT_BYTES * split * (owned_d if dp > 1 else 0)
                       if cfg.optimizer == "muon" else 0.0)
        elementwise = profile.seconds("elementwise", ELEMENTWISE_BYTES[cfg.optimizer] * local_mat + owner_bytes)
        side = profile.seconds("elementwise", ADAMW_BYTES * local_rest)  # AdamW groups on a side stream
        host = profile.host_seconds(launches_d + launches_e)  # the owners' eager Muon steps, issued by the host
        opt = _eager_step(max(ns, side) + exchange + elementwise, host, notes)  # ns holds the TP traffic
        adamw_opt = profile.seconds("fused_adamw", ADAMW_BYTES * (dense_shard + expert_shard))
        state = (_state(cfg, dense, tp) / dp + _state(cfg, experts, 1) / edp
                 + 8 * local_rest)
        transient = 2 * 2 * layer_el  # two layers' bf16 parameters gathered (current and prefetched)
        gathered = 2 * params_el if once else transient  # gather-once: the whole model's bf16 parameters
        ws = max(_workspace(dense, dp, tp), _workspace(experts, edp, 1))  # gathered stacks, one bucket at a time
        # gradients beside the activations: the last step's sharded ones were freed (zero_grad(set_to_none=True)),
        # but between micro-batches FSDP2 keeps every gradient unsharded, upcast to the fp32 reduce dtype; plus two
        # layers' bf16 gradients before their reduction (or upcast). The step reads the sharded ones.
        grads = 4 * params_el if acc > 1 else 0.0
        memory = Memory(params=4 * (dense_shard + expert_shard) + gathered,
                        grads=grads + transient, optimizer_state=state, buffers=ws,
                        activations=_activations(model, mb, tp, cfg.recompute),
                        step_grads=4 * (dense_shard + expert_shard))
        adamw_memory = dataclasses.replace(memory, optimizer_state=8 * (dense_shard + expert_shard), buffers=0.0)
        if tp > 1 and cfg.optimizer == "muon":
            notes.append(f"TP Newton-Schulz {layout.tp_mode}")
        if once:
            notes.append("parameters gathered once per step")
    exposed = shared + sync + opt_comm
    step = fwd_bwd - saved + shared + sync + opt
    adamw_step = fwd_bwd + shared + adamw_sync + adamw_opt
    return Prediction(layout=layout, fwd_bwd_s=fwd_bwd, opt_step_s=opt, opt_comm_s=opt_comm, exposed_comm_s=exposed,
                      step_s=step, adamw_opt_step_s=adamw_opt, adamw_step_s=adamw_step, memory=memory,
                      adamw_memory=adamw_memory, capacity_bytes=cfg.memory_fraction * profile.memory_bytes,
                      tokens_per_gpu=T, notes=tuple(notes))


def _state(cfg: PlanConfig, mats: Sequence[Matrix], tp: int) -> float:
    """Optimizer state bytes of ``mats`` (all of them, TP shards where split) under ``cfg``'s optimizer."""
    total = 0.0
    for m in mats:
        rows, cols = _split_matrix(m, tp)
        cols = -(-cols // tp) if _tp_sharded(m, tp) else cols
        total += m.count * preconditioner_state_bytes(cfg.optimizer, rows, cols, cfg.root_method,
                                                      cfg.matmul_precision)
    return total


def _workspace(mats: Sequence[Matrix], owners: int, tp: int) -> float:
    """Newton–Schulz workspace of the largest stack one owner runs: three bf16 copies of it and its Gram, for at
    most :data:`~matrixopt.optim.layout.BUCKET_NUMEL` elements, the optimizers' batches."""
    best = 0.0
    for m in mats:
        el = m.m * m.n // (tp if _tp_sharded(m, tp) else 1)
        b = max(1, min(m.count // max(1, owners), BUCKET_NUMEL // el))
        s = min(m.m, m.n)
        best = max(best, b * (3 * 2 * el + 3 * 2 * s * s))
    return best


def _activations(model: Architecture | ExplicitModel, tokens: int, tp: int, recompute: bool) -> float:
    """Activation bytes per GPU (:meth:`~matrixopt.plan.models.Architecture.activation_bytes_per_token`): a TP
    group's ``tp * tokens`` with residual streams and norms replicated (no sequence parallelism) and the rest
    split, plus bf16 logits and their fp32 loss copy split over the vocab. With ``recompute``, each layer keeps
    its bf16 input and one layer at a time holds the rest."""
    d = model.d_model
    per_layer = tp * tokens * 8 * d + tokens * (model.activation_bytes_per_token() - 8 * d)
    logits = tokens * getattr(model, "vocab", 0) * 6
    if recompute:
        return model.n_layer * tp * tokens * 2 * d + per_layer + logits
    return model.n_layer * per_layer + logits


# ----------------------------------------------------------------------------------------------------------
# the plan


HOST_BOUND = "optimizer step bound by the host issuing its kernels"
"""The note of a layout whose eager owner step takes its host longer to issue than its device to run
(:func:`~matrixopt.distributed.cost.muon_host_time`); the printed plan lists those layouts."""


def assumptions(cfg: PlanConfig, profile: DeviceProfile) -> tuple[str, ...]:
    return (
        f"forward+backward: {cfg.model.flops_per_token() / 1e9:.3g} GFLOP per token x {cfg.tokens_per_gpu} tokens "
        f"per GPU ({cfg.grad_accum} micro-batch{'es' if cfg.grad_accum > 1 else ''}) at MFU {cfg.mfu:g} of "
        f"{profile.peak_flops / 1e12:.0f} TFLOP/s"
        + (", every layer recomputed in backward" if cfg.recompute else ", no recomputation"),
        f"device profile {profile.name} ({profile.source}); links: intra {profile.links['intra'].bandwidth / 1e9:g} "
        f"GB/s, inter {profile.links['inter'].bandwidth / 1e9:g} GB/s per GPU",
        f"{cfg.optimizer}: {cfg.ns_steps} Newton-Schulz steps" if cfg.optimizer == "muon"
        else f"{cfg.optimizer}: roots refreshed every {cfg.precondition_frequency} steps"
        + (f" ({cfg.root_method})" if cfg.optimizer == "shampoo" else "")
        + (f", {cfg.matmul_precision} products" if cfg.optimizer != "muon" else ""),
        *((f"{cfg.optimizer}'s step is priced by its device time alone: the host's time to issue its eager step "
           "(240-1200 kernels) is not modelled, and binds it where a rank's share of the matrices is small",)
          if cfg.optimizer in ("shampoo", "soap") else ()),
        "AdamW in the same layout (layer-wise against DDP); fp32 master weights, gradients and state; bf16 compute",
        "layer-wise keeps its matrices in bf16 (fp32 masters on their owners), DDP AdamW in fp32" if cfg.bf16_weights
        else "layer-wise keeps its matrices in fp32, as DDP AdamW",
        *(("FSDP: parameters gathered once per step, the whole model's bf16 copy held between micro-batches",)
          if cfg.fsdp_gather_once and cfg.grad_accum > 1 else ()),
        *((f"{profile.name}'s products were timed in bursts (its env has no heat_s): a GPU held at its power limit, "
           "as in training, may run them 10-20% slower; matrixopt plan --calibrate times them sustained",)
          if profile.source == "measured" and not profile.env.get("heat_s") else ()),
        f"a layout fits in {cfg.memory_fraction:g} of {profile.memory_bytes / 1e9:.0f} GB per GPU",
    )


def plan(cfg: PlanConfig, profile: DeviceProfile) -> Plan:
    """Every candidate layout's :class:`Prediction`; the best is the fitting one with the most matrix-optimizer
    tokens/s (ties: the first candidate) among those computing the optimizer's own update: TP ``blockwise``
    orthogonalizes each shard alone, a different update, so it is listed but never picked. ValueError when none
    fits, naming the closest and its memory."""
    preds = tuple(predict(layout, cfg, profile) for layout in candidates(cfg))
    fitting = [p for p in preds if p.fits and p.layout.tp_mode != "blockwise"]
    if not fitting:
        closest = min(preds, key=lambda p: p.memory.total)
        m = closest.memory
        raise ValueError(
            f"{cfg.model.name} with {cfg.optimizer} fits no layout on {cfg.gpus} GPUs of "
            f"{profile.memory_bytes / 1e9:.0f} GB (usable {closest.capacity_bytes / 1e9:.0f} GB): the smallest, "
            f"{closest.layout.label}, needs {m.total / 1e9:.1f} GB per GPU (parameters {m.params / 1e9:.1f}, "
            f"gradients {m.grads / 1e9:.1f}, optimizer state {m.optimizer_state / 1e9:.1f}, buffers "
            f"{m.buffers / 1e9:.1f}, activations {m.activations / 1e9:.1f}); use more GPUs, fewer tokens per GPU, "
            f"a larger tp/ep, or --recompute"
            + (", or gather per micro-batch (without --fsdp-gather-once)" if cfg.fsdp_gather_once else ""))
    best = max(fitting, key=lambda p: p.tokens_per_s)
    adamw = min((p for p in preds if p.adamw_memory.total <= p.capacity_bytes and p.layout.tp_mode != "blockwise"),
                key=lambda p: p.adamw_step_s, default=best)
    label = "ddp" if adamw.layout.kind == "layerwise" else dataclasses.replace(adamw.layout, tp_mode=None).label
    return Plan(cfg, profile, preds, best, label, adamw.adamw_step_s, assumptions(cfg, profile))


def ratio_curve(cfg: PlanConfig, profile: DeviceProfile, gpus: Sequence[int] = GPU_COUNTS) -> list[dict[str, Any]]:
    """At each GPU count, the best layout's Muon/AdamW ratio (same layout, and against AdamW's best layout) and,
    per layout kind, its fastest fitting layout's tokens/s over AdamW's best layout's, the other settings kept;
    counts where nothing fits or the degrees do not divide are skipped."""
    rows = []
    for g in gpus:
        try:
            c = dataclasses.replace(cfg, gpus=g, dp=None)
            p = plan(c, profile)
        except ValueError:
            continue
        fastest: dict[str, Prediction] = {}
        for q in p.predictions:
            key = q.layout.kind if q.layout.tp == 1 else f"fsdp tp {q.layout.tp_mode}"
            if q.fits and (key not in fastest or q.tokens_per_s > fastest[key].tokens_per_s):
                fastest[key] = q
        kinds = {k: p.adamw_step_s / q.step_s for k, q in fastest.items()}
        rows.append({"gpus": g, "best": p.best.layout.label, "ratio": p.best.ratio,
                     "vs_best_adamw": p.adamw_step_s / p.best.step_s,
                     "step_ms": p.best.step_s * 1e3, "by_kind": dict(kinds)})
    return rows


def to_dict(p: Plan, curve: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    c = p.config
    return {"model": c.model.name, "total_params": c.model.total_params(), "gpus": c.gpus,
            "gpus_per_node": c.gpus_per_node, "tokens_per_gpu": c.tokens_per_gpu, "grad_accum": c.grad_accum,
            "fsdp_gather_once": c.fsdp_gather_once, "recompute": c.recompute, "optimizer": c.optimizer,
            "mfu": c.mfu, "profile": {"name": p.profile.name, "source": p.profile.source},
            "assumptions": list(p.assumptions), "best": p.best.layout.label, "adamw_best": p.adamw_best,
            "vs_best_adamw": p.adamw_step_s / p.best.step_s,
            "layouts": [q.to_dict() for q in p.predictions], "curve": curve or []}


def format_plan(p: Plan) -> str:
    """A readable table of every layout, the best marked with ``*``."""
    c = p.config
    head = (f"{c.model.name} ({c.model.total_params() / 1e9:.3g}B parameters), {c.optimizer} vs AdamW, {c.gpus} GPUs "
            f"({c.gpus_per_node} per node), {c.tokens_per_gpu} tokens per GPU per step in {c.grad_accum} "
            f"micro-batch{'es' if c.grad_accum > 1 else ''}")
    cols = ["", "layout", "opt step ms", "exposed comm ms", "step ms", "AdamW step ms", "memory GB", "fits",
            f"{c.optimizer}/AdamW", "vs best AdamW"]
    other = " (other update)"
    rows = [["*" if q is p.best else "", q.layout.label + (other if q.layout.tp_mode == "blockwise" else ""),
             f"{q.opt_step_s * 1e3:.2f}", f"{q.exposed_comm_s * 1e3:.2f}",
             f"{q.step_s * 1e3:.1f}", f"{q.adamw_step_s * 1e3:.1f}", f"{q.memory.total / 1e9:.1f}",
             "yes" if q.fits else "no", f"{q.ratio:.3f}", f"{p.adamw_step_s / q.step_s:.3f}"]
            for q in p.predictions]
    widths = [max(len(r[i]) for r in [cols, *rows]) for i in range(len(cols))]
    lines = [head, "", "  ".join(h.ljust(w) for h, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    lines += ["", f"* best: {p.best.layout.label}, {p.best.tokens_per_s:.0f} tokens/s per GPU, "
                  f"{p.best.ratio:.3f} of AdamW's in the same layout, {p.adamw_step_s / p.best.step_s:.3f} of "
                  f"AdamW's in its best layout ({p.adamw_best})"]
    bound = [q.layout.label for q in p.predictions if HOST_BOUND in q.notes]
    if bound:
        lines.append(f"{HOST_BOUND} ({p.profile.host_launch * 1e6:.0f} us per kernel on {p.profile.name}): "
                     f"{', '.join(bound)}. A host's pace differs between machines with the same GPU (2x between H200 "
                     f"hosts measured): matrixopt plan --calibrate on the target machine measures its own")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in p.assumptions]
    return "\n".join(lines)


def plot_curve(curve: list[dict[str, Any]], title: str, path: str) -> bool:
    """Tokens/s over AdamW's best layout's against the GPU count: the best layout's and each layout kind's
    fastest; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    kinds = sorted({k for r in curve for k in r["by_kind"]})
    for kind in kinds:
        pts = [(r["gpus"], r["by_kind"][kind]) for r in curve if kind in r["by_kind"]]
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=kind)
    ax.plot([r["gpus"] for r in curve], [r["vs_best_adamw"] for r in curve], "k--", label="best layout")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("tokens/s over AdamW's in its best layout")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
