"""``matrixopt bench ns``: how fast is one Newton–Schulz orthogonalization, and how close to the exact polar factor?

For each ``(batch, m, n)`` stack of fp32 matrices (m <= n), ``steps`` iterations of the default schedule
(``modded_nanogpt``, :mod:`matrixopt.linalg.ortho`) through
:func:`matrixopt.newton_schulz`: the default (the Gram form for wide shapes, in float16) with the dispatcher on
``auto``, forced to cuBLAS (``torch``) and forced to Triton, and the standard form (``method="standard"``), against
torch.optim.Muon's iteration (``torch.optim._muon._zeropower_via_newtonschulz``, one matrix at a time, as
the optimizer runs it). Then the Gram matrix ``X X^T`` alone: cuBLAS ``bmm`` against the Triton SYRK, and against
``emerging_optimizers``' Triton ``tsyrk_ex`` where that is installed (:mod:`matrixopt.bench.peers`).

FLOPs (dense count, the work a GEMM library does; the SYRK does about half of the first two terms), from
:mod:`matrixopt.linalg.ortho`:
    per Newton–Schulz step on an (m, n) matrix (``ns_step_flops``): 2 m^2 n (X X^T) + 2 m^3 (A A) + 2 m^2 n (B X)
    = 4 m^2 n + 2 m^3, times ``steps`` (``newton_schulz_flops(..., method="standard")``)
    Gram X X^T of an (m, k) matrix (``gram_flops``): 2 m^2 k
``limit`` is the time those FLOPs take at ``PEAK_BF16_TFLOPS``; ``of_limit`` = limit / measured. The limit counts
the standard form's FLOPs, so the Gram form, with fewer, can exceed 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from matrixopt.bench.common import PEAK_BF16_TFLOPS, environment, kernel_choices, table
from matrixopt.bench.peers import peer_gram
from matrixopt.device import resolve_device, sync, time_ms
from matrixopt.kernels.ns_step import ns_backend, triton_available
from matrixopt.linalg.ortho import DEFAULT_SCHEDULE, QUINTIC, gram_flops, newton_schulz, newton_schulz_flops, polar

# Muon's shapes: GPT-2 small (12 x 768: QKV, attn proj, MLP in/out), medium's MLP, 1.3B's MLP, and squares.
DEFAULT_SHAPES = [(1, 1024, 1024), (1, 1024, 4096), (1, 4096, 4096), (12, 768, 2304), (12, 768, 768),
                  (24, 768, 3072), (48, 1024, 4096), (8, 2048, 8192)]
DEFAULT_GRAM = [(1, 1024, 1024), (1, 1024, 2048), (1, 1024, 4096), (1, 1024, 8192), (1, 4096, 4096),
                (24, 768, 3072)]
TORCH_MUON_COEFFICIENTS = QUINTIC[0]  # torch.optim.Muon's default ns_coefficients


def torch_muon_ns(G: Tensor, steps: int) -> Tensor:
    """torch.optim.Muon's orthogonalization, one matrix at a time (``(b, m, n)`` -> ``(b, m, n)``)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    return torch.stack([_zeropower_via_newtonschulz(g, TORCH_MUON_COEFFICIENTS, steps, 1e-7) for g in G])


def _rel_err(out: Tensor, ref: Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def _methods(G: Tensor, steps: int) -> dict[str, Callable[[], Tensor]]:
    """Ours (the default: Gram form for wide shapes, each product dispatched; then the standard form; then each
    backend forced) and torch.optim.Muon's."""

    def ours(backend: str) -> Callable[[], Tensor]:
        def fn() -> Tensor:
            with ns_backend(backend):
                return newton_schulz(G, steps)
        return fn

    def standard() -> Tensor:
        return newton_schulz(G, steps, method="standard")

    methods = {"matrixopt": ours("auto"), "matrixopt standard form": standard, "matrixopt cuBLAS only": ours("torch")}
    if G.is_cuda and triton_available():
        methods["matrixopt Triton only"] = ours("triton")
    methods["torch.optim.Muon"] = lambda: torch_muon_ns(G, steps)
    return methods


def bench_ns(shapes: Sequence[tuple[int, int, int]], steps: int, device: torch.device, reps: int) -> list[dict]:
    rows = []
    for batch, m, n in shapes:
        G = torch.randn(batch, m, n, device=device)
        P = polar(G[:1])  # (1, m, n) exact polar factor of the first matrix, float64 SVD
        flops = newton_schulz_flops(m, n, steps, "standard", batch)
        limit_ms = flops / (PEAK_BF16_TFLOPS * 1e12) * 1e3
        row: dict[str, Any] = {"batch": batch, "m": m, "n": n, "steps": steps, "gflop": flops / 1e9,
                               "limit_ms": limit_ms, "methods": {}}
        for name, fn in _methods(G, steps).items():
            t0 = time.perf_counter()
            out = fn()  # first call: compiles, tunes and measures the dispatch for this shape
            sync(device)
            first_s = time.perf_counter() - t0
            t = time_ms(fn, device, reps=reps)
            row["methods"][name] = {"ms": t, "first_call_s": first_s, "tflops": flops / t["median"] / 1e9,
                                    "of_limit": limit_ms / t["median"], "err_vs_polar": _rel_err(out[:1], P)}
        base = row["methods"]["torch.optim.Muon"]["ms"]["median"]
        row["speedup_vs_torch_muon"] = base / row["methods"]["matrixopt"]["ms"]["median"]
        row["speedup_vs_cublas"] = (row["methods"]["matrixopt cuBLAS only"]["ms"]["median"]
                                    / row["methods"]["matrixopt"]["ms"]["median"])
        rows.append(row)
    return rows


def bench_gram(shapes: Sequence[tuple[int, int, int]], device: torch.device, reps: int) -> list[dict]:
    rows = []
    use_triton = device.type == "cuda" and triton_available()
    peer = peer_gram(device)
    for batch, m, k in shapes:
        X = torch.randn(batch, m, k, device=device).to(torch.bfloat16)
        ref = torch.bmm(X.double(), X.double().mT) if device.type == "cpu" else None
        flops = gram_flops(m, k, batch)
        row: dict[str, Any] = {"batch": batch, "m": m, "k": k, "gflop": flops / 1e9,
                               "limit_ms": flops / (PEAK_BF16_TFLOPS * 1e12) * 1e3}
        t = time_ms(lambda X=X: torch.bmm(X, X.mT), device, reps=reps)
        tg = time_ms(lambda X=X: torch.bmm(X, X.mT), device, reps=reps, inner=10, graph=True)
        row["cublas"] = {"ms": t, "tflops": flops / t["median"] / 1e9, "graph_ms": tg,
                         "graph_tflops": flops / tg["median"] / 1e9}
        if use_triton:
            from matrixopt.kernels.syrk import syrk

            t0 = time.perf_counter()
            out = syrk(X)
            sync(device)
            first_s = time.perf_counter() - t0
            t = time_ms(lambda X=X: syrk(X), device, reps=reps)
            tg = time_ms(lambda X=X: syrk(X), device, reps=reps, inner=10, graph=True)
            exact = torch.bmm(X.double(), X.double().mT) if ref is None else ref
            row["triton_syrk"] = {"ms": t, "tflops": flops / t["median"] / 1e9, "first_call_s": first_s,
                                  "graph_ms": tg, "graph_tflops": flops / tg["median"] / 1e9,
                                  "err_vs_float64": _rel_err(out, exact)}
            row["speedup_vs_cublas"] = row["cublas"]["ms"]["median"] / t["median"]
            row["graph_speedup_vs_cublas"] = row["cublas"]["graph_ms"]["median"] / tg["median"]
        if callable(peer):
            t0 = time.perf_counter()
            out = peer(X)  # first call: its autotuner times every config for this shape
            sync(device)
            first_s = time.perf_counter() - t0
            t = time_ms(lambda X=X: peer(X), device, reps=reps)
            tg = time_ms(lambda X=X: peer(X), device, reps=reps, inner=10, graph=True)
            row["emerging_tsyrk"] = {"ms": t, "first_call_s": first_s, "graph_ms": tg,
                                     "graph_tflops": flops / tg["median"] / 1e9,
                                     "err_vs_float64": _rel_err(out, torch.bmm(X.double(), X.double().mT))}
        else:
            row["emerging_tsyrk"] = {"status": peer}
        rows.append(row)
    return rows


def run(shapes: Sequence[tuple[int, int, int]] = DEFAULT_SHAPES,
        gram: Sequence[tuple[int, int, int]] = DEFAULT_GRAM, *, steps: int = 5,
        device: torch.device | None = None, reps: int = 20) -> dict[str, Any]:
    """Run both benchmarks; returns the JSON record."""
    device = device or resolve_device("auto")
    ns_rows = bench_ns(shapes, steps, device, reps)
    gram_rows = bench_gram(gram, device, reps)
    return {"benchmark": "ns", "env": environment(device), "coefficients": DEFAULT_SCHEDULE, "reps": reps,
            "ns": ns_rows, "gram": gram_rows, **kernel_choices()}


def format_tables(record: dict[str, Any]) -> str:
    ns_rows = []
    for r in record["ns"]:
        for name, v in r["methods"].items():
            ns_rows.append({"shape": f"{r['batch']}x{r['m']}x{r['n']}", "method": name, "ms": v["ms"]["median"],
                            "TFLOP/s": v["tflops"], "of limit": v["of_limit"], "err vs polar": v["err_vs_polar"]})
    gram_rows = [{"shape": f"{r['batch']}x{r['m']}x{r['k']}", "cuBLAS ms": r["cublas"]["ms"]["median"],
                  "SYRK ms": r.get("triton_syrk", {}).get("ms", {}).get("median"),
                  "speedup": r.get("speedup_vs_cublas"),
                  "graphed cuBLAS ms": r["cublas"].get("graph_ms", {}).get("median"),
                  "graphed SYRK ms": r.get("triton_syrk", {}).get("graph_ms", {}).get("median"),
                  "graphed speedup": r.get("graph_speedup_vs_cublas"),
                  "SYRK eff. TFLOP/s": r.get("triton_syrk", {}).get("graph_tflops"),
                  "graphed emerging tsyrk ms": r.get("emerging_tsyrk", {}).get("graph_ms", {}).get("median")}
                 for r in record["gram"]]
    steps = record["ns"][0]["steps"] if record["ns"] else 0
    return (f"Newton–Schulz, {steps} {record['coefficients']} steps (medians)\n"
            + table(ns_rows, ["shape", "method", "ms", "TFLOP/s", "of limit", "err vs polar"])
            + "\n\nGram X X^T, bf16 (medians, eager and replayed from a CUDA graph of 10 calls; effective TFLOP/s"
              " on the dense 2 m^2 k count)\n"
            + table(gram_rows, ["shape", "cuBLAS ms", "SYRK ms", "speedup", "graphed cuBLAS ms", "graphed SYRK ms",
                                "graphed speedup", "SYRK eff. TFLOP/s", "graphed emerging tsyrk ms"]))
