"""SOAP's and Shampoo's update step, ``W <- decay(W) - lr U``, by the one-pass kernel against the foreach
reference, on one GPU: the pass alone on the matrices of half of the trainer's 1.3B preset
(:func:`refresh_schedule_gpu.matrices`, what one of two FSDP2 owners steps), then each optimizer's whole step with
one update or the other, alternated over three rounds (bf16 products for SOAP, TF32 and eigenbasis roots for
Shampoo, refreshes staggered, the deferred check; CUDA events per step over two refresh periods). Writes
``$OUT/apply_ab_h200.json``.

    PYTHONPATH=. python scripts/update_pass_gpu.py
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from refresh_schedule_gpu import matrices  # noqa: E402

from matrixopt import SOAP, Shampoo  # noqa: E402
from matrixopt.device import time_ms  # noqa: E402
from matrixopt.kernels import muon_elementwise as ew  # noqa: E402

DEVICE = torch.device("cuda")
UPDATES = {"reference": ew.decay_update_reference, "fused": ew.decay_update}


def main() -> None:
    out: dict[str, list[float]] = {}
    ps = matrices()
    time_pass(ps, out)
    grads = [torch.randn_like(p) * 1e-3 for p in ps]
    for which in ("soap", "shampoo"):
        for _ in range(3):
            for name, fn in UPDATES.items():
                ew.decay_update = fn  # what KroneckerOptimizer._apply calls
                opt = (SOAP(ps, lr=1e-4, stagger_refresh=True, matmul_precision="bf16", deferred_nonfinite=True)
                       if which == "soap" else
                       Shampoo(ps, lr=1e-4, stagger_refresh=True, matmul_precision="tf32", root_method="eigenbasis",
                               deferred_nonfinite=True))

                def step(opt: torch.optim.Optimizer = opt) -> None:
                    for p, g in zip(ps, grads):
                        p.grad = g
                    opt.step()

                t = time_ms(step, DEVICE, reps=20, warmup=14)
                out.setdefault(f"{which} {name}", []).append(t["median"])
                print(f"{which} step, update by {name}: {t['median']:.2f} ms (p20 {t['p20']:.2f}, p80 {t['p80']:.2f})",
                      flush=True)
                del opt
                torch.cuda.empty_cache()
    ew.decay_update = UPDATES["fused"]
    path = os.path.join(os.environ.get("OUT", "."), "apply_ab_h200.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def time_pass(ps: list[torch.Tensor], out: dict[str, list[float]]) -> None:
    """The update pass alone on copies of ``ps``, each way twice, alternated."""
    W, U = [p.detach().clone() for p in ps], [torch.randn_like(p) for p in ps]
    skip = torch.zeros((), device=DEVICE)
    for _ in range(2):
        for name, fn in UPDATES.items():
            t = time_ms(lambda fn=fn: fn(W, U, 1e-4, 0.1, "decoupled", skip), DEVICE, reps=20, warmup=3)
            out.setdefault(f"pass {name}", []).append(t["median"])
            print(f"pass {name}: {t['median']:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
