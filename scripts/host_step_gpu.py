"""Host time of SOAP's and Shampoo's optimizer step: how long ``optimizer.step()`` takes to return (issuing its
kernels) and until the GPU has run them, with the queue drained before each step.

The matrices of half of the trainer's 1.3B preset (:func:`refresh_schedule_gpu.matrices`, what one of two FSDP2
owners steps), refreshes staggered; SOAP with bf16 products, Shampoo with eigenbasis roots and TF32 products (the
FSDP2 benchmark's settings). 14 steps, then the medians of 10. A step whose host time exceeds its device time is
bound by the host: the GPU waits for its kernels. ``--profile`` adds ``cProfile`` of five more steps (by total and
by cumulative time).

    PYTHONPATH=. python scripts/host_step_gpu.py soap shampoo [--profile]
"""

import cProfile
import functools
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from refresh_schedule_gpu import matrices  # noqa: E402

from matrixopt import SOAP, Shampoo  # noqa: E402


def main() -> None:
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or ["soap", "shampoo"]
    ps = matrices()
    grads = [torch.randn_like(p) * 1e-3 for p in ps]
    for name in names:
        if name == "soap":
            opt = SOAP(ps, lr=0.0, stagger_refresh=True, matmul_precision="bf16")
        else:
            opt = Shampoo(ps, lr=0.0, stagger_refresh=True, matmul_precision="tf32", root_method="eigenbasis")
        step = functools.partial(_step, opt, ps, grads)

        for _ in range(14):
            step()
        host, done = [], []
        for _ in range(10):
            torch.cuda.synchronize()
            t = time.perf_counter()
            step()
            host.append(1e3 * (time.perf_counter() - t))
            torch.cuda.synchronize()
            done.append(1e3 * (time.perf_counter() - t))
        print(f"== {name}: host issue {statistics.median(host):.1f} ms, to done {statistics.median(done):.1f} ms",
              flush=True)
        if "--profile" in sys.argv:
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            prof.disable()
            stats = pstats.Stats(prof)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(40)
        del opt, step
        torch.cuda.empty_cache()


def _step(opt: torch.optim.Optimizer, ps: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, g in zip(ps, grads):
        p.grad = g
    opt.step()


if __name__ == "__main__":
    main()
