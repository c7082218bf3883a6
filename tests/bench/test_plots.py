"""``matrixopt bench plot`` draws a non-empty PNG for every record kind, on the CPU."""

import json

import pytest

from matrixopt.bench import plots

pytest.importorskip("matplotlib")


def ms(median):
    return {"median": median, "p20": 0.9 * median, "p80": 1.1 * median, "min": 0.8 * median}


ENV = {"device": "cpu", "torch": "2.13.0"}
RECORDS = {
    "step": [{"benchmark": "step", "model": m, "env": ENV,
              "results": {"adamw (fused)": {"status": "ok", "ms": ms(1.0 * k)},
                          "matrixopt muon": {"status": "ok", "ms": ms(2.0 * k)},
                          "emerging_optimizers Muon": {"status": "not installed"}}}
             for k, m in enumerate(["toy", "gpt2-small"], start=1)],
    "train": [{"benchmark": "train", "model": "tiny-cpu", "batch": 2, "block_size": 32, "env": ENV,
               "results": {"adamw": {"status": "ok", "vs_adamw": 1.0}, "muon": {"status": "ok", "vs_adamw": 0.9}}}],
    "scale": [{"env": ENV, "summary": [{"preset": "toy", "gpus": 2, "config": c, "tokens_per_s_per_gpu": t}
                                       for c, t in [("ddp:adamw", 2e3), ("layerwise:muon", 1.5e3)]]}],
}


@pytest.mark.parametrize("kind", sorted(RECORDS))
def test_plot_writes_png(tmp_path, kind):
    paths = []
    for i, rec in enumerate(RECORDS[kind]):
        paths.append(tmp_path / f"{kind}{i}.json")
        paths[-1].write_text(json.dumps(rec))
    out = plots.plot_files(paths, tmp_path / "out" / f"{kind}.png")
    assert out.is_file() and out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 1000


def test_plot_refuses_mixed_kinds(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(RECORDS["step"][0]))
    b.write_text(json.dumps(RECORDS["train"][0]))
    with pytest.raises(ValueError, match="one kind at a time"):
        plots.plot_files([a, b], tmp_path / "x.png")


def test_plot_names_a_non_record(tmp_path):
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not a benchmark record"):
        plots.plot_files([a], tmp_path / "x.png")


def test_bench_plot_command(tmp_path, capsys):
    import argparse

    from matrixopt.bench import cli

    path, out = tmp_path / "train.json", tmp_path / "train.png"
    path.write_text(json.dumps(RECORDS["train"][0]))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(["plot", str(path), "--out", str(out)])) == 0
    assert out.stat().st_size > 1000 and str(out) in capsys.readouterr().out
