"""The tensorrt backend. Without a GPU: which plans run here (manifest records against the
installed version and the GPU), which calls a plan's profiles cover, the one-line refusals, the
device-memory address arithmetic (checked by replaying it on host bytes) and `check`'s cases in
a fixed-shape backend's shapes. With a GPU: device arrays through the CUDA bindings, and (where
a TensorRT flavor targets the GPU) generations and `check` on real plans."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

from engines import captions
from lantern.export import trt_export
from lantern.export.check import check_engine
from lantern.runtime import backends
from lantern.runtime.backends import cuda
from lantern.runtime.backends import tensorrt as tb
from lantern.runtime.backends import tensorrt_plans as trt_plans
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.manifest import (PlanFile, PlanProfile, TensorRTPlans, describe_files, read_manifest)
from lantern.runtime.tree import build_tree

VERSION = "1.7.1.116"
GPU = cuda.gpu_compute_capability()


def _one_line(err):
    text = str(err.value)
    assert text and "\n" not in text
    return text


def _with_plans(engine, directory, builds, step_kinds=()):
    """A copy of an engine whose manifest records plan builds {key: (flavor, version, ccs, batches,
    cfgs)} with the profiles `lantern-export trt` makes (and its step graphs' of step_kinds). The
    plan files hold placeholder bytes: choosing plans reads only the manifest (a plan's bytes need
    a GPU to be read at all)."""
    shutil.copytree(engine, directory)
    m = read_manifest(directory)
    entries, files = {}, []
    for key, (flavor, version, ccs, batches, cfgs) in builds.items():
        trees = [build_tree(m.tree)] if m.tree else []
        calls = trt_export.call_shapes(m, batches, cfgs, trees)
        jobs = [(graph, trt_export.graph_profiles(m, graph, calls[graph])) for graph in calls]
        jobs += trt_export.step_jobs(str(directory), m, batches, cfgs, trees, step_kinds)
        os.makedirs(os.path.join(directory, "plans", key))
        plans = {}
        for graph, graph_profiles in jobs:
            file = f"plans/{key}/{graph.replace('/', '_')}.plan"
            with open(os.path.join(directory, file), "wb") as f:
                f.write(b"placeholder")
            files.append(file)
            profiles = [PlanProfile(serves=labels, shapes={n: dict(zip(("min", "opt", "max"), map(list, t)))
                                                           for n, t in p.items()})
                        for labels, p in graph_profiles]
            plans[graph] = PlanFile(file=file, profiles=tuple(profiles))
        steps = {g: m.files[g].sha256 for g in plans if g.startswith("step/")}
        entries[key] = TensorRTPlans(flavor=flavor, version=version, compute_capabilities=tuple(ccs), plans=plans,
                                     batches=tuple(batches), cfg=tuple(cfgs), trees=tuple(t.name for t in trees),
                                     builder={"step_files": steps} if steps else {})
    m.replace(tensorrt=entries, files={**m.files, **describe_files(directory, files)}).write(directory)
    return directory


@pytest.fixture(scope="module")
def planned(c2i_engine, tmp_path_factory):
    """The c2i fixture with SM89 TensorRT-RTX plans for 1 image, with and without CFG."""
    return _with_plans(c2i_engine, tmp_path_factory.mktemp("planned") / "engine",
                       {"tensorrt-rtx-SM89": ("tensorrt-rtx", VERSION, ["SM89"], [1], [False, True])})


# ---------------------------------------------------------------------------------------------
# The manifest record


def test_plan_builds_round_trip_through_the_manifest(planned):
    m = read_manifest(planned, verify=True)
    entry = m.tensorrt["tensorrt-rtx-SM89"]
    assert entry.compute_capabilities == ("SM89",) and entry.cfg == (False, True) and entry.trees == ("mc_sim_7b_63",)
    again = read_manifest(planned).tensorrt["tensorrt-rtx-SM89"]
    assert again == entry
    assert [p.serves for p in entry.plans["target"].profiles] == [
        ("prefill n1",), ("verify n1 ar",), ("verify n1 mc_sim_7b_63",), ("prefill n1 cfg",), ("verify n1 cfg ar",),
        ("verify n1 cfg mc_sim_7b_63",)]


def _edit(planned, tmp_path, change):
    d = shutil.copytree(planned, tmp_path / "edited")
    m = json.loads((d / "manifest.json").read_text())
    change(m["tensorrt"]["tensorrt-rtx-SM89"], m)
    (d / "manifest.json").write_text(json.dumps(m))
    return d


@pytest.mark.parametrize("change, words", [
    (lambda t, m: t.update(flavor="tensorrt-llm"), "flavor is 'tensorrt-llm', expected one of tensorrt, tensorrt-rtx"),
    (lambda t, m: t.update(compute_capabilities=["89"]), "compute_capabilities is ['89']"),
    (lambda t, m: t["plans"].update(embed=t["plans"]["target"]), "plans.embed is a plan for a graph the engine does not"),
    (lambda t, m: t["plans"]["target"].update(file="plans/x.plan"), "file names plans/x.plan, which `files` does not list"),
    (lambda t, m: t["plans"]["target"]["profiles"][0]["shapes"]["input_ids"].update(min=[2, 2]),
     "needs min <= opt <= max"),
    (lambda t, m: t["plans"]["target"]["profiles"][0]["shapes"].update(inputs_embeds={"min": [1], "opt": [1],
                                                                                      "max": [1]}),
     "inputs_embeds is not an input of the target graph"),
    (lambda t, m: t.update(cfg=[True, True]), "cfg is [True, True]"),
    (lambda t, m: t.update(batches=[]), "batches is []"),
    (lambda t, m: t.update(timing="x"), "unknown field(s) timing"),
])
def test_bad_plan_records_are_refused_in_one_line(planned, tmp_path, change, words):
    d = _edit(planned, tmp_path, change)
    with pytest.raises(LanternError) as err:
        read_manifest(d)
    assert words in _one_line(err) and "rebuild the plans with `lantern-export trt" in str(err.value)


# ---------------------------------------------------------------------------------------------
# Which plans run here


def test_plans_are_chosen_by_version_and_gpu(c2i_engine, planned, tmp_path):
    m = read_manifest(planned)
    here = {"tensorrt-rtx": VERSION}
    assert trt_plans.select_plans(m, planned, "SM89", here)[0] == "tensorrt-rtx-SM89"

    with pytest.raises(LanternError) as err:
        trt_plans.select_plans(m, planned, "SM86", here)
    assert _one_line(err) == (
        f"{planned}: no TensorRT plans run here: plans/tensorrt-rtx-SM89 were built for SM89; this GPU is SM86; "
        f"rebuild them with `lantern-export trt {planned} --flavor tensorrt-rtx --compute-capability 86 --batch 1 "
        f"--tree mc_sim_7b_63 --force`")
    with pytest.raises(LanternError) as err:  # Hopper: TensorRT for RTX does not target it
        trt_plans.select_plans(m, planned, "SM90", here)
    assert "this GPU is SM90" in _one_line(err) and "--flavor tensorrt --compute-capability current" in str(err.value)
    with pytest.raises(LanternError) as err:
        trt_plans.select_plans(m, planned, "SM89", {"tensorrt-rtx": "1.6.1.120"})
    assert "plans/tensorrt-rtx-SM89 were built by tensorrt-rtx 1.7.1.116; this is 1.6.1.120" in _one_line(err)
    assert "--compute-capability 89" in str(err.value)
    with pytest.raises(LanternError) as err:
        trt_plans.select_plans(m, planned, "SM89", {})
    assert "need tensorrt-rtx 1.7.1.116, which is not installed (pip install 'lantern[tensorrt-rtx]')" in _one_line(err)
    with pytest.raises(LanternError, match="has no TensorRT plans for tensorrt;"):
        trt_plans.select_plans(m, planned, "SM89", here, flavor="tensorrt")
    with pytest.raises(LanternError, match=r"has no plans/tensorrt-SM90 \(it has: tensorrt-rtx-SM89\)"):
        trt_plans.select_plans(m, planned, "SM89", here, key="tensorrt-SM90")

    # two builds: the first one that runs here wins
    two = _with_plans(c2i_engine, tmp_path / "two", {
        "tensorrt-SM90": ("tensorrt", "10.15.1", ["SM90"], [1], [True]),
        "tensorrt-rtx-SM120": ("tensorrt-rtx", VERSION, ["SM120"], [2], [True])})
    m2 = read_manifest(two)
    installed = {"tensorrt": "10.15.1", "tensorrt-rtx": VERSION}
    assert trt_plans.select_plans(m2, two, "SM120", installed)[0] == "tensorrt-rtx-SM120"
    assert trt_plans.select_plans(m2, two, "SM90", installed)[0] == "tensorrt-SM90"
    with pytest.raises(LanternError) as err:
        trt_plans.select_plans(m2, two, "SM80", installed)
    assert "plans/tensorrt-SM90 were built for SM90; this GPU is SM80; plans/tensorrt-rtx-SM120 were built for " \
           "SM120; this GPU is SM80" in _one_line(err)


def test_an_engine_without_plans_says_how_to_build_them(c2i_engine):
    with pytest.raises(LanternError) as err:
        trt_plans.select_plans(read_manifest(c2i_engine), c2i_engine, "SM89", {"tensorrt-rtx": VERSION})
    assert f"has no TensorRT plans; build them with `lantern-export trt {c2i_engine} --flavor tensorrt-rtx " \
           f"--compute-capability 89 --force`" in _one_line(err)
    with pytest.raises(LanternError, match="has no TensorRT plans; build them with `lantern-export trt"):
        Engine(c2i_engine, backend="tensorrt", device="cuda")


class _Calls:
    """The ONNX Runtime backend with every call (and the plan it came from) written down."""

    def __init__(self, backend):
        self.inner, self.calls, self.plan = backend, [], None

    def bind(self, plan):
        self.plan = plan
        return self.inner.bind(plan)

    def run(self, call):
        self.calls.append((call, {k: tuple(np.shape(v)) for k, v in call.feeds.items()}, self.plan))
        return self.inner.run(call)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_calls_the_profiles_do_not_cover_are_refused_with_the_rebuild_line(planned):
    m = read_manifest(planned)
    entry = m.tensorrt["tensorrt-rtx-SM89"]
    recorder = _Calls(Engine(planned, threads=2).backend)
    engine = Engine(planned, backend=recorder)
    engine.generate(classes=[1, 2, 3], mode="exact", tree="naive_extend_57", greedy=True, k=4)
    verify = [(c, s, p) for c, s, p in recorder.calls if c.regime == "verify"][0]
    call, shapes, plan = verify
    assert trt_plans.find_profile(entry.plans["target"], shapes) is None
    err = trt_plans.uncovered_call(planned, "tensorrt-rtx-SM89", entry, "target", "verify", shapes, "SM89", plan)
    text = str(err)
    assert "\n" not in text and text.startswith("the target call verify (tree naive_extend_57, 3 image(s), without "
                                                "CFG) with input_ids [3, 58]")
    assert text.endswith(f"rebuild them with `lantern-export trt {planned} --flavor tensorrt-rtx --compute-capability 89 "
                         f"--batch 1 3 --tree mc_sim_7b_63 naive_extend_57 --force`")
    # the calls of the generations the plans were built for are all covered
    recorder.calls.clear()
    engine.generate(classes=[4], mode="lantern++", lam=3.0, k=4, cfg_scale=3.0)
    engine.generate(classes=[5], mode="ar")
    assert all(trt_plans.find_profile(entry.plans[c.graph], s) is not None for c, s, _ in recorder.calls)


def test_every_regime_of_a_plan_gets_a_profile_of_its_own(planned):
    """One execution context per profile at a time: the calls of one step plan never share one,
    even where their shapes are equal (c2i prefill and AR verification, draft depths of equal
    width), and each gets the profile built for its regime."""
    entry = read_manifest(planned).tensorrt["tensorrt-rtx-SM89"]
    recorder = _Calls(Engine(planned, threads=2).backend)
    engine = Engine(planned, backend=recorder)
    for kwargs in (dict(mode="ar"), dict(mode="exact", cfg_scale=3.0), dict(mode="lantern++", lam=2.0, k=4)):
        engine.generate(classes=[1], greedy=True, **kwargs)
        plan = recorder.plan
        profiles = trt_plans.assign_profiles(planned, "tensorrt-rtx-SM89", entry, plan, "SM89")
        assert set(profiles) == set(plan.calls)
        for graph in ("target", "drafter"):
            used = [profiles[r] for r, call in plan.calls.items() if call.graph == graph]
            assert len(set(used)) == len(used)
        cfg = " cfg" if kwargs.get("cfg_scale") else ""
        for regime, call in plan.calls.items():
            assert f"{regime} n1{cfg}" in " ".join(entry.plans[call.graph].profiles[profiles[regime]].serves), regime


def test_profile_coverage():
    p = PlanProfile(serves=("x",), shapes={"a": {"min": [1, 2], "opt": [2, 2], "max": [4, 2]}})
    assert p.covers({"a": (1, 2), "b": (9,)}) and p.covers({"a": (4, 2)})
    assert not p.covers({"a": (5, 2)}) and not p.covers({"a": (2, 3)}) and not p.covers({"a": (2,)})
    assert not p.covers({"b": (1,)})


def test_opening_without_a_gpu_is_one_line(planned, tmp_path):
    with pytest.raises(LanternError) as err:
        Engine(planned, backend="tensorrt", device="cpu")
    assert "the tensorrt backend runs on an NVIDIA GPU: device must be cuda or cuda:N, got 'cpu'" in _one_line(err)
    if GPU is not None:
        pytest.skip("the rest checks the no-GPU messages; a GPU is present")
    try:
        import cuda.bindings  # noqa: F401
        words = "no CUDA GPU is visible (the tensorrt backend runs on NVIDIA GPUs)"
    except ImportError:
        words = "the tensorrt backend needs NVIDIA's CUDA Python bindings"
    for device in ("cuda", None):  # None: the backend's own default, cuda
        with pytest.raises(LanternError) as err:
            Engine(planned, backend="tensorrt", device=device)
        assert words in _one_line(err)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "lantern.tools.run_cli", "generate", str(planned), "--backend", "tensorrt",
                        "--classes", "1", "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and words in r.stderr
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# Device memory arithmetic, replayed on host bytes


def _memcpy3d(dst, src, src_at, dst_at, box):
    """CUDA's cudaMemcpy3D on linear memory, on numpy byte arrays: a box of (width bytes, height
    rows, depth slices); a side is (byte offset, pitch, rows per slice)."""
    width, height, depth = box
    for z in range(depth):
        for y in range(height):
            s = src_at[0] + (z * src_at[2] + y) * src_at[1]
            d = dst_at[0] + (z * dst_at[2] + y) * dst_at[1]
            dst[d: d + width] = src[s: s + width]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_commit_as_3d_copies_moves_exactly_the_kept_entries(dtype):
    rng = np.random.default_rng(0)
    L, B, H, T, P, hd = 3, 4, 2, 7, 11, 5
    new = rng.standard_normal((L, B, H, T, hd)).astype(dtype)
    cache = rng.standard_normal((L, B, H, P, hd)).astype(dtype)
    # an append (consecutive slots), a tree path (gaps), one row twice, a single entry
    rows = np.array([0, 0, 0, 2, 2, 2, 3, 1])
    src = np.array([0, 1, 2, 0, 3, 5, 6, 4])
    dst = np.array([4, 5, 6, 1, 2, 3, 10, 0])
    want = cache.copy()
    want[:, rows, :, dst] = new[:, rows, :, src]
    runs = cuda.commit_runs(cache.shape, new.shape, rows, src, dst)
    assert runs == [(0, 0, 4, 3), (2, 0, 1, 1), (2, 3, 2, 1), (2, 5, 3, 1), (3, 6, 10, 1), (1, 4, 0, 1)]
    got = cache.copy()
    flat_new, flat_got = new.reshape(-1).view(np.uint8), got.reshape(-1).view(np.uint8)
    for run in runs:
        p = cuda.copy3d_params(cache.shape, new.shape, new.itemsize, *run)
        _memcpy3d(flat_got, flat_new, p["src"], p["dst"], p["box"])
    np.testing.assert_array_equal(got, want)
    with pytest.raises(IndexError):
        cuda.commit_runs(cache.shape, new.shape, [0], [T], [0])


def test_gather_as_vector_copies_matches_numpy():
    rng = np.random.default_rng(1)
    src = rng.standard_normal((4, 9, 6)).astype(np.float32)
    B, W = 4, 5
    rows = np.broadcast_to(np.arange(B)[:, None], (B, W))
    cols = np.array([[0, 1, 2, 3, 4], [8, 0, 0, 0, 0], [3, 3, 4, 5, 1], [2, 3, 7, 8, 0]])
    runs = cuda.gather_runs(src.shape, rows, cols, B, W)
    out = np.zeros((B, W, 6), dtype=np.float32)
    flat_src, flat_out = src.reshape(-1, 6), out.reshape(-1, 6)
    for s, d, n in runs:
        flat_out[d: d + n] = flat_src[s: s + n]
    np.testing.assert_array_equal(out, src[rows, cols])
    assert runs[0] == (0, 0, 5) and len(runs) < B * W  # consecutive pairs move in one copy


def test_bfloat16_conversion_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(1000).astype(np.float32) * 100, np.array([0.0, -0.0, 1.0, 3.0e38],
                                                                                   dtype=np.float32)])
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(cuda.to_bfloat16(x), want)
    np.testing.assert_array_equal(cuda.from_bfloat16(want), torch.from_numpy(want.view(np.int16)).view(
        torch.bfloat16).float().numpy())


def test_device_array_views():
    a = cuda.DeviceArray(None, 0x1000, (3, 2, 4), "float16")
    assert a.nbytes == 48 and len(a) == 3
    assert (a[1].ptr, a[1].shape) == (0x1000 + 16, (2, 4)) and a[-1].ptr == 0x1000 + 32
    assert a[np.int64(2)][1].ptr == 0x1000 + 32 + 8
    with pytest.raises(IndexError):
        a[3]
    view = a[:, -1:]
    assert isinstance(view, cuda._HostView) and view.index == (slice(None), slice(-1, None))


# ---------------------------------------------------------------------------------------------
# check in a fixed-shape backend's shapes


class _FixedShapes:
    """ONNX Runtime that serves only the plans' profile shapes, as TensorRT does: call_shapes
    from the manifest's plans, and a refusal of any other call."""

    def __init__(self, directory, manifest, **options):
        from lantern.runtime.backends.onnxruntime import OnnxRuntimeBackend

        self.inner = OnnxRuntimeBackend(directory, manifest, **options)
        self.plans = next(iter(manifest.tensorrt.values()))
        self.seen = []

    call_shapes = tb.TensorRTBackend.call_shapes

    def run(self, call):
        shapes = {k: tuple(np.shape(v)) for k, v in call.feeds.items()}
        assert trt_plans.find_profile(self.plans.plans[call.graph], shapes) is not None, (call.graph, call.regime)
        self.seen.append((call.graph, call.regime))
        return self.inner.run(call)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_check_runs_in_the_shapes_a_fixed_shape_backend_serves(planned, monkeypatch):
    made = []
    monkeypatch.setitem(backends.RUNNERS, "fixed", dataclasses.replace(
        backends.ONNXRUNTIME, name="fixed", open=lambda d, m, **o: made.append(_FixedShapes(d, m, **o)) or made[-1]))
    report = check_engine(planned, backend="fixed", against="torch", verify=False)
    assert report["ok"], report["failures"]
    entry = read_manifest(planned).tensorrt["tensorrt-rtx-SM89"]
    want = [(g, p.serves[0]) for g in entry.plans for p in entry.plans[g].profiles]
    assert made[0].seen == want  # one case per profile, named by the first call it serves
    assert {r["case"] for r in report["results"]} == {case for _, case in want}


# ---------------------------------------------------------------------------------------------
# The device step: GraphStep on the step graphs' plans (what can be checked without a GPU)


@pytest.fixture(scope="module")
def step_planned(c2i_engine, tmp_path_factory):
    """The c2i fixture with SM89 TensorRT-RTX plans for 1 image with CFG, its greedy step graphs' included."""
    return _with_plans(c2i_engine, tmp_path_factory.mktemp("step-planned") / "engine",
                       {"tensorrt-rtx-SM89": ("tensorrt-rtx", VERSION, ["SM89"], [1], [True])}, step_kinds=("greedy",))


def _step_of(directory, **kwargs):
    """(plan, GraphStep) of a real generation on ONNX Runtime's device step over the same step graphs."""
    engine = Engine(directory, threads=2)
    assert engine.generate(seed=0, **kwargs).stats["step"] == "device"
    [step] = engine.backend._steps.values()
    return engine._plan, step


def test_the_device_step_needs_step_plans_and_says_how_to_build_them(planned, step_planned, monkeypatch):
    from lantern.runtime.sampling import Greedy, Sampling

    key = "tensorrt-rtx-SM89"
    m, bare = read_manifest(step_planned), read_manifest(planned)
    entry = m.tensorrt[key]
    plan, _ = _step_of(step_planned, classes=[1], greedy=True, mode="exact", cfg_scale=3.0)
    assert trt_plans.step_plan_refusal(m, step_planned, key, entry, plan, Greedy(), "SM89") is None
    # plans built before the step graphs had plans (or with --step-graphs greedy): the rebuild line
    why = missing = trt_plans.step_plan_refusal(bare, planned, key, bare.tensorrt[key], plan, Greedy(), "SM89")
    assert why.startswith(f"plans/{key} have no plans of the step graphs of tree mc_sim_7b_63 (step/mc_sim_7b_63-")
    assert why.endswith(f"and 6 more); rebuild them with `lantern-export trt {planned} --flavor tensorrt-rtx "
                        f"--compute-capability 89 --batch 1 --tree mc_sim_7b_63 --force`")
    why = trt_plans.step_plan_refusal(m, step_planned, key, entry, plan, Sampling(top_k=10), "SM89")
    assert "/sampling.begin.onnx and 6 more); rebuild them with `lantern-export trt" in why  # begin, 5 levels, accept+top_k
    assert why.endswith(" --cfg --step-graphs greedy sampling --force`")
    old = m.replace(step_graphs={n: dataclasses.replace(e, version=0) for n, e in m.step_graphs.items()})
    assert trt_plans.step_plan_refusal(old, step_planned, key, entry, plan, Greedy(), "SM89").startswith(
        "the engine's step graphs are version 0")
    assert trt_plans.step_plan_refusal(m.replace(step_graphs={}), step_planned, key, entry, plan, Greedy(), "SM89") == (
        f"the engine has no step graphs for tree mc_sim_7b_63; add them with `lantern-export accept {step_planned}`, "
        f"then rebuild the plans with `lantern-export trt {step_planned} --flavor tensorrt-rtx --compute-capability 89 "
        f"--force`")
    # the backend's own refusal is this one (its plans' key, flavor and GPU)
    backend = types.SimpleNamespace(manifest=bare, directory=planned, key=key, plans=bare.tensorrt[key], gpu="SM89")
    assert tb.TensorRTBackend.device_step_refusal(backend, plan, Greedy()) == missing


def test_a_graph_steps_calls_get_a_profile_each(step_planned):
    """GraphStep binds every phase twice (even and odd steps, the state buffers swapped): each of
    its calls gets an exact profile of its own; a batch the plans were not built for is refused
    with the rebuild line."""
    from lantern.runtime.plan import Call

    key = "tensorrt-rtx-SM89"
    entry = read_manifest(step_planned).tensorrt[key]
    for kwargs in (dict(mode="exact", cfg_scale=3.0), dict(mode="ar", cfg_scale=3.0)):
        _, step = _step_of(step_planned, classes=[1], greedy=True, **kwargs)
        calls = [Call(graph=c.graph[len("file:"):], regime=c.regime, feeds=c.feeds) for parity in step.calls
                 for c in parity if c.graph.startswith("file:")]
        profiles = trt_plans.step_profiles(step_planned, key, entry, calls, "SM89")
        assert len(set(zip((c.graph for c in calls), profiles))) == len(calls)
        for call, index in zip(calls, profiles):
            profile = entry.plans[call.graph].profiles[index]
            assert profile.covers(trt_plans.call_shapes(call)) and profile.serves[0].startswith("step n1 cfg")
        half = len(calls) // 2  # the even steps' calls, then the odd steps'
        assert [entry.plans[c.graph].profiles[i].serves[0].endswith(" even") for c, i in zip(calls, profiles)] == \
            [True] * half + [False] * half
    _, step = _step_of(step_planned, classes=[1, 2], greedy=True, mode="exact", cfg_scale=3.0)
    calls = [Call(graph=c.graph[len("file:"):], regime=c.regime, feeds=c.feeds) for c in step.calls[0]
             if c.graph.startswith("file:")]
    with pytest.raises(LanternError) as err:
        trt_plans.step_profiles(step_planned, key, entry, calls, "SM89")
    assert f"is not covered by plans/{key} (built for step n1 cfg" in _one_line(err)
    assert "rebuild them with `lantern-export trt" in str(err.value)


def test_step_plans_are_recorded_by_their_files(step_planned, tmp_path):
    """A step graph's plan is keyed by its file, which the engine must have; the backend refuses
    a plan built from another version of that file (lantern-export accept --force since)."""
    m = read_manifest(step_planned, verify=True)
    entry = m.tensorrt["tensorrt-rtx-SM89"]
    begin = m.step_graphs_for(build_tree(m.tree)).greedy["begin"]
    assert begin in entry.plans and entry.builder["step_files"][begin] == m.files[begin].sha256
    d = _edit(step_planned, tmp_path, lambda t, _: t["plans"].update({"step/gone/greedy.begin.onnx": t["plans"][begin]}))
    with pytest.raises(LanternError) as err:
        read_manifest(d)
    assert "plans.step/gone/greedy.begin.onnx is a plan for a graph the engine does not have" in _one_line(err)
    stale = dataclasses.replace(entry, builder={"step_files": {begin: "0" * 64}})
    backend = types.SimpleNamespace(directory=step_planned, manifest=m, key="tensorrt-rtx-SM89", plans=stale,
                                    gpu="SM89", engines={})
    with pytest.raises(LanternError) as err:
        tb.TensorRTBackend.open_graphs(backend, {"begin": begin})
    assert _one_line(err) == (f"plans/tensorrt-rtx-SM89: the plan of {begin} was built from another version of the "
                              f"step graph; rebuild them with `lantern-export trt {step_planned} --flavor tensorrt-rtx "
                              f"--compute-capability 89 --force`")
    backend.plans = dataclasses.replace(entry, plans={"target": entry.plans["target"]})
    with pytest.raises(LanternError, match=f"have no plan of {begin[:-5]}"):
        tb.TensorRTBackend.open_graphs(backend, {"begin": begin})


# ---------------------------------------------------------------------------------------------
# On a GPU


@pytest.mark.skipif(GPU is None, reason="needs an NVIDIA GPU and the CUDA bindings (pip install cuda-bindings)")
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_device_arrays_move_what_numpy_moves(dtype):
    arrays = cuda.CudaArrays("cuda", dtype)
    rng = np.random.default_rng(3)
    L, B, H, T, P, hd = 2, 3, 2, 6, 9, 8
    host_new = rng.standard_normal((L, B, H, T, hd)).astype(np.float32)
    host_cache = rng.standard_normal((L, B, H, P, hd)).astype(np.float32)
    exact = (lambda x: cuda.from_bfloat16(cuda.to_bfloat16(x))) if dtype == "bf16" else (lambda x: x.astype(np.float16))
    new, cache = arrays.zeros(host_new.shape), arrays.zeros(host_cache.shape)
    assert not arrays.numpy(cache).any()
    arrays.copy(host_new, new)
    arrays.copy(host_cache, cache)
    np.testing.assert_array_equal(arrays.numpy(new), exact(host_new))
    rows, src, dst = np.array([0, 0, 2, 1]), np.array([1, 2, 5, 0]), np.array([3, 4, 0, 8])
    arrays.commit(cache, new, rows, src, dst)
    want = exact(host_cache)
    want[:, rows, :, dst] = exact(host_new)[:, rows, :, src]
    np.testing.assert_array_equal(arrays.numpy(cache), want)
    np.testing.assert_array_equal(arrays.numpy(cache[1]), want[1])  # a layer view
    np.testing.assert_array_equal(arrays.numpy(cache[:, -1:]), want[:, -1:])  # a host view
    hidden = arrays.zeros((B, T, 16))
    arrays.copy(rng.standard_normal((B, T, 16)).astype(np.float32), hidden)
    out = arrays.zeros((B, 4, 16))
    r = np.broadcast_to(np.arange(B)[:, None], (B, 4))
    c = np.array([[0, 1, 2, 3], [5, 5, 0, 1], [2, 0, 4, 4]])
    arrays.gather(hidden, r, c, out)
    np.testing.assert_array_equal(arrays.numpy(out), arrays.numpy(hidden)[r, c])
    # a captured copy replays what it copied
    dst_buf = arrays.zeros((B, T, 16))
    graph = arrays.cuda.capture(lambda: arrays.copy(hidden, dst_buf) or True)
    assert graph is not None and not arrays.numpy(dst_buf).any()
    graph.launch()
    np.testing.assert_array_equal(arrays.numpy(dst_buf), arrays.numpy(hidden))


def _flavor_for_gpu():
    versions = trt_plans.installed_versions()
    if "tensorrt" in versions:
        return "tensorrt"
    if "tensorrt-rtx" in versions and GPU in trt_plans.rtx_targets():
        return "tensorrt-rtx"
    return None


@pytest.mark.skipif(GPU is None or _flavor_for_gpu() is None,
                    reason="needs an NVIDIA GPU and a TensorRT flavor that targets it (full TensorRT, or TensorRT-RTX "
                           "on an RTX-class GPU)")
def test_tensorrt_generates_what_onnxruntime_generates(c2i_engine, tmp_path):
    d = shutil.copytree(c2i_engine, tmp_path / "engine")
    trt_export.build_engine_plans(d, flavor=_flavor_for_gpu(), compute_capabilities=["current"], batches=[2],
                                  step_kinds=())
    reference = Engine(d, threads=2)
    for graphs in (True, False):
        engine = Engine(d, backend="tensorrt", device="cuda", cuda_graphs=graphs)
        for kw in (dict(mode="exact", cfg_scale=3.0), dict(mode="ar", cfg_scale=3.0), dict(mode="exact"),
                   dict(mode="lantern++", lam=3.0, k=4)):
            got = engine.generate(classes=[1, 2], greedy=True, **kw)
            np.testing.assert_array_equal(got.tokens, reference.generate(classes=[1, 2], greedy=True, **kw).tokens)
        ar = engine.generate(classes=[1, 2], greedy=True, mode="ar")
        np.testing.assert_array_equal(engine.generate(classes=[1, 2], greedy=True, mode="exact").tokens, ar.tokens)
        images = engine.decode(ar.tokens)
        np.testing.assert_array_equal(images, reference.decode(ar.tokens))
        with pytest.raises(LanternError, match="--tree mc_sim_7b_63 naive_extend_57 --force`"):
            engine.generate(classes=[1, 2], greedy=True, mode="exact", tree="naive_extend_57")
    report = check_engine(d, backend="tensorrt", against="onnxruntime", verify=False)
    assert report["ok"], report["failures"]


@pytest.mark.skipif(GPU is None or _flavor_for_gpu() is None, reason="needs an NVIDIA GPU and a TensorRT flavor for it")
def test_tensorrt_t2i(t2i_engine, tmp_path):
    d = shutil.copytree(t2i_engine, tmp_path / "engine")
    trt_export.build_engine_plans(d, flavor=_flavor_for_gpu(), compute_capabilities=["current"], batches=[2],
                                  step_kinds=())
    caption, mask = captions(2)
    kw = dict(caption=caption, caption_mask=mask, greedy=True, mode="exact", cfg_scale=2.0)
    got = Engine(d, backend="tensorrt", device="cuda").generate(**kw)
    np.testing.assert_array_equal(got.tokens, Engine(d, threads=2).generate(**kw).tokens)


@pytest.mark.skipif(GPU is None or _flavor_for_gpu() is None,
                    reason="needs an NVIDIA GPU and a TensorRT flavor that targets it (full TensorRT, or TensorRT-RTX "
                           "on an RTX-class GPU)")
def test_tensorrt_device_step_equals_the_host_step(c2i_engine, tmp_path):
    """The whole step on the greedy step graphs' plans (GraphStep, step='device'), with and
    without CUDA graphs: the host step's tokens, CFG on and off, batch 1 and 3; greedy exact
    gives AR's tokens token for token. Sampling has no plans in this build: refused in one line."""
    d = shutil.copytree(c2i_engine, tmp_path / "engine")
    trt_export.build_engine_plans(d, flavor=_flavor_for_gpu(), compute_capabilities=["current"], batches=[1, 3],
                                  step_kinds=("greedy",))
    host = Engine(d, backend="tensorrt", device="cuda", step="host")
    for graphs in (True, False):
        device = Engine(d, backend="tensorrt", device="cuda", step="device", cuda_graphs=graphs)
        for images in (1, 3):
            classes = list(range(1, images + 1))
            for kw in (dict(mode="exact", cfg_scale=3.0), dict(mode="exact"), dict(mode="lantern++", lam=3.0, k=4),
                       dict(mode="lantern++", lam=3.0, k=4, cfg_scale=4.0, cfg_interval=5), dict(mode="ar")):
                got, want = device.generate(classes=classes, greedy=True, **kw), host.generate(classes=classes,
                                                                                               greedy=True, **kw)
                assert (got.stats["step"], want.stats["step"]) == ("device", "host")
                np.testing.assert_array_equal(got.tokens, want.tokens)
            exact = device.generate(classes=classes, greedy=True, mode="exact", cfg_scale=3.0)
            ar = device.generate(classes=classes, greedy=True, mode="ar", cfg_scale=3.0)
            np.testing.assert_array_equal(exact.tokens, ar.tokens)
        with pytest.raises(LanternError, match=r"have no plans of the step graphs of tree mc_sim_7b_63 .*--force`"):
            device.generate(classes=[1], mode="exact", temperature=1.0, seed=[4])


# -- TensorRT plans inside the torch backend (runtime/backends/tensorrt_torch.py) ---------------
def _torch_cuda():
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_torch_cuda(), reason="checks the refusal where torch sees no CUDA device")
def test_tensorrt_torch_needs_a_cuda_device_and_says_so(c2i_engine, tmp_path, capsys):
    from lantern.tools import run_cli

    with pytest.raises(LanternError, match="tensorrt-torch backend runs TensorRT plans on an NVIDIA GPU"):
        Engine(c2i_engine, backend="tensorrt-torch")
    out = tmp_path / "out"
    assert run_cli.main(["generate", str(c2i_engine), "--backend", "tensorrt-torch", "--classes", "1",
                         "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torch sees no CUDA device" in err[0]
    assert not out.exists()


@pytest.mark.skipif(GPU is None or _flavor_for_gpu() is None or not _torch_cuda(),
                    reason="needs an NVIDIA GPU, torch with CUDA and a TensorRT flavor that targets the GPU")
def test_tensorrt_torch_generates_what_onnxruntime_generates(c2i_engine, tmp_path):
    """The plans as the torch backend's modules: host step (per-call CUDA graphs) and the whole
    step as one CUDA graph, greedy, equal to ONNX Runtime CPU token for token."""
    from lantern.export.torch_backend import open_tensorrt_torch_backend

    d = shutil.copytree(c2i_engine, tmp_path / "engine")
    trt_export.build_engine_plans(d, flavor=_flavor_for_gpu(), compute_capabilities=["current"], batches=[2],
                                  step_kinds=())
    reference = Engine(d, threads=2)
    backend = open_tensorrt_torch_backend(d)
    for step in ("host", "device"):
        engine = Engine(d, backend=backend, step=step)
        for kw in (dict(mode="exact", cfg_scale=3.0), dict(mode="lantern++", lam=3.0, k=4, cfg_scale=3.0),
                   dict(mode="ar")):
            got = engine.generate(classes=[1, 2], greedy=True, **kw)
            assert got.stats["step"] == step
            np.testing.assert_array_equal(got.tokens, reference.generate(classes=[1, 2], greedy=True, **kw).tokens)
        if step == "host":
            engine.release()  # its plan's contexts hold the profiles the next engine's plan needs
    # the VQ decoder's one spanning profile serves every batch (an unbound call rebinds its context)
    for tokens in (got.tokens, got.tokens[:1]):
        np.testing.assert_allclose(engine.decode(tokens).astype(int), reference.decode(tokens).astype(int), atol=2)
