"""(5) Distributed faults of the layer-wise optimizer (gloo, 2 CPU processes): ranks that disagree on the
parameter set fail at construction with an error naming the mismatch (no hang), and a rank killed mid-step
makes the survivor fail within a bounded time."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("matrixopt.distributed.layerwise")

from .common import NAMES, child_env  # noqa: E402

CHILD = Path(__file__).with_name("_dist_child.py")
STEP_TIMEOUT_S = 10  # as in _dist_child.py
HANG_S = 120  # a rank still running after this is hung (start-up of two torch processes on 2 busy cores included)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario: str, name: str, world: int = 2) -> list[tuple[int, str, float]]:
    """(exit code, output, seconds) of each rank; a rank that hangs is killed and fails the test."""
    port = str(_free_port())
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(CHILD), scenario, str(r), str(world), port, name],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=child_env()) for r in range(world)]
    results = []
    try:
        for r, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=max(1.0, HANG_S - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} of scenario {scenario!r} hung for {HANG_S} s")
            results.append((p.returncode, out, time.monotonic() - t0))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


@pytest.mark.parametrize("name", NAMES)
def test_agreeing_ranks_train(name):
    for code, out, _ in run_ranks("ok", name):
        assert code == 0 and "DONE" in out, out[-2000:]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("scenario, named", [("extra", "`5.weight`"), ("shape", "`2.weight`")])
def test_ranks_disagreeing_on_parameters_fail_at_construction_naming_it(scenario, named, name):
    for r, (code, out, _) in enumerate(run_ranks(scenario, name)):
        assert code == 3, f"rank {r}: {out[-2000:]}"
        assert "VALUE_ERROR" in out and named in out, f"rank {r}: {out[-2000:]}"


@pytest.mark.parametrize("name", NAMES)
def test_a_rank_killed_mid_step_makes_the_other_fail_in_bounded_time(name):
    (code0, out0, _), (code1, _, _) = run_ranks("kill", name)
    assert code1 == -9
    assert code0 == 4 and "STEP_FAILED" in out0, out0[-2000:]
    failed_after = float(out0.split("STEP_FAILED after ")[1].split("s:")[0])
    assert failed_after < STEP_TIMEOUT_S + 30, out0[-2000:]
