"""The cost model: α–β collectives against hand-computed cases, rate tables, Newton–Schulz FLOPs, profile files."""

import dataclasses
import json
import math

import pytest
import torch
from _mp import run

from matrixopt.distributed import balance, cost
from matrixopt.distributed.calibrate import NOMINAL, measure, nominal
from matrixopt.distributed.cost import DeviceProfile, Link, Shapes, collective_time
from matrixopt.linalg import ortho

LINK = Link(latency=1e-5, bandwidth=1e9)  # 10 us per message step, 1 GB/s: easy hand arithmetic
MB = 1e6


@pytest.mark.parametrize("kind, parts, nbytes, expected", [
    ("all_gather", 4, MB, 3 * 1e-5 + 0.75 * 1e-3),  # (P-1) a + (P-1)/P n b
    ("reduce_scatter", 4, MB, 3 * 1e-5 + 0.75 * 1e-3),
    ("all_to_all", 2, MB, 1e-5 + 0.5 * 1e-3),
    ("all_reduce", 4, MB, 6 * 1e-5 + 1.5 * 1e-3),  # ring 1.56 ms beats tree 2 * 2 a + 2 n b = 2.04 ms
    ("all_reduce", 64, 8, 2 * 6 * 1e-5 + 2 * 8e-9),  # tiny message: tree 2 ceil(log2 P) a beats ring's 126 a
    ("broadcast", 8, MB, 3 * 1e-5 + 1e-3),  # ceil(log2 P) a + n b
    ("broadcast", 5, MB, 3 * 1e-5 + 1e-3),  # ceil(log2 5) = 3
    ("all_reduce", 1, MB, 0.0),  # one rank: nothing to do
])
def test_alpha_beta_by_hand(kind, parts, nbytes, expected):
    assert collective_time(kind, nbytes, parts, LINK) == pytest.approx(expected, rel=1e-12)


def test_collective_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown collective 'gather'"):
        collective_time("gather", MB, 2, LINK)
    with pytest.raises(ValueError, match=">= 1 rank"):
        collective_time("all_reduce", MB, 0, LINK)
    with pytest.raises(ValueError, match="bandwidth"):
        Link(latency=0.0, bandwidth=0.0)
    with pytest.raises(ValueError, match="latency"):
        Link(latency=-1.0, bandwidth=1.0)


def _flat(rate: float = 1e12, bw: float = 1e11, **links: Link) -> DeviceProfile:
    """A profile whose every call runs at one rate, with no launch floor below 1 FLOP."""
    table = ((1.0, rate), (1e18, rate))
    return DeviceProfile(name="flat", device="test", source="nominal", peak_flops=rate, memory_bytes=1e10,
                         gpus_per_node=8, gemm=table, syrk=table, fp32_gemm=table, qr=table,
                         elementwise=((1.0, bw), (1e18, bw)),
                         links=links or {"intra": LINK, "inter": Link(latency=1e-4, bandwidth=1e8)})


def test_link_class_by_group_span():
    p = _flat()
    assert p.link(8) is p.links["intra"]  # one node of 8
    assert p.link(16) is p.links["inter"]
    assert p.link(2, stride=4) is p.links["intra"]  # ranks 0 and 4: same node
    assert p.link(2, stride=8) is p.links["inter"]  # ranks 0 and 8: next node
    assert p.with_network(cost.NETWORKS["eth-100g"]).link(16) == cost.NETWORKS["eth-100g"]


def test_rate_tables_interpolate_in_log_size():
    p = DeviceProfile(**{**_flat()._fields(), "gemm": ((1e6, 1e9), (1e8, 3e9))})
    assert p.seconds("gemm", 1e6) == pytest.approx(1e-3)
    assert p.seconds("gemm", 1e7) == pytest.approx(1e7 / 2e9)  # halfway in log size: the mean rate
    assert p.seconds("gemm", 1e3) == pytest.approx(1e-3)  # below the table: the first point's (launch) time
    assert p.seconds("gemm", 1e10) == pytest.approx(1e10 / 3e9)  # above: the last point's rate
    assert p.seconds("gemm", 0) == 0.0


def _on_grid(rates: list[float]) -> tuple[tuple[float, float], ...]:
    """A product table measured on the calibration's stacks, with ``rates`` by width."""
    return tuple((8.0 * b * s**3, r) for (s, b), r in zip(cost.CALIBRATION_STACKS, rates))


def test_calibration_stacks_are_the_calibrations():
    from matrixopt.distributed import calibrate

    assert cost.CALIBRATION_STACKS == calibrate.CUDA_SHAPES


def test_a_table_on_the_calibration_grid_caps_each_width_at_its_rate():
    """Width 256 at 2e14 FLOP/s and 512 at 5e14 (the rest 7e14): a stack of 320 matrices of 384 x 1024 has
    FLOPs between the 768- and 1024-wide points, but runs at most at the rate of width 384, log2(1.5) = 0.585 of
    the way (in log width) from 256 to 512."""
    table = _on_grid([2e14, 5e14] + [7e14] * 5)
    p = DeviceProfile(**{**_flat()._fields(), "gemm": table})
    assert cost.width_rates(table)[:2] == ((256.0, 2e14), (512.0, 5e14))
    flops = 2.0 * 320 * 384 * 384 * 1024  # 96.6 GFLOP: between the 768- and 1024-wide points by size
    assert p.seconds("gemm", flops) == pytest.approx(flops / 7e14)  # by size alone
    assert p.seconds("gemm", flops, 384) == pytest.approx(flops / (2e14 + math.log2(1.5) * 3e14))
    assert p.seconds("gemm", flops, 4096) == pytest.approx(flops / 7e14)  # wide enough: the size's rate
    assert p.seconds("gemm", flops, 64) == pytest.approx(flops / 2e14)  # narrower than the grid: its first width
    small = 2.0 * 384**3  # below the first point: the launch floor, slower than either rate
    assert p.seconds("gemm", small, 384) == pytest.approx(table[0][0] / 2e14)


def test_a_table_off_the_calibration_grid_has_no_widths():
    assert cost.width_rates(((1e6, 1e9), (1e8, 3e9))) is None
    p = nominal(next(iter(NOMINAL)))
    assert cost.width_rates(p.gemm) is None
    assert p.seconds("gemm", 1e11, 256) == p.seconds("gemm", 1e11)


@pytest.mark.parametrize("b, m, n", [(1, 64, 64), (3, 64, 256), (2, 256, 64), (1, 96, 100)])
def test_newton_schulz_time_counts_the_shared_flops(b, m, n):
    p = _flat(rate=1e12)
    t = cost.newton_schulz_time(p, b, m, n, steps=5)
    assert t == pytest.approx(ortho.newton_schulz_flops(m, n, 5, "auto", batch=b) / 1e12)
    assert cost.newton_schulz_time(p, b, m, n, 5, "standard") == pytest.approx(
        ortho.newton_schulz_flops(m, n, 5, "standard", batch=b) / 1e12)


@pytest.mark.parametrize("b, s, l", [(1, 1024, 14336), (3, 768, 3072), (64, 1024, 4096)])
def test_an_eager_newton_schulz_takes_the_form_the_dispatcher_takes_eagerly(b, s, l):
    """Replayed from a graph ``auto`` takes the Gram form by aspect alone; launched eagerly only for stacks of
    enough work (a TP shard, a layer-wise owner's small stack run standard), as ``uses_gram`` decides on CUDA."""
    p = _flat(rate=1e12)
    gram, standard = (ortho.newton_schulz_flops(s, l, 5, m, batch=b) / 1e12 for m in ("gram", "standard"))
    assert gram != pytest.approx(standard)
    assert cost.newton_schulz_time(p, b, s, l, 5) == pytest.approx(gram)
    eager = gram if ortho.uses_gram("auto", b, s, l, eager_cuda=True) else standard
    assert cost.newton_schulz_time(p, b, s, l, 5, eager=True) == pytest.approx(eager)
    assert cost.matrix_step_time(p, "muon", [cost.Shapes(s, l, b)], eager=True) - cost.matrix_step_time(
        p, "muon", [cost.Shapes(s, l, b)]) == pytest.approx(eager - gram)
    if b * s * s * l < ortho.GRAM_MIN_EAGER_WORK:
        assert eager == standard


def test_step_times_and_state():
    p = _flat(rate=1e12, bw=1e11)
    groups = [Shapes(64, 256, 3)]
    adamw = cost.matrix_step_time(p, "adamw", groups)
    assert adamw == pytest.approx(cost.ADAMW_BYTES * 3 * 64 * 256 / 1e11)
    muon = cost.matrix_step_time(p, "muon", groups)
    assert muon == pytest.approx(ortho.newton_schulz_flops(64, 256, 5, batch=3) / 1e12
                                 + cost.MUON_BYTES * 3 * 64 * 256 / 1e11)
    assert cost.MUON_BYTES == (4 + 4 + 4 + 2) + (2 + 2) + (2 + 4 + 4)  # momentum + pack, normalize, update
    every = cost.matrix_step_time(p, "shampoo", groups, precondition_frequency=1)
    tenth = cost.matrix_step_time(p, "shampoo", groups, precondition_frequency=10)
    assert every > tenth > 0  # roots amortized over the period
    assert cost.matrix_step_time(p, "soap", groups, precondition_frequency=10) > 0
    assert cost.preconditioner_state_bytes("muon", 64, 256) == 4 * 64 * 256
    # Shampoo: momentum and the graft's second moment (8 B per element), a factor and a root per side in fp32, and
    # the step's kept stack of the roots (fp32; bf16 for bf16 products)
    assert cost.preconditioner_state_bytes("shampoo", 64, 256) == 8 * 64 * 256 + 12 * (64**2 + 256**2)
    assert cost.preconditioner_state_bytes("soap", 64, 256, matmul_precision="bf16") == (
        8 * 64 * 256 + 10 * (64**2 + 256**2))
    with pytest.raises(ValueError, match="optimizer 'lion'"):
        cost.matrix_step_time(p, "lion", groups)
    with pytest.raises(ValueError, match="precondition_frequency"):
        cost.matrix_step_time(p, "soap", groups, precondition_frequency=0)


def test_shampoo_eigenbasis_roots_cost_soaps_refresh_and_the_roots_product():
    """root_method="eigenbasis": a refresh is SOAP's (a power step's product, which also gives the eigenvalue
    estimates, and a QR) plus the product forming the root (in fp32; under TF32 the power step takes three TF32
    products for float32 accuracy), where Newton's is ROOT_STEPS * ROOT_PRODUCTS products; the state holds a
    basis per factor more."""
    p = _flat(rate=1e12, bw=1e11)
    groups = [Shapes(64, 256, 3)]

    def refresh(optimizer, method="newton", precision="fp32"):  # a refresh's seconds: every step's less 1 in 10^6
        t = [cost.matrix_step_time(p, optimizer, groups, precondition_frequency=f, root_method=method,
                                   matmul_precision=precision) for f in (1, 10**6)]
        return t[0] - t[1]

    cubes = sum(p.seconds("fp32_gemm", 2.0 * 3 * k**3, k) for k in (64, 256))
    assert refresh("shampoo") == pytest.approx(cost.ROOT_STEPS * cost.ROOT_PRODUCTS * cubes, rel=1e-5)
    assert refresh("shampoo", "eigenbasis") == pytest.approx(refresh("soap") + cubes, rel=1e-5)
    # under TF32 the power step takes three TF32 products (float32 accuracy) against SOAP's one, and the root one:
    # three TF32 products more than SOAP's refresh, each at half the bf16 rate
    tf32_cubes = sum(2 * p.seconds("gemm", 2.0 * 3 * k**3, k) for k in (64, 256))
    assert refresh("shampoo", "eigenbasis", "tf32") == pytest.approx(refresh("soap", precision="tf32") + 3 * tf32_cubes,
                                                                    rel=1e-5)
    assert cost.preconditioner_state_bytes("shampoo", 64, 256, "eigenbasis") == (
        cost.preconditioner_state_bytes("shampoo", 64, 256) + 4 * (64**2 + 256**2))
    with pytest.raises(ValueError, match="root_method 'svd'"):
        cost.matrix_step_time(p, "shampoo", groups, root_method="svd")


def test_tf32_products_are_priced_at_half_the_bf16_rate_and_newton_roots_stay_fp32():
    p = _flat(rate=1e12, bw=1e11)
    groups = [Shapes(64, 256, 3)]
    soap = {mp: cost.matrix_step_time(p, "soap", groups, precondition_frequency=10**9, matmul_precision=mp)
            for mp in ("fp32", "tf32")}
    pair = 2.0 * 3 * 64 * 256 * (64 + 256)
    # three passes of products each step: at the fp32 rate, or at twice the bf16 table's time
    assert soap["fp32"] - soap["tf32"] == pytest.approx(
        3 * (p.seconds("fp32_gemm", pair, 64) - 2 * p.seconds("gemm", pair, 64)), rel=1e-3)

    def refresh(mp):
        t = [cost.matrix_step_time(p, "shampoo", groups, precondition_frequency=f, matmul_precision=mp)
             for f in (1, 10**9)]
        return t[0] - t[1]

    assert refresh("tf32") == pytest.approx(refresh("fp32"))  # the Newton iteration runs in fp32 either way
    with pytest.raises(ValueError, match="matmul_precision"):
        cost.matrix_step_time(p, "soap", groups, matmul_precision="fp16")
    # a measured TF32 table replaces the half-rate rule: here TF32 at a quarter of the bf16 rate
    quarter = dataclasses.replace(p, tf32_gemm=((1.0, 0.25e12), (1e18, 0.25e12)))
    measured = cost.matrix_step_time(quarter, "soap", groups, precondition_frequency=10**9, matmul_precision="tf32")
    assert measured - soap["tf32"] == pytest.approx(3 * 2 * p.seconds("gemm", pair, 64), rel=1e-3)
    assert cost.matrix_step_time(quarter, "soap", groups, precondition_frequency=10**9,
                                 matmul_precision="fp32") == pytest.approx(soap["fp32"])


def test_bf16_products_are_priced_at_the_bf16_rate_and_the_refresh_as_under_tf32():
    p = _flat(rate=1e12, bw=1e11)
    groups = [Shapes(64, 256, 3)]

    def times(optimizer, mp, **kw):  # (step without its refresh, one refresh)
        t = [cost.matrix_step_time(p, optimizer, groups, precondition_frequency=f, matmul_precision=mp, **kw)
             for f in (1, 10**9)]
        return t[1], t[0] - t[1]

    pair = 2.0 * 3 * 64 * 256 * (64 + 256)
    for optimizer, passes, kw in (("soap", 3, {}), ("shampoo", 2, dict(root_method="eigenbasis"))):
        (bf16_step, bf16_refresh), (tf32_step, tf32_refresh) = (times(optimizer, mp, **kw) for mp in ("bf16", "tf32"))
        # each pass of the step's products: the bf16 table's time instead of twice it
        assert tf32_step - bf16_step == pytest.approx(passes * p.seconds("gemm", pair, 64), rel=1e-3)
        assert bf16_refresh == pytest.approx(tf32_refresh)


def test_adamw_groups_hide_behind_the_products_and_the_check_reads_every_gradient():
    """Muon on 3 x (64, 256) at 1e12 FLOP/s and 1e11 B/s, with AdamW groups of 1e5 or 1e7 elements."""
    p = _flat(rate=1e12, bw=1e11)
    groups, numel = [Shapes(64, 256, 3)], 3 * 64 * 256
    ns = ortho.newton_schulz_flops(64, 256, 5, batch=3) / 1e12  # 0.12 ms
    passes = cost.MUON_BYTES * numel / 1e11
    small, large = 1e5, 1e7  # AdamW's pass: 28 us (hidden behind the products) and 2.8 ms (not)
    assert cost.matrix_step_time(p, "muon", groups, adamw_numel=small) == pytest.approx(ns + passes)
    assert cost.matrix_step_time(p, "muon", groups, adamw_numel=large) == pytest.approx(
        cost.ADAMW_BYTES * large / 1e11 + passes)
    check = cost.CHECK_BYTES * (numel + small) / 1e11  # one fp32 read of every gradient
    assert cost.matrix_step_time(p, "muon", groups, adamw_numel=small, check=True) == pytest.approx(
        ns + passes + check)
    assert cost.matrix_step_time(p, "adamw", groups, adamw_numel=small) == pytest.approx(
        cost.ADAMW_BYTES * (numel + small) / 1e11)


def test_shampoo_and_soap_pay_their_block_stacking_and_copies():
    """Per (m, n) block, beyond their per-parameter passes and products: SOAP stacks the gradient (8 m n) and the
    bases (8 (m^2 + n^2)), updates the factors in one pass (12 (m^2 + n^2)) and copies the update back (8 m n);
    Shampoo stacks the gradient and the numerator (16 m n), the roots and factors as SOAP, and grafts and selects in
    two passes (20 m n). At 1e11 B/s the step's passes take exactly their bytes' time."""
    assert cost.block_pass_bytes("soap", 64, 256) == 16 * 64 * 256 + 20 * (64**2 + 256**2)
    assert cost.block_pass_bytes("shampoo", 64, 256) == 36 * 64 * 256 + 20 * (64**2 + 256**2)
    with pytest.raises(ValueError, match="optimizer 'muon'"):
        cost.block_pass_bytes("muon", 8, 8)
    p = _flat(rate=1e30, bw=1e11)  # products free: the step is its passes
    groups, numel = [Shapes(64, 256, 3), Shapes(1500, 700, 1)], 3 * 64 * 256 + 1500 * 700
    blocks = 3 * cost.block_pass_bytes("soap", 64, 256) + sum(cost.block_pass_bytes("soap", m, n)
                                                               for m in (750, 750) for n in (700,))
    assert cost.matrix_step_time(p, "soap", groups) == pytest.approx((cost.SOAP_BYTES * numel + blocks) / 1e11)


def test_fused_adamw_runs_at_its_own_rate_where_the_profile_has_one(tmp_path):
    """torch's fused AdamW at 5e10 B/s where measured; the matrix optimizer's own AdamW groups and every other
    pass stay at the elementwise 1e11 B/s. Without the table, the fused step falls back to the elementwise rate."""
    plain = _flat(rate=1e12, bw=1e11)
    p = DeviceProfile(**{**plain._fields(), "fused_adamw": ((1.0, 5e10), (1e12, 5e10))})
    groups, numel, rest = [Shapes(64, 256, 3)], 3 * 64 * 256, 1e7
    assert cost.matrix_step_time(p, "adamw", groups) == pytest.approx(cost.ADAMW_BYTES * numel / 5e10)
    assert cost.matrix_step_time(plain, "adamw", groups) == pytest.approx(cost.ADAMW_BYTES * numel / 1e11)
    assert cost.matrix_step_time(p, "muon", groups, adamw_numel=rest) == pytest.approx(
        cost.matrix_step_time(plain, "muon", groups, adamw_numel=rest))
    p.save(tmp_path / "p.json")
    assert DeviceProfile.load(tmp_path / "p.json") == p
    plain.save(tmp_path / "plain.json")
    assert "fused_adamw" not in json.loads((tmp_path / "plain.json").read_text())
    with pytest.raises(ValueError, match="'fused_adamw' sizes must be strictly ascending"):
        DeviceProfile(**{**plain._fields(), "fused_adamw": ((2.0, 1.0), (1.0, 1.0))})


def test_tp_modes_by_hand():
    """TP 2 on a (64, 256) matrix, contracted dim split: hand-computed seconds of each mode."""
    rate, link = 1e12, Link(latency=1e-5, bandwidth=1e9)
    t = cost.tp_ns_times(64, 256, 2, steps=5, itemsize=2, chunks=1, link=link,
                         ns=lambda s, l, b: ortho.newton_schulz_flops(s, l, 5, "standard", b) / rate,
                         gemm=lambda f: f / rate)
    gather = 1e-5 + 0.5 * 64 * 256 * 2 / 1e9
    assert t["duplicated"] == pytest.approx(gather + 5 * ortho.ns_step_flops(64, 256) / rate)
    reduce = min(2e-5 + 64 * 64 * 2 / 1e9, 2e-5 + 2 * 64 * 64 * 2 / 1e9)  # ring and tree are equal terms at P=2
    per_step = ortho.ns_step_flops(64, 128) / rate + reduce
    assert t["distributed"] == pytest.approx(2 * (2e-5 + 4 / 1e9) + 5 * per_step)
    assert t["blockwise"] == pytest.approx(5 * ortho.ns_step_flops(64, 128) / rate)


def test_balancer_packs_on_the_shared_flops():
    assert balance.muon_cost(768, 3072) == cost.matrix_step_flops("muon", 768, 3072) \
        == ortho.newton_schulz_flops(768, 3072, 5)
    assert balance.MATRIX_COSTS["soap"](64, 32) == cost.matrix_step_flops("soap", 64, 32)
    with pytest.raises(ValueError, match="no FLOP count"):
        cost.matrix_step_flops("lion", 4, 4)


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_shipped_profiles_and_round_trip(tmp_path, name):
    """Both shipped profiles are measured, with the inter-node link and the MFU peak of the nominal one (NVLink
    measured over 2 ranks, no network), and no rate above the data sheet's: a calibration that counts bytes or
    FLOPs it does not move fails here."""
    prof, sheet = cost.shipped_profile(name), NOMINAL[name]
    assert prof.source == "measured" and prof.device.lower().find(name) >= 0
    assert prof.links["inter"] == nominal(name).links["inter"]
    assert prof.peak_flops == sheet["matmul_flops"] == 989e12
    assert prof.links["intra"].bandwidth <= sheet["nvlink_bytes_per_s"]
    assert max(r for _, r in prof.gemm) <= sheet["matmul_flops"]
    assert max(r for _, r in prof.fp32_gemm) <= sheet["fp32_flops"]
    assert max(r for _, r in prof.elementwise + (prof.fused_adamw or ())) <= sheet["hbm_bytes_per_s"]
    prof.save(tmp_path / "p.json")
    assert DeviceProfile.load(tmp_path / "p.json") == prof
    with pytest.raises(ValueError, match="no shipped profile 'a100'"):
        cost.shipped_profile("a100")


def test_bad_profiles_say_what_is_wrong(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        DeviceProfile.load(bad)
    with pytest.raises(ValueError, match="cannot read device profile"):
        DeviceProfile.load(tmp_path / "missing.json")
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="not a device profile"):
        DeviceProfile.load(bad)
    good = cost.shipped_profile("h100").to_dict()
    for change, message in (({"gemm": [[2.0, 1.0], [1.0, 1.0]]}, "strictly ascending"),
                            ({"links": {"intra": good["links"]["intra"]}}, "missing \\['inter'\\]"),
                            ({"source": "guessed"}, "source"), ({"extra": 1}, "unknown keys"),
                            ({"elementwise": [[1.0, -1.0]]}, "finite and > 0")):
        bad.write_text(json.dumps({**good, **change}))
        with pytest.raises(ValueError, match=message):
            DeviceProfile.load(bad)


@pytest.mark.parametrize("parts", [2, 3, 8])
def test_link_from_all_reduce_inverts_the_model(parts):
    small, large = collective_time("all_reduce", 4, parts, LINK), collective_time("all_reduce", 64 * MB, parts, LINK)
    got = cost.link_from_all_reduce(parts, small, large, 64 * MB)
    assert got.latency == pytest.approx(LINK.latency, rel=1e-3)
    assert got.bandwidth == pytest.approx(LINK.bandwidth, rel=1e-3)


def _calibrate_two_ranks(rank: int, world: int) -> None:
    import matrixopt.distributed.calibrate as calibrate

    heats = []
    timer = calibrate.time_ms

    def recording(fn, device, **kw):
        heats.append(kw.get("heat_s", 0.0))
        return timer(fn, device, **kw)

    calibrate.time_ms = recording
    try:  # every call heated (each rank for its own time) but the two all-reduces, which must pair up on the ranks
        p = measure(torch.device("cpu"), reps=2, heat_s=0.002 * (1 + rank))
    finally:
        calibrate.time_ms = timer
    assert heats[-2:] == [0.0, 0.0] and all(h > 0 for h in heats[:-2])
    assert p.links["intra"] != nominal("h100").links["intra"] and "measured by all-reduce over 2" in p.notes
    assert p.links["inter"] == nominal("h100").links["inter"]


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_square_products_run_at_the_sym_mul_rate_where_the_profile_has_one(tmp_path, method):
    """Newton–Schulz's (s, s) products at the sym_mul table's 2e12 FLOP/s, the Gram and X products at the flat
    1e12; without the table every product at the gemm rate."""
    plain = _flat(rate=1e12)
    p = DeviceProfile(**{**plain._fields(), "sym_mul": ((1.0, 2e12), (1e18, 2e12))})
    b, s, l = 3, 64, 256
    squares = {"standard": 5, "gram": (4 * 3 - 3) + (4 * 2 - 3)}[method]  # per step, or per phase of 3 and 2
    square_flops = squares * 2 * b * s**3
    assert cost.newton_schulz_time(plain, b, s, l, 5, method) == pytest.approx(
        ortho.newton_schulz_flops(s, l, 5, method, batch=b) / 1e12)
    assert cost.newton_schulz_time(plain, b, s, l, 5, method) - cost.newton_schulz_time(p, b, s, l, 5, method) == (
        pytest.approx(square_flops / 1e12 - square_flops / 2e12))
    p.save(tmp_path / "p.json")
    assert DeviceProfile.load(tmp_path / "p.json") == p
    plain.save(tmp_path / "plain.json")
    assert "sym_mul" not in json.loads((tmp_path / "plain.json").read_text())


def test_calibrate_measures_the_link_over_gloo():
    run(_calibrate_two_ranks, 2)


def test_calibrate_on_cpu_writes_the_shipped_format(tmp_path):
    p = measure(torch.device("cpu"), reps=2)
    assert p.source == "measured" and "links not measured" in p.notes
    assert p.env["heat_s"] == 0.0  # the CPU's calls are not heated, and the profile says so
    assert p.env["host"]["op_us"] > 0 and p.env["host"]["cpus"] >= 1  # the host's pace, for its host_launch
    assert p.to_dict().keys() == cost.shipped_profile("h100").to_dict().keys() | {"tf32_gemm"}
    assert all(math.isfinite(r) and r > 0
               for _, r in p.gemm + p.syrk + p.sym_mul + p.tf32_gemm + p.qr + p.elementwise + p.fused_adamw)
    assert 0 < p.host_launch < 0.01 and p.host_launch != cost.HOST_LAUNCH  # measured, not the default
    p.save(tmp_path / "cpu.json")
    assert DeviceProfile.load(tmp_path / "cpu.json") == p


def test_distributed_tp_gram_runs_at_the_gemm_rate():
    """Distributed mode's Gram rows are plain ``torch.bmm`` products (both triangles), so only ``gemm`` is used:
    a slower product rate slows every product of the step, hand-computed at TP 2 on (64, 256), one chunk."""
    link = Link(latency=0.0, bandwidth=1e300)
    t = cost.tp_ns_times(64, 256, 2, steps=5, chunks=1, link=link, ns=lambda s, l, b: 0.0,
                         gemm=lambda f: f / 1e12)
    gram, square, apply = 2 * 64 * 64 * 128, 2 * 64**3, 2 * 64 * 64 * 128  # X_p X_p^T, A A, B X_p
    assert t["distributed"] == pytest.approx(5 * (gram + square + apply) / 1e12)


def test_a_collective_of_no_bytes_costs_nothing():
    """No bytes, no collective (e.g. the expert gathers of a dense model): no latency charged either."""
    assert all(collective_time(k, 0, 8, LINK) == 0.0 for k in cost.COLLECTIVES)
