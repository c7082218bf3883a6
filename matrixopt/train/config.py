"""A training run as one typed config, composed of the component configs.

``TrainConfig()`` with no arguments is nanoGPT's CPU quick-start on TinyShakespeare (4 layers, 4 heads,
width 128, context 64, batch 12, dropout 0, 2000 iterations, lr 1e-3 with 100 warmup steps and a cosine decay
to 1e-4, beta2 0.99, weight decay 0.1, clip 1.0). Every config validates itself on construction and raises
ValueError naming the field, its value and the accepted range. ``from_dict`` builds one from JSON and rejects
unknown keys with a suggestion, so a typo in a config file is an error rather than a silent default.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field

from matrixopt.distributed.parallelism import parallelism_class
from matrixopt.optim.offload import OFFLOAD_CHOICES
from matrixopt.optim.registry import OPTIMIZERS, accepted
from matrixopt.optim.state import check_state_dtype
from matrixopt.train.data import DataConfig
from matrixopt.train.model import PRESETS, GPTConfig, GPTOptions
from matrixopt.train.schedule import ScheduleConfig

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "bf16", "fp32")
SHAPE = ("n_layer", "n_head", "n_embd", "block_size", "n_expert", "topk", "expert_ffn")


@dataclass(kw_only=True)
class ModelConfig(GPTOptions):
    """A preset plus optional overrides of its shape, and the GPT's options; the vocab comes from the data."""

    preset: str = "tiny-cpu"
    """One of PRESETS: tiny-cpu, shakespeare-char, gpt2-small, gpt2-medium, 1.3b, 2.7b, 6.7b, moe-tiny, moe-small,
    qwen3-30b-a3b, moe-2b."""
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    block_size: int | None = None
    n_expert: int | None = None
    topk: int | None = None
    expert_ffn: int | None = None
    """Overrides of the preset's shape (None keeps the preset's value); n_expert > 0 makes every MLP a mixture of
    n_expert experts of width expert_ffn, topk per token."""

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown model preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        self.gpt_config(vocab_size=1)  # validates the shape and the options

    def gpt_config(self, vocab_size: int) -> GPTConfig:
        shape = PRESETS[self.preset] | {k: getattr(self, k) for k in SHAPE if getattr(self, k) is not None}
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(GPTOptions)}
        return GPTConfig(vocab_size=vocab_size, **shape, **options)


@dataclass(kw_only=True)
class OptimConfig:
    """Arguments of ``matrixopt.build_optimizer``; the name is checked against the registry there."""

    name: str = "adamw"
    """A key of matrixopt.optim.registry.OPTIMIZERS."""
    lr: float = 1e-3
    """Peak learning rate of the optimizer's main groups."""
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas (also used for the AdamW-routed parameters of a matrix optimizer)."""
    hparams: dict[str, typing.Any] = field(default_factory=dict)
    """Further keyword arguments for the optimizer, e.g. {"momentum": 0.95, "ns_steps": 5}."""
    state_dtype: str | None = None
    """How the momentum and Adam's moments are stored: None (float32), "bf16" or "int8" (stochastically rounded,
    computed in float32; matrixopt.optim.state). Muon, MOP, NorMuon, AdaMuon, Shampoo and SOAP."""
    offload: str | None = None
    """None, or "cpu": the optimizer state lives in CPU memory and is brought to the GPU chunk by chunk, overlapped
    with the update (matrixopt.optim.offload). Muon, MOP, NorMuon, AdaMuon, Shampoo and SOAP."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        self.betas = tuple(self.betas)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        check_state_dtype(self.state_dtype)
        if self.offload is not None and self.offload not in OFFLOAD_CHOICES:
            raise ValueError(f"offload must be None or one of {OFFLOAD_CHOICES}, got {self.offload!r}")
        memory = self._memory_options()
        if memory and self.name in OPTIMIZERS and accepted(self.name, **memory) != memory:
            takers = [n for n in OPTIMIZERS if accepted(n, **memory) == memory]
            raise ValueError(f"optimizer {self.name!r} does not take {', '.join(memory)}; use one of "
                             f"{', '.join(takers)}")

    def _memory_options(self) -> dict[str, typing.Any]:
        return {k: v for k, v in (("state_dtype", self.state_dtype), ("offload", self.offload)) if v is not None}

    def optimizer_kwargs(self) -> dict[str, typing.Any]:
        """The keyword arguments for the registered optimizer. ``betas`` go to its AdamW: as ``betas`` where it
        takes them, else as ``adamw_betas`` (Muon, MOP). Where the optimizer has it, ``deferred_nonfinite=True``
        (unless ``hparams`` ask for ``skip_nonfinite``): no host sync per step, which would let the GPU run dry
        while the host queues the next forward; a NaN/Inf gradient still stops the run, one step later, and never
        reaches a checkpoint (``state_dict()`` raises it first)."""
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}; choose from {', '.join(sorted(OPTIMIZERS))}")
        betas_key = "adamw_betas" if accepted(self.name, adamw_betas=None) else "betas"
        deferred = {} if self.hparams.get("skip_nonfinite") else accepted(self.name, deferred_nonfinite=True)
        return ({"lr": self.lr, "weight_decay": self.weight_decay, betas_key: self.betas} | deferred
                | self._memory_options() | self.hparams)


@dataclass(kw_only=True)
class TrainConfig:
    """One training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    steps: int = 2000
    """Optimizer steps."""
    batch_size: int = 12
    """Sequences per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; tokens per step = batch_size * grad_accum * block_size."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    qk_clip: float | None = None
    """QK-clip threshold tau (MuonClip, Kimi K2, which uses 100): after every optimizer step, the query and key
    rows of each head whose largest pre-softmax logit in that step exceeded tau are scaled by sqrt(tau / that
    logit) each, which brings it down to tau (matrixopt.QKClip). None: off. Not with tp > 1 yet."""
    eval_every: int = 100
    """Evaluate val loss every this many steps, and at the last step."""
    eval_iters: int = 50
    """Val batches (of batch_size windows, fixed across evaluations) per evaluation."""
    log_every: int = 10
    """Write a metrics line every this many steps."""
    ckpt_every: int = 0
    """Checkpoint every this many steps (0: only at the end and on Ctrl-C)."""
    seed: int = 1337
    device: str = "auto"
    """'auto' (cuda when available), 'cpu' or 'cuda'."""
    dtype: str = "auto"
    """'auto' (bf16 autocast on CUDA, fp32 on CPU), 'bf16' or 'fp32'."""
    compile: bool = False
    """torch.compile the model."""
    threads: int = 0
    """CPU threads for torch (0: torch's default)."""
    parallel: str = "none"
    """Data parallelism over the ranks torchrun starts: 'none' (one process), 'ddp' (DistributedDataParallel,
    the whole optimizer on every rank), 'layerwise' (matrixopt.distributed: each rank owns whole parameters) or
    'fsdp' (FSDP2 fully_shard; Muon as ShardedMuon, or AdamW). batch_size stays global: each rank takes its
    slice of every micro-batch, so N ranks log the losses of one process."""
    tp: int = 1
    """Tensor-parallel degree: each block's matrices are sharded over groups of tp ranks (Megatron's layout, see
    matrixopt.train.parallelize) and FSDP2 shards over the world / tp data-parallel groups, which take the
    batch slices. tp > 1 needs parallel 'fsdp' (tp equal to the world size is TP alone) and must divide n_head
    and the world size. A checkpoint resumes at any tp (it holds the single-process layout)."""
    tp_mode: str = "auto"
    """Muon's tensor-parallel Newton–Schulz under tp > 1: 'auto' (by a measured cost model), 'duplicated',
    'distributed' or 'blockwise' (matrixopt.distributed.tp). Other optimizers ignore it."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's experts are split over groups of ep consecutive ranks, which send
    tokens to the experts' ranks and back (matrixopt.distributed.ep); data parallelism over the world / ep
    replicas of each expert. ep > 1 needs parallel 'ddp', 'layerwise' or 'fsdp' ('none' refuses it), a
    mixture-of-experts model whose n_expert it divides, and a world size it divides. Under 'ddp' every rank steps
    its own expert stacks; under 'layerwise' each rank's stacks are owned among their world / ep replicas and the
    dense parameters over every rank, balanced together; under 'fsdp' FSDP2 shards the dense parameters over every
    rank and each rank steps its own expert stacks, kept out of FSDP2 (the Muon family or AdamW, tp 1). A checkpoint
    resumes at any ep and world size of its mode (it holds the single-process layout)."""

    fsdp_gather_once: bool = False
    """Under 'fsdp' with grad_accum > 1: gather each block's parameters once per step and keep them gathered until
    the last micro-batch (2 all-gathers of each block per step instead of 2 per micro-batch), at the cost of the
    whole model's gathered parameters in memory between micro-batches. The same result."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "eval_every", "eval_iters", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        for name in ("ckpt_every", "threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        parallelism_class(self.parallel, tp=self.tp, tp_mode=self.tp_mode, ep=self.ep,
                          gather_once=self.fsdp_gather_once)  # checks parallel, tp, ep and the FSDP2 option
        gpt = self.model.gpt_config(vocab_size=1)
        n_head = gpt.n_head
        if self.ep > 1 and (not gpt.n_expert or gpt.n_expert % self.ep):
            raise ValueError(f"ep={self.ep} must divide the model's n_expert={gpt.n_expert} (each rank holds "
                             f"n_expert / ep whole experts); pick an --ep that divides it, or a mixture-of-experts "
                             f"model (--model moe-tiny, --experts E)")
        if n_head % self.tp:
            raise ValueError(f"tp={self.tp} must divide the model's n_head={n_head} (each TP rank computes whole "
                             f"heads); pick a --tp that divides {n_head}")
        if self.qk_clip is not None:
            if isinstance(self.qk_clip, bool) or not isinstance(self.qk_clip, (int, float)) or not (
                    math.isfinite(self.qk_clip) and self.qk_clip > 0):
                raise ValueError(f"qk_clip (--qk-clip) must be a finite number > 0, the largest pre-softmax logit a "
                                 f"head may reach (Kimi K2 uses 100), got {self.qk_clip!r}; pass e.g. --qk-clip 100, "
                                 f"or leave it out to turn QK-clip off")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def from_dict(cls: type, values: dict, where: str = "config"):
    """Build dataclass ``cls`` from nested ``values``; unknown keys raise ValueError with a suggestion."""
    if not isinstance(values, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(fields)}"
            raise ValueError(f"unknown key {key!r} in {where}{hint}")
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            kwargs[key] = from_dict(kind, value, f"{where}.{key}")
        else:
            kwargs[key] = _check_type(value, kind, f"{where}.{key}")
    return cls(**kwargs)


def _check_type(value, kind, where: str):
    allowed = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    for t in allowed:
        origin = typing.get_origin(t) or t
        if t is type(None) and value is None:
            return value
        if origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if origin is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if origin is tuple and isinstance(value, list):
            return tuple(value)
        if origin not in (float, int, tuple, type(None)) and isinstance(value, origin):
            return value
    raise ValueError(f"{where} must be {kind}, got {value!r}")
