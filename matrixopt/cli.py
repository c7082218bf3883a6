"""``matrixopt train | compare | report | plan | bench``: arguments -> TrainConfig -> train/ or bench/.

Run flags override a JSON config (``--config FILE``, the nested shape of ``TrainConfig.to_dict()``), which
overrides the defaults (nanoGPT's CPU quick-start on TinyShakespeare). Bad input prints one line,
``matrixopt: error: ...``, and exits with status 2; Ctrl-C saves a checkpoint and exits with 130.

    matrixopt compare                                  # AdamW vs Muon, TinyShakespeare, CPU-sized
    matrixopt train --optimizer muon --steps 500 --out runs/muon
    matrixopt compare --optimizers adamw,muon --lr adamw=1e-3,muon=4e-3 --model shakespeare-char --out runs/sc
    matrixopt report runs/compare
    torchrun --nproc-per-node 2 -m matrixopt train --optimizer muon --parallel layerwise --out runs/muon-2
    torchrun --nproc-per-node 4 -m matrixopt train --optimizer muon --parallel fsdp --tp 2 --out runs/muon-tp2
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import sys
from pathlib import Path

# (flag, config path, type, help). Flags default to "not given", so the config file or defaults apply.
RUN_FLAGS = [
    ("--model", "model.preset", str, "preset: tiny-cpu, shakespeare-char, gpt2-small, gpt2-medium, 1.3b, moe-tiny, "
                                     "moe-small, moe-2b, qwen3-30b-a3b"),
    ("--n-layer", "model.n_layer", int, "override the preset's layer count"),
    ("--n-head", "model.n_head", int, "override the preset's head count"),
    ("--n-embd", "model.n_embd", int, "override the preset's width"),
    ("--block-size", "model.block_size", int, "override the preset's context length"),
    ("--experts", "model.n_expert", int, "experts per MoE layer (0: dense MLP)"),
    ("--topk", "model.topk", int, "experts per token of an MoE"),
    ("--expert-ffn", "model.expert_ffn", int, "hidden width of each expert"),
    ("--aux-loss", "model.aux_loss_coef", float, "MoE load-balancing loss coefficient (default 0.01, 0 off)"),
    ("--router-bias-rate", "model.router_bias_rate", float, "MoE auxiliary-loss-free balancing step (default 0: off)"),
    ("--dropout", "model.dropout", float, "dropout probability (default 0)"),
    ("--norm", "model.norm", str, "layernorm (default) or rmsnorm"),
    ("--data", "data.data", str, "'shakespeare' (built in), a text file or folder, or a .bin/.npy/.u16.xz token file"),
    ("--val-data", "data.val_data", str, "separate val file (default: sibling *val* token file, else last 10%%)"),
    ("--tokenizer", "data.tokenizer", str, "for text: char (default), byte or gpt2"),
    ("--tokenizer-file", "data.tokenizer_file", str, "GPT-2 BPE ranks file (gpt2.tiktoken) for offline gpt2"),
    ("--vocab-size", "data.vocab_size", int, "vocab of a token file (default 50257)"),
    ("--steps", "steps", int, "optimizer steps (default 2000)"),
    ("--batch-size", "batch_size", int, "sequences per micro-batch (default 12)"),
    ("--grad-accum", "grad_accum", int, "micro-batches per step (default 1)"),
    ("--weight-decay", "optim.weight_decay", float, "weight decay (default 0.1)"),
    ("--state-dtype", "optim.state_dtype", str, "optimizer state storage: bf16 or int8 (stochastically rounded; "
                                                "default float32)"),
    ("--offload", "optim.offload", str, "cpu: keep the optimizer state in CPU memory, streamed to the GPU for "
                                        "each step (default: on the device)"),
    ("--schedule", "schedule.schedule", str, "cosine (default), wsd or constant"),
    ("--warmup", "schedule.warmup_steps", int, "warmup steps (default 100)"),
    ("--min-lr-ratio", "schedule.min_lr_ratio", float, "final lr / peak lr (default 0.1)"),
    ("--decay-frac", "schedule.decay_frac", float, "share of steps decaying, for wsd (default 0.2)"),
    ("--grad-clip", "grad_clip", float, "clip the gradient norm (default 1.0, 0 disables)"),
    ("--qk-clip", "qk_clip", float, "QK-clip threshold (MuonClip; Kimi K2 uses 100): after each step, shrink the "
                                    "W_q, W_k rows of every head whose max pre-softmax logit exceeded it (default: "
                                    "off)"),
    ("--eval-every", "eval_every", int, "evaluate val loss every N steps (default 100)"),
    ("--eval-iters", "eval_iters", int, "val batches per evaluation (default 50)"),
    ("--log-every", "log_every", int, "metrics line every N steps (default 10)"),
    ("--ckpt-every", "ckpt_every", int, "checkpoint every N steps (default: end and Ctrl-C only)"),
    ("--seed", "seed", int, "seed for init, batches and dropout (default 1337)"),
    ("--device", "device", str, "auto (default), cpu or cuda"),
    ("--dtype", "dtype", str, "auto (bf16 autocast on CUDA), bf16 or fp32"),
    ("--threads", "threads", int, "CPU threads (default: torch's)"),
    ("--parallel", "parallel", str, "none (default), ddp, layerwise or fsdp: data parallel over torchrun's ranks"),
    ("--tp", "tp", int, "tensor-parallel degree (default 1): with --parallel fsdp, shard each block over groups of "
                        "TP ranks (Megatron layout) and FSDP over world/TP; must divide n_head and the world size"),
    ("--tp-mode", "tp_mode", str, "Muon's TP Newton-Schulz: auto (default), duplicated, distributed or blockwise"),
    ("--ep", "ep", int, "expert-parallel degree (default 1): with --parallel ddp, layerwise or fsdp, split each MoE "
                        "layer's experts over groups of EP ranks; must divide the expert count and the world size"),
]
SWITCHES = [
    ("--bias", "model.bias", "biases in Linear layers and norms"),
    ("--rope", "model.rope", "rotary position embeddings"),
    ("--untied", "model.tie_embeddings", "separate lm_head weight (sets tie_embeddings false)"),
    ("--compile", "compile", "torch.compile the model"),
    ("--shared-expert", "model.shared_expert", "MoE: a shared expert every token goes through"),
    ("--fsdp-gather-once", "fsdp_gather_once", "with --parallel fsdp and --grad-accum > 1: gather the parameters "
                                               "once per step and keep them until the last micro-batch (fewer "
                                               "all-gathers, the gathered model in memory)"),
]


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (and a suggestion for a misspelled flag)."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments:"):
            flags = {s for a in self._all_actions() for s in a.option_strings}
            bad = message.split(":", 1)[1].split()[0].split("=")[0]
            close = difflib.get_close_matches(bad, flags, n=1)
            if close:
                message += f" (did you mean {close[0]}?)"
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    def _all_actions(self):
        for action in self._actions:
            yield action
            for sub in getattr(action, "choices", None) or {}:
                if isinstance(action.choices, dict):
                    yield from action.choices[sub]._actions


def add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="JSON file with TrainConfig fields (flags override it)")
    for flag, _, kind, help in RUN_FLAGS:
        p.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=help)
    for flag, _, help in SWITCHES:
        p.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=help)
    p.add_argument("--betas", default=argparse.SUPPRESS, help="AdamW betas as B1,B2 (default 0.9,0.99)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--overwrite", action="store_true", help="replace a different run in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> Parser:
    parser = Parser(prog="matrixopt", description="Train and compare matrix-aware optimizers.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    p = sub.add_parser("train", help="train the reference GPT with one optimizer")
    add_run_flags(p)
    p.add_argument("--optimizer", default=argparse.SUPPRESS, help="optimizer name (default adamw)")
    p.add_argument("--lr", type=float, default=argparse.SUPPRESS, help="peak learning rate (default 1e-3)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="extra optimizer hyperparameter, e.g. --opt momentum=0.9 (repeatable)")
    p.add_argument("--out", default=None, help="output folder (default runs/train-OPTIMIZER)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("compare", help="train with several optimizers and write a report")
    add_run_flags(p)
    p.add_argument("--optimizers", default="adamw,muon", help="comma-separated names (default adamw,muon)")
    p.add_argument("--lr", default=None,
                   help="peak lrs: one value for all, or NAME=LR,... (default: the CPU sweep's, adamw=1e-3,muon=4e-3)")
    p.add_argument("--opt", action="append", default=[], metavar="NAME.KEY=VALUE",
                   help="extra hyperparameter of one optimizer, e.g. --opt muon.momentum=0.9 (repeatable)")
    p.add_argument("--out", default="runs/compare", help="output folder (default runs/compare)")
    p.add_argument("--target", default="final",
                   help="the loss to reach: AdamW's final val loss (default) or its best (for runs that overfit)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("sweep", help="train one optimizer over a learning-rate grid (and weight decays)")
    add_run_flags(p)
    p.add_argument("--optimizer", required=True, help="optimizer name")
    p.add_argument("--lrs", required=True, help="comma-separated peak learning rates, e.g. 1e-3,2e-3,4e-3,8e-3")
    p.add_argument("--weight-decays", default=None, help="comma-separated weight decays (default: --weight-decay)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="extra optimizer hyperparameter (repeatable)")
    p.add_argument("--out", required=True, help="output folder: one run folder per point, sweep.json, sweep.png")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("compare-sweeps", help="compare the best run of each sweep (report, sweep curves)")
    p.add_argument("sweeps", nargs="+", help="the --out folders of `matrixopt sweep`, one per optimizer")
    p.add_argument("--out", required=True, help="output folder for the comparison")
    p.add_argument("--overwrite", action="store_true", help="replace run folders already in --out")
    p.add_argument("--target", default="final",
                   help="the loss to reach: AdamW's final val loss (default) or its best (for runs that overfit)")
    p.set_defaults(func=cmd_compare_sweeps)

    p = sub.add_parser("report", help="rebuild summary.json, plots and report of a compare folder")
    p.add_argument("dir", help="the --out folder of `matrixopt compare`")
    p.add_argument("--target", default="final",
                   help="the loss to reach: AdamW's final val loss (default) or its best (for runs that overfit)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("plan", help="predict a matrix optimizer's step, memory and throughput on a cluster")
    from matrixopt.plan.cli import add_arguments as add_plan_arguments

    add_plan_arguments(p)
    p.set_defaults(func=cmd_plan)

    sub.add_parser("bench", help="benchmarks (see `matrixopt bench --help`)", add_help=False)
    return parser


# ----------------------------------------------------------------------------------------------------------
# arguments -> config


def parse_value(text: str):
    """A command-line value as JSON when it parses (numbers, true/false, lists), else as a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_pairs(items: list[str], flag: str) -> dict[str, object]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} {item!r} is not KEY=VALUE")
        pairs[key.strip()] = parse_value(value.strip())
    return pairs


def per_optimizer(items: list[str], flag: str) -> dict[str, dict[str, object]]:
    """``["muon.momentum=0.9", ...]`` -> ``{"muon": {"momentum": 0.9}}``: hyperparameters of one optimizer each."""
    hparams: dict[str, dict[str, object]] = {}
    for key, value in parse_pairs(items, flag).items():
        name, dot, field = key.partition(".")
        if not dot:
            raise ValueError(f"{flag} {key}=... needs an optimizer prefix, e.g. {flag} muon.{key}=...")
        hparams.setdefault(name, {})[field] = value
    return hparams


def set_path(d: dict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        d = d.setdefault(key, {})
    d[leaf] = value


def run_config(args: argparse.Namespace):
    from matrixopt.train.config import TrainConfig, from_dict

    values: dict = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {path} is not valid JSON ({e})") from None
    given = vars(args)
    for flag, path, _, _ in RUN_FLAGS:
        if (dest := flag[2:].replace("-", "_")) in given:
            set_path(values, path, given[dest])
    for flag, path, _ in SWITCHES:
        if flag[2:].replace("-", "_") in given:  # argparse's dest of --shared-expert is shared_expert
            set_path(values, path, flag != "--untied")
    if "betas" in given:
        try:
            set_path(values, "optim.betas", [float(b) for b in given["betas"].split(",")])
        except ValueError:
            raise ValueError(f"--betas must be two numbers like 0.9,0.99, got {given['betas']!r}") from None
    if "optimizer" in given:
        set_path(values, "optim.name", given["optimizer"])
    if isinstance(given.get("lr"), float):
        set_path(values, "optim.lr", given["lr"])
    return from_dict(TrainConfig, values, where=args.config or "config")


# ----------------------------------------------------------------------------------------------------------
# commands


def cmd_train(args: argparse.Namespace) -> int:
    from matrixopt.train.compare import check_optimizers
    from matrixopt.train.trainer import train

    cfg = run_config(args)
    check_optimizers([cfg.optim.name])
    cfg.optim.hparams |= parse_pairs(args.opt, "--opt")
    out = Path(args.out or f"runs/train-{cfg.optim.name}")
    run = train(cfg, out, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress)
    if is_rank_zero():
        print(f"{run['optimizer']}: val loss {run['final_val_loss']:.4f} after {run['steps']} steps, "
              f"{run['elapsed_s']:.1f} s, {run['tokens_per_s']:.0f} tokens/s -> {out}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from matrixopt.train.compare import compare, run_configs

    base = run_config(args)
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    lrs: dict = {}
    if args.lr is not None:
        try:
            lrs = dict.fromkeys(names, float(args.lr))
        except ValueError:
            lrs = parse_pairs(args.lr.split(","), "--lr")
    for name, lr in lrs.items():
        if not isinstance(lr, (int, float)):
            raise ValueError(f"--lr {name}={lr!r} is not a number")
    configs = run_configs(base, names, {k: float(v) for k, v in lrs.items()}, per_optimizer(args.opt, "--opt"))
    summary = compare(configs, args.out, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress,
                      target=args.target)
    if summary is not None:  # rank 0 (or the only process) writes the report
        print_summary(summary, Path(args.out))
    return 0


def print_summary(summary: dict, out: Path) -> None:
    """The summary table of a compare folder, and where its report is."""
    from matrixopt.train.report import table

    header, rows = table(summary)
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(row))
    print(f"report: {out / 'report.md'}")


def parse_floats(text: str, flag: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated numbers, got {text!r}") from None


def cmd_sweep(args: argparse.Namespace) -> int:
    from matrixopt.train.compare import check_optimizers
    from matrixopt.train.sweep import sweep

    base = run_config(args)
    check_optimizers([args.optimizer])
    base.optim.hparams |= parse_pairs(args.opt, "--opt")
    wds = parse_floats(args.weight_decays, "--weight-decays") if args.weight_decays else None
    s = sweep(base, args.optimizer, parse_floats(args.lrs, "--lrs"), args.out, weight_decays=wds,
              resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress)
    if is_rank_zero():
        for p in s["points"]:
            print(f"{s['optimizer']} lr={p['lr']:g} wd={p['weight_decay']:g}: final val loss {p['final_val_loss']:.4f}")
        edge = " (on the grid's edge: widen the grid)" if s["best_lr_at_edge"] else ""
        print(f"best: lr={s['best']['lr']:g}{edge} -> {Path(args.out) / 'sweep.json'}")
    return 0


def cmd_compare_sweeps(args: argparse.Namespace) -> int:
    from matrixopt.train.sweep import compare_best

    summary = compare_best(args.sweeps, args.out, overwrite=args.overwrite, target=args.target)
    print_summary(summary, Path(args.out))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from matrixopt.train.report import write_report

    write_report(args.dir, target=args.target)
    print(f"report: {Path(args.dir) / 'report.md'}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from matrixopt.plan.cli import run

    return run(args)


def cmd_bench(argv: list[str]) -> int:
    try:
        bench_cli = importlib.import_module("matrixopt.bench.cli")
    except ImportError as e:
        print(f"matrixopt bench: error: the benchmark CLI is unavailable ({e})", file=sys.stderr)
        return 2
    parser = Parser(prog="matrixopt bench", description="Benchmarks that write JSON.")
    bench_cli.add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        return bench_cli.run(args)
    except (ValueError, OSError) as e:  # bad input: one line, as the other commands print it
        print(f"matrixopt bench: error: {e}", file=sys.stderr)
        return 2


def is_rank_zero() -> bool:
    """Whether this process prints: the only one, or rank 0 of a parallel run."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``matrixopt`` console script; returns the exit status."""
    from matrixopt.train.trainer import Interrupted

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return cmd_bench(argv[1:])
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        return args.func(args)
    except Interrupted as e:
        print(f"matrixopt: {e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("matrixopt: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:
        print(f"matrixopt: error: {e}", file=sys.stderr)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_initialized():  # joined by a parallel run (train() leaves the group to its caller)
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
