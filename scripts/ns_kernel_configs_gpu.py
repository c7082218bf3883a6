"""Sweep the tile configs of the Triton SYRK and fused-update kernels on the Newton–Schulz shapes of the GPT
presets, beside cuBLAS, to see how far the autotuner's candidates (matrixopt/kernels/syrk.py, ns_update.py) are
from the best tile shape. One GPU; prints one line per kernel and shape, the four fastest configs first ("/P":
the persistent TMA kernel).

    python scripts/ns_kernel_configs_gpu.py [--kernels syrk update] [--persistent-only] > ns_kernel_configs.txt

SYRK's "real TF/s" counts the ``b m^2 k`` FLOPs of the lower triangle (half of X X^T's); cuBLAS computes the full
``2 b m^2 k``. The update (``a X + B X``) counts ``2 b m^2 k`` for both.
"""

import argparse
import functools
import itertools

import torch
import triton.testing

from matrixopt.kernels import ns_update, syrk

SHAPES = [(24, 1024, 3072), (48, 1024, 4096), (24, 1024, 1024), (48, 2048, 8192), (24, 2048, 6144),
          (12, 768, 2304), (24, 768, 3072), (12, 768, 768), (1, 1024, 2048), (1, 1024, 4096), (1, 4096, 4096)]
SYRK_GRID = [syrk.SyrkConfig(blk, bk, 1, w, st, persistent, pair)
             for (persistent, pair), blk, bk, w, st in itertools.product(((False, False), (True, False), (True, True)),
                                                                          (128, 64), (64, 128), (4, 8), (3, 4, 5))
             if (blk == 128 or w == 4) and not (pair and (blk == 64 or w == 4))]
UPDATE_GRID = [ns_update.GemmConfig(bm, bn, bk, 8, w, st, persistent) for persistent in (False, True)
               for bm, bn, bk, w, st in
               [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (128, 128, 64, 4, 4),
                (128, 256, 64, 8, 4), (128, 128, 128, 8, 3), (256, 128, 64, 8, 3), (128, 64, 64, 4, 4)]]


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


_ERRORS: dict[str, int] = {}


def sweep(launch, grid) -> list[tuple[float, object]]:
    """(ms, config) for every config that compiles and fits in shared memory, fastest first. Failures are
    counted by message and printed at the end (most are out of resources: the config does not fit this GPU)."""
    out = []
    for cfg in grid:
        try:
            out.append((ms(functools.partial(launch, cfg)), cfg))
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            _ERRORS[msg] = _ERRORS.get(msg, 0) + 1
    return sorted(out, key=lambda r: r[0])


def best_lines(best, flops: float, fmt) -> str:
    """The four fastest configs, then the fastest persistent one if none of those is: "us (TF/s) config"."""
    shown = best[:4] + [r for r in best if r[1].persistent][:1] * (not any(c.persistent for _, c in best[:4]))
    return "; ".join(f"{t * 1e3:.0f} us ({flops / t / 1e9:.0f} TF/s) {fmt(c)}{'/P' * c.persistent}" for t, c in shown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", nargs="+", choices=["syrk", "update"], default=["syrk", "update"])
    parser.add_argument("--persistent-only", action="store_true", help="sweep only the persistent TMA kernels")
    args = parser.parse_args()
    syrk_grid = [c for c in SYRK_GRID if c.persistent or not args.persistent_only] * ("syrk" in args.kernels)
    update_grid = [c for c in UPDATE_GRID if c.persistent or not args.persistent_only] * ("update" in args.kernels)
    torch.manual_seed(0)
    for b, m, k in SHAPES:
        X = torch.randn(b, m, k, device="cuda").bfloat16() / k**0.5
        out = torch.empty(b, m, m, device="cuda", dtype=torch.bfloat16)
        t_cublas = ms(lambda X=X: torch.bmm(X, X.mT))
        best = sweep(lambda cfg, X=X, out=out: syrk._launch(X, X, None, out, 1.0, 0.0, cfg), syrk_grid)
        if best:
            print(f"SYRK {b}x{m}x{k}: cuBLAS bmm {t_cublas * 1e3:.0f} us ({2 * b * m * m * k / t_cublas / 1e9:.0f} "
                  "TF/s) | best (real TF/s): "
                  + best_lines(best, b * m * m * k,
                               lambda c: f"{c.block}{'x2' * c.pair}/{c.block_k}/w{c.num_warps}/s{c.num_stages}"),
                  flush=True)
        B = torch.randn(b, m, m, device="cuda").bfloat16() / m
        upd = torch.empty_like(X)
        t_cublas = ms(lambda X=X, B=B: torch.baddbmm(X, B, X, beta=2.0))
        best = sweep(lambda cfg, X=X, B=B, upd=upd: ns_update._launch(B, X, upd, 2.0, cfg), update_grid)
        if best:
            print(f"UPD  {b}x{m}x{k}: cuBLAS baddbmm {t_cublas * 1e3:.0f} us ({2 * b * m * m * k / t_cublas / 1e9:.0f}"
                  " TF/s) | best: "
                  + best_lines(best, 2 * b * m * m * k,
                               lambda c: f"{c.block_m}x{c.block_n}x{c.block_k}/w{c.num_warps}/s{c.num_stages}"),
                  flush=True)
    for msg, count in _ERRORS.items():
        print(f"{count} configs failed: {msg}")


if __name__ == "__main__":
    main()
