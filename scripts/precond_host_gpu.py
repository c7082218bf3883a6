"""SOAP's and Shampoo's eager step on 1, 3, 6 and 12 layers of the 1.3B's matrices (QKV split in three) on one
GPU: the device's time per step (CUDA events, after 0.3 s of steps), the host's time to issue one (the queue
drained before it) and the kernels launched per step (a trace of 10 steps). bf16 products for SOAP, TF32 and
eigenbasis roots for Shampoo, refreshes staggered, the deferred check; 14 steps first. Where the host's time
reaches the device's, an owner holding that share of the matrices is bound by its host.

    PYTHONPATH=. python scripts/precond_host_gpu.py --out docs/results/plan/host_h200/precond_host_h200.json
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from refresh_schedule_gpu import matrices  # noqa: E402

from matrixopt import SOAP, Shampoo  # noqa: E402
from matrixopt.bench.common import environment  # noqa: E402
from matrixopt.bench.profile import traced  # noqa: E402
from matrixopt.device import host_ms, time_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for layers in (1, 3, 6, 12):
        ps = matrices(layers)
        grads = [torch.randn_like(p) * 1e-3 for p in ps]
        for which in ("soap", "shampoo"):
            opt = (SOAP(ps, lr=1e-4, stagger_refresh=True, matmul_precision="bf16", deferred_nonfinite=True)
                   if which == "soap" else
                   Shampoo(ps, lr=1e-4, stagger_refresh=True, matmul_precision="tf32", root_method="eigenbasis",
                           deferred_nonfinite=True))

            def step(opt: torch.optim.Optimizer = opt, ps: list = ps, grads: list = grads) -> None:
                for p, g in zip(ps, grads):
                    p.grad = g
                opt.step()

            for _ in range(14):
                step()
            device = time_ms(step, dev, reps=20, warmup=0, heat_s=0.3)["median"]
            host = host_ms(step, dev, reps=20)["median"]
            launches = len(traced(step, dev, steps=10)) / 10
            rows.append(dict(layers=layers, optimizer=which, device_ms=device, host_ms=host, launches=launches))
            print(f"{which:8s} {layers:3d} layers: device {device:7.2f} ms  host {host:7.2f} ms  launches "
                  f"{launches:6.1f}  host per launch {1e3 * host / launches:6.1f} us", flush=True)
            del opt
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(dict(env=environment(dev), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
