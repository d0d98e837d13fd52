"""The drafter-free jacobi window on the torch backend's device step (lantern.runtime.graph_step
over lantern.export.step_jacobi's modules) against the host step (runtime/jacobi.py, the specification): the same tokens, token for token,
greedy (every window size and init, CFG off and on, batches) and sampling (exact, lantern++, with
CFG), on the c2i engine and on Lumina-mGPT (forced tokens); the step as a captured graph replays
to the same tokens and reads nothing on the host; gsd stays refused on the device."""
import numpy as np
import pytest
import torch

from lantern.export.torch_backend import open_torch_backend
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine

torch.set_grad_enabled(False)

CLASSES = [1, 2, 3]
LUMINA = dict(prompt=["a red cat", "a dog on a mat"], grid=(4, 4))  # tests/test_chameleon_engine.py's inputs


@pytest.fixture(scope="module")
def c2i(c2i_engine):
    """One host and one device engine on one torch backend (CPU)."""
    backend = open_torch_backend(c2i_engine, threads=2)
    return Engine(c2i_engine, backend=backend, step="host"), Engine(c2i_engine, backend=backend, step="device")


@pytest.fixture(scope="module")
def lumina(chameleon_engines):
    directory = chameleon_engines["lumina_mgpt"]
    backend = open_torch_backend(directory, threads=2)
    return Engine(directory, backend=backend, step="host"), Engine(directory, backend=backend, step="device")


def same(engines, **kw):
    """Host and device generations of the same request: the same body, statistics and, step by
    step, the same window (every draft, as an observer reads them)."""
    host_engine, device_engine = engines
    kw = dict(proposer="jacobi", **kw)
    windows = {"host": [], "device": []}
    host = host_engine.generate(**kw, observer=lambda record: windows["host"].append(record.tokens))
    device = device_engine.generate(**kw, observer=lambda record: windows["device"].append(record.tokens))
    assert (host.stats["step"], device.stats["step"]) == ("host", "device")
    assert device.stats["proposer"] == "jacobi"
    np.testing.assert_array_equal(device.body, host.body, err_msg=str(kw))
    np.testing.assert_array_equal(np.stack(windows["device"]), np.stack(windows["host"]), err_msg=str(kw))
    for key in ("steps_per_image", "accepted_histogram"):
        assert device.stats[key] == host.stats[key], (key, kw)
    return host, device


@pytest.mark.parametrize("window, init, cfg", [(2, "random", 1.0), (4, "uniform", 3.0), (4, "spatial", 1.0),
                                               (8, "spatial", 3.0), (8, "random", 3.0)])
def test_greedy_exact_on_the_device_is_the_host_step(c2i, window, init, cfg):
    _, device = same(c2i, mode="exact", greedy=True, cfg_scale=cfg, window=window, init=init, classes=CLASSES)
    if window > 2:
        assert device.stats["mean_accepted_drafts"] > 0  # the window's re-drafts were accepted


@pytest.mark.parametrize("mode, window, init, extra", [
    ("exact", 4, "random", dict(temperature=1.0)),
    ("exact", 8, "uniform", dict(top_k=30, cfg_interval=6)),
    ("lantern++", 4, "uniform", dict(lam=3.0, k=8, top_p=0.95)),
    ("lantern++", 8, "random", dict(lam=3.0, k=8))])
def test_sampling_on_the_device_is_the_host_step(c2i, mode, window, init, extra):
    seeds = [11 + 7 * i for i in range(len(CLASSES))]
    _, device = same(c2i, mode=mode, greedy=False, cfg_scale=3.0, window=window, init=init, classes=CLASSES,
                     seed=seeds, **extra)
    assert device.stats["mean_accepted_drafts"] > 0
    if window == 8 and mode == "lantern++":  # the seeds matter, and an image is the same alone
        other = c2i[1].generate(proposer="jacobi", mode=mode, greedy=False, cfg_scale=3.0, window=window, init=init,
                                classes=CLASSES, seed=[s + 1 for s in seeds], **extra)
        assert not np.array_equal(other.tokens, device.tokens)
        alone = c2i[1].generate(proposer="jacobi", mode=mode, greedy=False, cfg_scale=3.0, window=window, init=init,
                                classes=CLASSES[1:2], seed=seeds[1:2], **extra)
        np.testing.assert_array_equal(alone.tokens[0], device.tokens[1])


@pytest.mark.parametrize("greedy, init", [(True, "spatial"), (False, "random")])
def test_forced_tokens_on_the_device(lumina, greedy, init):
    kw = dict(greedy=True) if greedy else dict(greedy=False, temperature=1.0, top_k=50, seed=[5, 9])
    same(lumina, mode="lantern++", lam=3.0, k=8, cfg_scale=3.0, window=6 if greedy else 4, init=init, **LUMINA, **kw)


def test_the_window_step_replays_as_one_captured_graph_and_reads_nothing_on_the_host(c2i_engine, chameleon_engines,
                                                                                    monkeypatch):
    """As test_device_step's captured-graph test: one eager step, then the first step's ops
    replayed with Python values baked in, for two generations in a row (load refilled the
    tensors): the host's tokens. And no op of the step reads a value on the host or makes a
    tensor off the device."""
    from engines import assert_captured_once, capture_steps_on_cpu, host_reads, run_one_step, \
        tensors_made_without_a_device

    capture_steps_on_cpu(monkeypatch)
    lumina = chameleon_engines["lumina_mgpt"]
    cases = [(c2i_engine, dict(greedy=True, window=4, init="spatial", classes=CLASSES, cfg_interval=5)),
             (c2i_engine, dict(greedy=False, window=4, init="uniform", top_k=20, top_p=0.9, classes=CLASSES,
                               seed=[3, 4, 5])),
             (lumina, dict(greedy=False, window=3, init="spatial", seed=[2], prompt=["a red cat"], grid=(4, 4)))]
    for directory, extra in cases:
        backend = open_torch_backend(directory, threads=2)
        kw = dict(proposer="jacobi", mode="lantern++", lam=3.0, k=8, cfg_scale=3.0, **extra)
        want = Engine(directory, backend=backend, step="host").generate(**kw).body
        device = Engine(directory, backend=backend, step="device")
        first, second = device.generate(**kw), device.generate(**kw)
        step = backend._steps[id(device._plan)]
        assert_captured_once(backend, step)
        np.testing.assert_array_equal(first.body, want, err_msg=str(extra))
        np.testing.assert_array_equal(second.body, want, err_msg=str(extra))
        # the eager step itself, watched op by op
        assert host_reads(lambda: run_one_step(step)) == {}, extra
        assert tensors_made_without_a_device(lambda: run_one_step(step)) == set(), extra


def test_a_cached_step_serves_only_its_own_proposer(c2i):
    """The tree and a window of the same chain share a plan's shape but never a device step."""
    host_engine, device_engine = c2i
    kw = dict(mode="exact", greedy=True, cfg_scale=3.0, classes=CLASSES)
    window = device_engine.generate(proposer="jacobi", window=4, init="random", **kw)
    key = device_engine.backend._steps[id(device_engine._plan)].key
    spatial = device_engine.generate(proposer="jacobi", window=4, init="spatial", **kw)
    assert device_engine.backend._steps[id(device_engine._plan)].key != key
    tree = device_engine.generate(tree="chain-3", **kw)
    assert tree.stats["step"] == "device" and tree.stats["proposer"] == "tree"
    ar = host_engine.generate(mode="ar", greedy=True, cfg_scale=3.0, classes=CLASSES)
    for out in (window, spatial, tree):  # greedy exact: AR's tokens whatever proposed
        np.testing.assert_array_equal(out.tokens, ar.tokens)


def test_gsd_is_refused_on_the_device_in_one_line(c2i):
    _, device_engine = c2i
    with pytest.raises(LanternError) as e:
        device_engine.generate(proposer="jacobi", mode="gsd", greedy=False, cfg_scale=3.0, window=4, classes=[1],
                               seed=[1])
    text = str(e.value)
    assert "\n" not in text and "gsd" in text and "step='host'" in text, text
