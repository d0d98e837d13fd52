"""Step plans, bound buffers and the typed manifest, on real tiny ONNX Runtime engines."""
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from engines import captions
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.manifest import read_manifest
from lantern.runtime.tree import build_tree


class RecordingBackend:
    """The real backend, with every call's regime and input shapes written down."""

    def __init__(self, backend):
        self.inner = backend
        self.calls = []

    def run(self, call):
        self.calls.append((call.regime, {k: tuple(np.shape(v)) for k, v in call.feeds.items()}))
        return self.inner.run(call)

    def run_all(self, calls):  # the device step's calls: its phases and the plan's engine calls
        for call in calls:
            self.run(call)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("kind, mode, cfg, n", [("c2i", "lantern++", 4.0, 3), ("t2i", "exact", 1.0, 2),
                                                ("c2i", "ar", 4.0, 2)])
def test_every_call_has_the_shapes_its_plan_lists(c2i_engine, t2i_engine, kind, mode, cfg, n):
    directory = c2i_engine if kind == "c2i" else t2i_engine
    base = Engine(directory, threads=2)
    recorder = RecordingBackend(base.backend)
    engine = Engine(directory, backend=recorder)
    cond = dict(classes=list(range(n))) if kind == "c2i" else dict(zip(("caption", "caption_mask"), captions(n)))
    out = engine.generate(mode=mode, greedy=False, cfg_scale=cfg, lam=3.0, k=8, seed=1, **cond)
    plan = engine._plan
    shapes = plan.shapes()
    rows = 2 * n if cfg > 1 else n
    tree = build_tree(base.manifest.tree)
    seen, phases = {}, {}
    for regime, feeds in recorder.calls:
        if regime not in shapes:  # the step graphs' phases between the engine calls
            phases.setdefault(regime, set()).add(tuple(sorted(feeds.items())))
            continue
        assert feeds == shapes[regime][1], regime
        seen[regime] = seen.get(regime, 0) + 1
    # the regimes are what the plan promises: fixed widths, one verify and D drafter calls a step
    steps = seen["verify"]
    assert seen["prefill"] == seen.get("condition", 1) == 1
    assert out.stats["step"] == "device" and all(len(f) <= 2 for f in phases.values())  # one shape per parity
    assert set(phases) == {"begin", "accept"} | {f"level{d}" for d in range(1, (mode != "ar") * tree.depth + 1)}
    if mode == "ar":
        assert set(seen) == {"condition", "prefill", "verify"} and steps == out.tokens.shape[1] - 1
        assert shapes["verify"][1]["input_ids"] == (rows, 1)
    else:
        assert seen["draft0"] == steps and all(seen[f"draft{d}"] == steps for d in range(1, tree.depth))
        assert shapes["draft0"][1]["input_ids"] == (rows, tree.depth + 1)
        assert shapes["verify"][1]["input_ids"] == (rows, tree.num_nodes)
        for level in tree.levels[:-1]:
            assert shapes[f"draft{level.depth}"][1]["input_ids"] == (rows, len(level.nodes))
        assert out.stats["engine_calls_per_step"] == tree.depth + 1
    capacity = plan.target_cache.capacity
    assert shapes["verify"][1]["past_keys_0"][2] == capacity == base.manifest.condition.tokens + out.tokens.shape[1]


def test_iobinding_gives_the_tokens_of_plain_session_runs(c2i_engine):
    bound = Engine(c2i_engine, threads=2)
    plain = Engine(c2i_engine, threads=2, io_binding=False)
    for kw in (dict(mode="lantern++", lam=3.0, k=8, greedy=True), dict(mode="exact", top_k=20, seed=3),
               dict(mode="ar", seed=4)):
        a = bound.generate(classes=[1, 2], cfg_scale=3.0, **kw)
        b = plain.generate(classes=[1, 2], cfg_scale=3.0, **kw)
        np.testing.assert_array_equal(a.tokens, b.tokens)
    assert bound.backend._bound and not plain.backend._bound


def test_a_reused_plan_starts_clean(c2i_engine):
    """Generations reuse the last plan's bound buffers; nothing of one may leak into the next."""
    engine = Engine(c2i_engine, threads=2)
    first = engine.generate(classes=[3, 5], mode="lantern++", lam=3.0, k=8, cfg_scale=4.0, cfg_interval=4, seed=2)
    plan = engine._plan
    engine.generate(classes=[7, 1], mode="lantern++", lam=3.0, k=8, cfg_scale=2.0, seed=9)  # new settings, same shapes
    again = engine.generate(classes=[3, 5], mode="lantern++", lam=3.0, k=8, cfg_scale=4.0, cfg_interval=4, seed=2)
    assert engine._plan is plan
    np.testing.assert_array_equal(first.tokens, again.tokens)
    fresh = Engine(c2i_engine, threads=2).generate(classes=[3, 5], mode="lantern++", lam=3.0, k=8, cfg_scale=4.0,
                                                    cfg_interval=4, seed=2)
    np.testing.assert_array_equal(first.tokens, fresh.tokens)


def test_observer_records_match_the_stats(c2i_engine):
    engine = Engine(c2i_engine, threads=2)
    records = []
    out = engine.generate(classes=[0, 1, 2], mode="lantern++", lam=3.0, k=8, cfg_scale=4.0, observer=records.append)
    tree = build_tree(engine.manifest.tree)
    assert [r.step for r in records] == list(range(len(records))) and len(records) >= out.stats["steps_per_image"]
    accepted = [int(a) for r in records for a, live in zip(r.accepted, r.active) if live]
    assert np.mean(accepted) == pytest.approx(out.stats["mean_accepted_drafts"])
    for r in records:
        assert r.decisions.shape == (3, tree.num_nodes) and r.tree == tree
        for n in range(3):
            on_path = np.flatnonzero(r.decisions[n] == 1)
            if r.active[n]:
                assert on_path[0] == 0 and len(on_path) == r.accepted[n] + 1
                # a node is evaluated only if its parent is on the path
                evaluated = np.flatnonzero(r.decisions[n] >= 0)[1:]
                assert all(r.decisions[n, tree.parents[i]] == 1 for i in evaluated)
            else:
                assert (r.decisions[n] == -1).all()


def test_a_tree_the_machine_cannot_hold_is_refused_before_allocating(c2i_engine):
    engine = Engine(c2i_engine, threads=2, memory_limit=2**30)
    with pytest.raises(LanternError, match=r"tree 'kary-2-11' \(4095 nodes\) for 2 image\(s\) with CFG needs about "):
        engine.generate(classes=[1, 2], mode="exact", cfg_scale=4.0, tree="kary-2-11")
    assert engine._plan is None
    engine.generate(classes=[1, 2], mode="exact", cfg_scale=4.0, tree="kary-2-2")  # a small tree fits


def _edit_manifest(src, tmp_path, name, change):
    d = tmp_path / name
    shutil.copytree(src, d)
    m = json.loads((d / "manifest.json").read_text())
    change(m)
    (d / "manifest.json").write_text(json.dumps(m))
    return d


@pytest.mark.parametrize("name, change, words", [
    ("old", lambda m: (m.pop("schema"), m.update(format_version=1)), "engine schema 1 is not the supported 2"),
    ("unknown", lambda m: m.update(quantum=1), "unknown field(s) quantum"),
    ("notree", lambda m: m.update(tree=None), "tree is missing; modes exact, lantern, lantern++ need"),
    ("nocand", lambda m: m.pop("candidates"), "candidates is missing"),
    ("nofiles", lambda m: m.update(files=None), "files is None, expected dict"),
    ("badmode", lambda m: m.update(modes=["ar", "medusa"]), "modes is ['ar', 'medusa']"),
    ("neighbors", lambda m: m.update(neighbors=None), "neighbors is missing; modes lantern and lantern++"),
    ("shape", lambda m: m["target"].update(layers="two"), "target.layers is 'two'"),
    ("graphfile", lambda m: m["graphs"]["target"].update(file="nowhere.onnx"), "names nowhere.onnx"),
    ("escape", lambda m: m["files"].update({"../x": m["files"]["target.onnx"]}), "outside the engine directory"),
    ("rank", lambda m: m["graphs"]["drafter"]["outputs"]["new_values"].update(shape=["B", 2, "T", 8]),
     "new_values.shape is ['B', 2, 'T', 8], of rank 4"),  # found by the manifest fuzz
])
def test_bad_manifests_are_refused_in_one_line(c2i_engine, tmp_path, name, change, words):
    d = _edit_manifest(c2i_engine, tmp_path, name, change)
    with pytest.raises(LanternError) as e:
        read_manifest(d)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert "re-export" in str(e.value) or "rebuild the engine" in str(e.value)


def test_runtime_imports_nothing_from_export(c2i_engine, tmp_path):
    code = ("import sys\n"
            "from lantern.runtime.generator import Engine\n"
            "import lantern.runtime.backends.torch, lantern.runtime.cli\n"
            f"Engine({c2i_engine!r}, threads=1).generate(classes=[1], mode='exact')\n"
            "bad = [m for m in sys.modules if m.startswith('lantern.export') or m.startswith('lantern.tools')]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
