"""The quality harness's Fréchet distance against an independent scipy computation."""
import numpy as np
import pytest
from scipy import linalg

from lantern.runtime.settings import GenerationSettings
from lantern.tools.quality import methods
from lantern.tools.quality_judge import frechet_distance


def scipy_frechet(a, b):
    mu_a, mu_b = a.mean(0), b.mean(0)
    sa, sb = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    root = linalg.sqrtm(sa @ sb).real
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(sa + sb - 2 * root))


@pytest.mark.parametrize("n,d", [(400, 8), (60, 16)])
def test_frechet_distance_matches_scipy(n, d):
    rng = np.random.default_rng(0)
    a = rng.normal(size=(n, d)) @ rng.normal(size=(d, d))
    b = rng.normal(size=(n, d)) * 2 + 1
    assert frechet_distance(a, b) == pytest.approx(scipy_frechet(a, b), rel=1e-6)
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-8)
    assert frechet_distance(a, a + 3) == pytest.approx(9.0 * d, rel=1e-9)


def test_sweep_covers_the_issue():
    names = [m for m, _ in methods([1, 1.5, 2, 3, 5], [5, 20], [0.1, 0.3])]
    assert names[:2] == ["ar", "exact"]
    assert "lantern++ k=20 lam=1.5" in names and "lantern k=20 delta=0.3" in names
    assert len(names) == 2 + 10 + 2
    rows = dict(methods([2], [5], [0.3], GenerationSettings(cfg_scale=3.0, top_k=7)))
    assert rows["lantern++ k=5 lam=2"] == GenerationSettings(mode="lantern++", k=5, lam=2.0, cfg_scale=3.0, top_k=7)
    assert rows["lantern k=5 delta=0.3"].key == "lantern_delta0.3_k5_t1-topk7-topp1_cfg3"
    assert all(s.cfg_scale == 3.0 and s.top_k == 7 for s in rows.values())


def test_projection_keeps_the_main_directions():
    from lantern.tools.quality_judge import project

    rng = np.random.default_rng(1)
    ref = rng.normal(size=(500, 3)) @ np.diag([10.0, 1.0, 0.1])
    p = project(ref, ref, 1)
    assert p.shape == (500, 1)
    assert abs(np.corrcoef(p[:, 0], ref[:, 0])[0, 1]) > 0.999


@pytest.mark.parametrize("sizes,says", [
    (["--per-class", "10000", "--batch", "100000"], "needs about"),  # the widest step plan
    (["--per-class", str(10**12), "--batch", "8"], "decoded"),  # a row's decoded images
])
def test_quality_refuses_what_the_machine_cannot_hold_up_front(c2i_engine, tmp_path, monkeypatch, capsys, sizes,
                                                                says):
    from lantern.runtime import generator
    from lantern.tools import quality, run_cli

    one_gib = lambda: 2**30  # noqa: E731 - this machine, as the memory readers would report it
    monkeypatch.setattr(generator, "available_memory", one_gib)
    monkeypatch.setattr(quality, "available_memory", one_gib)
    out = tmp_path / "report"
    # A classifier that does not exist: the refusal must come before it is loaded (and before any
    # plan or quantized copy), not from the sweep's first generate call.
    argv = ["quality", c2i_engine, "--schemes", "int8", "--classifier", str(tmp_path / "missing.safetensors"),
            "--no-progress", "--out", str(out)] + sizes
    assert run_cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "GiB" in lines[0] and "1.00 GiB available" in lines[0], lines
    assert captured.out == ""
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_jacobi_rows_run_in_a_tiny_sweep(c2i_engine, tmp_path, capsys):
    """--proposers jacobi: ar and the drafter-free rows only (no drafter tree row), each through
    the same judging; the jacobi rows verify windows (fewer steps than ar's one per token), exact
    keeps ar's greedy tokens and gsd names its proposer."""
    import json

    from lantern.tools import run_cli

    out = tmp_path / "report"
    argv = ["quality", c2i_engine, "--schemes", "none", "--per-class", "1", "--proposers", "jacobi", "--ks", "4",
            "--window", "6", "--init", "uniform", "--threads", "1", "--no-progress", "--out", str(out)]
    assert run_cli.main(argv) == 0, capsys.readouterr().err
    rows = {r["method"]: r for r in json.loads((out / "report.json").read_text())["results"]}
    assert list(rows) == ["ar", "jacobi exact", "jacobi lantern++ k=4 lam=5", "gsd k=4 (jacobi)"]
    for name in list(rows)[1:]:
        r = rows[name]
        assert r["proposer"] == "jacobi" and r["tree"] is None, r
        assert r["settings"]["window"] == 6 and r["settings"]["init"] == "uniform"
        assert r["steps_per_image"] < rows["ar"]["steps_per_image"]
        assert 0 <= r["accuracy"] <= 1 and r["frechet_vs_ar"] >= 0
    assert rows["gsd k=4 (jacobi)"]["settings"]["tau"] == 1.0
    assert rows["jacobi exact"]["greedy_agreement"] == 1.0  # lossless: ar's greedy tokens
    # Both proposers: the tree's rows keep their names, gsd gets a row per proposer.
    both = [m for m, _ in methods([5], [20], [], proposers=["tree", "jacobi"], taus=[1.0, 0.15])]
    assert both == ["ar", "exact", "lantern++ k=20 lam=5", "gsd k=20 (tree)", "gsd k=20 tau=0.15 (tree)",
                    "jacobi exact", "jacobi lantern++ k=20 lam=5", "gsd k=20 (jacobi)", "gsd k=20 tau=0.15 (jacobi)"]


def test_jacobi_bench_quick_prints_its_json(c2i_engine, capsys):
    """bench.jacobi --quick on the tiny engine (the demo classifier judges any image size): one
    JSON object on stdout with its three parts, ar's ratio 1 and the windows swept."""
    import json

    from lantern.tools.bench import jacobi

    assert jacobi.main(["--engine", c2i_engine, "--quick", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    compression = result["step_compression"]["methods"]
    assert compression["ar"]["ratio_vs_ar"] == 1.0 and compression["ar"]["frechet_vs_ar"] == pytest.approx(0, abs=1e-6)
    assert {"tree exact", "jacobi exact random", "jacobi exact spatial"} <= set(compression)
    assert any(name.startswith("gsd tree") for name in compression)
    assert set(result["step_compression"]["noise"]) == {"accuracy_ar", "accuracy_ar_other_seeds",
                                                        "frechet_ar_vs_ar_other_seeds"}
    (engine_wall,) = result["wall_clock"].values()
    rows = engine_wall["batches"]["1"]["methods"]
    assert rows["ar"]["step_cost_in_ar_steps"] == pytest.approx(1.0) and len(rows) == 5  # ar + 2 modes x 2 windows
    assert set(result["window_sweep"]["windows"]) == {"3", "4", "6", "8", "16"}
    assert "step compression" in captured.err
