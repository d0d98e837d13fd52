"""Step graphs in an engine directory: `lantern-export accept` exports them for the engine's trees
and AR (Manifest.step_graphs, STEP_VERSION each), the manifest confines and hashes their files, and
ONNX Runtime's device step runs them token for token as the host step, refusing in one line what
they cannot serve."""
import dataclasses
import os
import shutil

import numpy as np
import pytest

from engines import edit_manifest, flip_a_bit, manifest as manifest_json
from lantern.export import cli
from lantern.runtime import graph_step
from lantern.runtime.contracts import ACCEPT_PHASES, STEP_VERSION
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.manifest import read_manifest
from lantern.runtime.settings import GenerationSettings
from lantern.runtime.tree import build_tree, root_only


def _strip_step_graphs(directory):
    """The engine as one written before step graphs: no entries, no step/ files."""
    m = read_manifest(directory)
    gone = {f for e in m.step_graphs.values() for f in e.files()}
    m.replace(step_graphs={}, files={k: v for k, v in m.files.items() if k not in gone}).write(directory)
    shutil.rmtree(os.path.join(directory, "step"), ignore_errors=True)


@pytest.fixture(scope="module")
def step_engine(c2i_engine, tmp_path_factory):
    """A copy of the session's c2i engine stripped of its step graphs, then given them again by
    `lantern-export accept`."""
    out = str(shutil.copytree(c2i_engine, tmp_path_factory.mktemp("step") / "engine"))
    _strip_step_graphs(out)
    assert read_manifest(out).step_graphs == {}
    assert cli.main(["accept", out, "--no-progress"]) == 0
    return out


@pytest.fixture
def copy(step_engine, tmp_path):
    return str(shutil.copytree(step_engine, tmp_path / "engine"))


def test_accept_writes_the_default_trees_and_ars_step_graphs(step_engine):
    m = read_manifest(step_engine)
    tree = build_tree(m.tree)
    assert set(m.step_graphs) == {tree.name, "ar"}
    for t, phases in ((tree, ["begin"] + [f"level{d}" for d in range(1, tree.depth + 1)] + ["accept"]),
                      (root_only(), ["begin", "accept"])):
        entry = m.step_graphs_for(t)
        assert entry is not None and entry.version == STEP_VERSION and entry.forced_ids == ()
        for kind, want in (("greedy", phases), ("sampling", phases[:-1] + list(ACCEPT_PHASES))):  # an accept per filter
            files = getattr(entry, kind)
            assert sorted(files) == sorted(want)
            for phase, name in files.items():
                assert name.startswith("step/") and name.endswith(f"{kind}.{phase}.onnx")
                assert os.path.dirname(name) == os.path.dirname(files["begin"])  # one folder per tree
                assert name in m.files and os.path.getsize(os.path.join(step_engine, name)) == m.files[name].size
    assert m.step_graphs["ar"].tree == {"name": "ar", "paths": []}
    assert m.step_graphs_for(build_tree("chain-4")) is None
    assert m.acceptance == {} and not os.path.exists(os.path.join(step_engine, "accept"))  # step graphs only


def test_the_manifest_round_trips(copy):
    m = read_manifest(copy)
    m.write(copy)
    again = read_manifest(copy)
    assert again.step_graphs == m.step_graphs and again.files == m.files
    assert manifest_json(copy)["step_graphs"]["ar"]["version"] == STEP_VERSION


def _add_legacy_acceptance(directory):
    """What an engine from before the step graphs also held: an acceptance-only graph of its
    default tree (accept/, Manifest.acceptance). Its file here is a copy of the tree's greedy
    accept phase (any ONNX file: nothing runs it), recorded with the accept_greedy contract's I/O."""
    from lantern.runtime.contracts import resolved_io
    from lantern.runtime.manifest import AcceptanceGraphs, Graph, TensorSpec, describe_files

    m = read_manifest(directory)
    tree = build_tree(m.tree)
    name = f"accept/{tree.name}-legacy.greedy.onnx"
    os.makedirs(os.path.join(directory, "accept"))
    shutil.copyfile(os.path.join(directory, m.step_graphs_for(tree).greedy["accept"]), os.path.join(directory, name))
    io = resolved_io("accept_greedy", {"M": tree.num_nodes, "V": m.vocabulary.size, "W": m.vocabulary.codes,
                                       "depth+1": tree.depth + 1}, "float32")
    specs = {kind: {k: TensorSpec(v["dtype"], tuple(v["shape"])) for k, v in io[kind].items()}
             for kind in ("inputs", "outputs")}
    entry = AcceptanceGraphs(tree=tree.to_json(), forced_ids=(), greedy=Graph(
        file=name, contract="accept_greedy", dtype="fp32", **specs))
    m.replace(acceptance={tree.name: entry}, files={**m.files, **describe_files(directory, [name])}).write(directory)
    return name


def test_an_engine_with_legacy_acceptance_graphs_reads_verifies_and_runs(copy):
    """An older engine's acceptance-only graphs: its manifest reads and verifies (their files are
    hashed like any other), it runs on its step graphs, `accept --force` leaves them as they are,
    and a changed one is refused."""
    name = _add_legacy_acceptance(copy)
    m = read_manifest(copy, verify=True)
    assert list(m.acceptance) == [build_tree(m.tree).name] and name in m.files
    device = Engine(copy, threads=2, step="device").generate(mode="lantern++", greedy=True, classes=[1], lam=3.0, k=8)
    host = Engine(copy, threads=2, step="host").generate(mode="lantern++", greedy=True, classes=[1], lam=3.0, k=8)
    assert device.stats["step"] == "device"
    np.testing.assert_array_equal(device.tokens, host.tokens)
    assert cli.main(["accept", copy, "--force", "--no-progress"]) == 0  # the step graphs written again
    again = read_manifest(copy, verify=True)
    assert again.acceptance == m.acceptance and again.files[name] == m.files[name]  # left alone
    assert set(again.step_graphs) == set(m.step_graphs)
    flip_a_bit(os.path.join(copy, name), 50)
    with pytest.raises(LanternError, match="accept/"):
        read_manifest(copy, verify=True)


def test_a_changed_step_graph_is_refused(copy):
    name = read_manifest(copy).step_graphs["ar"].greedy["accept"]
    flip_a_bit(os.path.join(copy, name), 50)
    with pytest.raises(LanternError, match="step/"):
        read_manifest(copy, verify=True)


@pytest.mark.parametrize("damage, match", [
    (lambda e: e["greedy"].update(begin="../outside.onnx"), "not a relative path inside"),
    (lambda e: e["greedy"].update(begin="/etc/passwd"), "not a relative path inside"),
    (lambda e: e["sampling"].update(begin="step/elsewhere.onnx"), "does not list"),
    (lambda e: e["greedy"].pop("accept"), "phases"),
    (lambda e: e.update(version="1"), "version"),
    (lambda e: e.update(tree={"name": "other", "paths": []}), "keyed"),
    (lambda e: e.update(extra=1), "unknown field"),
])
def test_a_malformed_step_entry_is_one_line(copy, damage, match):
    edit_manifest(copy, lambda data: damage(data["step_graphs"]["ar"]))
    with pytest.raises(LanternError, match=match) as e:
        read_manifest(copy, verify=False)
    assert "\n" not in str(e.value) and "lantern-export accept" in str(e.value)


def _generate(engine, mode="exact", greedy=True, **extra):
    return engine.generate(GenerationSettings(mode=mode, greedy=greedy, cfg_scale=3.0), classes=[1, 2], seed=3, **extra)


def test_a_missing_entry_is_refused_and_the_default_falls_back_to_the_host(copy):
    tree = read_manifest(copy).tree["name"]
    edit_manifest(copy, lambda data: data["step_graphs"].pop(tree))
    engine = Engine(copy, backend="onnxruntime", threads=2, step="device")
    with pytest.raises(LanternError, match=rf"no step graphs for tree {tree}; add them with "
                                           rf"`lantern-export accept {copy}`"):
        _generate(engine)
    with pytest.raises(LanternError, match=rf"no step graphs for tree chain-4; .*accept {copy} --tree \.\.\.`"):
        _generate(engine, tree="chain-4")
    assert _generate(engine, mode="ar").stats["step"] == "device"  # AR's graphs are still there
    default = Engine(copy, backend="onnxruntime", threads=2)
    assert _generate(default).stats["step"] == "host" and _generate(default, mode="ar").stats["step"] == "device"


def test_another_version_is_refused_and_accept_upgrades_it(copy):
    tree = read_manifest(copy).tree["name"]
    edit_manifest(copy, lambda data: data["step_graphs"][tree].update(version=0))
    engine = Engine(copy, backend="onnxruntime", threads=2, step="device")
    with pytest.raises(LanternError, match=rf"step graphs are version 0, this lantern runs {STEP_VERSION}: re-export "
                                           rf"them with `lantern-export accept {copy} --force`"):
        _generate(engine)
    assert cli.main(["accept", copy, "--no-progress"]) == 0  # another version is exported again
    assert read_manifest(copy).step_graphs[tree].version == STEP_VERSION
    before = manifest_json(copy)
    assert cli.main(["accept", copy, "--no-progress"]) == 0  # nothing to do: unchanged
    assert manifest_json(copy) == before
    edit_manifest(copy, lambda data: data["step_graphs"]["ar"].update(version=0))
    assert cli.main(["accept", copy, "--force", "--no-progress"]) == 0
    m = read_manifest(copy, verify=True)
    assert {e.version for e in m.step_graphs.values()} == {STEP_VERSION}
    assert _generate(Engine(copy, backend="onnxruntime", threads=2, step="device")).stats["step"] == "device"


def test_what_the_graphs_cannot_serve_is_one_line(copy, monkeypatch):
    engine = Engine(copy, backend="onnxruntime", threads=2, step="device")
    m = engine.manifest
    tree = build_tree(m.tree)
    backend = engine.backend
    _generate(engine)
    plan = engine._plan  # the last generation's plan
    sampler = GenerationSettings(greedy=False, top_k=20).resolve(m, copy).sampler()
    assert backend.device_step_refusal(plan, sampler) is None
    # forced ids other than the generation's (a prompt engine's graphs on another grid)
    entry = m.step_graphs_for(tree)
    monkeypatch.setattr(backend, "manifest", m.replace(step_graphs={
        **m.step_graphs, tree.name: dataclasses.replace(entry, forced_ids=(70,))}))
    assert "serve forced ids [70], this generation forces []" in backend.device_step_refusal(plan, sampler)
    monkeypatch.setattr(backend, "manifest", m)
    # a top-k the sampling acceptance cannot filter: the step graphs' TopK limit
    monkeypatch.setattr(graph_step, "ACCEPT_TOP_K_LIMIT", 10)
    assert backend.device_step_refusal(plan, sampler) == "its sampling acceptance graph serves top_k up to 10 (or " \
                                                         "none), not 20"
    with pytest.raises(LanternError, match="serves top_k up to 10"):
        engine.generate(GenerationSettings(mode="exact", greedy=False, top_k=20), classes=[1], seed=0)
    # no IOBinding
    unbound = Engine(copy, backend="onnxruntime", threads=2, step="device", io_binding=False)
    with pytest.raises(LanternError, match="IOBinding"):
        _generate(unbound, mode="ar")


@pytest.mark.parametrize("mode", ["ar", "exact", "lantern++"])
def test_the_graph_step_equals_the_host_step(step_engine, mode):
    host = Engine(step_engine, backend="onnxruntime", threads=2, step="host")
    device = Engine(step_engine, backend="onnxruntime", threads=2, step="device")
    for greedy in (True, False):
        settings = GenerationSettings(mode=mode, greedy=greedy, cfg_scale=3.0)
        want = host.generate(settings, classes=[1, 2, 5], seed=7)
        got = device.generate(settings, classes=[1, 2, 5], seed=7)
        assert got.stats["step"] == "device" and want.stats["step"] == "host"
        np.testing.assert_array_equal(got.tokens, want.tokens)
    assert Engine(step_engine, backend="onnxruntime", threads=2).step == "device"  # ONNX Runtime's default
