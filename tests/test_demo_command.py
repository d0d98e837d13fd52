"""The README's main command, `lantern-export demo`, and the quality harness on the shipped model."""
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
    assert set(rows) == {"ar", "exact", "lantern++", "lantern++ tuned"}
    assert rows["ar"]["steps_per_image"] == 63  # 64 tokens: one from prefill, 63 AR steps
    assert rows["exact"]["steps_per_image"] < 45  # the trained drafter compresses steps
    for name in ("report.md", "acceptance.png", "ar.png", "lanternpp.png"):
        assert (demo / "report" / name).stat().st_size > 0
    # Step costs at the batch and at one image, and what they show.
    for key in ("step_cost_vs_ar", "step_cost_vs_ar_batch1", "verify_cost_vs_ar", "verify_cost_vs_ar_batch1"):
        assert rows["ar"][key] == pytest.approx(1.0) and rows["lantern++"][key] > 1
    assert rows["lantern++"]["engine_calls_per_step_batch1"] > rows["ar"]["engine_calls_per_step_batch1"]
    assert "compute per verified token" in report["reading"] and "call overhead" in report["reading"]
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


def test_acceptance_per_depth_from_the_histogram():
    from lantern.export.demo import acceptance_per_depth

    # 2 steps accepted nothing, 3 one draft, 5 two drafts: depth 1 reached by 8 of 10 steps,
    # depth 2 by 5 of those 8.
    assert acceptance_per_depth([2, 3, 5]) == [0.8, 0.625]
    assert acceptance_per_depth([4, 0, 0]) == [0.0, 0.0]
    assert acceptance_per_depth([]) == []


def test_quality_harness_small_sweep(demo, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["quality", str(demo), "--per-class", "1", "--lams", "1,3", "--ks", "5", "--deltas", "",
            "--threads", "1", "--no-progress"]
    assert run_cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "4 methods" in printed and "15 images" in printed and "expect about" in printed
    out = tmp_path / f"quality-{demo.name}"  # its own directory, not inside the engine
    assert not (demo / "quality").exists()
    report = json.loads((out / "report.json").read_text())
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == {"ar", "exact", "lantern++ k=5 lam=1", "lantern++ k=5 lam=3"}
    # lam = 1 is exact: the same tokens, so the same accuracy and distance.
    assert rows["lantern++ k=5 lam=1"]["accuracy"] == rows["exact"]["accuracy"]
    assert rows["lantern++ k=5 lam=1"]["frechet_vs_ar"] == rows["exact"]["frechet_vs_ar"]
    assert rows["ar"]["accuracy"] > 0.5  # the classes are recognisable
    assert (out / "speed_vs_quality.png").stat().st_size > 0
    # A second run does not mix into the first report: refused at once without --force.
    assert run_cli.main(argv) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert json.loads((out / "report.json").read_text()) == report


def test_quality_defaults_are_the_short_sweep():
    from lantern.tools import quality

    args = run_cli.build_parser().parse_args(["quality", "engines/demo"])
    names = [name for name, _ in quality.methods(args.lams, args.ks, args.deltas)]
    assert names == ["ar", "exact", "lantern++ k=20 lam=5"]
