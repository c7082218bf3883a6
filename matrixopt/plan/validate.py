"""Predicted against measured: every committed measurement the cost model can be checked on, read from the JSON
files under ``docs/results/`` (``matrixopt plan --validate``).

Each row names its source file and what the model was given. Up to three device profiles are compared: the shipped
profile of the device the run used (``measured`` for the H100, ``nominal`` for the H200), the nominal one built
from the data sheet where the shipped one is measured, and ``limits``: the nominal one with the matmul rate and
copy bandwidth the run's machine measured (the ``env.limits`` every benchmark JSON records) as the achieved rates.
Where a throughput ratio is predicted, the forward and backward time comes from the measured AdamW step of the
same run minus the model's AdamW optimizer step (the planner cannot predict MFU); the matrix optimizer's step is
the prediction.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from matrixopt.distributed import balance
from matrixopt.distributed.calibrate import NOMINAL, nominal
from matrixopt.distributed.cost import (
    ADAMW_BYTES,
    MATMUL_EFFICIENCY,
    DeviceProfile,
    Shapes,
    matrix_step_time,
    newton_schulz_time,
    nominal_profile,
    shipped_profile,
    tp_ns_times,
)
from matrixopt.plan.models import PRESETS, Architecture, Matrix, fused_qkv_matrices, gpt
from matrixopt.plan.planner import Layout, PlanConfig, predict

THRESHOLD = 0.15  # the relative error the model aims to stay within
ROOT = Path(__file__).resolve().parents[2] / "docs" / "results"


def profiles_for(record: dict[str, Any], device: str) -> dict[str, DeviceProfile]:
    """The profiles of ``device`` ("h100" or "h200") by label, the shipped one first (labelled by its source):
    the shipped profile, the nominal one if the shipped one is measured, and the ``limits`` variant of the nominal
    one from ``record['env']``."""
    shipped = shipped_profile(device)
    out = {shipped.source: shipped}
    if shipped.source != "nominal":
        out["nominal"] = nominal(device)
    limits = record["env"].get("limits")
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


def _groups(arch: Architecture, fused: bool) -> tuple[list[Shapes], int]:
    groups = _shape_groups(fused_qkv_matrices(arch) if fused else arch.matrices())
    return groups, arch.total_params() - sum(g.numel for g in groups)


def _step(profile: DeviceProfile, optimizer: str, groups: list[Shapes], rest: int, frequency: int = 10) -> float:
    """One process's step: the optimizer on the matrices and AdamW on the rest (one elementwise pass)."""
    if optimizer == "adamw":
        return profile.seconds("elementwise", ADAMW_BYTES * (sum(g.numel for g in groups) + rest))
    return (matrix_step_time(profile, optimizer, groups, precondition_frequency=frequency)
            + profile.seconds("elementwise", ADAMW_BYTES * rest))


def _row(what: str, source: str, profile: str, predicted: float, measured: float, unit: str) -> dict[str, Any]:
    err = predicted / measured - 1
    return {"what": what, "source": source, "profile": profile, "predicted": predicted, "measured": measured,
            "unit": unit, "error": err, "within": abs(err) <= THRESHOLD}


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
        for pname, prof in profiles_for(rec, "h100").items():
            for label, key, opt in (("Muon step", "matrixopt muon, deferred check, CUDA graph", "muon"),
                                    ("AdamW step", "adamw (fused)", "adamw")):
                rows.append(_row(f"{name}: {label}, 1 H100", path.name, pname, _step(prof, opt, groups, rest) * 1e3,
                                 rec["results"][key]["ms"]["median"], "ms"))
    path = root / "moe" / "step_qwen3-30b-a3b.json"  # one MoE layer: attention and 128 experts, router on AdamW
    rec = json.loads(path.read_text())
    layer = dataclasses.replace(PRESETS["qwen3-30b-a3b"], n_layer=1)
    groups = _shape_groups(m for m in layer.matrices() if m.name != "moe.router")
    for pname, prof in profiles_for(rec, "h100").items():
        for label, key, opt in (("Muon step", "matrixopt muon, deferred check, CUDA graph", "muon"),
                                ("AdamW step", "adamw (fused)", "adamw")):
            predicted = _step(prof, opt, groups, rec["limit"]["adamw_params"]) * 1e3
            rows.append(_row(f"qwen3-30b-a3b layer: {label}, 1 H100", path.name, pname, predicted,
                             rec["results"][key]["ms"]["median"], "ms"))
    path = root / "bench" / "shampoo_step_gpt2-small.json"
    rec = json.loads(path.read_text())
    groups, rest = _groups(gpt("gpt2-small"), fused=True)
    for pname, prof in profiles_for(rec, "h100").items():
        for opt in ("shampoo", "soap"):
            for f in (1, 10):
                measured = rec["results"][f"{opt}, frequency {f}"]["median"]
                rows.append(_row(f"gpt2-small: {opt} step, roots every {f}, 1 H100", path.name, pname,
                                 _step(prof, opt, groups, rest, f) * 1e3, measured, "ms"))
    for name in ("gpt2-small", "gpt2-medium"):
        path = root / "bench" / f"train_{name}.json"
        rec = json.loads(path.read_text())
        groups, rest = _groups(gpt(name), fused=False)  # the trainer splits Q, K and V
        adamw_ms = rec["results"]["adamw"]["step_ms"]["median"]
        for pname, prof in profiles_for(rec, "h100").items():
            fwd_bwd = adamw_ms - _step(prof, "adamw", groups, rest) * 1e3
            ratio = adamw_ms / (fwd_bwd + _step(prof, "muon", groups, rest) * 1e3)
            rows.append(_row(f"{name}: Muon/AdamW tokens/s, training, 1 H100", path.name, pname, ratio,
                             rec["results"]["muon"]["vs_adamw"], "x"))
    return rows


def _scale_rows(path: Path, summary: list[dict[str, Any]], world: int, tokens: int,
                pairs: list[tuple[str, str, Layout]]) -> list[dict[str, Any]]:
    """Rows for ``(muon config, its AdamW config, layout)`` of one scaling record."""
    rec = json.loads(path.read_text())
    rows = []
    by = {(s["preset"], s["config"]): s for s in summary}
    for preset in sorted({s["preset"] for s in summary}):
        arch = gpt(preset)
        for muon_cfg, adamw_cfg, layout in pairs:
            mu, ad = by.get((preset, muon_cfg)), by.get((preset, adamw_cfg))
            if mu is None or ad is None:
                continue
            for pname, prof in profiles_for(rec, "h200").items():
                cfg = PlanConfig(model=arch, gpus=world, tokens_per_gpu=tokens)
                p = predict(layout, cfg, prof)
                fwd_bwd = ad["step_ms"] - (p.adamw_step_s - p.fwd_bwd_s) * 1e3  # measured AdamW step less its model
                muon_step = fwd_bwd + (p.step_s - p.fwd_bwd_s) * 1e3
                where = f"{preset}, {world} H200, {layout.kind}"
                rows += [_row(f"{where}: Muon optimizer step", path.name, pname, p.opt_step_s * 1e3,
                              mu["opt_step_ms_max"], "ms"),
                         _row(f"{where}: Muon training step", path.name, pname, muon_step, mu["step_ms"], "ms"),
                         _row(f"{where}: Muon/AdamW tokens/s", path.name, pname, ad["step_ms"] / muon_step,
                              ad["step_ms"] / mu["step_ms"], "x"),
                         _row(f"{where}: Muon peak memory per GPU", path.name, pname, p.memory.total / 1e9,
                              mu["peak_mem_gb_max"], "GB"),
                         _row(f"{where}: AdamW peak memory per GPU", path.name, pname, p.adamw_memory.total / 1e9,
                              ad["peak_mem_gb_max"], "GB")]
    return rows


def layerwise_owners(root: Path) -> list[dict[str, Any]]:
    """The layer-wise balancer's assignment of the 1.3B GPT over 2 ranks (QKV fused as the trainer owns it, split
    in three for Newton–Schulz), each owner's step predicted by the cost model: its slowest/mean owner step and its
    largest state share against the measured ones."""
    path = root / "distributed" / "layerwise_1.3b_2gpu.json"
    rec = json.loads(path.read_text())
    world, shape = rec["world_size"], rec["shape"]
    d, L, V, T = shape["n_embd"], shape["n_layer"], shape["vocab_size"], shape["block_size"]
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
    prof = shipped_profile("h200")
    step, held = [0.0] * world, [0] * world
    for r in range(world):
        stacks: dict[tuple[int, int], int] = {}
        for i, ps in enumerate(pieces):
            if owner[i] == r:
                for mn in ps:
                    stacks[mn] = stacks.get(mn, 0) + 1
        groups = [Shapes(m, n, c) for (m, n), c in stacks.items()]
        rest = sum(b // 8 for b, o in zip(tables, owner[len(pieces):]) if o == r)
        step[r] = _step(prof, "muon", groups, rest)
        held[r] = sum(b for b, o in zip(sizes + tables, owner) if o == r)
    measured_steps = [p["layerwise_step_ms"] for p in rec["per_rank"]]
    return [_row("1.3b, 2 H200, layer-wise owners: slowest / mean owner step", path.name, prof.source,
                 max(step) / (sum(step) / world), max(measured_steps) / (sum(measured_steps) / world), "x"),
            _row("1.3b, 2 H200, layer-wise owners: largest state / single-process state", path.name, prof.source,
                 max(held) / sum(held), rec["state_ratio"], "x")]


def scaling(root: Path) -> list[dict[str, Any]]:
    lw, fsdp = Layout(kind="layerwise"), Layout(kind="fsdp")
    rows = layerwise_owners(root)
    two = json.loads((root / "distributed" / "scale_1.3b_2gpu.json").read_text())
    two_fsdp = json.loads((root / "distributed" / "scale_1.3b_2gpu_fsdp.json").read_text())
    rows += _scale_rows(root / "distributed" / "scale_1.3b_2gpu.json", two["summary"], 2, two["tokens_per_gpu"],
                        [("layerwise:muon", "ddp:adamw", lw)])
    rows += _scale_rows(root / "distributed" / "scale_1.3b_2gpu_fsdp.json", two_fsdp["summary"], 2,
                        two_fsdp["tokens_per_gpu"], [("fsdp:muon", "fsdp:adamw", fsdp)])
    four = json.loads((root / "distributed" / "scale_4gpu.json").read_text())
    rows += _scale_rows(root / "distributed" / "scale_4gpu.json", four["summary"], 4, four["tokens_per_gpu"],
                        [("layerwise:muon", "ddp:adamw", lw), ("fsdp:muon", "fsdp:adamw", fsdp)])
    return rows


def _tp_times(prof: DeviceProfile, world: int, steps: int, r: int, c: int, chunks: int) -> dict[str, float]:
    return tp_ns_times(r, c, world, steps=steps, chunks=chunks, link=prof.link(world),
                       ns=lambda s, l, b: newton_schulz_time(prof, b, s, l, steps),
                       gemm=lambda f: prof.seconds("gemm", f), gram=lambda f: prof.seconds("syrk", f))


def tensor_parallel(root: Path) -> list[dict[str, Any]]:
    rows = []
    for world in (2, 4):
        path = root / "distributed" / f"tp_ns_{world}gpu.json"
        rec = json.loads(path.read_text())
        steps = rec["env"].get("ns_steps", 5)
        prof = shipped_profile("h200")
        times = functools.partial(_tp_times, prof, world, steps)

        best: dict[tuple, dict[str, float]] = {}
        for e in rec["newton_schulz"]:
            m, n = e["shape"]
            if e["shard_dim"] is None:
                rows.append(_row(f"NS {m}x{n}, 1 H200", path.name, prof.source,
                                 newton_schulz_time(prof, 1, m, n, steps) * 1e3, e["median_ms"], "ms"))
                continue
            if e["mode"] == "distributed" and e["chunks"] != 4:
                continue  # the default, 4 chunks, is the row compared
            r, c = (n, m) if e["shard_dim"] == 0 else (m, n)
            pred = times(r, c, e["chunks"] or 1)[e["mode"]] * 1e3
            rows.append(_row(f"NS {m}x{n} split dim {e['shard_dim']}, TP {world} {e['mode']}", path.name, prof.source,
                             pred, e["median_ms"], "ms"))
            if e["mode"] in ("duplicated", "distributed"):
                best.setdefault((m, n, e["shard_dim"]), {})[e["mode"]] = e["median_ms"]
                best[(m, n, e["shard_dim"])]["picked"] = e["auto_picks"]
        for (m, n, dim), meas in best.items():
            r, c = (n, m) if dim == 0 else (m, n)
            t = times(r, c, 4)
            ours = min(("duplicated", "distributed"), key=t.get)
            fastest = min(("duplicated", "distributed"), key=meas.get)
            rows.append({"what": f"TP {world} mode choice, {m}x{n} split dim {dim}", "source": path.name,
                         "profile": prof.source, "predicted": ours, "measured": fastest, "unit": "mode",
                         "error": None, "within": ours == fastest})
    return rows


SECTIONS: dict[str, Callable[[Path], list[dict[str, Any]]]] = {
    "single GPU": single_gpu, "scaling": scaling, "tensor-parallel Newton-Schulz": tensor_parallel}


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
    return f"{r['predicted']:{fmt}} ({err if r['within'] else f'**{err}**'})"


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
    lines.append(f"{sum(r['within'] for r in shipped)} of {len(shipped)} rows within {THRESHOLD:.0%} (or the same "
                 f"mode) with the shipped profiles; {sum(r['within'] for r in flat)} of {len(flat)} with any")
    return "\n".join(lines)
