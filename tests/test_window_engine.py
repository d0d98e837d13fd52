"""A Jacobi window's step graphs in an engine directory: `lantern-export accept --window W --init
INIT` exports them (Manifest.window_graphs, keyed by window and init, the two things that change
the graphs), the manifest reads them back, confines their files and refuses a bad entry in one
line, and ONNX Runtime's device step runs a jacobi generation on them token for token as the host
step; without them it refuses in one line naming the command that adds them, and its default
step gives way to the host."""
import os
import shutil

import numpy as np
import pytest

from engines import edit_manifest, manifest as manifest_json
from lantern.export import accept_engine, cli
from lantern.runtime.contracts import ACCEPT_PHASES, STEP_VERSION
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.manifest import read_manifest

CLASSES = [1, 2, 3]


@pytest.fixture(scope="module")
def window_engine(c2i_engine, tmp_path_factory):
    """A copy of the c2i engine (its trees' step graphs already there) given the graphs of a
    window of 4 slots, random and spatial, through the CLI."""
    out = str(shutil.copytree(c2i_engine, tmp_path_factory.mktemp("window") / "engine"))
    assert read_manifest(out).window_graphs == {} and "window_graphs" not in manifest_json(out)
    argv = ["accept", out, "--window", "4", "--init", "random", "--init", "spatial", "--no-progress"]
    assert cli.main(argv) == 0
    return out


@pytest.fixture
def copy(window_engine, tmp_path):
    return str(shutil.copytree(window_engine, tmp_path / "engine"))


def test_accept_writes_a_set_per_window_and_init(window_engine, c2i_engine):
    m = read_manifest(window_engine, verify=True)
    assert set(m.window_graphs) == {"jacobi4-random", "jacobi4-spatial"}
    assert m.step_graphs == read_manifest(c2i_engine).step_graphs  # the trees' graphs untouched
    for init in ("random", "spatial"):
        entry = m.window_graphs_for(4, init)
        assert (entry.window, entry.init, entry.version, entry.forced_ids) == (4, init, STEP_VERSION, ())
        for kind, phases in (("greedy", ["begin", "accept"]), ("sampling", ["begin"] + list(ACCEPT_PHASES))):
            files = getattr(entry, kind)
            assert sorted(files) == sorted(phases)  # no drafter calls: no levels
            for phase, name in files.items():
                assert name == f"step/jacobi4-{init}/{kind}.{phase}.onnx"
                assert os.path.getsize(os.path.join(window_engine, name)) == m.files[name].size
    assert m.window_graphs_for(4, "uniform") is None and m.window_graphs_for(6, "random") is None


def test_the_manifest_round_trips(copy):
    m = read_manifest(copy)
    m.write(copy)
    again = read_manifest(copy)
    assert again.window_graphs == m.window_graphs and again.files == m.files
    assert manifest_json(copy)["window_graphs"]["jacobi4-spatial"]["init"] == "spatial"


@pytest.mark.parametrize("damage, match", [
    (lambda e: e["greedy"].update(begin="../outside.onnx"), "not a relative path inside"),
    (lambda e: e["sampling"].update(begin="step/elsewhere.onnx"), "does not list"),
    (lambda e: e["greedy"].pop("accept"), "phases"),
    (lambda e: e["sampling"].update(level1=e["sampling"]["begin"]), "phases"),
    (lambda e: e.update(init="spatial"), "keyed 'jacobi4-random'"),
    (lambda e: e.update(window=5), "keyed 'jacobi4-random'"),
    (lambda e: e.update(window=1), r"window.*\[2, "),
    (lambda e: e.update(init="zigzag"), "random, uniform, spatial"),
    (lambda e: e.update(version="2"), "version"),
    (lambda e: e.update(extra=1), "unknown field"),
])
def test_a_malformed_window_entry_is_one_line(copy, damage, match):
    edit_manifest(copy, lambda data: damage(data["window_graphs"]["jacobi4-random"]))
    with pytest.raises(LanternError, match=match) as e:
        read_manifest(copy, verify=False)
    assert "\n" not in str(e.value) and "window_graphs" in str(e.value) and "lantern-export accept" in str(e.value)


def _same(host_engine, device_engine, **kw):
    """Host and device jacobi generations of one request: the same tokens and, step by step, the
    same windows (every draft, as an observer reads them)."""
    kw = dict(proposer="jacobi", classes=CLASSES, cfg_scale=3.0, **kw)
    windows = {"host": [], "device": []}
    host = host_engine.generate(**kw, observer=lambda record: windows["host"].append(record.tokens))
    device = device_engine.generate(**kw, observer=lambda record: windows["device"].append(record.tokens))
    assert (host.stats["step"], device.stats["step"]) == ("host", "device"), device.stats.get("step_reason")
    np.testing.assert_array_equal(device.tokens, host.tokens, err_msg=str(kw))
    np.testing.assert_array_equal(np.stack(windows["device"]), np.stack(windows["host"]), err_msg=str(kw))
    assert device.stats["mean_accepted_drafts"] > 0  # the window's drafts were accepted, not only its root
    return device


def test_onnxruntime_runs_the_window_on_its_graph_step_as_the_host_step(window_engine):
    host = Engine(window_engine, backend="onnxruntime", threads=2, step="host")
    device = Engine(window_engine, backend="onnxruntime", threads=2)  # the default: the device step
    seeds = [11, 18, 25]
    _same(host, device, mode="exact", greedy=True, window=4, init="random")
    _same(host, device, mode="exact", greedy=True, window=4, init="spatial", cfg_interval=5)
    _same(host, device, mode="exact", greedy=False, window=4, init="random", seed=seeds, top_k=30)
    out = _same(host, device, mode="lantern++", lam=3.0, k=8, greedy=False, window=4, init="spatial", seed=seeds,
                top_p=0.95)
    assert "step_reason" not in out.stats


def test_a_window_without_graphs_is_refused_in_one_line_and_the_default_gives_way(copy):
    asked = Engine(copy, backend="onnxruntime", threads=2, step="device")
    kw = dict(proposer="jacobi", mode="exact", greedy=True, cfg_scale=3.0, classes=CLASSES[:1])
    for window, init in ((6, "random"), (4, "uniform")):
        command = f"lantern-export accept {copy} --window {window} --init {init}"
        with pytest.raises(LanternError) as e:
            asked.generate(window=window, init=init, **kw)
        assert str(e.value) == (f"the device step cannot run this generation: the engine has no step graphs for a "
                                f"jacobi window of {window} slots with init {init}; add them with `{command}`; use "
                                f"step='host'")
    default = Engine(copy, backend="onnxruntime", threads=2)
    out = default.generate(window=6, init="random", **kw)
    assert out.stats["step"] == "host" and "--window 6 --init random`" in out.stats["step_reason"]
    assert default.generate(window=4, init="random", **kw).stats["step"] == "device"
    # the command it names adds them, and the window then runs on the device
    assert cli.main(["accept", copy, "--window", "6", "--no-progress"]) == 0
    assert default.__class__(copy, backend="onnxruntime", threads=2).generate(window=6, init="random", **kw) \
        .stats["step"] == "device"


def test_another_version_is_refused_and_accept_exports_it_again(copy):
    edit_manifest(copy, lambda data: data["window_graphs"]["jacobi4-spatial"].update(version=0))
    kw = dict(proposer="jacobi", mode="exact", greedy=True, cfg_scale=3.0, classes=CLASSES[:1], window=4)
    with pytest.raises(LanternError, match=rf"version 0, this lantern runs {STEP_VERSION}: re-export them with "
                                           rf"`lantern-export accept {copy} --window 4 --init spatial`"):
        Engine(copy, backend="onnxruntime", threads=2, step="device").generate(init="spatial", **kw)
    before = manifest_json(copy)["window_graphs"]["jacobi4-random"]
    assert cli.main(["accept", copy, "--no-progress"]) == 0  # a plain accept re-exports the old window too
    m = read_manifest(copy, verify=True)
    assert m.window_graphs["jacobi4-spatial"].version == STEP_VERSION
    assert manifest_json(copy)["window_graphs"]["jacobi4-random"] == before  # the current one skipped
    assert Engine(copy, backend="onnxruntime", threads=2).generate(init="spatial", **kw).stats["step"] == "device"


def test_a_failed_accept_changes_nothing(copy, monkeypatch):
    before = manifest_json(copy)
    listing = sorted(os.listdir(os.path.join(copy, "step")))

    def broken(*args, **kwargs):
        raise RuntimeError("export failed")

    monkeypatch.setattr(accept_engine, "write_step_graphs", broken)
    with pytest.raises(RuntimeError, match="export failed"):
        accept_engine.add_step_graphs(copy, windows=[8], inits=("uniform",))
    assert manifest_json(copy) == before and sorted(os.listdir(os.path.join(copy, "step"))) == listing
    assert not [n for n in os.listdir(copy) if n.startswith(".lantern-stage")]


@pytest.mark.parametrize("argv, match", [(["--window", "1"], "window must be an integer in"),
                                         (["--init", "spatial"], "give --window too")])
def test_bad_window_arguments_are_one_line(copy, capsys, argv, match):
    before = manifest_json(copy)
    assert cli.main(["accept", copy, "--no-progress"] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1, err
    assert manifest_json(copy) == before
