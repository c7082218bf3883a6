"""Per-step time of SOAP's and Shampoo's step with the refreshes on one step or spread over the steps.

The matrices of half of the trainer's 1.3B preset (12 layers of width 2048: QKV split in three, the output
projection, the MLP's two), what one of two FSDP2 owners steps; fp32 parameters and gradients, TF32 products,
refreshes every 10 steps (Shampoo's roots by eigenbasis). Steps 13 to 32 are timed one by one: the host's time to
issue ``step()`` and its time on the GPU (CUDA events). Writes ``$OUT/refresh_schedule.json``.

    PYTHONPATH=. python scripts/refresh_schedule_gpu.py soap:0 soap:1 shampoo:0 shampoo:1   # :1 staggered
"""

import json
import os
import statistics
import sys
import time

import torch

from matrixopt import SOAP, Shampoo
from matrixopt.optim.layout import mark_split

D, LAYERS, STEPS, TIMED_FROM = 2048, 12, 32, 13


def matrices(layers: int = LAYERS, d: int = D) -> list[torch.nn.Parameter]:
    """The trainer's GPT matrices of ``layers`` layers of width ``d`` (QKV split in three; by default the 1.3B's
    half), fp32 on the GPU, seeded."""
    torch.manual_seed(0)
    ps = []
    for _ in range(layers):
        qkv = torch.nn.Parameter(torch.randn(3 * d, d, device="cuda") * 0.02)
        mark_split(qkv, 3)
        ps += [qkv] + [torch.nn.Parameter(torch.randn(*s, device="cuda") * 0.02)
                       for s in ((d, d), (4 * d, d), (d, 4 * d))]
    return ps


def main() -> None:
    ps, out = matrices(), {}
    for name in sys.argv[1:] or ["soap:0", "soap:1", "shampoo:0", "shampoo:1"]:
        which, stagger = name.split(":")
        cls = SOAP if which == "soap" else Shampoo
        kw = dict(lr=0.0, matmul_precision="tf32", stagger_refresh=stagger == "1")
        if cls is Shampoo:
            kw["root_method"] = "eigenbasis"
        opt = cls(ps, **kw)
        grads = [torch.randn_like(p) * 1e-3 for p in ps]
        rows = []
        for step in range(1, STEPS + 1):
            for p, g in zip(ps, grads):
                p.grad = g
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            opt.step()
            host = (time.perf_counter() - t0) * 1e3
            end.record()
            torch.cuda.synchronize()
            rows.append(dict(step=step, host=host, device=start.elapsed_time(end)))
        del opt
        torch.cuda.empty_cache()
        out[name] = rows
        dev = [r["device"] for r in rows[TIMED_FROM - 1:]]
        print(f"{name}: device ms per step mean {statistics.mean(dev):.1f}, median {statistics.median(dev):.1f}, "
              f"max {max(dev):.1f}")
    out["env"] = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    with open(os.path.join(os.environ.get("OUT", "."), "refresh_schedule.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
