"""scripts/scaling_gpu.py runs end to end at toy size on CPU (torchrun, 2 gloo ranks) and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _mp import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_scaling_gpu_script_toy(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(ROOT / "scripts" / "scaling_gpu.py"), "--toy", "--iters", "2", "--warmup", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "scaling_gpu.json").read_text())
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    lines = {line["config"]: line for line in result["summary"]}
    assert set(lines) == {"ddp:adamw", "fsdp:adamw", "layerwise:muon", "fsdp:muon"}
    for line in lines.values():
        assert line["tokens_per_s"] > 0 and line["opt_step_ms_max"] >= line["opt_step_ms_min"] > 0
        assert len(result["per_rank"][0]) == 2
    assert lines["ddp:adamw"]["vs_ddp_adamw"] == 1.0
    assert lines["layerwise:muon"]["single_gpu_muon_step_ms"] > 0
    layerwise = next(ranks for ranks in result["per_rank"] if ranks[0]["config"] == "layerwise:muon")
    assert sum(r["owned_cost_share"] for r in layerwise) == pytest.approx(1.0)  # every matrix has one owner
    assert all(r["inner_step_ms"] > 0 for r in layerwise)
