"""The README's main command, `lantern-export demo`, and the quality harness on the shipped model."""
import json

import pytest

from lantern.export import cli
from lantern.runtime.manifest import read_manifest
from lantern.tools import run_cli


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "engine"
    assert cli.main(["demo", "--out", str(out), "--per-class", "1", "--threads", "1"]) == 0
    return out


def test_demo_exports_checks_generates_and_reports(demo):
    report = json.loads((demo / "report" / "report.json").read_text())
    assert report["check"]["ok"]
    rows = {r["mode"]: r for r in report["results"]}
    assert set(rows) == {"ar", "exact", "lantern++", "lantern++ tuned"}
    assert rows["ar"]["steps_per_image"] == 63  # 64 tokens: one from prefill, 63 AR steps
    assert rows["exact"]["steps_per_image"] < 45  # the trained drafter compresses steps
    assert rows["lantern++"]["tree"] == "mc_sim_7b_63"  # the preset row keeps the preset
    for name in ("report.md", "acceptance.png", "ar.png", "lanternpp.png", "lanternpp_tuned.png"):
        assert (demo / "report" / name).stat().st_size > 0
    # the demo tuned the tree for this machine, and generate picked it up for the tuned row
    manifest = read_manifest(demo, verify=True)
    entry = manifest.tuned_trees[report["tuned"]["key"]]
    assert [t.images for t in entry.trees] == [1, 8]
    batch1 = entry.tree_for(1)
    assert rows["lantern++ tuned"]["tree_batch1"] == (batch1.name if batch1.file else "ar")
    assert rows["lantern++ tuned"]["tree"] == (entry.tree_for(15).name if entry.tree_for(15).file else "ar")
    assert "Tuned draft tree" in (demo / "report" / "report.md").read_text()


def test_demo_runs_again_over_its_own_engine(demo, capsys):
    assert cli.main(["demo", "--out", str(demo), "--per-class", "1", "--threads", "1", "--no-tune"]) == 0
    printed = capsys.readouterr().out
    assert "check passed" in printed and "speedup" in printed


def test_quality_harness_small_sweep(demo, tmp_path):
    out = tmp_path / "quality"
    assert run_cli.main(["quality", str(demo), "--per-class", "3", "--lams", "1,3", "--ks", "5", "--deltas", "0.2",
                         "--threads", "1", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == {"ar", "exact", "lantern++ k=5 lam=1", "lantern++ k=5 lam=3", "lantern k=5 delta=0.2"}
    # lam = 1 is exact: the same tokens, so the same accuracy and distance.
    assert rows["lantern++ k=5 lam=1"]["accuracy"] == rows["exact"]["accuracy"]
    assert rows["lantern++ k=5 lam=1"]["frechet_vs_ar"] == rows["exact"]["frechet_vs_ar"]
    assert rows["ar"]["accuracy"] > 0.5  # the classes are recognisable
    assert (out / "speed_vs_quality.png").stat().st_size > 0
