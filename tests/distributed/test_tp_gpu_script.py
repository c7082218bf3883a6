"""scripts/tp_gpu.py runs end to end on CPU with gloo (``--toy``) under torchrun and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tp_gpu_script_toy(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "scripts" / "tp_gpu.py"), "--toy", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "tp_gpu.json").read_text())
    assert result["env"]["toy"] and result["env"]["world_size"] == 2 and result["env"]["backend"] == "gloo"
    modes = {(r["shape"][0], r["shard_dim"], r["mode"], r["chunks"]) for r in result["newton_schulz"]}
    for m in (32, 64):
        for pd in (0, 1):
            for mode, chunks in (("duplicated", 1), ("distributed", 4), ("distributed", 1), ("blockwise", 1)):
                assert (m, pd, mode, chunks) in modes
    assert all(r["median_ms"] > 0 and r["auto_picks"] in ("duplicated", "distributed")
               for r in result["newton_schulz"] if r["shard_dim"] is not None)
    assert len(result["overlap"]) == 4
    assert {(r["preset"], r["optimizer"]) for r in result["train"]} == {("tiny-cpu", "adamw"), ("tiny-cpu", "muon")}
    assert result["muon_over_adamw_tokens_per_s"]["tiny-cpu"] > 0
    assert "Muon / AdamW tokens/s" in proc.stdout
