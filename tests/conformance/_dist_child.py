"""One rank of the distributed fault tests: argv = scenario rank world_size port optimizer.

Scenarios: "ok" (both ranks agree), "extra" (rank 1's model has one more layer), "shape" (a layer of another
shape on rank 1), "kill" (rank 1 SIGKILLs itself between its backward and its optimizer step). A ValueError at
construction exits 3 and a failure inside a step exits 4, each printing the error."""

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from matrixopt.distributed.layerwise import LayerwiseOptimizer

STEP_TIMEOUT_S = 10  # the process group timeout: a dead rank must make the others fail after about this

scenario, rank, world, port, name = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=timedelta(seconds=60))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
if rank == 1 and scenario == "extra":
    model.append(nn.Linear(4, 4, bias=False))
if rank == 1 and scenario == "shape":
    model[2] = nn.Linear(8, 6)
    model[4] = nn.Linear(6, 4)
try:
    opt = LayerwiseOptimizer(model, name, timeout=timedelta(seconds=STEP_TIMEOUT_S), lr=1e-2)
except ValueError as e:
    print(f"VALUE_ERROR: {e}", flush=True)
    os._exit(3)
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
for step in range(4):
    t0 = time.monotonic()
    try:
        loss = model(x).square().mean()
        loss.backward()
        if scenario == "kill" and rank == 1 and step == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        opt.zero_grad()
    except Exception as e:  # noqa: BLE001 - any error is the expected outcome; report it
        print(f"STEP_FAILED after {time.monotonic() - t0:.1f}s: {type(e).__name__}: {e}", flush=True)
        os._exit(4)
opt.wait_params()  # the last step's broadcasts are in flight until waited for (or the next forward)
print("DONE", flush=True)
dist.destroy_process_group()
os._exit(0)  # skip interpreter teardown: gloo objects destroyed after their group sometimes abort the process
