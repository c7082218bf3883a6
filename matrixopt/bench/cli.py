"""``matrixopt bench ns|step|train|kernels|profile|scale|tp``: arguments -> one benchmark -> a printed table and
a JSON file; ``matrixopt bench plot`` draws records as a PNG.

``scale`` and ``tp`` run one process per rank under torchrun (``torchrun --nproc-per-node N -m matrixopt bench
scale ...``); rank 0 prints and writes. ``matrixopt.cli`` delegates to :func:`add_arguments` and :func:`run`;
``python -m matrixopt.bench`` does the same.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

import torch
import torch.distributed as dist

from matrixopt.bench import kernels, ns, plots, profile, scale, step, tp, train
from matrixopt.bench.common import write_json
from matrixopt.cli import per_optimizer
from matrixopt.device import resolve_device
from matrixopt.distributed import comm
from matrixopt.train.model import PRESETS

SUBCOMMANDS = ("ns", "step", "train", "kernels", "profile", "scale", "tp", "plot")
DISTRIBUTED = ("scale", "tp")


def _shape(text: str) -> tuple[int, int, int]:
    """``"24x768x3072"`` (batch x m x n) or ``"768x3072"`` (batch 1)."""
    try:
        dims = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) == 2:
        dims = (1, *dims)
    if len(dims) != 3 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: write BATCHxMxN or MxN with positive integers, "
                                         f"e.g. 24x768x3072")
    return dims  # type: ignore[return-value]


def _matrix(text: str) -> tuple[int, int]:
    """``"4096x14336"`` (m x n)."""
    batch, m, n = _shape(text)
    if batch != 1 or text.count("x") != 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: write MxN with positive integers, e.g. 4096x14336")
    return m, n


def _config(text: str) -> scale.ScaleConfig:
    try:
        return scale.parse_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark subcommands to ``parser``."""
    sub = parser.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    output = argparse.ArgumentParser(add_help=False)
    output.add_argument("--json", metavar="PATH", help="write the full record here (default: print only)")
    common = argparse.ArgumentParser(add_help=False, parents=[output])
    common.add_argument("--device", default="auto", help="cuda, cpu, cuda:1, or auto (default: CUDA if present)")
    common.add_argument("--reps", type=int, default=None, help="timed repeats (medians are reported)")
    ranks = argparse.ArgumentParser(add_help=False, parents=[output])
    ranks.add_argument("--toy", action="store_true", help="tiny sizes on the CPU with gloo (what the tests run)")
    ranks.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 3; --toy 1)")

    p = sub.add_parser("ns", parents=[common], help="Newton–Schulz and Gram kernels vs cuBLAS and torch.optim.Muon")
    p.add_argument("--shapes", type=_shape, nargs="+", default=ns.DEFAULT_SHAPES, metavar="BxMxN",
                   help="stacks to orthogonalize (m <= n)")
    p.add_argument("--gram", type=_shape, nargs="*", default=ns.DEFAULT_GRAM, metavar="BxMxK",
                   help="Gram X X^T shapes (none to skip)")
    p.add_argument("--steps", type=int, default=5, help="Newton–Schulz iterations (default 5)")

    p = sub.add_parser("step", parents=[common], help="optimizer-step time for a model's parameter set")
    p.add_argument("--model", default="gpt2-small", choices=list(step.MODELS))
    p.add_argument("--ep", type=int, default=1,
                   help="a mixture of experts' expert-parallel degree: time one rank's share, experts / EP experts")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help="time only these rows, e.g. 'matrixopt muon' 'matrixopt shampoo, frequency 10'")

    p = sub.add_parser("train", parents=[common], help="end-to-end training tokens/s, ratio to AdamW, and GPU "
                                                       "memory (the step's peak, the optimizer's)")
    p.add_argument("--model", default="gpt2-small", choices=list(train.BATCHES))
    p.add_argument("--optimizers", nargs="+",
                   default=list(train.DEFAULT_OPTIMIZERS),
                   help="registry names (with the trainer's options), suffixed +eager (without the CUDA graph), "
                        "+standard (standard Newton–Schulz, not the Gram form), +fused_qkv (the QKV weight "
                        "orthogonalized whole, as the peers take it), +qk_clip (the trainer's --qk-clip 100), "
                        "+offload (optimizer state in CPU memory) and/or +bf16 or +int8 (compact state; not for "
                        "adamw), e.g. muon+offload+bf16, or a peer: "
                        "'torch.optim.Muon', 'emerging_optimizers Muon', 'emerging_optimizers Muon, SYRK'")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    p.add_argument("--batch", type=int, default=None, help="override the preset's batch size")

    p = sub.add_parser("kernels", parents=[common], help="Triton SYRK and fused-update kernels by tile config, "
                                                          "vs cuBLAS (CUDA)")
    p.add_argument("--shapes", type=_shape, nargs="+", default=kernels.DEFAULT_SHAPES, metavar="BxMxK",
                   help="X shapes: the SYRK computes X X^T, the update a X + B X with B (b, m, m)")
    p.add_argument("--kernels", nargs="+", choices=kernels.KERNELS, default=list(kernels.KERNELS))
    p.add_argument("--persistent-only", action="store_true", help="sweep only the persistent TMA kernels")

    p = sub.add_parser("profile", parents=[common], help="one GPU's time by kernel (step), idle gaps (train), "
                                                          "host time per launch (launch)")
    p.add_argument("what", choices=["step", "train", "launch"])
    p.add_argument("--model", default="gpt2-small",
                   help=f"step: one of {', '.join(step.MODELS)}; train: one of {', '.join(train.BATCHES)}")
    p.add_argument("--optimizers", nargs="+",
                   help="step: optimizers to profile (default muon, eager and from a CUDA graph; e.g. soap shampoo); "
                        "train: as `matrixopt bench train --optimizers` takes them (default adamw muon muon+eager)")

    p = sub.add_parser("scale", parents=[ranks], help="training throughput of the parallel modes on N GPUs "
                                                       "(torchrun)")
    p.add_argument("--configs", type=_config, nargs="+", default=list(map(scale.parse_config, scale.CONFIGS)),
                   metavar="PARALLEL:OPTIMIZER[:tpN[:MODE]]",
                   help=f"e.g. ddp:adamw or fsdp:muon:tp2:distributed (default {' '.join(scale.CONFIGS)})")
    p.add_argument("--presets", nargs="+", default=list(scale.PRESETS), choices=list(PRESETS),
                   help="model presets, e.g. moe-small or moe-2b for a mixture of experts (--toy: tiny-cpu, or "
                        "moe-tiny for a mixture of experts)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel degree of every configuration: each MoE layer's experts split over groups "
                        "of EP ranks (its parallel mode must take it, as for `matrixopt train --ep`; default 1)")
    p.add_argument("--tokens-per-gpu", type=int, default=4096, help="tokens per GPU per step (default 4096)")
    p.add_argument("--micro-batch", type=int, default=None, metavar="ROWS",
                   help="rows per micro-batch: gradient accumulation over the step's rows (default: one micro-batch)")
    p.add_argument("--iters", type=int, default=10,
                   help="timed steps, and as many profiled with --exposed-comm (default 10)")
    p.add_argument("--phases", action="store_true", help="also print the step's forward/backward/clip/step timeline")
    p.add_argument("--opt", action="append", default=[], metavar="NAME.KEY=VALUE",
                   help="a hyperparameter of one optimizer over the trainer's, e.g. --opt muon.cuda_graph=true "
                        "(repeatable)")
    p.add_argument("--fsdp-gather-once", action="store_true",
                   help="fsdp configurations: gather parameters once per step under accumulation (as the trainer's "
                        "--fsdp-gather-once)")
    p.add_argument("--exposed-comm", action="store_true",
                   help="profile --iters more steps for the share of NCCL time no compute overlaps (CUDA; slow: "
                        "minutes per configuration at 1.3B)")
    p.add_argument("--trace", metavar="DIR", help="write each rank's profiler trace here (CUDA; chrome://tracing; "
                                                  "implies --exposed-comm)")

    p = sub.add_parser("tp", parents=[ranks], help="tensor-parallel Newton–Schulz in each mode (torchrun)")
    p.add_argument("--shapes", type=_matrix, nargs="+", default=None, metavar="MxN",
                   help=f"weights to shard over the ranks (default {' '.join(f'{m}x{n}' for m, n in tp.DEFAULT_SHAPES)}"
                        f"; --toy {' '.join(f'{m}x{n}' for m, n in tp.TOY_SHAPES)})")
    p.add_argument("--reps", type=int, default=None, help="timed calls per mode (default 10; --toy 3)")

    p = sub.add_parser("plot", help=f"a PNG from records of one kind ({', '.join(plots.PLOTTERS)})")
    p.add_argument("records", nargs="+", metavar="JSON", help="records that --json wrote")
    p.add_argument("--out", required=True, metavar="PNG", help="the image to write")


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark, print its table, write its JSON. Returns the exit code; under torchrun (scale, tp)
    ends the process instead, after rank 0 has printed and written (see :func:`matrixopt.distributed.comm.leave`)."""
    if args.bench in DISTRIBUTED:
        return run_ranks(args)
    if args.bench == "plot":
        print(plots.plot_files(args.records, args.out))
        return 0
    device = resolve_device(args.device)
    match args.bench:
        case "ns":
            record = ns.run(args.shapes, args.gram, steps=args.steps, device=device, reps=args.reps or 20)
            text = ns.format_tables(record)
        case "step":
            record = step.run(args.model, device=device, reps=args.reps or 10, only=args.only, ep=args.ep)
            text = step.format_tables(record)
        case "train":
            record = train.run(args.model, tuple(args.optimizers), device=device, steps=args.steps,
                               reps=args.reps or 3, batch=args.batch)
            text = train.format_tables(record)
        case "kernels":
            record = kernels.run(args.shapes, args.kernels, device=device, reps=args.reps or 10,
                                 persistent_only=args.persistent_only)
            text = kernels.format_tables(record)
        case "profile":
            record = profile.run(args.what, model=args.model, optimizers=args.optimizers, device=device,
                                 reps=args.reps or 10)
            text = profile.format_tables(record)
        case _:
            raise NotImplementedError(f"bench {args.bench!r}")
    print(text)
    write_json(args.json, record)
    return 0


def run_ranks(args: argparse.Namespace) -> NoReturn:
    """``scale`` or ``tp`` on this torchrun rank."""
    warmup = args.warmup if args.warmup is not None else 1 if args.toy else 3
    if args.bench == "scale":
        settings = scale.Settings(toy=args.toy, ep=args.ep, tokens_per_gpu=args.tokens_per_gpu,
                                  micro_batch=args.micro_batch, iters=args.iters, warmup=warmup,
                                  exposed_comm=args.exposed_comm, trace=args.trace,
                                  fsdp_gather_once=args.fsdp_gather_once, hparams=per_optimizer(args.opt, "--opt"))
        record = scale.run(args.configs, args.presets, settings, json_path=args.json)
        text, path = scale.format_tables(record, phases=args.phases), None  # run() wrote it after each configuration
    else:
        device = tp.join(args.toy)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        shapes = args.shapes or (tp.TOY_SHAPES if args.toy else tp.DEFAULT_SHAPES)
        record = tp.run(shapes, device=device, dtype=dtype, warmup=warmup, reps=args.reps or (3 if args.toy else 10))
        text, path = tp.format_tables(record), args.json
    if dist.get_rank() == 0:
        print(text)
        write_json(path, record)
    comm.leave(0)  # destroys the group; no interpreter teardown (see its docstring)
