"""``matrixopt bench profile``: kernel totals and idle gaps from a trace (synthetic events here), a clear refusal
on the CPU, and on a CUDA GPU the three profiles as JSON."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from matrixopt.bench.profile import busy_and_gaps, kernel_intervals, per_kernel_ms
from tests.bench.test_bench import run_cli


def test_kernel_intervals_keep_timed_gpu_kernels_in_order():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(name=n, device_type=d, time_range=SimpleNamespace(start=s, end=e))
              for n, d, s, e in [("gemm", cuda, 50, 90), ("host op", cpu, 0, 100), ("copy", cuda, 10, 20),
                                 ("marker", cuda, 30, 30)]]
    assert kernel_intervals(SimpleNamespace(events=lambda: events)) == [(10, 20, "copy"), (50, 90, "gemm")]


def test_per_kernel_ms_sums_launches_per_step():
    kernels = [(0, 1000, "gemm"), (1000, 1500, "add"), (2000, 3000, "gemm")]
    assert per_kernel_ms(kernels, steps=2) == {"gemm": 1.0, "add": 0.25}
    assert list(per_kernel_ms(kernels, steps=2)) == ["gemm", "add"]  # largest first


def test_busy_and_gaps_counts_overlap_once():
    # two steps (us): a [0, 1000], b [500, 1500] overlapping it, idle 1500-2500, c [2500, 3000], idle, d [3200, 4000]
    kernels = [(0, 1000, "a"), (500, 1500, "b"), (2500, 3000, "c"), (3200, 4000, "d")]
    r = busy_and_gaps(kernels, steps=2)
    assert r["span_ms"] == pytest.approx(2.0) and r["busy_ms"] == pytest.approx(1.4)
    assert r["idle_ms"] == pytest.approx(0.6)
    assert r["gaps"] == [{"ms": 1.0, "after": "b", "before": "c"}, {"ms": 0.2, "after": "c", "before": "d"}]


def test_cpu_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match="CUDA traces.*matrixopt bench step"):
        run_cli(["profile", "step", "--device", "cpu"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="reads GPU kernels from CUDA traces: needs a CUDA GPU")
@pytest.mark.parametrize("argv", [["step", "--model", "toy"], ["step", "--model", "toy", "--optimizers", "soap"],
                                  ["train", "--model", "tiny-cpu", "--optimizers", "adamw",
                                                                "muon"], ["launch"]])
def test_profile_writes_json(tmp_path, argv):
    path = tmp_path / "profile.json"
    assert run_cli(["profile", *argv, "--reps", "2", "--json", str(path)]) == 0
    rec = json.loads(path.read_text())
    assert rec["benchmark"] == "profile" and rec["profile"] == argv[0]
    res = rec["results"]
    match argv[0]:
        case "step":
            assert set(res) == ({"soap"} if "soap" in argv else {"eager", "CUDA graph"})
            assert all(r["kernel_ms"] > 0 and r["launches"] > 0 and r["host_ms"]["median"] > 0 for r in res.values())
        case "train":
            assert set(res) == {"adamw", "muon"}
            assert all(0 < r["busy_ms"] <= r["span_ms"] for r in res.values())
        case _:
            assert all(us > 0 for us in res.values())
