"""Shampoo's and SOAP's step on the whole 1.3B on one GPU, for the tree PYTHONPATH names (old or new code):
``python shampoo_ab.py TAG`` writes ``$OUT/shampoo_ab_TAG.json`` with every step's time."""
import json
import os
import statistics
import sys

import torch

from matrixopt import build_optimizer
from matrixopt.bench.scale import VOCAB, model_config
from matrixopt.train.model import GPT, QKV_SPLITS

DEVICE = torch.device("cuda")


def run(out: dict, tag: str, name: str, optimizer: str, steps: int = 22, **hparams) -> None:
    torch.manual_seed(0)
    with DEVICE:
        model = GPT(model_config("1.3b", False).gpt_config(VOCAB))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt = build_optimizer(model, optimizer, splits=QKV_SPLITS, lr=0.0, **hparams)
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    r = {"all_ms": times, "median_ms": statistics.median(times[12:]), "mean_last10_ms": sum(times[-10:]) / 10}
    print(f"{tag:4s} {name:22s} median {r['median_ms']:7.1f} ms, mean of the last 10 (one refresh) "
          f"{r['mean_last10_ms']:7.1f} ms, max {max(times[12:]):7.1f}", flush=True)
    out[name] = r
    del opt, model
    torch.cuda.empty_cache()


def main() -> None:
    tag = sys.argv[1]
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tag": tag}
    run(out, tag, "shampoo eigen tf32", "shampoo", matmul_precision="tf32", root_method="eigenbasis")
    run(out, tag, "soap tf32", "soap", matmul_precision="tf32")
    with open(os.path.join(os.environ["OUT"], f"shampoo_ab_{tag}.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
