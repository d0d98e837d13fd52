"""Acceptance graphs in an engine directory: `lantern-export accept` exports them for the engine's
trees and records them (Manifest.acceptance); the runtime finds a tree's graphs by its paths,
runs them from the directory, and refuses damaged or mismatched records in one line."""
import json
import os
import shutil

import numpy as np
import onnxruntime as ort
import pytest

from engines import flip_a_bit, manifest as manifest_json
from lantern.export import cli
from lantern.runtime import accept as acceptance
from lantern.runtime.errors import LanternError
from lantern.runtime.manifest import read_manifest
from lantern.runtime.tree import build_tree


@pytest.fixture(scope="module")
def accept_engine(c2i_engine, tmp_path_factory):
    """A private copy of the session's c2i engine with its default tree's acceptance graphs."""
    out = shutil.copytree(c2i_engine, tmp_path_factory.mktemp("accept") / "engine")
    assert cli.main(["accept", str(out)]) == 0
    return str(out)


def test_accept_records_the_default_trees_graphs(accept_engine, c2i_engine):
    m = read_manifest(accept_engine)
    tree = build_tree(m.tree)
    entry = m.acceptance_for(tree)
    assert entry is not None and entry.forced_ids == () and list(m.acceptance) == [tree.name]
    assert entry.greedy.contract == "accept_greedy" and entry.greedy.file.startswith("accept/")
    assert entry.greedy.file in m.files and entry.greedy.inputs["tokens"].shape == ("N", tree.num_nodes)
    assert m.acceptance_for(build_tree("chain-4")) is None  # no graph: that tree's step accepts on the host
    # the engine's other graphs and files are untouched
    before = read_manifest(c2i_engine)
    assert m.graphs == before.graphs and {k: v for k, v in m.files.items() if not k.startswith("accept/")} == before.files


def test_the_engines_graph_runs_and_equals_the_numpy_rules(accept_engine):
    m = read_manifest(accept_engine)
    tree = build_tree(m.tree)
    entry = m.acceptance_for(tree)
    session = ort.InferenceSession(os.path.join(accept_engine, entry.greedy.file), providers=["CPUExecutionProvider"])
    neighbors = np.load(os.path.join(accept_engine, m.neighbors.file)).astype(np.int64)
    rng = np.random.default_rng(0)
    V, M, N = m.vocabulary.size, tree.num_nodes, 3
    logits = (rng.integers(-4, 4, size=(N, M, V)) / 2).astype(np.float32)
    top = logits.argmax(axis=2)
    tokens = np.where(rng.random((N, M)) < 0.6, top[:, np.maximum(tree.parents, 0)], rng.integers(0, V, (N, M)))
    rule = acceptance.LanternPP(k=4, lam=3.0)
    feeds = dict(logits=logits, cond_rows=np.arange(N), uncond_rows=np.arange(N), cfg_scale=np.ones(1, np.float32),
                 cfg_interval=np.array([-1]), count=np.ones(N, np.int64), forced_columns=np.full(10, -1),
                 tokens=tokens, neighbors=neighbors, k=np.array([rule.k]), lam=np.array([rule.lam], np.float32),
                 delta=np.zeros(1, np.float32))
    got = dict(zip(entry.greedy.outputs, session.run(list(entry.greedy.outputs), feeds)))
    want = acceptance.accept_greedy_batch(tree, tokens, logits, rule, neighbors)
    np.testing.assert_array_equal(got["path"], want.path)
    np.testing.assert_array_equal(got["next_token"], want.next_token)
    assert (want.accepted > 0).any()


def test_a_changed_acceptance_graph_is_refused(accept_engine, tmp_path):
    copy = shutil.copytree(accept_engine, tmp_path / "engine")
    m = read_manifest(copy)
    path = os.path.join(copy, next(iter(m.acceptance.values())).greedy.file)
    flip_a_bit(path, 100)
    with pytest.raises(LanternError, match="accept/"):
        read_manifest(copy, verify=True)


@pytest.mark.parametrize("damage, match", [
    (lambda e: e["greedy"]["inputs"]["tokens"].update(shape=["N", 7]), "dims"),
    (lambda e: e.update(forced_ids=[3]), "image token"),
    (lambda e: e["greedy"].update(contract="accept_sampling"), "contract"),
    (lambda e: e.update(extra=1), "unknown field"),
])
def test_a_mismatched_acceptance_record_is_one_line(accept_engine, tmp_path, damage, match):
    copy = shutil.copytree(accept_engine, tmp_path / "engine")
    data = manifest_json(copy)
    damage(next(iter(data["acceptance"].values())))
    with open(os.path.join(copy, "manifest.json"), "w") as f:
        json.dump(data, f)
    with pytest.raises(LanternError, match=match) as e:
        read_manifest(copy, verify=False)
    assert "\n" not in str(e.value) and "lantern-export accept" in str(e.value)


def test_accept_refuses_an_engine_without_a_drafter_in_one_line(tmp_path, capsys, c2i_engine):
    copy = shutil.copytree(c2i_engine, tmp_path / "engine")
    data = manifest_json(copy)
    assert cli.main(["accept", str(copy), "--tree", "kary-20-1"]) == 2  # wider than the drafter's candidates
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "candidates" in err[0]
    assert manifest_json(copy) == data


def test_check_covers_the_acceptance_graphs_and_catches_a_wrong_one(accept_engine, monkeypatch):
    from lantern.export import accept_engine as engine_graphs, accept_graphs

    m = read_manifest(accept_engine)
    rows = engine_graphs.check_acceptance(accept_engine, m, np.random.default_rng(0), cases=2)
    assert {r["graph"] for r in rows} == {f"accept_greedy@{m.tree['name']}", f"accept_sampling@{m.tree['name']}"}
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]

    class Shifted(accept_graphs.GreedyAcceptance):  # a wrong next token
        def forward(self, *inputs):
            accepted, next_token, path, decisions, invalid = super().forward(*inputs)
            return accepted, next_token + 1, path, decisions, invalid

    monkeypatch.setitem(accept_graphs.KINDS, "greedy", Shifted)
    rows = engine_graphs.check_acceptance(accept_engine, m, np.random.default_rng(0), cases=1)
    assert [r["ok"] for r in rows if r["graph"].startswith("accept_greedy")] == [True, False]


def test_trt_lays_out_the_acceptance_plans_from_the_step_plans(accept_engine):
    """`lantern-export trt` builds a plan per acceptance graph of the trees it builds for, one
    exact profile per batch and CFG setting, in the shapes a generation's step feeds: the target's
    rows as verification returns them, the body's length, the engine's neighbor table."""
    from lantern.export import trt_export

    m = read_manifest(accept_engine)
    tree = build_tree(m.tree)
    jobs = dict(trt_export.acceptance_jobs(m, (1, 3), (False, True), [tree, build_tree("chain-4")]))
    assert set(jobs) == {f"accept_greedy@{tree.name}", f"accept_sampling@{tree.name}"}  # chain-4 has no graphs
    for label, profiles in jobs.items():
        assert [labels for labels, _ in profiles] == [(f"accept n{n}{c} {tree.name}",) for n in (1, 3) for c in ("", " cfg")]
        for (labels, profile), (images, cfg) in zip(profiles, [(1, False), (1, True), (3, False), (3, True)]):
            lo, opt, hi = profile["logits"]
            assert lo == opt == hi == (2 * images if cfg else images, tree.num_nodes, m.vocabulary.size)
            assert profile["forced_columns"][0] == (m.image.tokens,)  # c2i: the body is the grid, nothing forced
            assert profile["neighbors"][0] == (m.vocabulary.codes, m.neighbors.k)
            assert profile["tokens"][0] == (images, tree.num_nodes)
            if label.startswith("accept_sampling"):
                assert profile["draft_probs"][0] == (images, tree.num_nodes, m.candidates)


def test_the_manifest_takes_plans_of_acceptance_graphs(accept_engine, tmp_path):
    """A `lantern-export trt` record with acceptance plans (keyed accept_<kind>@TREE) reads back;
    one for a graph the engine does not have is refused."""
    from lantern.export import trt_export
    from lantern.runtime.manifest import PlanFile, PlanProfile, TensorRTPlans, describe_files

    copy = shutil.copytree(accept_engine, tmp_path / "engine")
    m = read_manifest(copy)
    tree = build_tree(m.tree)
    (label, profiles), _ = trt_export.acceptance_jobs(m, (1,), (True,), [tree])
    os.makedirs(os.path.join(copy, "plans", "tensorrt-rtx-SM89"))
    plan = "plans/tensorrt-rtx-SM89/" + os.path.basename(m.all_graphs()[label].file)[:-len(".onnx")] + ".plan"
    with open(os.path.join(copy, plan), "wb") as f:
        f.write(b"not a real plan")
    shapes = {n: {"min": list(a), "opt": list(b), "max": list(c)} for n, (a, b, c) in profiles[0][1].items()}
    entry = TensorRTPlans(flavor="tensorrt-rtx", version="1.7", compute_capabilities=("SM89",),
                          plans={label: PlanFile(file=plan, profiles=(PlanProfile(serves=profiles[0][0], shapes=shapes),))},
                          batches=(1,), cfg=(True,), trees=(tree.name,))
    m.replace(tensorrt={"tensorrt-rtx-SM89": entry}, files={**m.files, **describe_files(copy, [plan])}).write(copy)
    assert read_manifest(copy).tensorrt["tensorrt-rtx-SM89"].plans[label].profiles[0].covers(
        {n: s["min"] for n, s in shapes.items()})
    data = manifest_json(copy)
    data["tensorrt"]["tensorrt-rtx-SM89"]["plans"]["accept_greedy@chain-4"] = data["tensorrt"]["tensorrt-rtx-SM89"]["plans"][label]
    with open(os.path.join(copy, "manifest.json"), "w") as f:
        json.dump(data, f)
    with pytest.raises(LanternError, match="accept_greedy@chain-4 is a plan for a graph the engine does not have"):
        read_manifest(copy)


def test_one_kind_at_a_time_keeps_the_others(c2i_engine, tmp_path):
    """add_acceptance_graphs(kinds=...) exports the kinds asked for and keeps the tree's others; a
    tree with no graphs gets its greedy one as well (an entry always has it)."""
    from lantern.export.accept_engine import add_acceptance_graphs

    out = str(shutil.copytree(c2i_engine, tmp_path / "engine"))
    tree = build_tree(read_manifest(out).tree)
    first = add_acceptance_graphs(out, kinds=("sampling",)).acceptance_for(tree)
    assert first.greedy is not None and first.sampling is not None
    greedy_bytes = open(os.path.join(out, first.greedy.file), "rb").read()
    again = add_acceptance_graphs(out, kinds=("sampling",), force=True).acceptance_for(tree)
    assert again.greedy == first.greedy and again.sampling.file == first.sampling.file
    assert open(os.path.join(out, again.greedy.file), "rb").read() == greedy_bytes
    m = read_manifest(out, verify=True)  # every recorded file is there with its hash
    assert {first.greedy.file, first.sampling.file} <= set(m.files)
