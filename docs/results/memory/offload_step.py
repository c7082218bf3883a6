"""The 1.3B GPT's Muon step alone between emulated forward and backward passes, for offloaded and compact state.

    python docs/results/memory/offload_step.py [gpu offload offload_bf16 gpu_bf16]   # on one GPU; JSON to $OUT

Each variant builds the trainer's 1.3B model with random gradients, takes three steps, then times six: before each, the
GPU sleeps ~300 ms (the forward and backward, during which the parameters' host backups are copied), and the step is
timed by CUDA events; ``host_issue_ms`` is the host's time until the step's final wait for its copies."""
import json
import os
import sys
import time

import torch

from matrixopt import build_optimizer
from matrixopt.bench import scale
from matrixopt.optim import offload
from matrixopt.optim.registry import accepted
from matrixopt.train.config import OptimConfig
from matrixopt.train.model import GPT, QKV_SPLITS

VARIANTS = {"gpu": {}, "offload": {"offload": "cpu"}, "offload_bf16": {"offload": "cpu", "state_dtype": "bf16"},
            "gpu_bf16": {"state_dtype": "bf16"}}
device = torch.device("cuda")
torch.cuda._sleep(1000)
torch.cuda.synchronize()
t = time.perf_counter()
torch.cuda._sleep(int(1e8))
torch.cuda.synchronize()
forward = int(300 * 1e8 / ((time.perf_counter() - t) * 1e3))  # cycles for ~300 ms

waits: list[float] = []
synchronize = offload.Offload.synchronize
offload.Offload.synchronize = lambda self: (waits.append(time.perf_counter()), synchronize(self))[1]

result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
for name in sys.argv[1:] or list(VARIANTS):
    torch.manual_seed(0)
    with device:
        model = GPT(scale.model_config("1.3b", False).gpt_config(scale.VOCAB))
    hp = accepted("muon", **OptimConfig(name="muon", lr=scale.LR).optimizer_kwargs())
    opt = build_optimizer(model, "muon", splits=QKV_SPLITS, **hp, **VARIANTS[name])
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    for _ in range(3):
        opt.step()
    steps, issue = [], []
    for _ in range(6):
        torch.cuda._sleep(forward)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        waits.clear()
        start.record()
        t = time.perf_counter()
        opt.step()
        end.record()
        torch.cuda.synchronize()
        steps.append(start.elapsed_time(end))
        issue.append(((waits[0] if waits else time.perf_counter()) - t) * 1e3)
    steps.sort()
    issue.sort()
    result[name] = {"step_ms": steps[3], "host_issue_ms": issue[3], "steps": steps}
    print(f"{name:14s} step {steps[3]:7.1f} ms  host issue {issue[3]:7.1f} ms", flush=True)
    del model, opt
    torch.cuda.empty_cache()
with open(os.path.join(os.environ.get("OUT", "."), "offload_step.json"), "w") as f:
    json.dump(result, f, indent=1)
