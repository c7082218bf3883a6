"""``matrixopt plan``: arguments -> :class:`~matrixopt.plan.planner.PlanConfig` -> table, JSON and plot; or
``--calibrate`` (measure this machine's profile) or ``--validate`` (predicted against the committed measurements).

    matrixopt plan --model 1.3b --gpus 64 --tokens-per-gpu 4096
    matrixopt plan --model qwen3-30b-a3b --gpus 8 --recompute --out runs/plan/qwen3     # writes .json and .png
    matrixopt plan --model qwen3-30b-a3b --gpus 8 --recompute --tokens-per-gpu 131072 --grad-accum 16
    matrixopt plan --model 1.3b --gpus 16 --tokens-per-gpu 16384 --grad-accum 4 --fsdp-gather-once
    matrixopt plan --model shapes.json --gpus 512 --tp 4 --network ib-200g --profile profile.json
    matrixopt plan --calibrate --out profile.json
    torchrun --nproc-per-node 8 -m matrixopt plan --calibrate --out profile.json     # the NVLink all-reduce too
    matrixopt plan --validate
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="1.3b, gpt2-small, gpt2-medium, qwen3-30b-a3b, kimi-k2-like, or a shapes .json "
                                   "(Architecture fields, or {\"matrices\": [{\"name\", \"shape\", \"count\", "
                                   "\"expert\"}], ...}; see matrixopt/plan/models.py)")
    p.add_argument("--gpus", type=int, help="GPUs in the job")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the profile's, 8)")
    p.add_argument("--tokens-per-gpu", type=int, default=4096,
                   help="tokens per GPU per optimizer step, all micro-batches (default 4096)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: try 1, 2, 4, 8)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default: try the divisors)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: gpus / tp)")
    p.add_argument("--optimizer", default="muon", help="muon (default), shampoo or soap; compared with AdamW")
    p.add_argument("--profile", default="h100", help="device profile: h100 (default), h200, or a JSON file")
    p.add_argument("--network", default=None, help="inter-node link: ib-400g, ib-200g, ib-800g, roce-400g, "
                                                   "eth-100g (default: the profile's)")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilization of forward+backward (default 0.4)")
    p.add_argument("--recompute", action="store_true", help="activation checkpointing of every layer")
    p.add_argument("--fsdp-gather-once", action="store_true",
                   help="FSDP layouts with --grad-accum > 1 gather the parameters once per step and keep them until "
                        "the last micro-batch (the trainer's --fsdp-gather-once)")
    p.add_argument("--precondition-frequency", type=int, default=10, help="Shampoo/SOAP root refresh (default 10)")
    p.add_argument("--root-method", default="newton", help="Shampoo's roots: newton (default) or eigenbasis")
    p.add_argument("--matmul-precision", default="fp32",
                   help="Shampoo's and SOAP's products: fp32 (default), tf32 or bf16")
    p.add_argument("--out", default=None, help="plan: write OUT.json and OUT.png; --calibrate: the profile file; "
                                               "--validate: a JSON of the rows")
    p.add_argument("--no-curve", action="store_true", help="skip the ratio curve over 8..4096 GPUs")
    p.add_argument("--calibrate", action="store_true", help="measure this machine and write a profile to --out")
    p.add_argument("--validate", action="store_true", help="predict every committed measurement and print errors")


def load_profile(spec: str, network: str | None):
    from matrixopt.distributed.cost import NETWORKS, DeviceProfile, shipped_profile

    # a shipped profile's name, or a file: anything named .json, holding a path separator or lying on disk
    is_file = spec.endswith(".json") or os.sep in spec or os.path.isfile(spec)
    profile = DeviceProfile.load(spec) if is_file else shipped_profile(spec)
    if network is not None:
        if network not in NETWORKS:
            raise ValueError(f"--network {network!r} is not one of {', '.join(NETWORKS)}")
        profile = profile.with_network(NETWORKS[network])
    return profile


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        return calibrate(args)
    if args.validate:
        return validate(args)
    from matrixopt.plan import planner
    from matrixopt.plan.models import load_model

    if args.model is None or args.gpus is None:
        raise ValueError("matrixopt plan needs --model and --gpus (or --calibrate, or --validate)")
    profile = load_profile(args.profile, args.network)
    cfg = planner.PlanConfig(model=load_model(args.model), gpus=args.gpus,
                             gpus_per_node=args.gpus_per_node or profile.gpus_per_node,
                             tokens_per_gpu=args.tokens_per_gpu, grad_accum=args.grad_accum, tp=args.tp, ep=args.ep,
                             dp=args.dp,
                             optimizer=args.optimizer, mfu=args.mfu, recompute=args.recompute,
                             fsdp_gather_once=args.fsdp_gather_once,
                             precondition_frequency=args.precondition_frequency, root_method=args.root_method,
                             matmul_precision=args.matmul_precision)
    result = planner.plan(cfg, profile)
    print(planner.format_plan(result))
    if args.out:
        curve = [] if args.no_curve else planner.ratio_curve(cfg, profile)
        out = Path(args.out)
        stem = out.with_suffix("") if out.suffix in (".json", ".png") else out  # "1.3b_64gpu" keeps its dot
        stem.parent.mkdir(parents=True, exist_ok=True)
        record, plot = stem.parent / f"{stem.name}.json", stem.parent / f"{stem.name}.png"
        record.write_text(json.dumps(planner.to_dict(result, curve), indent=1) + "\n")
        print(f"wrote {record}")
        if curve and planner.plot_curve(curve, f"{cfg.model.name}, {cfg.tokens_per_gpu} tokens/GPU, "
                                               f"{profile.name}", str(plot)):
            print(f"wrote {plot}")
    return 0


def calibrate(args: argparse.Namespace) -> int:
    """Measure this machine; under torchrun (``WORLD_SIZE`` > 1) join the ranks to measure the link too, rank 0
    writing the profile."""
    import os

    import torch
    import torch.distributed as dist

    from matrixopt.distributed.calibrate import measure

    if not args.out:
        raise ValueError("matrixopt plan --calibrate needs --out FILE.json for the profile")
    cuda = torch.cuda.is_available()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    profile = measure(device, base=load_profile(args.profile, args.network))
    if dist.is_initialized() and dist.get_rank() != 0:
        return 0
    profile.save(args.out)
    best = max(r for _, r in profile.gemm)
    print(f"{profile.device}: matmul up to {best / 1e12:.3g} TFLOP/s, elementwise up to "
          f"{max(r for _, r in profile.elementwise) / 1e9:.3g} GB/s -> {args.out}")
    return 0


def validate(args: argparse.Namespace) -> int:
    from matrixopt.plan.validate import format_validation
    from matrixopt.plan.validate import validate as run_validation

    sections = run_validation()
    print(format_validation(sections))
    if args.out:
        Path(args.out).write_text(json.dumps(sections, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0
