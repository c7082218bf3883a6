"""Shampoo's (and SOAP's) step on the whole 1.3B on one GPU, this tree or the copy given by PYTHONPATH."""
import json, os, statistics, sys
import torch
from matrixopt import build_optimizer
from matrixopt.bench.scale import model_config, VOCAB
from matrixopt.train.model import GPT, QKV_SPLITS

dev = torch.device("cuda")
tag = sys.argv[1]
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tag": tag}

def run(name, opt_name, steps=22, **hp):
    torch.manual_seed(0)
    with dev:
        m = GPT(model_config("1.3b", False).gpt_config(VOCAB))
    for p in m.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt = build_optimizer(m, opt_name, splits=QKV_SPLITS, lr=0.0, **hp)
    times = []
    for i in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); opt.step(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b))
    period = hp.get("precondition_frequency", 10)
    plain = [t for t in times[12:]]
    r = {"all_ms": times, "median_ms": statistics.median(times[12:]), "mean_last10_ms": sum(times[-10:]) / 10}
    print(f"{tag:4s} {name:22s} median {r['median_ms']:7.1f} ms, mean of the last 10 (one refresh) "
          f"{r['mean_last10_ms']:7.1f} ms, max {max(times[12:]):7.1f}", flush=True)
    out[name] = r
    del opt, m
    torch.cuda.empty_cache()

run("shampoo eigen tf32", "shampoo", matmul_precision="tf32", root_method="eigenbasis")
run("soap tf32", "soap", matmul_precision="tf32")
json.dump(out, open(os.path.join(os.environ["OUT"], f"shampoo_ab_{tag}.json"), "w"), indent=1)
