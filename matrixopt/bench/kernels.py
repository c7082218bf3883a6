"""``matrixopt bench kernels``: how far from the best tile config are the Triton SYRK and fused-update kernels,
as tuned, and how do they compare with cuBLAS?

On the Newton–Schulz shapes of the GPT presets (bf16, one CUDA GPU), every config of a grid of tile shapes is
timed through the kernels' ``config=`` override: the pointer kernels, the persistent TMA kernels (SYRK alone and in
pairs) and the SYRK's wide TMA kernel. Beside them: the tuned call (the autotuner's pick among
``get_syrk_configs`` / ``get_ns_update_configs``, which the JSON marks ``candidate``) and cuBLAS. A config that
does not compile or fit this GPU's shared memory is counted by its error message.

    SYRK    X X^T of X (b, m, k), lower-triangle tiles only:  "real" FLOPs b m^2 k; cuBLAS bmm does 2 b m^2 k
    update  a X + B X of B (b, m, m), X (b, m, k):              2 b m^2 k, cuBLAS baddbmm the same
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from matrixopt.bench.common import environment, kernel_choices, table
from matrixopt.device import time_ms
from matrixopt.kernels.ns_step import triton_available

# (batch, m, k): the QKV, MLP and square stacks of GPT-2 small, medium and a 1.3B GPT, and single matrices.
DEFAULT_SHAPES = [(24, 1024, 3072), (48, 1024, 4096), (24, 1024, 1024), (48, 2048, 8192), (24, 2048, 6144),
                  (12, 768, 2304), (24, 768, 3072), (12, 768, 768), (1, 1024, 2048), (1, 1024, 4096),
                  (1, 4096, 4096)]
KERNELS = ("syrk", "update")
SHOWN = 4  # fastest configs per row of the printed table


def syrk_grid() -> list[Any]:
    """Square tiles 128 (8 warps) and 64 (4 warps), K blocks 64 and 128, 3 to 5 stages: pointer, persistent and
    persistent pair kernels (pairs at 128, 8 warps); the wide kernel's 64 x 128 tiles."""
    from matrixopt.kernels.syrk import SyrkConfig

    grid = [SyrkConfig(blk, bk, 1, w, st, persistent, pair)
            for (persistent, pair), blk, bk, w, st in itertools.product(
                ((False, False), (True, False), (True, True)), (128, 64), (64, 128), (4, 8), (3, 4, 5))
            if (blk == 128 or w == 4) and not (pair and (blk == 64 or w == 4))]
    return grid + [SyrkConfig(64, bk, 1, 4, st, wide=True) for bk in (64, 128) for st in (3, 4)]


def update_grid() -> list[Any]:
    """GEMM tiles of 64 to 256 by 64 to 256, as the pointer and the persistent TMA kernel."""
    from matrixopt.kernels.ns_update import GemmConfig

    tiles = [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (128, 128, 64, 4, 4),
             (128, 256, 64, 8, 4), (128, 128, 128, 8, 3), (256, 128, 64, 8, 3), (128, 64, 64, 4, 4)]
    return [GemmConfig(bm, bn, bk, 8, w, st, persistent) for persistent in (False, True)
            for bm, bn, bk, w, st in tiles]


def config_name(cfg: Any) -> str:
    """``128/64/w8/s4`` (SYRK tile/K block/warps/stages; ``128x2``: a pair, ``64x128``: wide) or ``128x256x64/w8/s3``
    (update tile m x n x k); ``/P`` marks a persistent TMA kernel."""
    if hasattr(cfg, "block"):
        tile = f"{cfg.block}{'x2' * cfg.pair}{'x128' * cfg.wide}/{cfg.block_k}"
    else:
        tile = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}"
    return f"{tile}/w{cfg.num_warps}/s{cfg.num_stages}{'/P' * cfg.persistent}"


def sweep(launch: Callable[[Any], object], grid: Sequence[Any], candidates: Sequence[Any], flops: float,
          device: torch.device, reps: int) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Every config of ``grid`` that runs here, fastest first (name, config, ms quantiles, TFLOP/s, whether the
    autotuner considers it), and those that failed with their error (most: the config does not fit this GPU's
    shared memory)."""
    rows, failed = [], []
    for cfg in grid:
        try:
            t = time_ms(lambda cfg=cfg: launch(cfg), device, reps=reps, inner=10, warmup=2)
        except Exception as e:  # noqa: BLE001  (Triton raises its own types for resources and compile errors)
            failed.append({"config": config_name(cfg), "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                           if str(e) else type(e).__name__})
            continue
        rows.append({"config": config_name(cfg), "params": dataclasses.asdict(cfg), "ms": t,
                     "tflops": flops / t["median"] / 1e9, "candidate": cfg in candidates})
    return sorted(rows, key=lambda r: r["ms"]["median"]), failed


def cases(X: torch.Tensor, B: torch.Tensor) -> dict[str, tuple]:
    """kernel -> (launch with a config, the tuned call, cuBLAS, the autotuner's candidates, FLOPs) on X
    ``(b, m, k)`` and B ``(b, m, m)``."""
    from matrixopt.kernels.ns_update import get_ns_update_configs, ns_update
    from matrixopt.kernels.syrk import get_syrk_configs, num_sms, syrk, tma_compatible

    (b, m, k), sms, tma = X.shape, num_sms(X.device), tma_compatible(X)
    return {
        "syrk": (lambda cfg: syrk(X, config=cfg), lambda: syrk(X), lambda: torch.bmm(X, X.mT),
                 get_syrk_configs(b, m, k, sms, tma), b * m * m * k),
        "update": (lambda cfg: ns_update(B, X, 2.0, config=cfg), lambda: ns_update(B, X, 2.0),
                   lambda: torch.baddbmm(X, B, X, beta=2.0), get_ns_update_configs(b, m, k, sms, tma),
                   2 * b * m * m * k),
    }


def run(shapes: Sequence[tuple[int, int, int]] = DEFAULT_SHAPES, kernels: Sequence[str] = KERNELS, *,
        device: torch.device, reps: int = 10, persistent_only: bool = False) -> dict[str, Any]:
    """Sweep each kernel's grid on each shape; returns the JSON record."""
    if device.type != "cuda" or not triton_available():
        raise ValueError(f"matrixopt bench kernels times compiled Triton kernels on a CUDA GPU; device {device} "
                         f"(Triton {'importable' if triton_available() else 'missing'}) cannot run them. Run it on a "
                         f"machine with a GPU (pip install triton), or use `matrixopt bench ns --device cpu`")
    grids = {"syrk": syrk_grid(), "update": update_grid()}
    if persistent_only:
        grids = {kernel: [c for c in grid if c.persistent] for kernel, grid in grids.items()}
    torch.manual_seed(0)
    rows = []
    for b, m, k in shapes:
        X = (torch.randn(b, m, k, device=device) / k**0.5).bfloat16()
        B = (torch.randn(b, m, m, device=device) / m).bfloat16()
        for kernel, (launch, tuned, cublas, candidates, flops) in cases(X, B).items():
            if kernel not in kernels:
                continue
            configs, failed = sweep(launch, grids[kernel], candidates, flops, device, reps)
            t_tuned = time_ms(tuned, device, reps=reps, inner=10, warmup=2)
            t_cublas = time_ms(cublas, device, reps=reps, inner=10, warmup=2)
            rows.append({"kernel": kernel, "shape": [b, m, k], "flops": flops,
                         "cublas": {"ms": t_cublas, "tflops": 2 * b * m * m * k / t_cublas["median"] / 1e9},
                         "tuned": {"ms": t_tuned, "tflops": flops / t_tuned["median"] / 1e9},
                         "configs": configs, "failed": failed})
    return {"benchmark": "kernels", "dtype": "bfloat16", "env": environment(device), "kernels": list(kernels),
            "results": rows, **kernel_choices()}


def format_tables(record: dict[str, Any]) -> str:
    """One row per kernel and shape: cuBLAS, the tuned call, and the fastest configs (microseconds, TFLOP/s)."""

    def us(t: dict[str, Any]) -> str:
        return f"{t['ms']['median'] * 1e3:.0f} us ({t['tflops']:.0f})"

    rows = []
    for r in record["results"]:
        best = r["configs"][:SHOWN]
        rows.append({"kernel": r["kernel"], "shape": "x".join(map(str, r["shape"])), "cuBLAS": us(r["cublas"]),
                     "tuned": us(r["tuned"]),
                     "fastest configs": "; ".join(f"{us(c)} {c['config']}{'*' * c['candidate']}" for c in best),
                     "tuned / best": r["tuned"]["ms"]["median"] / best[0]["ms"]["median"] if best else None})
    errors = collections.Counter(re.sub(r"\d+", "N", f["error"]) for r in record["results"] for f in r["failed"])
    failed = "".join(f"\n{n} configs failed: {msg}" for msg, n in errors.items())
    return ("Triton kernels by tile config, bf16, median us (TFLOP/s; SYRK: its real FLOPs, cuBLAS: the full "
            "product's); * marks the autotuner's candidates\n"
            + table(rows, ["kernel", "shape", "cuBLAS", "tuned", "fastest configs", "tuned / best"]) + failed)
