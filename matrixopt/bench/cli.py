"""``matrixopt bench ns|step|train``: arguments -> one benchmark -> a printed table and a JSON file.

``matrixopt.cli`` delegates to :func:`add_arguments` and :func:`run`; ``python -m matrixopt.bench`` does the same.
"""

from __future__ import annotations

import argparse

from matrixopt.bench import ns, step, train
from matrixopt.bench.common import resolve_device, write_json


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``ns``, ``step`` and ``train`` subcommands to ``parser``."""
    sub = parser.add_subparsers(dest="bench", required=True, metavar="{ns,step,train}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", metavar="PATH", help="write the full record here (default: print only)")
    common.add_argument("--device", default="auto", help="cuda, cpu, cuda:1, or auto (default: CUDA if present)")
    common.add_argument("--reps", type=int, default=None, help="timed repeats (medians are reported)")

    p = sub.add_parser("ns", parents=[common], help="Newton–Schulz and Gram kernels vs cuBLAS and torch.optim.Muon")
    p.add_argument("--shapes", type=_shape, nargs="+", default=ns.DEFAULT_SHAPES, metavar="BxMxN",
                   help="stacks to orthogonalize (m <= n)")
    p.add_argument("--gram", type=_shape, nargs="*", default=ns.DEFAULT_GRAM, metavar="BxMxK",
                   help="Gram X X^T shapes (none to skip)")
    p.add_argument("--steps", type=int, default=5, help="Newton–Schulz iterations (default 5)")

    p = sub.add_parser("step", parents=[common], help="optimizer-step time for a model's parameter set")
    p.add_argument("--model", default="gpt2-small", choices=list(step.MODELS))
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help="time only these optimizers")

    p = sub.add_parser("train", parents=[common], help="end-to-end training tokens/s, ratio to AdamW")
    p.add_argument("--model", default="gpt2-small", choices=list(train.BATCHES))
    p.add_argument("--optimizers", nargs="+",
                   default=list(train.DEFAULT_OPTIMIZERS),
                   help="registry names (with the trainer's options), suffixed +eager (without the CUDA graph), "
                        "+standard (standard Newton–Schulz, not the Gram form) and/or +fused_qkv (the QKV weight "
                        "orthogonalized whole, as the issue's shapes and the peers take it), or a peer: "
                        "'torch.optim.Muon', 'emerging_optimizers Muon', 'emerging_optimizers Muon, SYRK'")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    p.add_argument("--batch", type=int, default=None, help="override the preset's batch size")


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark, print its table, write its JSON. Returns the exit code."""
    device = resolve_device(args.device)
    if args.bench == "ns":
        record = ns.run(args.shapes, args.gram, steps=args.steps, device=device, reps=args.reps or 20)
        text = ns.format_tables(record)
    elif args.bench == "step":
        record = step.run(args.model, device=device, reps=args.reps or 10, only=args.only)
        text = step.format_tables(record)
    else:
        record = train.run(args.model, tuple(args.optimizers), device=device, steps=args.steps,
                           reps=args.reps or 3, batch=args.batch)
        text = train.format_tables(record)
    print(text)
    write_json(args.json, record)
    return 0
