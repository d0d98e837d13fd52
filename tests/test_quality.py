"""The quality harness's Fréchet distance against an independent scipy computation."""
import numpy as np
import pytest
from scipy import linalg

from lantern.runtime.settings import GenerationSettings
from lantern.tools.quality import frechet_distance, methods


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
    from lantern.tools.quality import project

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
