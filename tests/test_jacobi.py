"""The drafter-free proposer, speculative Jacobi decoding (runtime/jacobi.py), end to end on tiny
real engines (ONNX Runtime; torch for the device-step refusal). Every check compares against an
independent path: AR's tokens (greedy), the PyTorch reference forward of the source checkpoint
(sampling: the tokens' probability integral transform under the target), AR's own samples, the
same image generated alone, the Python API against the CLI."""
import json

import numpy as np
import pytest
from scipy import stats as scipy_stats

from conftest import built_once
from engines import build_engine, captions, export_like
from lantern.export.torch_backend import open_torch_backend
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.jacobi import JacobiWindow, MAX_WINDOW
from lantern.runtime.settings import GenerationSettings
from lantern.tools import run_cli
from references import llamagen_forward

CLASSES = [1, 2, 3, 4]
CHAMELEON = dict(prompt=["a red cat", "a dog on a mat"], grid=(4, 4))  # tests/test_chameleon_engine.py's inputs


@pytest.fixture(scope="module")
def c2i(c2i_engine):
    return Engine(c2i_engine, threads=1)


@pytest.fixture(scope="session")
def no_drafter_engine(tmp_path_factory):
    """The c2i checkpoints' kind exported without a drafter (with a VQ, so a neighbor table)."""
    return built_once(tmp_path_factory, "c2i-no-drafter", lambda root: build_engine(root, "c2i", drafter=False))


@pytest.fixture(scope="session")
def inplace_c2i_engine(c2i_engine, tmp_path_factory):
    """The c2i engine's checkpoints again with --attention inplace (static caches, commit.onnx)."""
    return built_once(tmp_path_factory, "c2i-inplace-jacobi",
                      lambda root: export_like(c2i_engine, root / "engine", "--attention", "inplace"))


@pytest.fixture(scope="session")
def inplace_no_drafter_engine(no_drafter_engine, tmp_path_factory):
    """The drafter-less checkpoints with --attention inplace and room for 8 verified tokens."""
    return built_once(tmp_path_factory, "c2i-no-drafter-inplace",
                      lambda root: export_like(no_drafter_engine, root / "engine", "--attention", "inplace",
                                               "--max-tree-nodes", "8"))


def one_line(excinfo):
    text = str(excinfo.value)
    assert text and "\n" not in text, text
    return text


# ---------------------------------------------------------------------------------------------
# Greedy: exactly AR's tokens


@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_greedy_jacobi_gives_ar_tokens_for_every_window_and_init(c2i, cfg):
    ar = c2i.generate(mode="ar", greedy=True, cfg_scale=cfg, classes=CLASSES)
    saved = []
    for window in (2, 4, 16):
        for init in ("random", "uniform", "spatial"):
            out = c2i.generate(mode="exact", greedy=True, cfg_scale=cfg, proposer="jacobi", window=window, init=init,
                               classes=CLASSES)
            np.testing.assert_array_equal(out.tokens, ar.tokens, err_msg=f"window {window}, init {init}")
            s = out.stats
            assert (s["proposer"], s["window"], s["init"], s["tree"]) == ("jacobi", window, init, f"chain-{window - 1}")
            assert s["step"] == "host" and s["mode"] == "exact"
            saved.append(ar.stats["steps_per_image"] - s["steps_per_image"])
    assert max(saved) > 0, "no case accepted a draft: the comparison above would hold for a proposer that never drafts"


def test_greedy_jacobi_on_the_text_conditional_engine(t2i_engine):
    engine = Engine(t2i_engine, threads=1)
    caption, mask = captions(3)
    kw = dict(greedy=True, cfg_scale=3.0, caption=caption, caption_mask=mask)
    ar = engine.generate(mode="ar", **kw)
    for window, init in ((4, "random"), (16, "spatial")):
        out = engine.generate(mode="exact", proposer="jacobi", window=window, init=init, **kw)
        np.testing.assert_array_equal(out.tokens, ar.tokens, err_msg=f"window {window}, init {init}")


@pytest.mark.parametrize("family", ["anole", "lumina_mgpt"])
def test_greedy_jacobi_on_the_chameleon_engines(chameleon_engines, family):
    """Lumina-mGPT's forced line ends and image end land inside the windows: drafted with q one-hot
    and taken outright, the body (forced tokens included) is AR's."""
    engine = Engine(chameleon_engines[family], threads=1)
    kw = dict(greedy=True, cfg_scale=3.0, **CHAMELEON)
    ar = engine.generate(mode="ar", **kw)
    for window, init in ((2, "random"), (4, "uniform"), (16, "spatial")):
        out = engine.generate(mode="exact", proposer="jacobi", window=window, init=init, **kw)
        np.testing.assert_array_equal(out.body, ar.body, err_msg=f"window {window}, init {init}")
        np.testing.assert_array_equal(out.tokens, ar.tokens)


# ---------------------------------------------------------------------------------------------
# An engine without a drafter


def test_an_engine_without_a_drafter_serves_jacobi_and_refuses_the_tree(no_drafter_engine):
    engine = Engine(no_drafter_engine, threads=1)
    m = engine.manifest
    assert m.graphs.get("drafter") is None and m.tree is None and tuple(m.modes) == ("ar",)
    assert m.neighbors is not None, "exported with --vq: the neighbor table the relaxed modes read"
    kw = dict(greedy=True, cfg_scale=3.0, classes=CLASSES)
    ar = engine.generate(mode="ar", **kw)
    exact = engine.generate(mode="exact", proposer="jacobi", window=8, **kw)
    np.testing.assert_array_equal(exact.tokens, ar.tokens)
    assert exact.stats["proposer"] == "jacobi"
    # the relaxed modes over the neighbor table: lam = 1 relaxes nothing (AR's tokens), a large
    # lam accepts at least as much as exact
    lam1 = engine.generate(mode="lantern++", lam=1.0, k=8, proposer="jacobi", window=8, **kw)
    np.testing.assert_array_equal(lam1.tokens, ar.tokens)
    relaxed = engine.generate(mode="lantern++", lam=5.0, k=16, proposer="jacobi", window=8, **kw)
    assert relaxed.stats["mean_accepted_length"] >= exact.stats["mean_accepted_length"]
    gsd = engine.generate(mode="gsd", k=8, proposer="jacobi", window=8, seed=1, classes=CLASSES)
    assert gsd.tokens.shape == ar.tokens.shape
    for mode in ("exact", "lantern", "lantern++", "gsd"):
        with pytest.raises(LanternError) as e:
            engine.generate(mode=mode, greedy=True, classes=[1])  # the tree proposer: needs the drafter
        assert "drafter" in one_line(e), mode


# ---------------------------------------------------------------------------------------------
# Sampling: the target's distribution


def pit_values(directory, tokens, classes, cfg, temperature, rng):
    """The randomised probability integral transform of every token under the target, from the
    PyTorch reference forward of the source checkpoint (not the engine): u = P(tokens more
    probable than x) + V * p(x), V uniform. Tokens sampled from the target's conditionals give
    iid uniform u (the Rosenblatt transform); a rule that favours drafts (less probable tokens
    than the target picks) pushes u up."""
    logits = llamagen_forward(directory, "c2i", tokens, {"classes": classes}, cfg)[0].astype(np.float64) / temperature
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    px = np.take_along_axis(p, tokens[..., None], -1)
    ids = np.arange(p.shape[-1])
    ahead = (p > px) | ((p == px) & (ids < tokens[..., None]))  # ties ordered by id
    return ((p * ahead).sum(-1) + rng.random(px.shape[:-1]) * px[..., 0]).ravel()


def ks_uniform(u):
    """sqrt(n) * the Kolmogorov-Smirnov distance of u from Uniform(0, 1); above 1.95 with
    probability 0.001 when u is uniform."""
    u, n = np.sort(u), len(u)
    i = np.arange(1, n + 1)
    return float(max((i / n - u).max(), (u - (i - 1) / n).max()) * np.sqrt(n))


def chi2_two_sample(a, b, minimum=10):
    """p-value of a chi-square test that samples a and b of one token position come from one
    distribution (categories with fewer than `minimum` pooled counts merged into one)."""
    codes = max(a.max(), b.max()) + 1
    table = np.stack([np.bincount(a, minlength=codes), np.bincount(b, minlength=codes)])
    big = table.sum(0) >= minimum
    table = np.concatenate([table[:, big], table[:, ~big].sum(1, keepdims=True)], axis=1)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    return float(scipy_stats.chi2.sf(statistic, table.shape[1] - 1))


def test_jacobi_exact_sampling_draws_the_target_distribution(c2i_engine, c2i):
    n = 400
    classes = list(np.arange(n) % 10)
    rng = np.random.default_rng(0)
    cases = [  # (settings, seed of image 0): disjoint seeds, so every run's samples are independent
        (dict(mode="ar"), 0),  # the test's own control: AR samples pass it
        (dict(mode="exact", proposer="jacobi", window=4, init="random"), n),
        (dict(mode="exact", proposer="jacobi", window=4, init="uniform", cfg_scale=3.0), 2 * n),
        (dict(mode="exact", proposer="jacobi", window=16, init="spatial", cfg_scale=3.0, temperature=0.5), 3 * n),
    ]
    samples = {}
    for kw, seed in cases:
        s = GenerationSettings(**kw)
        out = c2i.generate(s, classes=classes, seed=seed)
        if s.proposer == "jacobi":
            assert out.stats["steps_per_image"] < out.tokens.shape[1] - 1  # drafts were accepted
        u = pit_values(c2i_engine, out.tokens, classes, s.cfg_scale, s.temperature, rng)
        assert ks_uniform(u) < 1.95, kw
        samples[s.key] = out.tokens
    # the same positions' empirical distributions against AR's own samples (fresh seeds)
    ar = samples[GenerationSettings(mode="ar").key]
    jacobi = samples[GenerationSettings(**cases[1][0]).key]
    for position in (1, 2, ar.shape[1] - 1):
        assert chi2_two_sample(ar[:, position], jacobi[:, position]) > 1e-3, position
    # power: a lossy rule over the same windows fails the same test by far
    lossy = c2i.generate(mode="lantern++", lam=5.0, k=32, proposer="jacobi", window=4, classes=classes, seed=4 * n)
    assert ks_uniform(pit_values(c2i_engine, lossy.tokens, classes, 1.0, 1.0, rng)) > 3.0


@pytest.mark.parametrize("init", ["random", "uniform"])
def test_every_draft_is_a_draw_from_the_q_it_is_offered_with(c2i, init, monkeypatch):
    """What exactness rests on, slot by slot: the window's drafts (re-drafts from the last
    verification's rows, fresh uniform codes) are draws from the q the rule is given. The real
    proposer runs; each step's block is recorded after it, and the drafts' randomised PIT under
    their own q must be uniform. Fresh drafts rarely reach acceptance (they sit behind the
    re-drafts), so the distribution test above barely sees a wrong q for them; this sees every one."""
    blocks = []
    propose = JacobiWindow.propose

    def recording(self, d, active, race):
        propose(self, d, active, race)
        a = np.flatnonzero(active)
        # node i's q is the distribution its child, slot i + 1, was drawn from
        blocks.append((d.view.columns(d.node_tokens[a, 1:]), np.array(d.cand_probs[a, :-1], dtype=np.float64)))

    monkeypatch.setattr(JacobiWindow, "propose", recording)
    c2i.generate(mode="exact", proposer="jacobi", window=8, init=init, cfg_scale=3.0, temperature=0.7,
                 classes=list(range(10)) * 4, seed=5)
    drafts = np.concatenate([x.ravel() for x, _ in blocks])
    q = np.concatenate([p.reshape(-1, p.shape[-1]) for _, p in blocks])
    np.testing.assert_allclose(q.sum(1), 1.0, atol=1e-6)
    below = np.where(np.arange(q.shape[1])[None, :] < drafts[:, None], q, 0.0).sum(1)
    u = below + np.random.default_rng(0).random(len(q)) * q[np.arange(len(q)), drafts]
    # given its q a draft is a draw from it, so the PIT is uniform within any group of slots
    # chosen by q alone: flat q (fresh uniform drafts) apart from the rest (re-drafts), so the
    # fewer fresh slots are not drowned; one-hot slots are their draft by construction
    flat = np.isclose(q, q.max(1, keepdims=True)).sum(1) * q.max(1) > 1 - 1e-9
    spread = q.max(1) < 1.0
    groups = {"re-drafts": spread & ~flat}
    if init == "uniform":
        groups["fresh"] = spread & flat
    for name, group in groups.items():
        assert group.sum() > 300, name
        assert ks_uniform(u[group]) < 1.95, name


def test_lam_one_and_gsd_k0_sample_exacts_tokens(c2i):
    """lantern++ with lam = 1 and gsd with k = 0 relax nothing: from the same seeds they draw
    exact's tokens, step for step."""
    kw = dict(proposer="jacobi", window=6, cfg_scale=3.0, classes=list(range(8)), seed=21, top_k=30)
    exact = c2i.generate(mode="exact", **kw)
    for relaxed in (dict(mode="lantern++", lam=1.0, k=16), dict(mode="gsd", k=0), dict(mode="lantern", delta=0.0, k=8)):
        out = c2i.generate(**relaxed, **kw)
        np.testing.assert_array_equal(out.tokens, exact.tokens, err_msg=str(relaxed))
    assert not np.array_equal(c2i.generate(mode="lantern++", lam=5.0, k=32, **kw).tokens, exact.tokens)


# ---------------------------------------------------------------------------------------------
# Per-image streams


@pytest.mark.parametrize("settings", [dict(mode="exact", init="random"), dict(mode="lantern++", lam=3.0, k=16, init="spatial")])
def test_an_image_is_the_same_alone_and_anywhere_in_a_batch(c2i, settings):
    kw = dict(proposer="jacobi", window=5, cfg_scale=3.0, **settings)

    def run(classes, seeds):
        accepted = []
        out = c2i.generate(classes=classes, seed=seeds, observer=lambda r: accepted.append(r.accepted), **kw)
        return out.tokens, np.array(accepted)  # [steps, images] drafts accepted per step

    batch, batch_accepted = run([1, 2, 3, 4, 5], [10, 11, 12, 13, 14])
    for index in (0, 2, 4):
        alone, alone_accepted = run([index + 1], [10 + index])
        np.testing.assert_array_equal(alone[0], batch[index])
        # the image advanced by its own accepted lengths, whatever its batch mates accepted
        np.testing.assert_array_equal(alone_accepted[:, 0], batch_accepted[:len(alone_accepted), index])
    assert (batch_accepted != batch_accepted[:, :1]).any(), "batch mates accepted alike: the check above is vacuous"
    moved, _ = run([5, 9, 3], [14, 77, 12])  # images 4 and 2 of the batch elsewhere, beside a new one
    np.testing.assert_array_equal(moved[[0, 2]], batch[[4, 2]])


# ---------------------------------------------------------------------------------------------
# Settings and the CLI


def test_settings_name_the_window_only_for_jacobi():
    tree = GenerationSettings(mode="exact")
    assert not {"proposer", "window", "init"} & set(tree.canonical())
    assert tree.key == GenerationSettings(mode="exact", window=4, init="spatial").key  # unused by the tree
    jacobi = GenerationSettings(mode="exact", proposer="jacobi", window=8, init="uniform")
    c = jacobi.canonical()
    assert (c["proposer"], c["window"], c["init"]) == ("jacobi", 8, "uniform")
    assert GenerationSettings.from_canonical(c) == jacobi
    keys = {jacobi.key, tree.key, jacobi.replace(window=9).key, jacobi.replace(init="random").key}
    assert len(keys) == 4 and "jacobi8-uniform" in jacobi.key
    assert "proposer" not in GenerationSettings(mode="ar", proposer="jacobi").canonical()  # ar drafts nothing
    # no window: the tuned one, else the default; the key leaves it open (what tune records under)
    open_window = GenerationSettings(mode="exact", proposer="jacobi", init="uniform")
    assert "window" not in open_window.canonical() and "jacobi-uniform" in open_window.key
    assert GenerationSettings.from_canonical(open_window.canonical()) == open_window
    for bad in (1, MAX_WINDOW + 1, 2.5, True, "8"):
        with pytest.raises(LanternError) as e:
            GenerationSettings(mode="exact", proposer="jacobi", window=bad)
        assert "window" in one_line(e), bad
    with pytest.raises(LanternError) as e:
        GenerationSettings(mode="exact", proposer="jacobi", init="diagonal")
    assert "diagonal" in one_line(e)
    with pytest.raises(LanternError) as e:
        GenerationSettings(mode="exact", proposer="lookahead")
    assert "lookahead" in one_line(e)


def test_a_tree_with_the_jacobi_proposer_is_refused(c2i):
    with pytest.raises(LanternError) as e:
        c2i.generate(mode="exact", greedy=True, proposer="jacobi", window=4, tree="chain-3", classes=[1])
    assert "window" in one_line(e)


def test_generate_cli_runs_the_jacobi_proposer(c2i, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli.main(["generate", c2i.directory, "--proposer", "jacobi", "--window", "8", "--classes", "1,2",
                         "--threads", "1", "--out", str(out)]) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert (stats["proposer"], stats["window"], stats["init"], stats["tree"]) == ("jacobi", 8, "random", "chain-7")
    want = c2i.generate(GenerationSettings(proposer="jacobi", window=8), classes=[1, 2], seed=0)
    np.testing.assert_array_equal(np.load(out / "tokens.npy"), want.tokens)
    # the option changes what runs: the tree proposer's tokens differ
    assert not np.array_equal(c2i.generate(classes=[1, 2], seed=0).tokens, want.tokens)
    capsys.readouterr()
    assert run_cli.main(["generate", c2i.directory, "--proposer", "jacobi", "--window", "1", "--classes", "1",
                         "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert "window" in err and len(err.splitlines()) == 1, err


# ---------------------------------------------------------------------------------------------
# Step paths and engine forms


def test_the_device_step_runs_jacobi_refuses_gsd_and_a_default_device_step_gives_way(c2i_engine):
    """The torch backend's device step runs the window (tests/test_device_jacobi.py: token for
    token against the host); gsd it refuses in one line, and a default device step gives gsd
    way to the host."""
    backend = open_torch_backend(c2i_engine, threads=1)
    kw = dict(mode="exact", greedy=True, cfg_scale=3.0, proposer="jacobi", window=4, classes=CLASSES)
    device = Engine(c2i_engine, backend=backend, step="device").generate(**kw)
    assert device.stats["step"] == "device" and device.stats["proposer"] == "jacobi"
    gsd = dict(kw, mode="gsd", greedy=False, seed=[1, 2, 3, 4])
    with pytest.raises(LanternError) as e:
        Engine(c2i_engine, backend=backend, step="device").generate(**gsd)
    assert "gsd" in one_line(e) and "step='host'" in one_line(e)
    # a backend whose default step is the device (the torch backend's on CUDA): the jacobi
    # generation runs there, a gsd one on the host instead
    backend.default_step = "device"
    engine = Engine(c2i_engine, backend=backend)
    assert engine.step == "device"
    out = engine.generate(**kw)
    assert out.stats["step"] == "device"
    assert engine.generate(**gsd).stats["step"] == "host"
    tree = engine.generate(mode="exact", greedy=True, cfg_scale=3.0, classes=CLASSES)
    assert tree.stats["step"] == "device"
    np.testing.assert_array_equal(out.tokens, tree.tokens)  # both greedy exact: AR's tokens
    np.testing.assert_array_equal(device.tokens, tree.tokens)


def test_greedy_jacobi_on_an_inplace_engine(inplace_c2i_engine):
    """The window's K/V are committed by the engine's commit graph in the static caches; the
    window's 16 slots fit the export tree's budget (mc_sim_7b_63: 26 nodes)."""
    engine = Engine(inplace_c2i_engine, threads=1)
    assert engine.manifest.attention == "inplace"
    kw = dict(greedy=True, cfg_scale=3.0, classes=CLASSES)
    ar = engine.generate(mode="ar", **kw)
    for window, init in ((4, "random"), (16, "spatial")):
        out = engine.generate(mode="exact", proposer="jacobi", window=window, init=init, **kw)
        np.testing.assert_array_equal(out.tokens, ar.tokens, err_msg=f"window {window}")
        assert out.stats["steps_per_image"] < ar.stats["steps_per_image"]


def test_greedy_jacobi_on_an_inplace_engine_without_a_drafter(inplace_no_drafter_engine):
    """No drafter, so no export tree: the static cache holds --max-tree-nodes verified tokens, a
    window of up to that many runs (AR's tokens) and a wider one is refused in one line."""
    engine = Engine(inplace_no_drafter_engine, threads=1)
    assert engine.manifest.inplace_cache.tree_nodes == 8 and "drafter" not in engine.manifest.graphs
    kw = dict(greedy=True, cfg_scale=3.0, classes=CLASSES)
    ar = engine.generate(mode="ar", **kw)
    for window in (2, 8):
        out = engine.generate(mode="exact", proposer="jacobi", window=window, **kw)
        np.testing.assert_array_equal(out.tokens, ar.tokens, err_msg=f"window {window}")
    with pytest.raises(LanternError) as e:
        engine.generate(mode="exact", proposer="jacobi", window=9, **kw)
    assert "static cache" in one_line(e) and "--window 8 or less" in one_line(e)
