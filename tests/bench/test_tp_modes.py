"""``matrixopt bench tp`` runs every tensor-parallel Newton–Schulz mode at toy size on CPU (torchrun, 2 gloo
ranks) and writes its JSON."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from matrixopt.bench import tp
from tests.bench.test_bench import run_cli
from tests.bench.test_scale import torchrun_bench


def test_tp_toy(tmp_path):
    path = tmp_path / "tp.json"
    proc = torchrun_bench(["tp", "--toy", "--json", str(path)], timeout=240)
    result = json.loads(path.read_text())
    assert result["benchmark"] == "tp" and result["world_size"] == 2 and result["backend"] == "gloo"
    assert result["env"]["device_type"] == "cpu" and result["dtype"] == "torch.float32"
    modes = {(r["shape"][0], r["shard_dim"], r["mode"], r["chunks"]) for r in result["newton_schulz"]}
    for m in (32, 64):
        for pd in (0, 1):
            for mode, chunks in (("duplicated", 1), ("distributed", 4), ("distributed", 1), ("blockwise", 1)):
                assert (m, pd, mode, chunks) in modes
    assert all(r["median_ms"] > 0 and r["auto_picks"] in ("duplicated", "distributed")
               for r in result["newton_schulz"] if r["shard_dim"] is not None)
    assert len(result["overlap"]) == 4
    assert "Overlap of the Gram all-reduce" in proc.stdout


def test_tp_shapes_are_matrices(capsys):
    with pytest.raises(SystemExit):
        run_cli(["tp", "--shapes", "2x32x64"])
    assert "write MxN" in capsys.readouterr().err


def test_tp_needs_two_ranks(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="launch 2 or more"):
            tp.run(device=torch.device("cpu"), dtype=torch.float32)
    finally:
        dist.destroy_process_group()
