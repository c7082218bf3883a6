"""Device time of SOAP's and Shampoo's optimizer step per ``matmul_precision`` and ``factor_dtype``.

The matrices of half of the trainer's 1.3B preset (:func:`refresh_schedule_gpu.matrices`, what one of two FSDP2
owners steps), refreshes staggered (``stagger_refresh=True``, every 10 steps), Shampoo's roots by eigenbasis. Each
configuration ``optimizer:precision:factor_dtype`` runs 32 steps; steps 13 to 32 are timed (CUDA events), then one
more step is profiled for its kernel time and the part of it in matrix-product kernels. Writes
``$OUT/precision_step.json``.

    PYTHONPATH=. python scripts/precision_step_gpu.py soap:tf32:fp32 soap:bf16:fp32 shampoo:tf32:fp32 shampoo:bf16:fp32
"""

import collections
import json
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from refresh_schedule_gpu import matrices  # noqa: E402

from matrixopt import SOAP, Shampoo  # noqa: E402

GEMM_KERNELS = ("gemm", "xmma", "cutlass", "nvjet", "sm90_")  # cuBLAS's matrix-product kernel names


def main() -> None:
    ps = matrices()
    grads = [torch.randn_like(p) * 1e-3 for p in ps]
    out = {}
    for name in sys.argv[1:]:
        which, precision, factor_dtype = name.split(":")
        cls = SOAP if which == "soap" else Shampoo
        kw = dict(matmul_precision=precision, lr=0.0, stagger_refresh=True, factor_dtype=factor_dtype)
        if cls is Shampoo:
            kw["root_method"] = "eigenbasis"
        opt = cls(ps, **kw)

        def step(opt: torch.optim.Optimizer = opt) -> None:
            for p, g in zip(ps, grads):
                p.grad = g
            opt.step()

        dev = []
        for i in range(32):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            if i >= 12:
                dev.append(start.elapsed_time(end))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        kernels = collections.defaultdict(float)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                kernels[ev.name[:60]] += ev.device_time_total / 1e3
        gemm = sum(v for k, v in kernels.items() if any(t in k.lower() for t in GEMM_KERNELS))
        out[name] = dict(device_ms=dev, mean=statistics.mean(dev), kernels_ms=sum(kernels.values()), gemm_ms=gemm)
        print(f"{name:28s} mean {statistics.mean(dev):6.1f} median {statistics.median(dev):6.1f} max {max(dev):6.1f}"
              f" | one step's kernels {sum(kernels.values()):5.1f} ms, GEMM {gemm:5.1f}", flush=True)
        del opt
        torch.cuda.empty_cache()
    out["env"] = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    with open(os.path.join(os.environ.get("OUT", "."), "precision_step.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
