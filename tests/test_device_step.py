"""The device step against the host step: the whole step on the device (lantern.runtime.
graph_step.GraphStep) run by the torch backend over lantern.export.step_graphs' modules on the
CPU, and by ONNX Runtime over the engine's exported step graphs. The same tokens, token for
token, over modes, CFG, batch sizes and a forced-token (Lumina-mGPT) engine; batch invariance;
the step replayed as a captured graph would be; and, through a backend that records every host
crossing, a step that moves only a few integers per image (and launches its calls) and nothing
that grows with the vocabulary, the cache or the tree: the logits never cross."""
import json

import numpy as np
import pytest
import torch

from lantern.export.torch_backend import open_torch_backend
from lantern.runtime.backends.torch import TorchBackend
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.tools.crossings import RecordingBackend
from lantern.tools.run_cli import main as run_main

torch.set_grad_enabled(False)


@pytest.fixture(scope="module")
def torch_c2i(c2i_engine):
    return c2i_engine, open_torch_backend(c2i_engine, threads=2)


def both(directory, backend, **kw):
    host = Engine(directory, backend=backend, step="host").generate(greedy=True, **kw)
    device = Engine(directory, backend=backend, step="device").generate(greedy=True, **kw)
    assert (host.stats["step"], device.stats["step"]) == ("host", "device")
    return host, device


@pytest.fixture(scope="module")
def engines(torch_c2i):
    """One host and one device engine for all cases: consecutive cases with the same tree and
    batch reuse the plan, and the device engine its step (refilled by load)."""
    directory, backend = torch_c2i
    return Engine(directory, backend=backend, step="host"), Engine(directory, backend=backend, step="device")


# each mode with CFG off and on, batch 1 and 3 among them (every case costs two generations)
CASES = [("ar", 4.0, 3, {}), ("exact", 1.0, 1, {}), ("exact", 4.0, 3, {"cfg_interval": 5}),
         ("lantern", 4.0, 3, {"delta": 0.2, "k": 8, "cfg_interval": 7}), ("lantern++", 1.0, 3, {"lam": 3.0, "k": 8}),
         ("lantern++", 4.0, 3, {"lam": 3.0, "k": 8})]


@pytest.mark.parametrize("mode, cfg, images, extra", CASES)
def test_device_step_equals_host_step(engines, mode, cfg, images, extra):
    host_engine, device_engine = engines
    kw = dict(mode=mode, greedy=True, cfg_scale=cfg, classes=list(range(1, images + 1)), **extra)
    if mode == "lantern":  # after an exact generation on the same plan, its device step is refilled, not rebuilt
        device_engine.generate(**{**kw, "mode": "exact"})
        built = device_engine.backend._steps[id(device_engine._plan)]
    host, device = host_engine.generate(**kw), device_engine.generate(**kw)
    assert (host.stats["step"], device.stats["step"]) == ("host", "device")
    np.testing.assert_array_equal(device.tokens, host.tokens)
    for key in ("steps_per_image", "mean_accepted_length", "accepted_histogram"):
        assert device.stats[key] == host.stats[key], key
    if mode == "lantern":
        assert device_engine.backend._steps.get(id(device_engine._plan)) is built
    if mode == "lantern++":  # relaxed acceptance really ran: drafts were accepted
        assert device.stats["mean_accepted_drafts"] > 0
    if images == 3 and cfg > 1 and mode == "lantern++":  # batch invariance: image 2 alone = in the batch
        alone = device_engine.generate(**{**kw, "classes": [2]})
        np.testing.assert_array_equal(alone.tokens[0], device.tokens[1])


def test_the_step_reads_nothing_on_the_host_so_cuda_can_capture_it(engines, torch_lumina):
    """Every op of the device step (drafting, verification, acceptance, commits, the streams'
    table) stays on the device: none reads a value back or sizes its output by the data, the
    ops CUDA stream capture refuses (engines.host_reads sees them on the CPU), and none makes a
    tensor without naming the device. Greedy and sampling (top-k, top-p), CFG with an
    interval, forced tokens."""
    from engines import host_reads, run_one_step, tensors_made_without_a_device

    assert host_reads(lambda: torch.arange(4)[torch.arange(2)[1]]) == {"aten::item": 1}  # the probes see them
    assert host_reads(lambda: torch.arange(4)[[0, 2]]) == {"aten::lift_fresh": 1}  # an index list goes up per call
    assert host_reads(lambda: torch.arange(4).numpy()) == {"Tensor.numpy": 1}
    assert {name for name, _ in tensors_made_without_a_device(lambda: torch.arange(4))} == {"arange"}
    _, device_engine = engines
    directory, backend = torch_lumina
    lumina = Engine(directory, backend=backend, step="device")
    kw = dict(mode="lantern++", lam=3.0, k=8, cfg_scale=4.0)
    for engine, extra in [(device_engine, dict(greedy=True, classes=[1, 2], cfg_interval=5)),
                          (device_engine, dict(greedy=False, temperature=1.0, top_k=20, top_p=0.9, classes=[1, 2],
                                               seed=[3, 4], cfg_interval=5)),
                          (lumina, dict(greedy=False, prompt=["a red cat"], grid=(4, 4), seed=[2]))]:
        engine.generate(**kw, **extra)
        step = engine.backend._steps[id(engine._plan)]
        assert host_reads(lambda: run_one_step(step)) == {}, extra
        assert tensors_made_without_a_device(lambda: run_one_step(step)) == set(), extra  # CPU tensors on CUDA


def test_the_step_replayed_as_one_captured_graph_gives_the_host_tokens(engines, torch_c2i, torch_lumina, monkeypatch):
    """The step as CUDA would run it once captured (engines.capture_steps_on_cpu: run_all runs
    each call list eagerly once, then a CpuGraph of it, its ops recorded once and replayed with
    every Python value as it was at capture, on the same tensors): the host step's tokens, greedy
    and sampling, CFG with an interval, forced tokens, and for a second generation that replays
    from its first step (load refilled the graph's tensors)."""
    from engines import assert_captured_once, capture_steps_on_cpu

    capture_steps_on_cpu(monkeypatch)
    host_engine, _ = engines
    lumina_dir, _ = torch_lumina
    cases = [(torch_c2i[0], host_engine, dict(greedy=True, classes=[1, 2, 3], cfg_interval=5)),
             (torch_c2i[0], host_engine, dict(greedy=False, temperature=1.0, top_k=20, top_p=0.9, classes=[1, 2, 3],
                                              seed=[3, 4, 5], cfg_interval=5)),
             (lumina_dir, Engine(lumina_dir, backend=torch_lumina[1], step="host"),
              dict(greedy=False, prompt=["a red cat"], grid=(4, 4), seed=[2]))]
    for directory, host, extra in cases:
        device = Engine(directory, backend=open_torch_backend(directory, threads=2), step="device")
        kw = dict(mode="lantern++", lam=3.0, k=8, cfg_scale=4.0, **extra)
        want = host.generate(**kw).tokens
        first, second = device.generate(**kw), device.generate(**kw)
        assert_captured_once(device.backend, device.backend._steps[id(device._plan)])  # one eager run, then replays
        np.testing.assert_array_equal(first.tokens, want, err_msg=str(extra))
        np.testing.assert_array_equal(second.tokens, want, err_msg=str(extra))


@pytest.fixture(scope="module")
def torch_lumina(chameleon_engines):
    directory = chameleon_engines["lumina_mgpt"]
    return directory, open_torch_backend(directory, threads=2)


def test_forced_tokens_on_the_device(torch_lumina):
    directory, backend = torch_lumina
    host, device = both(directory, backend, mode="lantern++", lam=4.0, k=8, prompt=["a red cat", "a dog on a mat"],
                        grid=(4, 4), cfg_scale=3.0)
    np.testing.assert_array_equal(device.body, host.body)  # forced line breaks and end of image included
    assert device.stats["mean_accepted_drafts"] > 0


def test_device_step_moves_a_few_integers_per_image(torch_c2i):
    directory, inner = torch_c2i
    backend = RecordingBackend(inner)
    kw = dict(mode="lantern++", lam=3.0, k=8, greedy=True, cfg_scale=4.0, classes=[1, 2, 3])
    engine = Engine(directory, backend=backend, step="device")
    device = engine.generate(**kw)
    events = backend.events[backend.start:]
    depth, vocab = engine.tree.depth, engine.manifest.vocabulary.size
    report = 3 * (depth + 3) * 8  # per image: accepted, depth + 1 tokens, invalid (int64)
    calls = len(backend._steps[id(engine._plan)].calls[0])  # phases and engine calls (one CUDA graph on CUDA)
    # per step its calls launched, one read of the report and its one synchronisation; nothing
    # written up, nothing that grows with the vocabulary, the cache or the tree
    assert {kind for kind, _ in events} == {"launch", "to_host", "sync"}
    assert events == ([("launch", 0)] * calls + [("to_host", report), ("sync", 0)]) * device.stats["steps"]
    assert device.stats["steps"] >= device.stats["steps_per_image"]

    start = len(backend.events)
    host = Engine(directory, backend=backend, step="host").generate(**kw)
    events = backend.events[start:]
    logits = 6 * engine.tree.num_nodes * vocab * 4  # [rows, nodes, vocabulary] float32, read back every step
    assert max(size for kind, size in events if kind == "to_host") >= logits
    assert sum(kind == "sync" for kind, _ in events) >= (depth + 2) * host.stats["steps_per_image"]
    np.testing.assert_array_equal(device.tokens, host.tokens)


def backend_manifest(directory):
    from lantern.runtime.manifest import read_manifest

    return read_manifest(directory)


def test_step_choice_and_refusals(torch_c2i, c2i_engine, tmp_path, capsys):
    directory, backend = torch_c2i
    assert Engine(directory, backend=backend).step == "host"  # torch on the CPU: the measured default
    with pytest.raises(LanternError, match="unknown step path 'gpu'"):
        Engine(directory, backend=backend, step="gpu")
    with pytest.raises(LanternError, match=r"no step graphs for tree chain-4; add them with `lantern-export accept "
                                           r".* --tree \.\.\.`"):  # the engine has its default tree's and AR's
        Engine(c2i_engine, step="device").generate(mode="exact", greedy=True, classes=[1], tree="chain-4")
    bare = TorchBackend(backend.modules, backend_manifest(directory))  # opened without the step's modules
    with pytest.raises(LanternError, match="opened without the step's modules.*open_torch_backend") as e:
        Engine(directory, backend=bare, step="device").generate(mode="exact", greedy=True, classes=[1])
    assert "\n" not in str(e.value)
    with pytest.raises(LanternError, match="accept_precision must be float64 or float32"):
        TorchBackend(backend.modules, backend_manifest(directory), accept_precision="float16")
    out = tmp_path / "run"
    assert run_main(["generate", str(directory), "--backend", "torch", "--step", "device", "--mode", "exact",
                     "--greedy", "--classes", "1,2", "--cfg-scale", "4", "--threads", "2", "--out", str(out)]) == 0
    assert "device step" in capsys.readouterr().out
    assert json.loads((out / "stats.json").read_text())["step"] == "device"
    host = Engine(directory, backend=backend, step="host").generate(mode="exact", greedy=True, cfg_scale=4.0,
                                                                     classes=[1, 2])
    np.testing.assert_array_equal(np.load(out / "tokens.npy"), host.tokens)


@pytest.mark.parametrize("mode, cfg, images, extra", [("exact", 4.0, 3, {"cfg_interval": 5}),
                                                      ("lantern++", 1.0, 1, {"lam": 3.0, "k": 8})])
def test_onnxruntime_graph_step_equals_host_and_keeps_the_logits(c2i_engine, mode, cfg, images, extra):
    from lantern.runtime.backends.onnxruntime import OnnxRuntimeBackend
    from lantern.runtime.graph_step import GraphStep
    from lantern.runtime.manifest import read_manifest

    manifest = read_manifest(c2i_engine)
    backend = RecordingBackend(OnnxRuntimeBackend(c2i_engine, manifest, threads=2))
    kw = dict(mode=mode, greedy=True, cfg_scale=cfg, classes=list(range(1, images + 1)), **extra)
    host = Engine(c2i_engine, backend=backend, step="host").generate(**kw)
    host_reads = max(size for kind, size in backend.events if kind == "to_host")
    device_engine = Engine(c2i_engine, backend=backend, step="device")
    device = device_engine.generate(**kw)
    assert (host.stats["step"], device.stats["step"]) == ("host", "device")
    assert isinstance(backend.last_step, GraphStep)  # the whole step on the engine's step graphs
    np.testing.assert_array_equal(device.tokens, host.tokens)
    logits = (2 if cfg > 1 else 1) * images * 26 * manifest.vocabulary.size * 4
    assert host_reads >= logits  # the host path reads the verification logits every step ...
    reads = [size for kind, size in backend.events[backend.start:] if kind == "to_host"]
    assert all(size < logits for size in reads)  # ... the device path never (its report, a few integers per image)


# -- ONNX Runtime's sampling step graphs ---------------------------------------------------------
@pytest.fixture(scope="module")
def ort_sampling(c2i_engine):
    """A recording ONNX Runtime backend over the engine with its step graphs, and one host and
    one device engine on it."""
    from lantern.runtime.backends.onnxruntime import OnnxRuntimeBackend
    from lantern.runtime.manifest import read_manifest

    directory = c2i_engine
    backend = RecordingBackend(OnnxRuntimeBackend(directory, read_manifest(directory), threads=2))
    return backend, Engine(directory, backend=backend, step="host"), Engine(directory, backend=backend, step="device")


# exact / lantern / lantern++, CFG on (with and without an interval) and off, batch 1 and 3, the filters
ORT_SAMPLED = [("exact", 4.0, 3, dict(temperature=0.8, top_k=20, cfg_interval=5)),
               ("exact", 1.0, 1, dict(temperature=1.0)),
               ("lantern", 1.0, 3, dict(temperature=1.2, top_p=0.9, delta=0.2, k=8)),
               ("lantern", 4.0, 1, dict(top_k=30, delta=0.1, k=8)),
               ("lantern++", 4.0, 3, dict(top_k=30, top_p=0.95, lam=3.0, k=8, cfg_interval=7)),
               ("lantern++", 1.0, 1, dict(temperature=0.9, top_p=0.9, lam=3.0, k=8))]


def test_onnxruntime_sampling_graph_step_equals_host(ort_sampling):
    """ONNX Runtime's device step on the sampling step graphs against the host step, over the
    cases above (12 images): the graphs accept in float64 on logits combined in float32 as the
    host's, with the same draws of the images' streams, so every image equals the host's token
    for token; the step runs the same engine calls; and the verification logits never cross to
    the host on the device path, as they do on the host's."""
    backend, host_engine, device_engine = ort_sampling
    same, images, drafts = 0, 0, []
    for mode, cfg, n, extra in ORT_SAMPLED:
        seeds = [21 + 5 * i for i in range(n)]
        kw = dict(mode=mode, greedy=False, cfg_scale=cfg, classes=list(range(1, n + 1)), seed=seeds, **extra)
        begin = len(backend.events)
        host = host_engine.generate(**kw)
        host_reads = max(size for kind, size in backend.events[begin:] if kind == "to_host")
        device = device_engine.generate(**kw)
        assert (host.stats["step"], device.stats["step"]) == ("host", "device")
        logits = (2 if cfg > 1 else 1) * n * device_engine.tree.num_nodes * device_engine.manifest.vocabulary.size * 4
        reads = [size for kind, size in backend.events[backend.start:] if kind == "to_host"]
        assert host_reads >= logits and all(size < logits for size in reads), mode  # the logits never cross
        assert device.stats["engine_calls_per_step"] == host.stats["engine_calls_per_step"]
        same += int((device.tokens == host.tokens).all(axis=1).sum())
        images += n
        drafts.append(device.stats["mean_accepted_drafts"])
    assert same == images
    assert min(drafts) > 0  # every case accepted drafts: the children's draw and acceptance really ran


def test_onnxruntime_sampling_refusals(ort_sampling, c2i_engine, monkeypatch):
    """What the ONNX Runtime device step still refuses, in one line each; AR runs on its graphs."""
    import dataclasses

    from lantern.runtime import graph_step
    from lantern.runtime.manifest import read_manifest
    from lantern.runtime.sampling import Greedy, Sampling

    backend, _, device_engine = ort_sampling
    directory = device_engine.directory
    kw = dict(greedy=False, cfg_scale=4.0, classes=[1], seed=[3])
    assert device_engine.generate(mode="ar", **kw).stats["step"] == "device"  # AR has step graphs
    monkeypatch.setattr(graph_step, "ACCEPT_TOP_K_LIMIT", 10)  # the tiny model's 64 codes are under the real one
    with pytest.raises(LanternError, match=r"serves top_k up to 10 \(or none\), not 20; use step='host'"):
        device_engine.generate(mode="exact", top_k=20, **kw)
    plan = device_engine._plan
    codes = device_engine.manifest.vocabulary.codes
    assert backend.device_step_refusal(plan, Sampling(top_k=codes)) is None  # top-k over every column: no filter
    assert backend.device_step_refusal(plan, Sampling(top_k=10)) is None
    manifest = read_manifest(directory)
    old = manifest.replace(step_graphs={n: dataclasses.replace(e, version=0) for n, e in manifest.step_graphs.items()})
    monkeypatch.setattr(backend.inner, "manifest", old)
    assert backend.device_step_refusal(plan, Greedy()).startswith("the engine's step graphs are version 0")
    monkeypatch.setattr(backend.inner, "manifest", manifest.replace(step_graphs={}))
    assert backend.device_step_refusal(plan, Sampling()) == (
        f"the engine has no step graphs for tree mc_sim_7b_63; add them with `lantern-export accept {directory}`")


# -- sampling on the device step: the host path is the specification --------------------------
# each mode, CFG off and on (with and without an interval), batch 1 and 3, the filters; the
# device acceptance runs in float64 on numbers combined in float32 as the host combines them, so
# the tokens are the host's, token for token
SAMPLED = [("ar", 4.0, 1, dict(temperature=1.0)),
           ("exact", 4.0, 3, dict(temperature=0.8, top_k=20, cfg_interval=5)),
           ("lantern", 1.0, 1, dict(temperature=1.2, top_p=0.9, delta=0.2, k=8)),
           ("lantern++", 4.0, 3, dict(temperature=1.0, top_k=30, top_p=0.95, lam=3.0, k=8, cfg_interval=7))]


@pytest.mark.parametrize("mode, cfg, images, extra", SAMPLED)
def test_sampling_device_step_equals_host_step(engines, mode, cfg, images, extra):
    host_engine, device_engine = engines
    seeds = [11 + 7 * i for i in range(images)]
    kw = dict(mode=mode, greedy=False, cfg_scale=cfg, classes=list(range(1, images + 1)), seed=seeds, **extra)
    host, device = host_engine.generate(**kw), device_engine.generate(**kw)
    assert (host.stats["step"], device.stats["step"]) == ("host", "device")
    np.testing.assert_array_equal(device.tokens, host.tokens)
    for key in ("steps_per_image", "mean_accepted_length", "accepted_histogram"):
        assert device.stats[key] == host.stats[key], key
    if mode == "lantern":  # the seeds matter
        other = device_engine.generate(**{**kw, "seed": [s + 1 for s in seeds]})
        assert not np.array_equal(other.tokens, device.tokens)
    if mode != "ar":  # drafts were accepted: the children's draw and acceptance really ran
        assert device.stats["mean_accepted_drafts"] > 0
    if images == 3 and mode == "lantern++" and cfg > 1:  # batch invariance: image 2 alone = in the batch
        alone = device_engine.generate(**{**kw, "classes": [2], "seed": seeds[1:2]})
        np.testing.assert_array_equal(alone.tokens[0], device.tokens[1])


def test_sampling_with_forced_tokens_on_the_device(torch_lumina):
    directory, backend = torch_lumina
    kw = dict(mode="lantern++", lam=4.0, k=8, prompt=["a red cat", "a dog on a mat"], grid=(4, 4), cfg_scale=3.0,
              greedy=False, temperature=1.0, top_k=50, seed=[5, 9])
    host = Engine(directory, backend=backend, step="host").generate(**kw)
    device = Engine(directory, backend=backend, step="device").generate(**kw)
    np.testing.assert_array_equal(device.body, host.body)  # forced line breaks and end of image included
    assert device.stats["mean_accepted_drafts"] > 0


def test_sampling_streams_in_chunks(torch_c2i, monkeypatch):
    """A table smaller than the generation: the next chunk is uploaded as the steps reach it."""
    from lantern.runtime import graph_step

    directory, backend = torch_c2i
    kw = dict(mode="lantern", delta=0.05, k=8, greedy=False, cfg_scale=4.0, classes=[1], seed=[3])
    host = Engine(directory, backend=backend, step="host").generate(**kw)
    engine = Engine(directory, backend=backend, step="device")
    block = 26 * (1 + engine.manifest.candidates)  # uniforms per image per step (mc_sim_7b_63)
    monkeypatch.setattr(graph_step, "TABLE_BYTES", 2 * 8 * block)  # 2 steps per chunk
    device = engine.generate(**kw)
    step = backend._steps[id(engine._plan)]
    assert 1 < step.table_steps < device.stats["steps"]
    np.testing.assert_array_equal(device.tokens, host.tokens)


def chi_square_p(a, b):
    """p-value of the chi-square homogeneity test of two samples of tokens (bins with counts)."""
    from scipy.stats import chi2_contingency

    counts = np.stack([np.bincount(a, minlength=max(a.max(), b.max()) + 1),
                       np.bincount(b, minlength=max(a.max(), b.max()) + 1)])
    counts = counts[:, counts.sum(axis=0) > 0]
    return chi2_contingency(counts)[1]


def test_float32_sampling_acceptance_distribution(torch_c2i):
    """The float32 device acceptance (what TensorRT would run): the emitted tokens' distribution
    equals the host path's (chi-square over 8 images' tokens, exact: lossless, so the target's),
    and its disagreement rate with the float64 host, image for image, is small (printed: pytest
    -s). On this 64-token model the test has little power against small biases (a temperature of
    0.3 in place of 1 passed it at 24 images); a biased draw (uniforms u^4) fails it (p ~ 3e-6)."""
    directory, backend = torch_c2i
    f32 = open_torch_backend(directory, threads=2, accept_precision="float32")
    kw = dict(mode="exact", greedy=False, temperature=1.0, cfg_scale=4.0, classes=[3] * 8, seed=list(range(100, 108)))
    host = Engine(directory, backend=backend, step="host").generate(**kw)
    device = Engine(directory, backend=f32, step="device").generate(**kw)
    assert device.stats["step"] == "device" and device.stats["mean_accepted_drafts"] > 0
    different = float((device.tokens != host.tokens).any(axis=1).mean())
    print(f"float32 sampling acceptance: {different:.1%} of 8 images differ from the float64 host")
    assert different <= 0.25
    assert chi_square_p(device.tokens.ravel(), host.tokens.ravel()) > 1e-3


# -- ONNX Runtime's step graphs with forced tokens (Lumina-mGPT) --------------------------------
@pytest.fixture(scope="module")
def ort_lumina(chameleon_engines, tmp_path_factory):
    """A copy of the tiny Lumina-mGPT engine with its tree's step graphs (their token space holds
    the forced line-break and end-of-image ids as extra columns), on a recording ONNX Runtime
    backend."""
    import shutil

    from lantern.export.accept_engine import add_step_graphs
    from lantern.runtime.backends.onnxruntime import OnnxRuntimeBackend
    from lantern.runtime.manifest import read_manifest

    directory = shutil.copytree(chameleon_engines["lumina_mgpt"], tmp_path_factory.mktemp("ort-lumina") / "engine")
    add_step_graphs(directory)
    manifest = read_manifest(directory)
    assert all(e.forced_ids for e in manifest.step_graphs.values())  # the graphs carry the forced ids
    return directory, RecordingBackend(OnnxRuntimeBackend(directory, manifest, threads=2))


def test_onnxruntime_forced_tokens_on_the_device(ort_lumina):
    """ONNX Runtime's step graphs give the host's tokens on a forced-token engine, line breaks
    and end of image included, greedy and sampling; drafts accepted, and the logits never cross."""
    directory, backend = ort_lumina
    common = dict(mode="lantern++", lam=4.0, k=8, prompt=["a red cat", "a dog on a mat"], grid=(4, 4), cfg_scale=3.0)
    host_engine, device_engine = Engine(directory, backend=backend, step="host"), Engine(directory, backend=backend,
                                                                                     step="device")
    logits = 2 * 2 * device_engine.tree.num_nodes * device_engine.manifest.vocabulary.size * 4  # CFG rows x nodes x V
    for kw in (dict(greedy=True), dict(greedy=False, temperature=1.0, top_k=50, seed=[5, 9])):
        host, device = host_engine.generate(**common, **kw), device_engine.generate(**common, **kw)
        assert (host.stats["step"], device.stats["step"]) == ("host", "device")
        reads = [size for kind, size in backend.events[backend.start:] if kind == "to_host"]
        assert all(size < logits for size in reads)
        np.testing.assert_array_equal(device.body, host.body)
        assert device.stats["mean_accepted_drafts"] > 0


def test_engine_release_gives_a_shared_backend_its_plan_back(torch_c2i):
    """Engine.release(): the step plan and its device step leave the shared backend (tensorrt-
    torch frees their TensorRT contexts with them); the next generation makes them anew, the
    same tokens."""
    directory, backend = torch_c2i
    engine = Engine(directory, backend=backend, step="device")
    kw = dict(mode="lantern++", lam=3.0, k=8, greedy=True, cfg_scale=4.0, classes=[1, 2])
    first = engine.generate(**kw)
    plan = engine._plan
    assert id(plan) in backend._steps
    engine.release()
    assert engine._plan is None and id(plan) not in backend._steps
    np.testing.assert_array_equal(engine.generate(**kw).tokens, first.tokens)
    engine.release()


def test_the_device_step_chains_its_calls_through_buffers_made_once(torch_c2i):
    """GraphStep wires the step once per plan: each engine call's feeds are device tensors that
    the phase before it writes in place (the very objects, for both parities), every drafter call
    reads the one cfg_pair buffer, and a phase reads an engine call's outputs from the buffers the
    call writes; so a CUDA graph of the sequence (and tensorrt-torch's contexts, keyed by
    addresses) stays valid from step to step. The tokens stay the host step's."""
    directory, backend = torch_c2i
    kw = dict(mode="lantern++", lam=3.0, k=8, greedy=True, cfg_scale=4.0, cfg_interval=5, classes=[1, 2, 3])
    device = Engine(directory, backend=backend, step="device")
    got = device.generate(**kw)
    want = Engine(directory, backend=backend, step="host").generate(**kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    step = backend._steps[id(device._plan)]
    calls = step.model_calls
    assert {"draft0", "verify"} <= set(calls) and len(calls) == device.tree.depth + 1  # D drafter calls, verify
    for regime, call in calls.items():
        assert all(isinstance(t, torch.Tensor) for t in call.feeds.values()), regime
    written = 0
    for sequence in step.calls:
        assert [c.regime for c in sequence if c.regime in calls] == list(calls)  # each call once per step, in order
        for call in sequence:
            if call.regime in calls:
                assert call is calls[call.regime]  # the same call (and buffers) at both parities
                continue
            for name, buffer in call.outputs.items():
                if "." in name:  # REGIME.FEED: written where the engine call reads it
                    regime, feed = name.split(".")
                    assert buffer is calls[regime].feeds[feed], name
                    written += 1
            for name, buffer in call.feeds.items():
                if "." in name:  # REGIME.OUTPUT: read where the engine call wrote it
                    regime, output = name.split(".")
                    assert buffer is calls[regime].outputs[output], name
    assert written > 0
    pairs = {id(call.feeds["cfg_pair"]) for regime, call in calls.items() if regime.startswith("draft")}
    assert len(pairs) == 1  # one cfg_pair for every drafter call
    device.release()


def test_fp16_engine_device_step_equals_host_step(fp16_engine):
    """The GPU runs fp16 engines (gpu_check's GPT-B): the device step on fp16 logits and caches
    (acceptance, drafting, commits) gives the host step's tokens, greedy and sampling."""
    backend = open_torch_backend(fp16_engine, threads=2)
    assert backend.dtype == torch.float16
    for kw in (dict(mode="ar", greedy=True), dict(mode="exact", greedy=True),
               dict(mode="exact", greedy=False, top_k=20, seed=[3, 4, 5])):
        kw.update(cfg_scale=4.0, classes=[1, 2, 3])
        tokens = {}
        for step in ("host", "device"):
            engine = Engine(fp16_engine, backend=backend, step=step)
            out = engine.generate(**kw)
            assert out.stats["step"] == step
            tokens[step] = out.tokens
            engine.release()
        np.testing.assert_array_equal(tokens["device"], tokens["host"])
        if kw["mode"] == "exact":
            assert out.stats["mean_accepted_drafts"] > 0, kw  # drafts were accepted: the tree really ran


def test_count_kernels_counts_the_ops_that_write_memory():
    """bench.device_step.count_kernels: a view or a no-op conversion launches nothing, a new
    tensor or an in-place write one kernel each; ops inside a part's call count under its name,
    and the hooks leave the call's output and the module as they were."""
    from lantern.tools.bench.device_step import count_kernels

    x = torch.arange(6.0).reshape(2, 3)
    assert count_kernels(lambda: (x.view(-1), x.t(), x[:, 1:], x.to(torch.float32), torch.empty(3))) == {}
    assert count_kernels(lambda: (x + 1, x.t().contiguous())) == {"step": 2}
    assert count_kernels(lambda: x.clone().add_(1)) == {"step": 2}
    linear = torch.nn.Linear(3, 4)
    want = linear(x)
    got = []
    assert count_kernels(lambda: got.append(linear(x) * 2), {"linear": linear}) == {"linear": 1, "step": 1}
    torch.testing.assert_close(got[0], want * 2)
    assert not linear._forward_hooks and not linear._forward_pre_hooks


def test_step_kernels_by_part(torch_c2i):
    """Kernels per device step (what its CUDA graph replays), by part: AR runs no drafter; a
    speculative step adds the drafter's calls (one per tree level above the leaves, the same
    kernels each) and more of the step's own bookkeeping; the parts add up."""
    from lantern.tools.bench.device_step import step_kernels

    directory, backend = torch_c2i
    counts = step_kernels(directory, backend, modes=("ar", "exact"), images=2)
    ar, exact = counts["ar"], counts["exact"]
    assert set(ar["by_part"]) == {"target", "accept", "step"} and set(exact["by_part"]) == {
        "target", "drafter", "accept", "step"}
    for row in (ar, exact):
        assert row["kernels"] == sum(row["by_part"].values())
    engine = Engine(directory, backend=backend, step="device")
    engine.generate(mode="exact", greedy=True, cfg_scale=4.0, classes=[1, 2])
    depth = backend._steps[id(engine._plan)].depth  # the drafter calls per step
    engine.release()
    assert depth > 1 and exact["by_part"]["drafter"] % depth == 0
    # AR's acceptance is the root's argmax alone; a tree's verifies every node
    assert exact["by_part"]["step"] > ar["by_part"]["step"] and exact["by_part"]["accept"] > ar["by_part"]["accept"]
    assert exact["in_ar_steps"] == round(exact["kernels"] / ar["kernels"], 2) > 1
