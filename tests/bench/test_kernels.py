"""``matrixopt bench kernels``: the tile grids hold only configs the kernels accept, the command refuses a device
it cannot time, and on a CUDA GPU it writes the sweep as JSON."""

from __future__ import annotations

import json

import pytest
import torch

from tests.bench.test_bench import run_cli

kernels = pytest.importorskip("matrixopt.bench.kernels")
pytest.importorskip("triton", reason="the kernel grids are Triton configs: pip install triton")


def test_grids_are_valid_and_distinct():
    syrk, update = kernels.syrk_grid(), kernels.update_grid()
    assert len(set(syrk)) == len(syrk) and len(set(update)) == len(update)
    assert not [c for c in syrk if c.pair and (c.block == 64 or c.num_warps == 4)]  # pairs: 128-tiles, 8 warps
    assert not [c for c in syrk if c.wide and c.persistent]  # two different TMA kernels
    assert {c.persistent for c in syrk} == {c.persistent for c in update} == {False, True}
    names = {kernels.config_name(c) for c in syrk + update}
    assert len(names) == len(syrk) + len(update)  # a name tells the config apart in the table
    assert "128x2/64/w8/s4/P" in names and "64x128/128/w4/s3" in names and "128x256x64/w8/s3" in names


def test_cpu_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match="CUDA GPU.*matrixopt bench ns --device cpu"):
        run_cli(["kernels", "--device", "cpu"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="times compiled Triton kernels: needs a CUDA GPU")
def test_kernels_writes_json(tmp_path):
    path = tmp_path / "kernels.json"
    assert run_cli(["kernels", "--shapes", "2x256x512", "--persistent-only", "--reps", "2", "--json", str(path)]) == 0
    rec = json.loads(path.read_text())
    assert rec["benchmark"] == "kernels" and [r["kernel"] for r in rec["results"]] == ["syrk", "update"]
    for r in rec["results"]:
        assert r["shape"] == [2, 256, 512] and r["cublas"]["ms"]["median"] > 0 and r["tuned"]["tflops"] > 0
        assert r["configs"] and all(c["params"]["persistent"] for c in r["configs"])
        assert all(f["config"].endswith("/P") and f["error"] for f in r["failed"])  # /P: a persistent kernel
        times = [c["ms"]["median"] for c in r["configs"]]
        assert times == sorted(times)
