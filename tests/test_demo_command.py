"""The README's main command, `lantern-export demo`, and the quality harness on the shipped model."""
import contextlib
import io
import json

import pytest

from lantern.runtime.manifest import read_manifest
from lantern.tools import run_cli


@pytest.fixture
def demo(demo_engine):
    return demo_engine  # conftest.py: `lantern-export demo --per-class 1`, once per session


def test_demo_exports_checks_generates_and_reports(demo):
    report = json.loads((demo / "report" / "report.json").read_text())
    assert report["check"]["ok"]
    rows = {r["mode"]: r for r in report["results"]}
    assert set(rows) == {"ar", "exact", "lantern++", "exact jacobi", "lantern++ jacobi", "lantern++ tuned"}
    assert rows["ar"]["steps_per_image"] == 63  # 64 tokens: one from prefill, 63 AR steps
    assert rows["exact"]["steps_per_image"] < 45  # the trained drafter compresses steps
    # so does the drafter-free window (SJD), with no drafter calls: one engine call per step
    assert rows["exact jacobi"]["steps_per_image"] < 45 and rows["exact jacobi"]["tree"] == "chain-5"
    assert rows["lantern++ jacobi"]["steps_per_image"] < rows["exact jacobi"]["steps_per_image"]
    assert rows["exact jacobi"]["engine_calls_per_step_batch1"] < rows["exact"]["engine_calls_per_step_batch1"]
    for name in ("report.md", "acceptance.png", "ar.png", "lanternpp.png"):
        assert (demo / "report" / name).stat().st_size > 0
    # Step costs at the batch and at one image, and what they show.
    for key in ("step_cost_vs_ar", "step_cost_vs_ar_batch1"):
        assert rows["ar"][key] == pytest.approx(1.0) and rows["lantern++"][key] > 1
    for key in ("verify_cost_vs_ar", "verify_cost_vs_ar_batch1"):  # the device step times no verify phase apart
        assert rows["ar"][key] is None and rows["lantern++"][key] is None
    assert rows["lantern++"]["engine_calls_per_step_batch1"] > rows["ar"]["engine_calls_per_step_batch1"]
    on = report["generated_on"]  # README's command: --device auto
    if on["device"] == "cpu":  # ONNX Runtime's default: the step graphs the demo added
        assert on == {"backend": "onnxruntime", "device": "cpu", "step": "device"}
        assert "On the CPU (onnxruntime, the device step)" in report["reading"]
    else:  # a suite run where torch sees a CUDA device: the torch backend's device step
        assert on == {"backend": "torch", "device": "cuda", "step": "device"} and "On cuda" in report["reading"]
    assert report["reading"] in (demo / "report" / "report.md").read_text()
    rates = rows["exact"]["acceptance_per_depth"]
    assert len(rates) == report["tree"]["depth"] and all(0 <= r <= 1 for r in rates)
    # the demo tuned the tree for this machine, and generate picked it up for the tuned row
    assert rows["lantern++"]["tree"] == "mc_sim_7b_63"  # the preset row keeps the preset
    assert (demo / "report" / "lanternpp_tuned.png").stat().st_size > 0
    entry = read_manifest(demo).tuned_trees[report["tuned"]["key"]]
    assert [t.images for t in entry.trees] == [1, 8]
    batch1 = entry.tree_for(1)
    assert rows["lantern++ tuned"]["tree_batch1"] == (batch1.name if batch1.file else "ar")
    assert rows["lantern++ tuned"]["tree"] == (entry.tree_for(15).name if entry.tree_for(15).file else "ar")
    assert "Tuned draft tree" in (demo / "report" / "report.md").read_text()


def test_demo_reports_the_int8_engine_beside_fp32(demo):
    q = json.loads((demo / "report" / "report.json").read_text())["quantized"]
    assert q["scheme"] == "int8" and q["engine"] == f"{demo}-int8" and "int8 keeps" in q["why"]
    assert q["check"] == {"ok": True, "tolerance": 0.05, "worst_relative_rms": q["check"]["worst_relative_rms"]}
    assert 1e-3 < q["check"]["worst_relative_rms"] <= 0.05  # quantized for real, within the tolerance
    assert 0.85 < q["teacher_forced_greedy_agreement"] < 1.0  # measured 94.8% on 15 greedy images
    rows = {r["mode"]: r for r in q["results"]}
    assert set(rows) == {"ar", "lantern++"} and rows["ar"]["steps_per_image"] == 63
    assert rows["lantern++"]["mean_accepted_length"] > 1.5 and all(r["speed_vs_fp32"] > 0 for r in rows.values())
    for r in rows.values():
        assert (demo / "report" / r["image"]).stat().st_size > 0
    markdown = (demo / "report" / "report.md").read_text()
    assert "## int8 engine beside fp32" in markdown and q["reading"] in markdown
    from lantern.runtime.manifest import quantization_scheme, read_manifest

    assert quantization_scheme(read_manifest(q["engine"])) == "int8"


def test_acceptance_per_depth_from_the_histogram():
    from lantern.tools.demo import acceptance_per_depth

    # 2 steps accepted nothing, 3 one draft, 5 two drafts: depth 1 reached by 8 of 10 steps,
    # depth 2 by 5 of those 8.
    assert acceptance_per_depth([2, 3, 5]) == [0.8, 0.625]
    assert acceptance_per_depth([4, 0, 0]) == [0.0, 0.0]
    assert acceptance_per_depth([]) == []


@pytest.fixture(scope="module")
def quality(demo_engine, tmp_path_factory):
    """One `lantern-run quality` sweep for the tests below (one sweep: the suite's time): fp32 and
    int4 x ar, exact and lantern++ k=5 at lam 1 and 3, one image per class, written to its default
    directory under the working directory. Returns (working directory, argv, what it printed)."""
    cwd = tmp_path_factory.mktemp("quality")
    argv = ["quality", str(demo_engine), "--schemes", "int4", "--per-class", "1", "--lams", "1,3", "--ks", "5",
            "--deltas", "", "--threads", "1", "--no-progress"]
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.chdir(cwd)
        assert run_cli.main(argv) == 0
    return cwd, argv, printed.getvalue()


def test_quality_harness_sweeps_methods(demo, quality, monkeypatch, capsys):
    cwd, argv, printed = quality
    assert "4 methods" in printed and "15 sampled images" in printed and "expect about" in printed
    out = cwd / f"quality-{demo.name}"  # its own directory, not inside the engine
    assert not (demo / "quality").exists()
    report = json.loads((out / "report.json").read_text())
    rows = {(r["scheme"], r["method"]): r for r in report["results"]}
    assert {m for s, m in rows} == {"ar", "exact", "lantern++ k=5 lam=1", "lantern++ k=5 lam=3"}
    # lam = 1 is exact: the same tokens, so the same accuracy and distance, in every scheme.
    for scheme in ("fp32", "int4"):
        assert rows[scheme, "lantern++ k=5 lam=1"]["accuracy"] == rows[scheme, "exact"]["accuracy"]
        assert rows[scheme, "lantern++ k=5 lam=1"]["frechet_vs_ar"] == rows[scheme, "exact"]["frechet_vs_ar"]
    assert rows["fp32", "ar"]["accuracy"] > 0.5  # the classes are recognisable
    assert (out / "speed_vs_quality.png").stat().st_size > 0
    # A second run does not mix into the first report: refused at once without --force.
    monkeypatch.chdir(cwd)
    assert run_cli.main(argv) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert json.loads((out / "report.json").read_text()) == report


def test_quality_compares_schemes(demo, quality):
    """fp32 (the reference) and int4 (int4 alone: the suite's time; the default adds int8): fp32
    exact is greedy-exact (agreement 1 with fp32 ar), int4 agrees less (teacher forced: measured
    82.7%)."""
    cwd, _, printed = quality
    out = cwd / f"quality-{demo.name}"
    assert "2 schemes (fp32, int4) x 4 methods" in printed
    report = json.loads((out / "report.json").read_text())
    rows = {(r["scheme"], r["method"]): r for r in report["results"]}
    assert len(rows) == 8 and report["reference"] == "fp32 ar"
    assert report["schemes"]["int4"]["quantization"]["target"]["bits"] == 4
    assert rows["fp32", "ar"]["greedy_agreement"] == rows["fp32", "exact"]["greedy_agreement"] == 1.0
    assert rows["int4", "ar"]["greedy_agreement"] < 1.0
    forced = {s: rows[s, "ar"]["teacher_forced_agreement"] for s in ("fp32", "int4")}
    assert forced["fp32"] == 1.0 and 0.7 < forced["int4"] < 0.95, forced
    for r in rows.values():
        assert 0 <= r["accuracy"] <= 1 and r["frechet_vs_ar"] >= 0 and r["speedup"] > 0
        assert (r["mean_accepted_length"] > 1.5) == (r["mode"] != "ar")
    assert "| int4 | lantern++ k=5 lam=3 |" in (out / "report.md").read_text()


def test_quality_refuses_schemes_on_a_quantized_engine(demo, capsys):
    assert run_cli.main(["quality", f"{demo}-int8", "--no-progress", "--out", "unused"]) == 2
    assert "is int8; the scheme comparison quantizes an fp32 engine" in capsys.readouterr().err


def test_quality_defaults_are_the_short_sweep():
    from lantern.tools import quality

    args = run_cli.build_parser().parse_args(["quality", "engines/demo"])
    names = [name for name, _ in quality.methods(args.lams, args.ks, args.deltas)]
    assert names == ["ar", "exact", "lantern++ k=20 lam=5"]
    assert args.schemes == ["int8", "int4"] and args.per_class == 6
    assert run_cli.build_parser().parse_args(["quality", "e", "--schemes", "none"]).schemes == []


def test_demo_device_choice(tmp_path, capsys):
    """--device auto takes CUDA where torch sees it (the torch backend, the whole step on the
    device), else ONNX Runtime on the CPU; --device cuda without CUDA is one line, before
    anything is written."""
    import torch

    from lantern.tools import export_cli
    from lantern.tools.demo import demo_backend

    assert demo_backend("cpu") == ("onnxruntime", "cpu")
    if torch.cuda.is_available():
        assert demo_backend("auto") == demo_backend("cuda") == ("torch", "cuda")
        return
    assert demo_backend("auto") == ("onnxruntime", "cpu")
    out = tmp_path / "demo"
    assert export_cli.main(["demo", "--device", "cuda", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torch sees no CUDA device" in err[0] and "--device cpu" in err[0]
    assert not out.exists()
