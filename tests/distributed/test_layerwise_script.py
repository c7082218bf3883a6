"""scripts/layerwise_gpu.py runs end to end at toy size on CPU (torchrun, 2 gloo ranks) and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from _mp import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_layerwise_gpu_script_toy(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(ROOT / "scripts" / "layerwise_gpu.py"), "--toy", "--iters", "2", "--warmup", "1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "layerwise_gpu.json").read_text())
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    for key in ("step_ratio", "tokens_ratio", "state_ratio"):
        assert result[key] > 0, key
    # two ranks each hold about half of the single-process optimizer state
    assert 0.4 < result["state_ratio"] < 0.6
    assert "optimizer step" in proc.stdout
