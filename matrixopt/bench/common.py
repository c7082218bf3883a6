"""What every benchmark shares: the machine's limits, the environment record, tables and JSON. Timing and the
device are :mod:`matrixopt.device`."""

from __future__ import annotations

import json
import platform
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from matrixopt.device import describe, host_pace

# One H100 SXM as measured on the lent machines (device README, KINDS.md, 2026-11-13): an 8192^3 bf16 matmul ran
# at 798 TFLOP/s on random data and a device-to-device copy moved 3.0 TB/s (read + write). These are the limits
# the benchmarks report against; on another device the ratios are still printed, against these numbers.
PEAK_BF16_TFLOPS = 800.0
COPY_TBPS = 3.0


def environment(device: torch.device) -> dict[str, Any]:
    """Device, library versions and git commit, for the JSON record."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True, cwd=Path(__file__).parent, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = None, None
    return {
        "device": describe(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "git_commit": commit,
        "git_dirty": dirty,
        "host": host_pace(device),
        "limits": {"peak_bf16_tflops": PEAK_BF16_TFLOPS, "copy_tbps": COPY_TBPS,
                   "source": "H100 measured on the lent machine: 8192^3 bf16 matmul, device-to-device copy"},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A markdown table of ``rows`` (dicts) over ``columns``; floats to 4 significant digits."""

    def fmt(v: Any) -> str:
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_json(path: str | Path | None, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON (parents created); nothing when ``path`` is None. The file is replaced
    whole (written beside it, then renamed), so a process stopped while writing leaves the previous version."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    tmp.replace(path)


def exposed_comm(prof) -> tuple[float, float]:
    """``(communication, exposed communication)`` seconds in a ``torch.profiler`` trace with CUDA activity: the
    union of NCCL kernel intervals, and the part of it during which no compute kernel runs on any stream."""
    comm, compute = [], []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        iv = (e.time_range.start, e.time_range.end)
        (comm if "nccl" in e.name.lower() else compute).append(iv)

    def union(ivs):
        out = []
        for s, t in sorted(ivs):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], t)
            else:
                out.append([s, t])
        return out

    comm_u, comp_u = union(comm), union(compute)
    total = sum(t - s for s, t in comm_u)
    overlap, j = 0.0, 0
    for s, t in comm_u:
        while j < len(comp_u) and comp_u[j][1] <= s:
            j += 1
        k = j
        while k < len(comp_u) and comp_u[k][0] < t:
            overlap += min(t, comp_u[k][1]) - max(s, comp_u[k][0])
            k += 1
    return total * 1e-6, (total - overlap) * 1e-6


def kernel_choices() -> dict[str, Any]:
    """What this process's kernels chose, for a record: the Newton–Schulz products' cuBLAS-or-Triton decisions
    (``dispatch``) and each Triton kernel's tuned config per shape (``tuned_configs``). Both come from timings,
    so two runs can differ; a record keeps the ones its figures were measured with."""
    from matrixopt.kernels._tuning import chosen
    from matrixopt.kernels.ns_step import dispatch_table

    return {"dispatch": dispatch_table(), "tuned_configs": {str(k): str(v) for k, v in chosen().items()}}
