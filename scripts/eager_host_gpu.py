"""The host's and the device's time of Muon's, SOAP's and Shampoo's eager steps on shares of GPT models' matrices,
on one GPU: where the host's time reaches the device's, an owner holding that share is bound by its host.

Each set is ``model:layers``: that many layers of the trainer's GPT of that preset (QKV split in three,
:func:`refresh_schedule_gpu.matrices`). Muon eager with the deferred check (as layer-wise and FSDP2 owners run
it), SOAP with bf16 products, Shampoo with TF32 products and eigenbasis roots, both with staggered refreshes and
the deferred check. After 14 steps: the device's time per step (CUDA events, after 0.3 s of steps; a step bound by
its host measures the host's pace), the host's time to issue one (``step()`` returning, the queue drained before
each; the middle of ``--rounds`` medians of 20) and the kernels launched per step (a trace of 10 steps).

    PYTHONPATH=. python scripts/eager_host_gpu.py --out docs/results/plan/host_h200/eager_host_h200.json
    # precond_host_h200.json: --optimizers soap shampoo --sets 1.3b:1 1.3b:3 1.3b:6 1.3b:12 --rounds 1
"""

import argparse
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from refresh_schedule_gpu import matrices  # noqa: E402

from matrixopt import SOAP, Muon, Shampoo  # noqa: E402
from matrixopt.bench.common import environment  # noqa: E402
from matrixopt.bench.profile import traced  # noqa: E402
from matrixopt.device import host_ms, time_ms  # noqa: E402
from matrixopt.train.model import PRESETS  # noqa: E402

SETS = ("1.3b:1", "1.3b:2", "1.3b:4", "1.3b:8", "1.3b:12", "gpt2-small:3", "gpt2-small:12", "gpt2-medium:6",
        "gpt2-medium:24")


def optimizer(name: str, ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if name == "muon":
        return Muon(ps, lr=1e-4, deferred_nonfinite=True, cuda_graph=False)
    if name == "soap":
        return SOAP(ps, lr=1e-4, stagger_refresh=True, matmul_precision="bf16", deferred_nonfinite=True)
    return Shampoo(ps, lr=1e-4, stagger_refresh=True, matmul_precision="tf32", root_method="eigenbasis",
                   deferred_nonfinite=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sets", nargs="+", default=SETS, help="model:layers, the model a trainer preset")
    ap.add_argument("--optimizers", nargs="+", default=["muon", "soap", "shampoo"],
                    choices=["muon", "soap", "shampoo"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for item in args.sets:
        model, layers = item.split(":")
        d, layers = PRESETS[model]["n_embd"], int(layers)
        ps = matrices(layers, d)
        grads = [torch.randn_like(p) * 1e-3 for p in ps]
        for name in args.optimizers:
            opt = optimizer(name, ps)

            def step(opt: torch.optim.Optimizer = opt, ps: list = ps, grads: list = grads) -> None:
                for p, g in zip(ps, grads):
                    p.grad = g
                opt.step()

            for _ in range(14):
                step()
            device = time_ms(step, dev, reps=20, warmup=0, heat_s=0.3)["median"]
            rounds = [host_ms(step, dev, reps=20)["median"] for _ in range(args.rounds)]
            launches = len(traced(step, dev, steps=10)) / 10
            rows.append(dict(model=model, layers=layers, d=d, optimizer=name, device_ms=device,
                             host_ms=sorted(rounds)[len(rounds) // 2], host_ms_rounds=rounds, launches=launches))
            print(f"{name:8s} {model:12s} {layers:3d} layers: device {device:7.2f} ms  host "
                  + " ".join(f"{h:7.2f}" for h in rounds) + f" ms  launches {launches:6.1f}", flush=True)
            del opt, step
            gc.collect()
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(dict(env=environment(dev), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
