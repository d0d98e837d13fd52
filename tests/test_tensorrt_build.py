"""TensorRT plans from tiny engines' ONNX graphs (TensorRT-RTX builds ahead of time without a GPU):
the build primitives of lantern.export.tensorrt_build and the `lantern-export trt` command.
What a plan holds can only be read back with a GPU; without one the build record's I/O (read
from TensorRT's parsed network) and profiles (read back from TensorRT's profile objects) are
checked against the manifest and the step plans of real generations."""
import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'lantern[tensorrt-rtx]')")

from engines import captions, strike_drafter  # noqa: E402
from lantern.export import cli, trt_export  # noqa: E402
from lantern.export import tensorrt_build as tb  # noqa: E402
from lantern.runtime.backends.cuda import gpu_compute_capability  # noqa: E402
from lantern.runtime.backends.tensorrt_plans import find_profile  # noqa: E402
from lantern.runtime.errors import LanternError  # noqa: E402
from lantern.runtime.generator import Engine  # noqa: E402
from lantern.runtime.integrity import sha256_file as sha256  # noqa: E402
from lantern.runtime.manifest import read_manifest  # noqa: E402
from lantern.runtime.tree import build_tree  # noqa: E402

FLAVOR = "tensorrt-rtx"
HAS_GPU = gpu_compute_capability() is not None
# Full TensorRT either is not installed, or refuses named compute capabilities.
FULL_TRT_REFUSES = "builds for the GPU it runs on" if "tensorrt" in tb.available_flavors() else "tensorrt is not installed"


def _copy(engine, tmp_path, name="engine"):
    """A private copy of a session engine (the fixtures are shared: never build into them)."""
    return shutil.copytree(engine, tmp_path / name)


def _calls(directory, batches=(1,), cfgs=(False, True)):
    m = read_manifest(directory)
    return m, trt_export.call_shapes(m, batches, cfgs, [build_tree(m.tree)])


def _assert_io_matches_manifest(record_io, graph):
    """Names, order and dtypes TensorRT parsed == the manifest's; fixed dims equal, dynamic dims
    named as the contract names them (TensorRT leaves outputs' dynamic dims unnamed: -1)."""
    for kind, want in (("inputs", graph.inputs), ("outputs", graph.outputs)):
        assert list(record_io[kind]) == list(want)
        for name, got in record_io[kind].items():
            spec = want[name]
            assert got["dtype"] == spec.dtype and not got["shape_tensor"], (name, got, spec)
            assert len(got["shape"]) == len(spec.shape), (name, got, spec)
            for g, w in zip(got["shape"], spec.shape):
                assert g == w if isinstance(w, int) else g in (w, -1), (name, got, spec)


# ---------------------------------------------------------------------------------------------
# build_plan on the graphs, with the step plans' profiles


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("cc", ["SM89", "SM120"])
def test_target_plan_builds_with_one_exact_profile_per_call_shape(c2i_engine, fp16_engine, dtype, cc):
    directory = c2i_engine if dtype == "fp32" else fp16_engine
    m, calls = _calls(directory, cfgs=(True,))
    profiles = trt_export.graph_profiles(m, "target", calls["target"])
    plan, record = tb.build_plan(os.path.join(directory, "target.onnx"), [p for _, p in profiles], flavor=FLAVOR,
                                 compute_capabilities=[cc])
    assert len(plan) == record["plan_bytes"] > 0
    assert record["compute_capabilities"] == [cc] and record["tensorrt_version"].startswith("1.")
    assert record["builder"]["strongly_typed"] is True and record["builder"]["tf32"] is False
    assert record["builder"]["require_user_allocation"] is True  # TensorRT-RTX: stream capture needs it
    _assert_io_matches_manifest(record["io"], m.graphs["target"])
    # strongly typed: the float inputs keep the export dtype, logits stay fp32
    assert record["io"]["inputs"]["cond_embeds"]["dtype"] == {"fp32": "float32", "fp16": "float16"}[dtype]
    assert record["io"]["outputs"]["logits"]["dtype"] == "float32"
    # the fixture: 1 class token + 36 image tokens of cache, CFG rows 2, mc_sim_7b_63 has 26 nodes;
    # c2i prefill (T = 1) and AR verification have equal shapes but a profile each (one step plan)
    assert [labels for labels, _ in profiles] == [("prefill n1 cfg",), ("verify n1 cfg ar",),
                                                  ("verify n1 cfg mc_sim_7b_63",)]
    one, tree = {"min": [2, 1, 1, 38], "opt": [2, 1, 1, 38], "max": [2, 1, 1, 38]}, \
        {"min": [2, 1, 26, 63], "opt": [2, 1, 26, 63], "max": [2, 1, 26, 63]}
    assert [p["attention_mask"] for p in record["profiles"]] == [one, one, tree]
    assert record["profiles"][2]["past_values_1"]["opt"] == [2, 2, 37, 8]


def test_drafter_plan_has_no_shape_tensors(c2i_engine):
    """v2 drafter: CFG is data (cfg_pair [B]), so profiles hold only shapes."""
    m, calls = _calls(c2i_engine, cfgs=(True,))
    profiles = trt_export.graph_profiles(m, "drafter", calls["drafter"])
    _, record = tb.build_plan(os.path.join(c2i_engine, "drafter.onnx"), [tb.spanning_profile(
        [{n: s[1] for n, s in p.items()} for _, p in profiles])], flavor=FLAVOR, compute_capabilities=["SM89", "SM120"])
    _assert_io_matches_manifest(record["io"], m.graphs["drafter"])
    assert record["profiles"][0]["cfg_pair"] == {"min": [2], "opt": [2], "max": [2]}
    # mc_sim_7b_63: draft0 feeds depth + 1 = 6 tokens, depths 1..4 have 4, 8, 8 and 3 nodes
    assert [lbl for lbl, _ in profiles] == [(f"draft{d} n1 cfg mc_sim_7b_63",) for d in range(5)]
    assert record["profiles"][0]["input_ids"] == {"min": [2, 3], "opt": [2, 8], "max": [2, 8]}
    assert "cfg_scale" not in record["profiles"][0]  # static inputs take no profile entry


def test_network_io_needs_no_build(t2i_engine):
    m = read_manifest(t2i_engine)
    for graph in ("condition", "target", "drafter"):
        _assert_io_matches_manifest(tb.network_io(os.path.join(t2i_engine, m.graphs[graph].file), flavor=FLAVOR),
                                    m.graphs[graph])


def test_profile_helpers():
    a = {"x": (2, 1, 8), "m": (2, 1, 1, 9)}
    b = {"x": (4, 26, 8), "m": (4, 1, 26, 34)}
    assert tb.exact_profile(a) == {"x": ((2, 1, 8),) * 3, "m": ((2, 1, 1, 9),) * 3}
    assert tb.spanning_profile([a, b]) == {"x": ((2, 1, 8), (4, 26, 8), (4, 26, 8)),
                                           "m": ((2, 1, 1, 9), (4, 1, 26, 34), (4, 1, 26, 34))}
    assert tb.spanning_profile([a, b], opt=a)["x"] == ((2, 1, 8), (2, 1, 8), (4, 26, 8))
    with pytest.raises(LanternError, match="rank"):
        tb.spanning_profile([a, {"x": (2, 8), "m": (2, 1, 1, 9)}])


@pytest.mark.parametrize("text,want", [("89", "SM89"), ("8.9", "SM89"), ("sm_120", "SM120"), ("12.0", "SM120"),
                                       (75, "SM75"), ("current", "current")])
def test_compute_capability_spellings(text, want):
    assert tb.normalise_compute_capability(text) == want


def _one_line(err):
    text = str(err.value)
    assert "\n" not in text and text
    return text


def test_broken_onnx_is_one_line_error(c2i_engine, tmp_path):
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes((open(os.path.join(c2i_engine, "condition.onnx"), "rb").read())[:2000])
    with pytest.raises(LanternError) as err:
        tb.build_plan(truncated, [{}], flavor=FLAVOR, compute_capabilities=["SM89"])
    assert _one_line(err).startswith(f"{truncated}: TensorRT's ONNX parser rejects the graph")

    import onnx
    from onnx import helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu"),
                               helper.make_node("Mystery", ["y"], ["z"], name="strange_node", domain="example.org")],
                              "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [2, 3])])
    unknown = tmp_path / "unknown_op.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("example.org", 1)]),
              unknown)
    with pytest.raises(LanternError) as err:
        tb.build_plan(unknown, [{}], flavor=FLAVOR, compute_capabilities=["SM89"])
    assert "node strange_node (Mystery)" in _one_line(err)

    with pytest.raises(LanternError, match="no such ONNX file"):
        tb.build_plan(tmp_path / "absent.onnx", [{}], flavor=FLAVOR)
    with pytest.raises(LanternError, match="no such ONNX file"):
        tb.network_io(tmp_path / "absent.onnx", flavor=FLAVOR)


def test_bad_profiles_and_targets_are_one_line_errors(c2i_engine):
    m, calls = _calls(c2i_engine, cfgs=(True,))
    path = os.path.join(c2i_engine, "target.onnx")
    call, one = calls["target"]["verify n1 cfg mc_sim_7b_63"][0], calls["target"]["prefill n1 cfg"][0]
    cases = [
        ([{**tb.exact_profile(call), "bogus": ((1,), (1,), (1,))}], "bogus, not inputs of the graph"),
        ([{k: v for k, v in tb.exact_profile(call).items() if k != "position_ids"}],
         "no shapes for dynamic input(s) position_ids"),
        ([tb.exact_profile({**call, "cond_embeds": (2, 1, 7)})], "does not fit its graph shape"),
        ([tb.spanning_profile([call, one], opt={**one, "input_ids": (2, 30)})], "min <= opt <= max"),
        ([], "no optimization profile"),
    ]
    for profiles, message in cases:
        with pytest.raises(LanternError) as err:
            tb.build_plan(path, profiles, flavor=FLAVOR, compute_capabilities=["SM89"])
        assert message in _one_line(err)
    with pytest.raises(LanternError, match="cannot target SM90"):
        tb.build_plan(path, [tb.exact_profile(call)], flavor=FLAVOR, compute_capabilities=["90"])
    with pytest.raises(LanternError, match="timing cache applies to full TensorRT only"):
        tb.build_plan(path, [tb.exact_profile(call)], flavor=FLAVOR, compute_capabilities=["89"], timing_cache="x.cache")


def test_progress_reports_the_builder_phases(c2i_engine):
    seen = []
    tb.build_plan(os.path.join(c2i_engine, "condition.onnx"), [tb.exact_profile({"class_ids": (2,)})], flavor=FLAVOR,
                  compute_capabilities=["SM89"], progress=lambda phase, done, total: seen.append((phase, done, total)))
    assert seen and seen[0][1] == 0 and seen[-1][1] == seen[-1][2]


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU message; a GPU is present")
def test_reading_a_plan_without_gpu_says_so(c2i_engine):
    plan, _ = tb.build_plan(os.path.join(c2i_engine, "condition.onnx"), [tb.exact_profile({"class_ids": (2,)})],
                            flavor=FLAVOR, compute_capabilities=["SM89"])
    with pytest.raises(LanternError) as err:
        tb.plan_io(plan, flavor=FLAVOR)
    assert "needs an NVIDIA GPU" in _one_line(err)
    with pytest.raises(LanternError) as err:
        tb.build_plan(os.path.join(c2i_engine, "condition.onnx"), [tb.exact_profile({"class_ids": (2,)})],
                      flavor=FLAVOR, compute_capabilities=["current"])
    assert "building for 'current' needs an NVIDIA GPU" in _one_line(err)


@pytest.mark.skipif(not HAS_GPU, reason="reading a plan back needs an NVIDIA GPU (TensorRT cannot deserialize without one)")
def test_plan_io_reads_back_what_was_built(c2i_engine):
    m, calls = _calls(c2i_engine, cfgs=(True,))
    profiles = [p for _, p in trt_export.graph_profiles(m, "target", calls["target"])]
    plan, record = tb.build_plan(os.path.join(c2i_engine, "target.onnx"), profiles, flavor=FLAVOR,
                                 compute_capabilities=["current"])
    io = tb.plan_io(plan, flavor=FLAVOR)
    assert list(io["inputs"]) == list(m.graphs["target"].inputs)
    for name, entry in io["inputs"].items():
        assert entry["dtype"] == record["io"]["inputs"][name]["dtype"]
        if name in profiles[0]:
            assert entry["profiles"] == [[list(p[name][0])] * 3 for p in profiles]


# ---------------------------------------------------------------------------------------------
# `lantern-export trt`: the engine directory's plans


def _listing(directory):
    """Every path under a directory with its bytes' hash: 'exactly as it was' means equal listings."""
    out = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, directory)] = sha256(path) if os.path.isfile(path) else "dir"
    return out


class RecordingBackend:
    """The ONNX Runtime backend with every call's graph and input shapes written down."""

    def __init__(self, backend):
        self.inner, self.calls = backend, []

    def run(self, call):
        self.calls.append((call.graph, call.regime, {k: tuple(np.shape(v)) for k, v in call.feeds.items()}))
        return self.inner.run(call)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _generation_calls(directory, kind, **kwargs):
    engine = Engine(directory, backend=RecordingBackend(Engine(directory, threads=2).backend))
    n = kwargs.pop("n", 1)
    cond = dict(classes=list(range(n))) if kind == "c2i" else dict(zip(("caption", "caption_mask"), captions(n)))
    engine.generate(k=4, seed=0, greedy=True, **cond, **kwargs)
    return engine.backend.calls


def _step_calls(directory, **kwargs):
    """The phase calls (both parities) of the GraphStep a real generation binds (ONNX Runtime's
    device step on the engine's step graphs), labelled by their files as the plans are."""
    from lantern.runtime.plan import Call

    engine = Engine(directory, threads=2)
    n = kwargs.pop("n", 1)
    result = engine.generate(classes=list(range(n)), k=4, seed=0, greedy=True, **kwargs)
    assert result.stats["step"] == "device"
    [step] = engine.backend._steps.values()
    return [Call(graph=c.graph[len("file:"):], regime=c.regime, feeds=c.feeds) for calls in step.calls
            for c in calls if c.graph.startswith("file:")]


def test_trt_command_builds_every_graph_and_records_it(c2i_engine, tmp_path, capsys):
    """Every graph's plan, and the greedy step graphs' (the sampling ones build as they do, in
    minutes for top-p's: left out here), recorded; every call of real generations covered."""
    d = _copy(c2i_engine, tmp_path)
    assert cli.main(["trt", str(d), "--compute-capability", "89,120", "--batch", "1", "2", "--step-graphs", "greedy",
                     "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "plans/tensorrt-rtx-SM89_SM120: tensorrt-rtx 1.7" in printed
    m = read_manifest(d, verify=True)  # sizes and sha256 of the plans as listed
    key = "tensorrt-rtx-SM89_SM120"
    entry = m.tensorrt[key]
    assert (entry.flavor, entry.compute_capabilities, entry.batches, entry.cfg, entry.trees) == (
        "tensorrt-rtx", ("SM89", "SM120"), (1, 2), (False, True), ("mc_sim_7b_63",))
    import tensorrt_rtx

    assert entry.version == tensorrt_rtx.__version__ and entry.builder["strongly_typed"] is True
    steps = sorted(f for e in m.step_graphs.values() for f in e.greedy.values())
    assert len(steps) == 2 + 7  # AR's begin and accept; the tree's begin, level1..level5 and accept
    assert sorted(entry.plans) == sorted(["condition", "drafter", "target", "vq_decoder"] + steps)
    assert entry.builder["step_files"] == {f: m.files[f].sha256 for f in steps}  # what the runtime checks
    for graph, plan in entry.plans.items():
        name = graph[:-len(".onnx")] if graph in steps else graph
        assert plan.file == f"plans/{key}/{name}.plan" and plan.file in m.files
        assert m.files[plan.file].size == os.path.getsize(d / plan.file) > 0
    # a step graph's plan: per batch and CFG setting one exact profile for even and one for odd steps
    begin = entry.plans[m.step_graphs_for(build_tree(m.tree)).greedy["begin"]]
    assert [p.serves for p in begin.profiles] == [(f"step n{n}{c} mc_sim_7b_63 {parity}",) for n in (1, 2)
                                                  for c in ("", " cfg") for parity in ("even", "odd")]
    # the GraphStep of real generations (its phases' calls as ONNX Runtime binds them): every call an
    # exact profile of its own, the two parities of a phase two profiles of the plan
    from lantern.runtime.backends.tensorrt_plans import step_profiles

    for kwargs in (dict(mode="exact", cfg_scale=4.0, n=2), dict(mode="lantern++", lam=3.0), dict(mode="ar")):
        calls = _step_calls(d, **kwargs)
        profiles = step_profiles(str(d), key, entry, calls, "SM89")
        assert len(set(zip([c.graph for c in calls], profiles))) == len(calls) == 2 * len(set(c.graph for c in calls))
        for call, index in zip(calls, profiles):
            shapes = {n: tuple(np.shape(v)) for n, v in call.feeds.items()}
            held = entry.plans[call.graph].profiles[index].shapes
            assert held and all(r["min"] == r["max"] == list(shapes[n]) for n, r in held.items()), call.graph
    # every call of real generations (ONNX Runtime, recorded) finds an exact profile
    for kwargs in (dict(mode="exact", cfg_scale=4.0, n=2), dict(mode="lantern++", lam=3.0), dict(mode="ar", n=2)):
        for graph, regime, shapes in _generation_calls(d, "c2i", **kwargs):
            index = find_profile(entry.plans[graph], shapes)
            assert index is not None, (graph, regime, shapes)
            profile = entry.plans[graph].profiles[index]
            assert all(r["min"] == r["max"] == list(shapes[n]) for n, r in profile.shapes.items())
    # the VQ decoder's one profile spans the batches
    assert entry.plans["vq_decoder"].profiles[0].shapes["codes"] == {"min": [1, 6, 6], "opt": [2, 6, 6],
                                                                     "max": [2, 6, 6]}
    # a tree the plans were not built for is not covered
    other = _generation_calls(d, "c2i", mode="exact", tree="naive_extend_57")
    assert any(find_profile(entry.plans[g], s) is None for g, r, s in other if r == "verify")


def test_trt_command_for_a_t2i_engine_without_cfg(t2i_engine, tmp_path):
    d = _copy(t2i_engine, tmp_path)
    key, entry, records = trt_export.build_engine_plans(d, compute_capabilities=["120"], batches=[3], cfg=False,
                                                        step_kinds=())
    assert key == "tensorrt-rtx-SM120" and entry.cfg == (False,) and entry.batches == (3,)
    for graph, regime, shapes in _generation_calls(d, "t2i", mode="exact", n=3):
        assert find_profile(entry.plans[graph], shapes) is not None, (graph, regime)
    cond = entry.plans["condition"].profiles
    assert [p.serves for p in cond] == [("condition n3",)] and cond[0].shapes["caption"]["opt"] == [3, 6, 24]
    assert all(r["io"]["inputs"] for r in records.values())


def test_trt_command_fp16_engine(fp16_engine, tmp_path):
    d = _copy(fp16_engine, tmp_path)
    _, entry, records = trt_export.build_engine_plans(d, compute_capabilities=["89"], batches=[1], cfg=True,
                                                      step_kinds=())
    assert records["target"]["io"]["inputs"]["past_keys_0"]["dtype"] == "float16"
    assert records["drafter"]["io"]["outputs"]["topk_probs"]["dtype"] == "float32"
    assert set(entry.plans) == {"condition", "target", "drafter"}  # no VQ decoder in this engine


def test_trt_builds_are_atomic_and_keyed(c2i_engine, tmp_path):
    d = _copy(c2i_engine, tmp_path)
    before = _listing(d)
    # a graph TensorRT cannot parse: the error in one line, the engine exactly as it was
    drafter = d / "drafter.onnx"
    original = drafter.read_bytes()
    drafter.write_bytes(original[:3000])
    m = json.loads((d / "manifest.json").read_text())
    m["files"]["drafter.onnx"].update(size=3000, sha256=sha256(drafter))  # the manifest agrees: the parser must fail
    (d / "manifest.json").write_text(json.dumps(m, indent=2))
    broken = _listing(d)
    with pytest.raises(LanternError) as err:
        trt_export.build_engine_plans(d, compute_capabilities=["89"], batches=[1])
    assert "drafter.onnx is not a readable ONNX model" in _one_line(err)  # the reader, before TensorRT's parser
    assert _listing(d) == broken
    drafter.write_bytes(original)
    shutil.copy(os.path.join(c2i_engine, "manifest.json"), d / "manifest.json")
    assert _listing(d) == before

    # bad options fail before anything is written
    for kwargs, words in ((dict(compute_capabilities=["90"]), "cannot target SM90"),
                          (dict(compute_capabilities=["89", "8.9"]), "repeat"),
                          (dict(compute_capabilities=["current"]), "building for 'current' needs an NVIDIA GPU"),
                          (dict(compute_capabilities=["89"], batches=[0]), "--batch takes positive integers"),
                          (dict(compute_capabilities=["89"], timing_cache="t.cache"), "full TensorRT only"),
                          (dict(compute_capabilities=["89"], trees=["kary-20-1"]), "needs 20 children"),
                          (dict(flavor="tensorrt", compute_capabilities=["89"]), FULL_TRT_REFUSES)):
        if kwargs.get("compute_capabilities") == ["current"] and HAS_GPU:
            continue
        with pytest.raises(LanternError) as err:
            trt_export.build_engine_plans(d, **kwargs)
        assert words in _one_line(err)
        assert _listing(d) == before

    # one build per key; a second key is added beside the first; --force replaces one (on the
    # engine's AR graphs: the keys are what is tested, and each build is then two graphs, not four)
    strike_drafter(d)
    trt_export.build_engine_plans(d, compute_capabilities=["89"], batches=[1], cfg=False, step_kinds=())
    with pytest.raises(LanternError, match="already has plans/tensorrt-rtx-SM89; pass --force"):
        trt_export.build_engine_plans(d, compute_capabilities=["89"], batches=[2])
    trt_export.build_engine_plans(d, compute_capabilities=["120"], batches=[1], cfg=False, step_kinds=())
    first = (d / "plans/tensorrt-rtx-SM89/target.plan").read_bytes()
    trt_export.build_engine_plans(d, compute_capabilities=["89"], batches=[2], cfg=False, force=True, step_kinds=())
    m = read_manifest(d, verify=True)
    assert sorted(m.tensorrt) == ["tensorrt-rtx-SM120", "tensorrt-rtx-SM89"]
    assert m.tensorrt["tensorrt-rtx-SM89"].batches == (2,) and m.tensorrt["tensorrt-rtx-SM120"].batches == (1,)
    assert (d / "plans/tensorrt-rtx-SM89/target.plan").read_bytes() != first
    assert sorted(os.listdir(d / "plans")) == ["tensorrt-rtx-SM120", "tensorrt-rtx-SM89"]  # no leftovers
    assert [n for n in os.listdir(d) if n.startswith(".")] == [".lantern.lock"]  # the writers' lock, nothing staged
    # the engine still runs on ONNX Runtime, plans or not
    Engine(d, threads=1).generate(classes=[1], mode="ar", greedy=True)


def test_ar_engine_builds_ar_plans(c2i_engine, tmp_path, monkeypatch):
    """An engine without a drafter (the c2i fixture with its drafter struck from the manifest).
    A plan changed in place after the build (same size) is refused by its sha256."""
    d = _copy(c2i_engine, tmp_path)
    strike_drafter(d)
    _, entry, _ = trt_export.build_engine_plans(d, compute_capabilities=["89"], batches=[1], cfg=False,
                                                step_kinds=())
    assert entry.trees == () and set(entry.plans) == {"condition", "target"}
    assert [p.serves for p in entry.plans["target"].profiles] == [("prefill n1",), ("verify n1 ar",)]
    with pytest.raises(LanternError, match="--tree needs an engine with a drafter"):
        trt_export.build_engine_plans(d, compute_capabilities=["89"], trees=["mc_sim_7b_63"], force=True)
    plan = d / entry.plans["target"].file
    data = bytearray(plan.read_bytes())
    data[len(data) // 2] ^= 1
    plan.write_bytes(bytes(data))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no remembered digests: every file is hashed
    with pytest.raises(LanternError) as err:
        read_manifest(d)
    assert f"{entry.plans['target'].file} does not match its sha256" in _one_line(err)
    assert "rebuild the plans with `lantern-export trt ENGINE --force`" in _one_line(err)


def test_no_graph_the_backend_binds_has_a_shape_tensor_input(c2i_engine):
    """The TensorRT backend gives every input a device address (runtime/backends/tensorrt.py);
    TensorRT reads a shape-tensor input from host memory instead. None of the engine's graphs,
    step graphs included (k, top_k and cfg_interval are [1] int64 inputs), parses to one."""
    import tensorrt_rtx as trt

    m = read_manifest(c2i_engine)
    logger = trt.Logger(trt.Logger.ERROR)
    steps = {f: set(trt_export.graph_input_shapes(os.path.join(c2i_engine, f)))
             for e in m.step_graphs.values() for f in e.files()}
    # AR: greedy's begin and accept, sampling's begin and 4 accepts (one per filter set); the tree of
    # depth 5: the same with 5 levels each
    assert len(steps) == (2 + 5) + (7 + 10)
    files = {label: (graph.file, set(graph.inputs)) for label, graph in m.all_graphs().items()}
    for label, (file, names) in {**files, **{f: (f, names) for f, names in steps.items()}}.items():
        network = trt.Builder(logger).create_network(0)
        assert trt.OnnxParser(network, logger).parse_from_file(os.path.join(c2i_engine, file)), label
        inputs = [network.get_input(i) for i in range(network.num_inputs)]
        assert {i.name for i in inputs} == names, label
        assert [i.name for i in inputs if i.is_shape_tensor] == [], label


def test_jacobi_windows_get_verification_profiles_and_no_drafter_calls(c2i_engine):
    """`lantern-export trt --window 4`: the plan of a Jacobi window verifies root + 3 drafts in one
    target call (a profile of its own) and calls no drafter; the drafter's profiles stay the
    tree's; a window out of range is refused in one line."""
    m = read_manifest(c2i_engine)
    tree = build_tree(m.tree)
    plain = trt_export.call_shapes(m, (1,), (True,), [tree])
    calls = trt_export.call_shapes(m, (1,), (True,), [tree], windows=(4,))
    shapes, _ = calls["target"]["verify n1 cfg jacobi4"]
    assert shapes["input_ids"] == (2, 4) and shapes["attention_mask"][2:] == (4, shapes["attention_mask"][3])
    assert calls["drafter"] == plain["drafter"] and not any("jacobi" in label for label in calls["drafter"])
    assert set(calls["target"]) - set(plain["target"]) == {"verify n1 cfg jacobi4"}
    with pytest.raises(LanternError, match=r"^window must be an integer in \[2, 17\]"):
        trt_export._windows((1,))
