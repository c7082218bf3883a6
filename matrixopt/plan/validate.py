"""Predicted against measured: every committed measurement the cost model can be checked on, read from the JSON
files under ``docs/results/`` (``matrixopt plan --validate``).

Each row names its source file and what the model was given. Up to three device profiles are compared: the shipped
profile of the device the run used (:func:`device_of`: ``measured`` for the H100 and the H200), the
nominal one built from the data sheet where the shipped one is measured, and ``limits``: the nominal one with the
matmul rate and copy bandwidth the run's machine measured (the ``env.limits`` every benchmark JSON records) as the
achieved rates. Where a throughput ratio is predicted, the forward and backward time comes from the measured AdamW
step of the same run minus the model's AdamW optimizer step (the planner cannot predict MFU); the matrix
optimizer's step is the prediction.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from matrixopt.distributed import balance
from matrixopt.distributed.calibrate import NOMINAL, nominal
from matrixopt.distributed.cost import (
    MATMUL_EFFICIENCY,
    TP_GRAM_CHUNKS,
    DeviceProfile,
    Shapes,
    matrix_step_time,
    muon_host_time,
    muon_launches,
    newton_schulz_time,
    nominal_profile,
    shipped_profile,
    tp_ns_times,
)
from matrixopt.plan.models import GPT_VOCAB, PRESETS, Architecture, Matrix, fused_qkv_matrices, gpt
from matrixopt.plan.planner import Layout, PlanConfig, predict
from matrixopt.train.model import PRESETS as GPT_PRESETS

THRESHOLD = 0.15  # the relative error the model aims to stay within

BEFORE_GRAM = {"313bf47a6f7d6032f9fda40a169563dd921f287d", "4a30a4f7fdce5a36e9f1862f8d5ec46bfb65dd01"}
"""``env.git_commit`` of records measured before Newton–Schulz had a Gram form (added in e8ebd8f; ``git
merge-base --is-ancestor e8ebd8f COMMIT`` fails for each): their Muon ran every matrix in the standard form."""

EXCLUDED = {
    # the script as first committed (e5aa442) is five minutes older than the record's env.time; b9dab79 moved its
    # optimizer-step timing to CUDA events on the compute stream
    "scale_4gpu.json": "timed by the first version of the scaling script, which synchronised the device around "
                       "every optimizer.step() (CUDA-synchronised wall time), so its step and optimizer-step times "
                       "include the layer-wise broadcasts and FSDP2's prefetches that the trainer overlaps; the "
                       "record has no per-phase (compute-stream) times, which every later scaling record has",
}
"""Records whose times measure something other than the trainer's step, by file: the reason. Their time rows are
still predicted and listed, but not counted; their memory rows are."""

STALE = (
    # 4a30a4f, fb53580f and d559a09d precede 5f15e3a, after which sharded Muon's deferred check skips on the
    # agreed device flag; before it a DTensor gradient's flags were read on the host (sharded.py's docstring)
    (("scale_1.3b_2gpu_fsdp.json", "scale_1.3b_16k_2xh100.json", "scale_1.3b_64k_2xh100.json",
      "scale_1.3b_16k_fsdp_2xh100.json", "scale_1.3b_16k_fsdp_gather_once_2xh100.json"), ("fsdp", ": Muon"),
     "its FSDP2 Muon time rows were measured before sharded Muon's non-finite check stopped reading the flags "
     "on the host: that step waited for the GPU every step (deferred_nonfinite changed nothing for sharded "
     "gradients), which the current step does not"),
    (("scale_1.3b_16k_precond_refresh_2xh100.json", "scale_1.3b_16k_precond_refresh_2xh200.json"), ("Shampoo",),
     "its Shampoo time rows were measured before Shampoo's Adam graft and its graft-and-select pass ran as fused "
     "kernels and before its eigenbasis roots' products moved to TF32 (scale_1.3b_16k_shampoo_alt_2xh100.json "
     "measures the current step)"),
    # made by the commit that kept the layer-wise matrices in bf16, before the next one changed the masters' cast
    (("scale_new16a_2xh100.json", "scale_new16b_2xh100.json", "scale_new4k_2xh100.json", "scale_new64k_2xh100.json"),
     ("layerwise", ": Muon"),
     "its layer-wise Muon time rows were measured before the owners' cast from their fp32 masters into the bf16 "
     "weights dropped its select on the skip flag (a select and a copy of every owned weight, 3-4 ms more per "
     "step at 1.3B; the records ending in c measure the current step)"),
    # no git commit recorded; made 2026-11-22 05:12, before 717ddc4 and ea0b86b changed both steps
    (("shampoo_step_gpt2-small.json",), (),
     "measured before the current Shampoo and SOAP steps (the record names no commit): since then a factor "
     "block's finiteness is judged by one pass instead of five, the step's batches are bounded in size, and SOAP "
     "accumulates its factors from the gradient stack it projects"),
)
"""Time rows measured with code that has since changed: ``(files, what the row's label contains, why)``. Like
:data:`EXCLUDED`'s rows, predicted and listed but not counted."""


LEFTOVER_PEAK = (
    "measured after a layer-wise configuration in the same process, by code in which a dropped layer-wise optimizer "
    "stayed alive (its parameters' gradient hooks held it): the peak also holds that configuration's model and "
    "state. Records made since release each configuration before the next and state what was still allocated "
    "(held_before_mb)")
"""Why a peak-memory row of :func:`_leftover_configs` is not counted."""


def _leftover_configs(rec: dict[str, Any]) -> set[tuple[str, str]]:
    """``(preset, config)`` of a ``bench scale`` record whose every run came after a layer-wise configuration in the
    process, in a record from before configurations were released between runs (no ``held_before_mb``): their
    peaks hold a dropped layer-wise optimizer's model and state (:data:`LEFTOVER_PEAK`)."""
    if any("held_before_mb" in r for ranks in rec.get("per_rank", []) for r in ranks):
        return set()
    clean, after_layerwise = set(), False
    for s in rec["summary"]:
        if not after_layerwise:
            clean.add((s["preset"], s["config"]))
        after_layerwise = after_layerwise or s["config"].startswith("layerwise:")
    return {(s["preset"], s["config"]) for s in rec["summary"]} - clean


def excluded(source: str, what: str, unit: str) -> str | None:
    """Why a time row (ms or a ratio) is not counted (:data:`EXCLUDED`, :data:`STALE`), or None; peak-memory rows
    are judged where their record is read (:func:`_leftover_configs`)."""
    if unit not in ("ms", "x"):
        return None
    if source in EXCLUDED:
        return EXCLUDED[source]
    for files, parts, why in STALE:
        if source in files and all(p in what for p in parts):
            return why
    return None

ROOT = Path(__file__).resolve().parents[2] / "docs" / "results"
MIB = 2**20  # bench scale records memory in MiB (peak_mem_mb_max); the model and the older records in GB


def device_of(record: dict[str, Any]) -> str:
    """The shipped profile's name ("h100" or "h200") of the GPU a benchmark record ran on: torch's device name in
    ``record['env']['device']`` (``record['device']`` in the older layer-wise record), e.g. "NVIDIA H100 80GB HBM3".
    ValueError for another device."""
    name = record.get("env", {}).get("device") or record.get("device") or ""
    found = [d for d in NOMINAL if d in name.lower()]
    if len(found) != 1:
        raise ValueError(f"the record's device {name!r} names none of the profiled GPUs ({', '.join(NOMINAL)}); "
                         f"validate only records from those, or ship a profile for it")
    return found[0]


def profiles_for(record: dict[str, Any]) -> dict[str, DeviceProfile]:
    """The profiles of the record's device (:func:`device_of`) by label, the shipped one first (labelled by its
    source): the shipped profile, the nominal one if the shipped one is measured, and the ``limits`` variant of the
    nominal one from ``record['env']``."""
    device = device_of(record)
    shipped = shipped_profile(device)
    out = {shipped.source: shipped}
    if shipped.source != "nominal":
        out["nominal"] = nominal(device)
    limits = record.get("env", {}).get("limits")
    if not limits:
        return out
    spec = {**NOMINAL[device], "matmul_flops": limits["peak_bf16_tflops"] * 1e12,
            "hbm_bytes_per_s": limits["copy_tbps"] * 1e12, "matmul_efficiency": 1.0, "hbm_efficiency": 1.0,
            "fp32_flops": NOMINAL[device]["fp32_flops"] * MATMUL_EFFICIENCY,  # not measured: as nominal
            "name": f"{device} with the lab's measured limits"}
    return {**out, "limits": nominal_profile(**spec)}


def _shape_groups(mats: Iterable[Matrix]) -> list[Shapes]:
    by_shape: dict[tuple[int, int], int] = {}
    for m in mats:
        by_shape[(m.m, m.n)] = by_shape.get((m.m, m.n), 0) + m.count
    return [Shapes(m, n, c) for (m, n), c in by_shape.items()]


def _moe_layer_groups(name: str) -> list[Shapes]:
    """The matrices of one layer of the MoE preset ``name`` as ``bench step`` steps them with Muon: attention and
    the experts (the router on AdamW)."""
    layer = dataclasses.replace(PRESETS[name], n_layer=1)
    return _shape_groups(m for m in layer.matrices() if m.name != "moe.router")


def _groups(arch: Architecture, fused: bool) -> tuple[list[Shapes], int]:
    groups = _shape_groups(fused_qkv_matrices(arch) if fused else arch.matrices())
    return groups, arch.total_params() - sum(g.numel for g in groups)


def _step(profile: DeviceProfile, optimizer: str, groups: list[Shapes], rest: int, frequency: int = 10, *,
          check: bool = False, eager: bool = False) -> float:
    """One process's step: the optimizer on the matrices and its AdamW groups on the rest (a side stream), or
    torch's fused AdamW on everything (one elementwise pass). ``check``: the matrix optimizer's step runs its own
    non-finite check (no clip before it hands it the gradients' norms: the benchmarks that time ``step()``
    alone, and DDP under expert parallelism, which clips with torch's ``clip_grads_with_norm_``). ``eager``: Muon's
    step launched eagerly, its Newton–Schulz forms as the dispatcher picks them eagerly."""
    return matrix_step_time(profile, optimizer, groups, precondition_frequency=frequency, adamw_numel=rest,
                            check=check and optimizer != "adamw", eager=eager)


def _gpus(rec: dict[str, Any], n: int) -> str:
    """"2 H100": ``n`` GPUs of the record's device."""
    return f"{n} {device_of(rec).upper()}"


def _peak_gb(summary: dict[str, Any]) -> float:
    """A summary row's largest peak memory per GPU in GB: ``peak_mem_gb_max``, or ``peak_mem_mb_max`` in MiB."""
    if "peak_mem_gb_max" in summary:
        return summary["peak_mem_gb_max"]
    return summary["peak_mem_mb_max"] * MIB / 1e9


def ns_method(record: dict[str, Any]) -> str:
    """The Newton–Schulz form the record's Muon ran: "standard" before the Gram form existed
    (:data:`BEFORE_GRAM`), else the default "auto"."""
    return "standard" if record.get("env", {}).get("git_commit") in BEFORE_GRAM else "auto"


def _row(what: str, source: str, profile: str, predicted: float, measured: float, unit: str,
         why_not_counted: str | None = None) -> dict[str, Any]:
    err = predicted / measured - 1
    return {"what": what, "source": source, "profile": profile, "predicted": predicted, "measured": measured,
            "unit": unit, "error": err, "within": abs(err) <= THRESHOLD,
            "excluded": why_not_counted or excluded(source, what, unit)}


def _shipped(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows predicted with the shipped profile: the first profile of each measurement."""
    first: dict[tuple[str, str], str] = {}
    for r in rows:
        first.setdefault((r["what"], r["source"]), r["profile"])
    return [r for r in rows if first[(r["what"], r["source"])] == r["profile"]]


def single_gpu(root: Path) -> list[dict[str, Any]]:
    rows = []
    for name in ("gpt2-small", "gpt2-medium", "1.3b"):
        path = root / "bench" / f"step_{name}.json"
        rec = json.loads(path.read_text())
        groups, rest = _groups(gpt(name), fused=True)  # bench step keeps QKV fused
        for pname, prof in profiles_for(rec).items():
            for label, key, opt in (("Muon step", "matrixopt muon, deferred check, CUDA graph", "muon"),
                                    ("AdamW step", "adamw (fused)", "adamw")):
                rows.append(_row(f"{name}: {label}, {_gpus(rec, 1)}", path.name, pname,
                                 _step(prof, opt, groups, rest, check=True) * 1e3, rec["results"][key]["ms"]["median"],
                                 "ms"))
    path = root / "moe" / "step_qwen3-30b-a3b.json"  # one MoE layer: attention and 128 experts, router on AdamW
    rec = json.loads(path.read_text())
    groups = _moe_layer_groups("qwen3-30b-a3b")
    for pname, prof in profiles_for(rec).items():
        for label, key, opt in (("Muon step", "matrixopt muon, deferred check, CUDA graph", "muon"),
                                ("AdamW step", "adamw (fused)", "adamw")):
            predicted = _step(prof, opt, groups, rec["limit"]["adamw_params"], check=True) * 1e3
            rows.append(_row(f"qwen3-30b-a3b layer: {label}, {_gpus(rec, 1)}", path.name, pname, predicted,
                             rec["results"][key]["ms"]["median"], "ms"))
    path = root / "bench" / "shampoo_step_gpt2-small.json"
    rec = json.loads(path.read_text())
    groups, rest = _groups(gpt("gpt2-small"), fused=True)
    for pname, prof in profiles_for(rec).items():
        for opt in ("shampoo", "soap"):
            for f in (1, 10):
                measured = rec["results"][f"{opt}, frequency {f}"]["median"]
                rows.append(_row(f"gpt2-small: {opt} step, roots every {f}, {_gpus(rec, 1)}", path.name, pname,
                                 _step(prof, opt, groups, rest, f, check=True) * 1e3, measured, "ms"))
    for name, path, rec, groups, rest in _eager_records(root):
        for pname, prof in profiles_for(rec).items():
            predicted = max(_step(prof, "muon", groups, rest, check=True, eager=True),
                            muon_host_time(prof, groups)) * 1e3
            rows.append(_row(f"{name}: Muon step, eager, {_gpus(rec, 1)}", path.name, pname, predicted,
                             rec["results"]["eager"]["ms"]["median"], "ms"))
    path = root / "plan" / "sustained_h200" / "sustained_step_h200.json"
    rec = json.loads(path.read_text())
    for step in rec["steps"]:
        for pname, prof in profiles_for(rec).items():
            rows.append(_row(f"1.3b, split QKV: Muon step, eager, {step['step']}, at the sustained clock, "
                             f"{_gpus(rec, 1)}", path.name, pname, max(owner_step_ms(prof, step["chunks"])),
                             step["measured_ms"], "ms"))
    for name in ("gpt2-small", "gpt2-medium"):
        path = root / "bench" / f"train_{name}.json"
        rec = json.loads(path.read_text())
        groups, rest = _groups(gpt(name), fused=False)  # the trainer splits Q, K and V
        adamw_ms = rec["results"]["adamw"]["step_ms"]["median"]
        for pname, prof in profiles_for(rec).items():
            fwd_bwd = adamw_ms - _step(prof, "adamw", groups, rest) * 1e3
            ratio = adamw_ms / (fwd_bwd + _step(prof, "muon", groups, rest) * 1e3)
            rows.append(_row(f"{name}: Muon/AdamW tokens/s, training, {_gpus(rec, 1)}", path.name, pname, ratio,
                             rec["results"]["muon"]["vs_adamw"], "x"))
    return rows


def owner_step_ms(profile: DeviceProfile, chunks: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """``(device ms, host ms)`` the cost model gives Muon's eager steps, one after the other, on ``chunks``: each
    ``{"shapes": [[m, n, count], ...], "adamw_numel": values on its AdamW}`` (a layer-wise owner steps its share
    in chunks), each step with its own non-finite check."""
    device = host = 0.0
    for c in chunks:
        groups = [Shapes(m, n, k) for m, n, k in c["shapes"]]
        device += _step(profile, "muon", groups, c["adamw_numel"], check=True, eager=True)
        host += muon_host_time(profile, groups)
    return device * 1e3, host * 1e3


EAGER_MODELS = ("gpt2-small", "gpt2-medium", "1.3b", "qwen3-30b-a3b")
"""The parameter sets whose eager Muon step ``plan/host_h200/`` holds (``matrixopt bench profile step``)."""


def _eager_records(root: Path) -> Iterable[tuple[str, Path, dict[str, Any], list[Shapes], int]]:
    """``(name, path, record, matrix groups, AdamW values)`` of each eager Muon step record on one H200 (bench
    step's parameter sets: GPT-2's QKV fused; one Qwen3-30B-A3B layer, its router on AdamW)."""
    for name in EAGER_MODELS:
        path = root / "plan" / "host_h200" / f"profile_step_{name}_h200.json"
        rec = json.loads(path.read_text())
        if name == "qwen3-30b-a3b":
            groups = _moe_layer_groups(name)
            rest = json.loads((root / "moe" / "step_qwen3-30b-a3b.json").read_text())["limit"]["adamw_params"]
        else:
            groups, rest = _groups(gpt(name), fused=True)
        yield name, path, rec, groups, rest


def host_launch_fit(root: Path = ROOT) -> float:
    """Seconds of host time per kernel of an eager Muon step on one H200: the geometric mean, over the records of
    :func:`_eager_records`, of each step's host time (``step()`` returning, the queue drained before it) over the
    kernels :func:`~matrixopt.distributed.cost.muon_launches` counts on its matrices. The shipped H200 profile's
    ``host_launch``."""
    per = [rec["results"]["eager"]["host_ms"]["median"] / 1e3 / muon_launches(groups)
           for _, _, rec, groups, _ in _eager_records(root)]
    return statistics.geometric_mean(per)


def _summaries(rec: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """A ``bench scale`` record's summary lines by (preset, config). A configuration timed more than once in the
    record (repeats alternated in one call) gets the median of each of its numbers over the repeats, but the least
    of its peak memories: in records from before configurations were released between runs, a later repeat's peak
    also holds what earlier configurations left allocated (:data:`LEFTOVER_PEAK`)."""
    lines: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for s in rec["summary"]:
        lines.setdefault((s["preset"], s["config"]), []).append(s)
    def merged(same: list[dict[str, Any]]) -> dict[str, Any]:
        out = dict(same[0])
        for k, v in out.items():
            values = [x[k] for x in same]
            if k.startswith("peak_mem"):
                out[k] = min(values)
            elif isinstance(v, float) or (isinstance(v, int) and not isinstance(v, bool) and len(set(values)) > 1):
                out[k] = statistics.median(values)
        return out

    return {key: merged(same) for key, same in lines.items()}


NAMES = {"muon": "Muon", "soap": "SOAP", "shampoo": "Shampoo"}


def _vs_adamw(*configs: str) -> list[tuple[str, str, Layout]]:
    """Each ``parallel:optimizer`` configuration with the AdamW run it is compared with (DDP AdamW for layer-wise,
    FSDP2 AdamW for FSDP2) and its planner layout: the ``pairs`` of :func:`_scale_rows`."""
    baseline = {"layerwise": "ddp:adamw", "fsdp": "fsdp:adamw"}
    return [(c, baseline[c.split(":")[0]], Layout(kind=c.split(":")[0])) for c in configs]


def _scale_rows(path: Path, pairs: list[tuple[str, str, Layout]]) -> list[dict[str, Any]]:
    """Rows for ``(matrix optimizer's config, its AdamW config, layout)`` of one ``bench scale`` record: the
    planner given the record's GPUs, tokens per GPU, micro-batches per step, expert-parallel degree, FSDP2
    gathering (``fsdp_gather_once``, absent in records from before the option: gathered per micro-batch) and the
    optimizer's hyperparameters (``--opt``: Shampoo's and SOAP's products, roots and refresh period). Shampoo's
    and SOAP's optimizer step is measured as the training step less its other phases, so that it holds the
    refreshes its timed steps ran (their median step has none)."""
    rec = json.loads(path.read_text())
    world, tokens = rec["world_size"], rec["tokens_per_gpu"]
    once = bool(rec.get("fsdp_gather_once", False))
    rows = []
    by, leftover = _summaries(rec), _leftover_configs(rec)
    for preset in sorted({s["preset"] for s in rec["summary"]}):
        arch = gpt(preset)
        for mat_cfg, adamw_cfg, layout in pairs:
            mu, ad = by.get((preset, mat_cfg)), by.get((preset, adamw_cfg))
            if mu is None or ad is None:
                continue
            optimizer = mat_cfg.split(":")[1]
            hp = rec.get("hparams", {}).get(optimizer, {})
            cfg = PlanConfig(model=arch, gpus=world, tokens_per_gpu=tokens, grad_accum=mu.get("micro_batches", 1),
                             ep=layout.ep if layout.ep > 1 else None, ns_method=ns_method(rec),
                             fsdp_gather_once=once, optimizer=optimizer,
                             # layer-wise matrices in bf16 where the record says so (absent before the option)
                             bf16_weights=mu.get("param_dtype") == "torch.bfloat16",
                             precondition_frequency=int(hp.get("precondition_frequency", 10)),
                             root_method=hp.get("root_method", "newton"),
                             matmul_precision=hp.get("matmul_precision", "fp32"))
            name, step_what = NAMES[optimizer], "optimizer step"
            opt_ms = mu["opt_step_ms_max"]
            if optimizer != "muon":
                step_what += ", refreshes amortized"
                opt_ms = mu["step_ms"] - sum(mu["phases"][ph]["device"] for ph in ("forward", "backward", "clip"))
            where = f"{preset}, {_gpus(rec, world)}, {tokens // 1024}k tokens per GPU, {layout.label}"
            where += " gathered once" if once and layout.kind == "fsdp" else ""
            for pname, prof in profiles_for(rec).items():
                p = predict(layout, cfg, prof)
                fwd_bwd = ad["step_ms"] - (p.adamw_step_s - p.fwd_bwd_s) * 1e3  # measured AdamW step less its model
                step = fwd_bwd + (p.step_s - p.fwd_bwd_s) * 1e3
                rows += [_row(f"{where}: {name} {step_what}", path.name, pname, p.opt_step_s * 1e3, opt_ms, "ms"),
                         _row(f"{where}: {name} training step", path.name, pname, step, mu["step_ms"], "ms"),
                         _row(f"{where}: {name}/AdamW tokens/s", path.name, pname, ad["step_ms"] / step,
                              ad["step_ms"] / mu["step_ms"], "x"),
                         _row(f"{where}: {name} peak memory per GPU", path.name, pname, p.memory.total / 1e9,
                              _peak_gb(mu), "GB", LEFTOVER_PEAK if (preset, mat_cfg) in leftover else None),
                         _row(f"{where}: AdamW peak memory per GPU", path.name, pname, p.adamw_memory.total / 1e9,
                              _peak_gb(ad), "GB", LEFTOVER_PEAK if (preset, adamw_cfg) in leftover else None)]
    return rows


def _ddp_rows(path: Path) -> list[dict[str, Any]]:
    """Rows for DDP Muon against DDP AdamW of one ``bench scale`` record: the planner has no DDP layout, so the
    cost model's step of one process (:func:`_step`) on what a rank steps: every dense matrix and, under expert
    parallelism, its ``1 / ep`` of the expert matrices; the router, tables and vectors on AdamW (as the trainer
    routes them)."""
    rec = json.loads(path.read_text())
    world, tokens, ep = rec["world_size"], rec["tokens_per_gpu"], rec.get("ep", 1)
    by = _summaries(rec)
    rows = []
    for preset in sorted({s["preset"] for s in rec["summary"]}):
        mu, ad = by.get((preset, "ddp:muon")), by.get((preset, "ddp:adamw"))
        if mu is None or ad is None:
            continue
        arch = gpt(preset)
        mats = [dataclasses.replace(m, count=m.count // ep) if m.expert else m
                for m in arch.matrices() if m.name != "moe.router"]
        groups = _shape_groups(mats)
        local = arch.total_params() - sum(m.numel for m in arch.matrices() if m.expert) * (ep - 1) // ep
        rest = local - sum(g.numel for g in groups)
        where = f"{preset}, {_gpus(rec, world)}, {tokens // 1024}k tokens per GPU, ddp" + (f" ep{ep}" if ep > 1 else "")
        for pname, prof in profiles_for(rec).items():
            muon = _step(prof, "muon", groups, rest, check=ep > 1) * 1e3
            adamw = _step(prof, "adamw", groups, rest) * 1e3
            muon_step = ad["step_ms"] - adamw + muon
            rows += [_row(f"{where}: Muon optimizer step", path.name, pname, muon, mu["opt_step_ms_max"], "ms"),
                     _row(f"{where}: AdamW optimizer step", path.name, pname, adamw, ad["opt_step_ms_max"], "ms"),
                     _row(f"{where}: Muon training step", path.name, pname, muon_step, mu["step_ms"], "ms"),
                     _row(f"{where}: Muon/AdamW tokens/s", path.name, pname, ad["step_ms"] / muon_step,
                          ad["step_ms"] / mu["step_ms"], "x")]
    return rows


def _gather_rows(per_micro_batch: Path, once: Path) -> list[dict[str, Any]]:
    """The FSDP2 AdamW training step gathered per micro-batch, predicted from the same call's run gathered once
    per step (two ``bench scale`` records of the same GPUs, preset and batch, ``fsdp_gather_once`` false and true):
    forward and backward from the gathered-once run's measured step less its modelled communication and optimizer
    step, plus the per-micro-batch layout's. The only rows that test what gathering once saves; the others take
    forward and backward from an AdamW run gathered the same way as the Muon run, so the gathers cancel."""
    recs = [json.loads(p.read_text()) for p in (per_micro_batch, once)]
    if [bool(r.get("fsdp_gather_once", False)) for r in recs] != [False, True]:
        raise ValueError(f"{per_micro_batch.name} must gather per micro-batch and {once.name} once per step "
                         f"(their fsdp_gather_once fields)")
    rows = []
    by = [{p: s for (p, c), s in _summaries(r).items() if c == "fsdp:adamw"} for r in recs]
    rec, world, tokens = recs[0], recs[0]["world_size"], recs[0]["tokens_per_gpu"]
    for preset in sorted(by[0].keys() & by[1].keys()):
        per, one = by[0][preset], by[1][preset]
        base = PlanConfig(model=gpt(preset), gpus=world, tokens_per_gpu=tokens, grad_accum=per["micro_batches"],
                          ns_method=ns_method(rec))
        where = f"{preset}, {_gpus(rec, world)}, {tokens // 1024}k tokens per GPU, fsdp"
        for pname, prof in profiles_for(rec).items():
            p_per, p_once = (predict(Layout(kind="fsdp"), dataclasses.replace(base, fsdp_gather_once=o), prof)
                             for o in (False, True))
            fwd_bwd = one["step_ms"] - (p_once.adamw_step_s - p_once.fwd_bwd_s) * 1e3
            predicted = fwd_bwd + (p_per.adamw_step_s - p_per.fwd_bwd_s) * 1e3
            rows.append(_row(f"{where}: AdamW training step gathered per micro-batch, from the run gathered once",
                             per_micro_batch.name, pname, predicted, per["step_ms"], "ms"))
    return rows


def _single_rows(path: Path) -> list[dict[str, Any]]:
    """Rows for the single-GPU reference of one ``bench scale`` record (``single_gpu_step_ms`` of a layer-wise
    line: the matrix optimizer stepping the whole model in one process, eagerly): the cost model's step of one
    process on every matrix, the router, tables and vectors on AdamW, or the host's time to issue it where that is
    longer (:func:`~matrixopt.distributed.cost.muon_host_time`)."""
    rec = json.loads(path.read_text())
    rows = []
    for line in rec["summary"]:
        if "single_gpu_step_ms" not in line or not line["config"].endswith(":muon"):
            continue
        arch = gpt(line["preset"])
        groups = _shape_groups(m for m in arch.matrices() if m.name != "moe.router")
        rest = arch.total_params() - sum(g.numel for g in groups)
        for pname, prof in profiles_for(rec).items():
            rows.append(_row(f"{line['preset']}, {_gpus(rec, 1)}: Muon step, whole model (the record's single-GPU "
                             f"reference)", path.name, pname,
                             max(_step(prof, "muon", groups, rest, check=True, eager=True),
                                 muon_host_time(prof, groups)) * 1e3,
                             line["single_gpu_step_ms"], "ms"))
    return rows


def layerwise_owners(path: Path, rec: dict[str, Any], preset: str, steps_ms: list[float],
                     state_ratio: float) -> list[dict[str, Any]]:
    """The layer-wise balancer's assignment of GPT ``preset`` (untied head, vocab 50304, learned positions) over
    the record's ranks (QKV fused as the trainer owns it, split in three for Newton–Schulz), each owner's step
    predicted by the cost model with the shipped profile of the record's device: its slowest/mean owner step and
    its largest state share against the measured ones (``steps_ms``: each rank's own optimizer step)."""
    world = rec["world_size"]
    shape = GPT_PRESETS[preset]
    d, L, V, T = shape["n_embd"], shape["n_layer"], GPT_VOCAB, shape["block_size"]
    pieces = [[(d, d)] * 3, [(d, d)], [(4 * d, d)], [(d, 4 * d)]] * L  # c_attn (three pieces), c_proj, c_fc, proj
    costs = [sum(balance.muon_cost(m, n) for m, n in ps) for ps in pieces]
    sizes = [4 * sum(m * n for m, n in ps) for ps in pieces]  # Muon momentum, fp32
    tables = [8 * V * d, 8 * V * d, 8 * T * d]  # token embedding, untied head, positions: AdamW's two moments
    owner, compute = balance.lpt(costs, world)
    state = [0] * world
    for i, r in enumerate(owner):
        state[r] += sizes[i]
    table_owner, _ = balance.lpt([float(b) for b in tables], world, state)
    owner = balance.rebalance_state(owner + table_owner, costs + [0.0] * 3, sizes + tables, world,
                                    (1 + balance.COST_TOLERANCE) * max(compute))
    prof = shipped_profile(device_of(rec))
    step, held = [0.0] * world, [0] * world
    for r in range(world):
        stacks: dict[tuple[int, int], int] = {}
        for i, ps in enumerate(pieces):
            if owner[i] == r:
                for mn in ps:
                    stacks[mn] = stacks.get(mn, 0) + 1
        groups = [Shapes(m, n, c) for (m, n), c in stacks.items()]
        rest = sum(b // 8 for b, o in zip(tables, owner[len(pieces):]) if o == r)
        step[r] = _step(prof, "muon", groups, rest, eager=True)
        held[r] = sum(b for b, o in zip(sizes + tables, owner) if o == r)
    where = f"{preset}, {_gpus(rec, world)}, layer-wise owners"
    return [_row(f"{where}: slowest / mean owner step", path.name, prof.source,
                 max(step) / (sum(step) / world), max(steps_ms) / (sum(steps_ms) / world), "x"),
            _row(f"{where}: largest state / single-process state", path.name, prof.source,
                 max(held) / sum(held), state_ratio, "x")]


def scaling(root: Path) -> list[dict[str, Any]]:
    """The 2- and 4-H200 records (one micro-batch of 4096 tokens per GPU)."""
    lw, fsdp = Layout(kind="layerwise"), Layout(kind="fsdp")
    dist = root / "distributed"
    rec = json.loads((dist / "layerwise_1.3b_2gpu.json").read_text())
    rows = layerwise_owners(dist / "layerwise_1.3b_2gpu.json", rec, "1.3b",
                            [p["layerwise_step_ms"] for p in rec["per_rank"]], rec["state_ratio"])
    rows += _scale_rows(dist / "scale_1.3b_2gpu.json", [("layerwise:muon", "ddp:adamw", lw)])
    rows += _scale_rows(dist / "scale_1.3b_2gpu_fsdp.json", [("fsdp:muon", "fsdp:adamw", fsdp)])
    rows += _scale_rows(dist / "scale_4gpu.json", [("layerwise:muon", "ddp:adamw", lw),
                                                   ("fsdp:muon", "fsdp:adamw", fsdp)])
    return rows


def scaling_h100(root: Path) -> list[dict[str, Any]]:
    """The 2-H100 records: 1.3B at 16k and 64k tokens per GPU in micro-batches of two rows, FSDP2 at 16k gathered
    per micro-batch and once per step in one call, moe-2b with expert parallelism 2 at 16k, the single-GPU step
    each record took as its reference, and the records that alternate repeats of their configurations."""
    lw, fsdp = Layout(kind="layerwise"), Layout(kind="fsdp")
    dist = root / "distributed"
    path = dist / "scale_1.3b_16k_2xh100.json"
    rec = json.loads(path.read_text())
    (layerwise,) = [ranks for ranks in rec["per_rank"] if ranks[0]["config"] == "layerwise:muon"]
    (line,) = [s for s in rec["summary"] if s["config"] == "layerwise:muon"]
    rows = layerwise_owners(path, rec, "1.3b", [r["inner_step_ms"] for r in layerwise], line["state_vs_single_gpu"])
    for name in ("scale_1.3b_16k_2xh100.json", "scale_1.3b_64k_2xh100.json"):
        rows += _single_rows(dist / name)
        rows += _scale_rows(dist / name, [("layerwise:muon", "ddp:adamw", lw), ("fsdp:muon", "fsdp:adamw", fsdp)])
    per_micro_batch, once = (dist / f"scale_1.3b_16k_fsdp{s}_2xh100.json" for s in ("", "_gather_once"))
    for path in (per_micro_batch, once):
        rows += _scale_rows(path, [("fsdp:muon", "fsdp:adamw", fsdp)])
    rows += _gather_rows(per_micro_batch, once)
    moe = dist / "scale_moe-2b_ep2_16k_2xh100.json"
    rows += _single_rows(moe) + _ddp_rows(moe)
    rows += _scale_rows(moe, [("layerwise:muon", "ddp:adamw", Layout(kind="layerwise", ep=2))])
    # alternated repeats in one call (medians over the repeats), FSDP2 Muon with the device-side non-finite check
    for name in ("scale_1.3b_16k_fsdp_deferred_a_2xh100.json", "scale_1.3b_16k_fsdp_deferred_b_2xh100.json",
                 "scale_1.3b_4k_fsdp_2xh100.json", "scale_1.3b_64k_fsdp_gather_once_2xh100.json",
                 "scale_1.3b_64k_fsdp_gather_once_alt_2xh100.json"):
        rows += _scale_rows(dist / name, [("fsdp:muon", "fsdp:adamw", fsdp)])
    for name in ("scale_1.3b_16k_layerwise_alt_2xh100.json", "scale_1.3b_64k_layerwise_alt_2xh100.json",
                 # the owners' mean inside NCCL's reduction and the clip's norms as the non-finite check
                 "layerwise_mean_ab/scale_new1_2xh100.json", "layerwise_mean_ab/scale_new2_2xh100.json",
                 # the matrices kept in bf16 (fp32 masters on their owners)
                 *(f"layerwise_bf16_weights/scale_{t}_2xh100.json"
                   for t in ("new16a", "new16b", "new16c", "new4k", "new4kc", "new64k", "new64kc"))):
        rows += _scale_rows(dist / name, [("layerwise:muon", "ddp:adamw", lw)])
    for name in ("scale_moe-2b_ep2_16k_alt_2xh100.json", "scale_moe-2b_ep2_16k_alt3_2xh100.json",
                 "scale_moe-2b_ep2_16k_clip_new_2xh100.json"):
        rows += _ddp_rows(dist / name)
    rows += _scale_rows(dist / "scale_1.3b_16k_precond_refresh_2xh100.json",
                        _vs_adamw("layerwise:soap", "fsdp:soap", "layerwise:shampoo", "fsdp:shampoo"))
    for name in ("scale_1.3b_16k_shampoo_alt_2xh100.json", "scale_1.3b_16k_shampoo_alt2_2xh100.json"):
        rows += _scale_rows(dist / name, [("layerwise:shampoo", "ddp:adamw", lw), ("fsdp:shampoo", "fsdp:adamw", fsdp)])
    rows += _scale_rows(dist / "layerwise_bf16_weights/scale_precond16_2xh100.json",
                        [("layerwise:soap", "ddp:adamw", lw), ("layerwise:shampoo", "ddp:adamw", lw)])
    for name in ("precond_fsdp/scale_soap_new_a_2xh100.json", "precond_fsdp/scale_soap_new_b_2xh100.json"):
        rows += _scale_rows(dist / name, [("fsdp:soap", "fsdp:adamw", fsdp)])  # SOAP's install in batches
    for name in ("fsdp_clip_ab/scale_fsdp64k_new_a_2xh100.json", "fsdp_clip_ab/scale_fsdp64k_new_b_2xh100.json",
                 "fsdp_clip_ab/scale_fsdp16k_new_2xh100.json"):
        rows += _scale_rows(dist / name, [("fsdp:muon", "fsdp:adamw", fsdp)])  # the clip held for the step
    for name in ("scale_base_a_2xh100.json", "scale_base_b_2xh100.json", "scale_new_a_2xh100.json",
                 "scale_new_b_2xh100.json"):  # gathered as the forward reaches each block, and all up front
        rows += _scale_rows(dist / "fsdp_gather_ahead" / name, [("fsdp:muon", "fsdp:adamw", fsdp)])
    rows += _scale_rows(dist / "fsdp_gather_ahead" / "scale_precond_ahead_2xh100.json",
                        _vs_adamw("fsdp:soap", "fsdp:shampoo"))
    for path in sorted((dist / "bf16_products").glob("ab_*.json")):  # staggered, TF32 or bf16 step products
        rows += _scale_rows(path, _vs_adamw("fsdp:soap", "fsdp:shampoo"))
    for pattern in ("fsdp_new_*.json", "fsdp_current_*.json"):  # the refresh trimmed, SOAP's block writes
        for path in sorted((dist / "refresh_triangles").glob(pattern)):
            rows += _scale_rows(path, _vs_adamw("fsdp:soap", "fsdp:shampoo"))
    return rows


def scaling_h200(root: Path) -> list[dict[str, Any]]:
    """The 2-H200 records of the current code (each configuration's model and optimizer released before the next is
    built, so its peak memory is its own): 1.3B at 4k, 16k and 64k tokens per GPU in micro-batches of two rows,
    FSDP2 gathered once per step, Shampoo and SOAP with a refresh in the window, moe-2b with expert parallelism 2;
    each alternating repeats of its configurations where it lists them twice."""
    lw, fsdp = Layout(kind="layerwise"), Layout(kind="fsdp")
    dist = root / "distributed"
    path = dist / "scale_1.3b_16k_layerwise_alt_2xh200.json"
    rec = json.loads(path.read_text())
    first = next(ranks for ranks in rec["per_rank"] if ranks[0]["config"] == "layerwise:muon")
    line = next(s for s in rec["summary"] if s["config"] == "layerwise:muon")
    rows = layerwise_owners(path, rec, "1.3b", [r["inner_step_ms"] for r in first], line["state_vs_single_gpu"])
    rows += _single_rows(path) + _scale_rows(path, [("layerwise:muon", "ddp:adamw", lw)])
    for name in ("scale_1.3b_4k_2xh200.json", "scale_1.3b_64k_2xh200.json"):
        rows += _scale_rows(dist / name, [("layerwise:muon", "ddp:adamw", lw), ("fsdp:muon", "fsdp:adamw", fsdp)])
    rows += _scale_rows(dist / "scale_1.3b_16k_fsdp_2xh200.json", [("fsdp:muon", "fsdp:adamw", fsdp)])
    for name in ("scale_moe-2b_ep2_16k_clocks_2xh200.json", "scale_moe-2b_ep2_16k_clocks2_2xh200.json"):
        rows += _ddp_rows(dist / name)
    rows += _scale_rows(dist / "scale_1.3b_16k_precond_refresh_2xh200.json",
                        _vs_adamw("layerwise:soap", "fsdp:soap", "layerwise:shampoo", "fsdp:shampoo"))
    # the current code (matrices in bf16 under layer-wise, the clip held under FSDP2), repeats alternated
    two = dist / "two_h200"
    muon = [("layerwise:muon", "ddp:adamw", lw), ("fsdp:muon", "fsdp:adamw", fsdp)]
    for name in ("scale_16k_2xh200.json", "scale_4k_2xh200.json", "scale_4k_rep_2xh200.json",
                 "scale_64k_2xh200.json", "scale_64k_rep_2xh200.json"):
        rows += _scale_rows(two / name, muon)
    rows += _scale_rows(two / "scale_fsdp16k_rep_2xh200.json", muon[1:])
    rows += _scale_rows(two / "scale_precond16k_2xh200.json",
                        _vs_adamw("layerwise:soap", "fsdp:soap", "layerwise:shampoo", "fsdp:shampoo"))
    rows += _scale_rows(two / "scale_precond16k_rep_2xh200.json",
                        _vs_adamw("fsdp:soap", "fsdp:shampoo"))
    # FSDP2 SOAP and Shampoo with their bases and roots kept stacked and Shampoo's estimates from the power step
    for path in sorted((dist / "kept_stacks").glob("fsdp_new_*.json")):
        rows += _scale_rows(path, _vs_adamw("fsdp:soap", "fsdp:shampoo"))
    # and with their blocks moved by one copy kernel, SOAP's gradients exchanged in bf16; then SOAP's updates sent
    # back beside its refresh (the current step)
    for pattern in ("exchange_new_*.json", "beside_new_*.json"):
        for path in sorted((dist / "step_trims").glob(pattern)):
            rows += _scale_rows(path, _vs_adamw("fsdp:soap", "fsdp:shampoo"))
    return rows


def scaling_4xh100(root: Path) -> list[dict[str, Any]]:
    """The 4-H100 record of the current code: 1.3B and GPT-2-medium at 4k tokens per GPU (one micro-batch),
    layer-wise Muon against DDP AdamW and FSDP2 Muon against FSDP2 AdamW, each configuration released before the
    next is built; the layer-wise owners of 1.3B and the whole-model step the record took on one GPU."""
    lw, fsdp = Layout(kind="layerwise"), Layout(kind="fsdp")
    path = root / "distributed" / "scale_4k_4xh100.json"
    rec = json.loads(path.read_text())
    first = next(ranks for ranks in rec["per_rank"] if ranks[0]["config"] == "layerwise:muon")
    line = next(s for s in rec["summary"] if s["config"] == "layerwise:muon" and s["preset"] == first[0]["preset"])
    rows = layerwise_owners(path, rec, first[0]["preset"], [r["inner_step_ms"] for r in first],
                            line["state_vs_single_gpu"])
    rows += _single_rows(path) + _scale_rows(path, [("layerwise:muon", "ddp:adamw", lw),
                                                    ("fsdp:muon", "fsdp:adamw", fsdp)])
    four = root / "distributed" / "four_gpus"  # 1.3B at 16k tokens per GPU, repeats alternated in one call
    rows += _scale_rows(four / "scale_muon16k_4xh100.json", [("layerwise:muon", "ddp:adamw", lw),
                                                             ("fsdp:muon", "fsdp:adamw", fsdp)])
    rows += _scale_rows(four / "scale_muon16k_rep_4xh100.json", [("fsdp:muon", "fsdp:adamw", fsdp)])
    for name in ("scale_precond16k_4xh100.json", "scale_precond16k_rep_4xh100.json"):
        rows += _scale_rows(four / name, _vs_adamw("fsdp:soap", "fsdp:shampoo"))
    return rows


def _tp_times(prof: DeviceProfile, world: int, steps: int, method: str, r: int, c: int,
              chunks: int) -> dict[str, float]:
    return tp_ns_times(r, c, world, steps=steps, chunks=chunks, link=prof.link(world),
                       ns=lambda s, l, b: newton_schulz_time(prof, b, s, l, steps, method, eager=True),
                       gemm=lambda f: prof.seconds("gemm", f))


def tensor_parallel(root: Path) -> list[dict[str, Any]]:
    rows = []
    for world, name in ((2, "tp_ns_2gpu.json"), (4, "tp_ns_4gpu.json"), (2, "tp_ns_2xh100.json"),
                        (4, "tp_ns_4xh100.json")):
        path = root / "distributed" / name
        rec = json.loads(path.read_text())
        steps = rec["env"].get("ns_steps", 5)
        prof = shipped_profile(device_of(rec))
        method = ns_method(rec)
        times = functools.partial(_tp_times, prof, world, steps, method)

        best: dict[tuple, dict[str, float]] = {}
        for e in rec["newton_schulz"]:
            m, n = e["shape"]
            if e["shard_dim"] is None:
                rows.append(_row(f"NS {m}x{n}, {_gpus(rec, 1)}", path.name, prof.source,
                                 newton_schulz_time(prof, 1, m, n, steps, method, eager=True) * 1e3,
                                 e["median_ms"], "ms"))
                continue
            if e["mode"] == "distributed" and e["chunks"] != TP_GRAM_CHUNKS:
                continue  # the default chunking is the row compared
            r, c = (n, m) if e["shard_dim"] == 0 else (m, n)
            pred = times(r, c, e["chunks"] or 1)[e["mode"]] * 1e3
            rows.append(_row(f"NS {m}x{n} split dim {e['shard_dim']}, TP {world} {e['mode']}", path.name, prof.source,
                             pred, e["median_ms"], "ms"))
            if e["mode"] in ("duplicated", "distributed"):
                best.setdefault((m, n, e["shard_dim"]), {})[e["mode"]] = e["median_ms"]
                best[(m, n, e["shard_dim"])]["picked"] = e["auto_picks"]
        for (m, n, dim), meas in best.items():
            r, c = (n, m) if dim == 0 else (m, n)
            t = times(r, c, TP_GRAM_CHUNKS)
            ours = min(("duplicated", "distributed"), key=t.get)
            fastest = min(("duplicated", "distributed"), key=meas.get)
            rows.append({"what": f"TP {world} mode choice, {m}x{n} split dim {dim}", "source": path.name,
                         "profile": prof.source, "predicted": ours, "measured": fastest, "unit": "mode",
                         "error": None, "within": ours == fastest, "excluded": None})
    return rows


SECTIONS: dict[str, Callable[[Path], list[dict[str, Any]]]] = {
    "single GPU": single_gpu, "scaling": scaling, "scaling, 2 H100": scaling_h100, "scaling, 2 H200": scaling_h200,
    "scaling, 4 H100": scaling_4xh100, "tensor-parallel Newton-Schulz": tensor_parallel}


def validate(root: Path = ROOT) -> dict[str, list[dict[str, Any]]]:
    """Every section's rows; ValueError naming a results file that is missing."""
    out = {}
    for name, fn in SECTIONS.items():
        try:
            out[name] = fn(root)
        except FileNotFoundError as e:
            raise ValueError(f"validation reads the committed results under {root}; missing {e.filename}") from None
    return out


def _cell(r: dict[str, Any]) -> str:
    if r["unit"] == "mode":
        return f"{r['predicted']} ({'same' if r['within'] else '**differs**'})"
    fmt = ".3f" if r["unit"] == "x" else ".3g"
    err = f"{r['error']:+.1%}"
    if r["excluded"]:
        return f"{r['predicted']:{fmt}} ({err}, excluded)"
    return f"{r['predicted']:{fmt}} ({err if r['within'] else f'**{err}**'})"


def _count(rows: list[dict[str, Any]]) -> str:
    counted = [r for r in rows if not r["excluded"]]
    return f"{sum(r['within'] for r in counted)} of {len(counted)}"


def format_validation(sections: dict[str, list[dict[str, Any]]]) -> str:
    """Markdown tables, one row per measurement and one column per profile (error in parentheses, in bold beyond
    :data:`THRESHOLD`), and the count of rows within it."""
    lines = []
    for name, rows in sections.items():
        profiles = list(dict.fromkeys(r["profile"] for r in rows))
        predicted = " | ".join(f"predicted, {p} profile" for p in profiles)
        lines += [f"## {name}", "", f"| measurement | measured | {predicted} | source |",
                  "| --- " * (len(profiles) + 3) + "|"]
        keyed: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
        for r in rows:
            keyed.setdefault((r["what"], r["source"]), {})[r["profile"]] = r
        for (what, source), by in keyed.items():
            first = next(iter(by.values()))
            fmt = ".3f" if first["unit"] == "x" else ".3g"
            meas = first["measured"] if first["unit"] == "mode" else f"{first['measured']:{fmt}} {first['unit']}"
            cells = [_cell(by[p]) if p in by else "" for p in profiles]
            lines.append(f"| {what} | {meas} | " + " | ".join(cells) + f" | {source} |")
        lines.append("")
    flat = [r for rows in sections.values() for r in rows]
    shipped = _shipped(flat)
    reasons = {r["source"]: r["excluded"] for r in shipped if r["excluded"]}
    lines.append(f"{_count(shipped)} rows within {THRESHOLD:.0%} (or the same mode) with the shipped profiles; "
                 f"{_count(flat)} with any; {sum(bool(r['excluded']) for r in shipped)} shipped-profile rows "
                 f"excluded")
    lines += [f"- excluded, {source}: {reason}" for source, reason in reasons.items()]
    return "\n".join(lines)
