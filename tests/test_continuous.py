"""Continuous batching (runtime/continuous.py) on tiny real engines (ONNX Runtime): images join a
running batch at step boundaries and leave when done, and every image equals Engine.generate of
that image alone, token for token (greedy and sampling, both proposers, CFG with an interval,
plain and in-place caches, class, caption and prompt conditions)."""
import numpy as np
import pytest

from conftest import built_once
from engines import captions, export_like
from lantern.runtime import graph_step
from lantern.runtime.continuous import ContinuousBatch
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.settings import GenerationSettings


@pytest.fixture(scope="module")
def c2i(c2i_engine):
    return Engine(c2i_engine, threads=1)


@pytest.fixture(scope="session")
def inplace_c2i_engine(c2i_engine, tmp_path_factory):
    return built_once(tmp_path_factory, "c2i-inplace-jacobi",
                      lambda root: export_like(c2i_engine, root / "engine", "--attention", "inplace"))


def run_staggered(batch, images, joins_per_step=2):
    """Admit `images` [(condition, seed, tag)] a few per step, as a server would; {tag: tokens}."""
    queue, got, admitted_while_running = list(images), {}, 0
    while queue or batch.running:
        for _ in range(joins_per_step):
            if not queue or not batch.free:
                break
            condition, seed, tag = queue[0]
            admitted_while_running += batch.running > 0
            assert batch.admit(condition, seed, tag)
            queue.pop(0)
        for done in batch.step():
            assert done.tag not in got
            got[done.tag] = done.tokens
            assert done.stats["steps_per_image"] >= 1
    assert admitted_while_running, "every image joined an empty batch: nothing was tested"
    return got


SETTINGS = {
    "greedy lantern++": GenerationSettings(mode="lantern++", greedy=True, cfg_scale=3.0),
    "sampling lantern++": GenerationSettings(mode="lantern++", cfg_scale=3.0, cfg_interval=5),
    "sampling exact jacobi": GenerationSettings(mode="exact", proposer="jacobi", window=4, cfg_scale=2.0),
    "greedy jacobi spatial": GenerationSettings(mode="exact", proposer="jacobi", window=3, init="spatial",
                                                greedy=True),
    "sampling ar": GenerationSettings(mode="ar", cfg_scale=3.0, top_k=20),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_every_image_equals_its_generation_alone(c2i, name):
    settings = SETTINGS[name]
    images = [({"classes": [c % 10]}, 40 + c, f"img{c}") for c in range(7)]
    got = run_staggered(ContinuousBatch(c2i, settings, slots=3), images)
    assert sorted(got) == sorted(tag for _, _, tag in images)
    for condition, seed, tag in images:
        alone = c2i.generate(settings, **condition, seed=seed).tokens
        np.testing.assert_array_equal(got[tag], alone, err_msg=tag)


# the graph step (ONNX Runtime's default on an engine with step graphs: its default tree and AR); a
# jacobi window runs where generate runs it (the host step while the engine has no window graphs)
GRAPH_SETTINGS = {
    "greedy lantern++ cfg": (GenerationSettings(mode="lantern++", greedy=True, cfg_scale=3.0), "device"),
    "sampling lantern++ cfg interval": (GenerationSettings(mode="lantern++", cfg_scale=3.0, cfg_interval=5), "device"),
    "sampling exact": (GenerationSettings(mode="exact", cfg_scale=1.0), "device"),
    "greedy ar": (GenerationSettings(mode="ar", greedy=True, cfg_scale=1.0), "device"),
    "sampling ar cfg top_k": (GenerationSettings(mode="ar", cfg_scale=3.0, top_k=20), "device"),
    "sampling jacobi": (GenerationSettings(mode="exact", proposer="jacobi", window=4, cfg_scale=2.0), None),
}


@pytest.fixture(scope="module")
def c2i_graphs(c2i_engine):
    return Engine(c2i_engine, threads=1)


@pytest.mark.parametrize("name", list(GRAPH_SETTINGS))
def test_the_graph_step_equals_each_generation_alone(c2i_graphs, name, monkeypatch):
    """Joiners are moved into the running GraphStep's buffers (its state, offsets, draft0's pairs
    and their streams' rows of the table); the streams' table holds 3 steps, so images join
    before, at and after the boundaries where it is refilled."""
    settings, path = GRAPH_SETTINGS[name]
    monkeypatch.setattr(graph_step, "table_steps", lambda images, steps, block: min(steps, 3))
    batch = ContinuousBatch(c2i_graphs, settings, slots=3)
    images = [({"classes": [c % 10]}, 40 + c, f"img{c}") for c in range(7)]
    got = run_staggered(batch, images, joins_per_step=1)
    assert batch.stats["step"] == (path or batch.stats["step"])
    assert ("step_reason" in batch.stats) == (batch.stats["step"] == "host")
    for condition, seed, tag in images:
        alone = c2i_graphs.generate(settings, **condition, seed=seed)
        assert alone.stats["step"] == batch.stats["step"]
        np.testing.assert_array_equal(got[tag], alone.tokens, err_msg=tag)
    batch.close()


@pytest.mark.parametrize("name, inplace", [("sampling lantern++", False), ("sampling exact jacobi", False),
                                           ("greedy lantern++", True)])
def test_the_torch_runners_graph_step(c2i_engine, inplace_c2i_engine, name, inplace, monkeypatch):
    """The torch runner's GraphStep (device tensors: fill_rows, draft0's pairs copied to the device;
    the window's state; in-place caches with their commit) on the CPU, asked for by step="device"."""
    pytest.importorskip("torch")
    from lantern.export.torch_backend import open_torch_backend

    directory = inplace_c2i_engine if inplace else c2i_engine
    engine = Engine(directory, backend=open_torch_backend(directory, threads=1), step="device")
    settings = SETTINGS[name]
    monkeypatch.setattr(graph_step, "table_steps", lambda images, steps, block: min(steps, 3))
    batch = ContinuousBatch(engine, settings, slots=2)
    images = [({"classes": [c]}, 5 + c, c) for c in range(4)]
    got = run_staggered(batch, images, joins_per_step=1)
    assert batch.stats["step"] == "device"
    for condition, seed, tag in images:
        np.testing.assert_array_equal(got[tag], engine.generate(settings, **condition, seed=seed).tokens)
    batch.close()


def test_inplace_engine(inplace_c2i_engine):
    engine = Engine(inplace_c2i_engine, threads=1)
    settings = GenerationSettings(mode="lantern++", cfg_scale=3.0)
    images = [({"classes": [c]}, 7 * c, c) for c in range(5)]
    got = run_staggered(ContinuousBatch(engine, settings, slots=2), images, joins_per_step=1)
    for condition, seed, tag in images:
        np.testing.assert_array_equal(got[tag], engine.generate(settings, **condition, seed=seed).tokens)


def test_caption_engine(t2i_engine):
    engine = Engine(t2i_engine, threads=1)
    settings = GenerationSettings(mode="exact", cfg_scale=2.0)
    feats, masks = captions(4)  # left-padded by 0, 1, 2 tokens
    images = [({"caption": feats[i: i + 1], "caption_mask": masks[i: i + 1]}, i, i) for i in range(4)]
    got = run_staggered(ContinuousBatch(engine, settings, slots=2), images, joins_per_step=1)
    for condition, seed, tag in images:
        np.testing.assert_array_equal(got[tag], engine.generate(settings, **condition, seed=seed).tokens)


def test_prompts_of_other_lengths_and_forced_line_ends(chameleon_engines):
    """Lumina-mGPT: forced line ends drafted as themselves in every slot; a shorter prompt joins
    a batch started by a longer one, a longer one waits for a batch of its own."""
    engine = Engine(chameleon_engines["lumina_mgpt"], threads=1)
    settings = GenerationSettings(mode="lantern++", greedy=True)
    batch = ContinuousBatch(engine, settings, slots=2)
    long, short = "a dog on a mat in the sun", "a cat"
    images = [({"prompt": [long], "grid": (4, 4)}, 1, "long"), ({"prompt": [short], "grid": (4, 4)}, 2, "short")]
    got = run_staggered(batch, images, joins_per_step=1)
    for condition, seed, tag in images:
        np.testing.assert_array_equal(got[tag], engine.generate(settings, **condition, seed=seed).tokens)
    longer = {"prompt": [long + " and a red ball under a big green tree"], "grid": (4, 4)}
    assert not batch.admit(longer, 3, "longer")
    assert not batch.admit({"prompt": [short], "grid": (2, 4)}, 3, "other grid")


def test_prefill_sizes_pad_a_lone_joiner(c2i, monkeypatch):
    """Joiners prefilled only at the sizes a compiled engine has plans for (here 2): a lone one
    is padded with a copy of itself, the copy never taken."""
    settings = GenerationSettings(mode="lantern++", cfg_scale=3.0)
    batch = ContinuousBatch(c2i, settings, slots=3, prefill_sizes=[2])
    images = [({"classes": [c]}, 3 * c, c) for c in range(5)]
    prefilled = []
    monkeypatch.setattr(batch, "_prefill_plan", lambda setup, make=batch._prefill_plan: prefilled.append(
        setup.prefix.images) or make(setup))
    got = run_staggered(batch, images, joins_per_step=1)
    assert set(prefilled) == {2}
    for condition, seed, tag in images:
        np.testing.assert_array_equal(got[tag], c2i.generate(settings, **condition, seed=seed).tokens)


def test_cancel_frees_the_slot_and_the_others_go_on(c2i):
    settings = GenerationSettings(mode="lantern++", greedy=True, cfg_scale=3.0)
    batch = ContinuousBatch(c2i, settings, slots=2)
    assert batch.admit({"classes": [1]}, 1, "a") and batch.admit({"classes": [2]}, 2, "b")
    assert not batch.admit({"classes": [3]}, 3, "c")  # full
    batch.step()
    assert batch.cancel("a") and not batch.cancel("a")
    assert batch.free == 1 and batch.admit({"classes": [3]}, 3, "c")
    got = {}
    while batch.running:
        got.update((f.tag, f.tokens) for f in batch.step())
    assert sorted(got) == ["b", "c"]
    np.testing.assert_array_equal(got["c"], c2i.generate(settings, classes=[3], seed=3).tokens)
    batch.close()


def test_bad_input_is_one_line(c2i):
    with pytest.raises(LanternError, match="slots must be an integer"):
        ContinuousBatch(c2i, GenerationSettings(), slots=0)
    batch = ContinuousBatch(c2i, GenerationSettings(mode="exact"), slots=2)
    with pytest.raises(LanternError, match="one image"):
        batch.admit({"classes": [1, 2]}, 0, "two")
    with pytest.raises(LanternError, match="class labels"):
        batch.admit({"classes": [10**6]}, 0, "bad")


def test_a_failing_group_keeps_the_groups_that_joined(c2i, monkeypatch):
    """Three joiners go in as a group of 2 and one of 1; when the second prefill fails (memory),
    the two stay joined and admit_many says 2, so a caller retrying the rest never admits an
    image twice."""
    settings = GenerationSettings(mode="exact", greedy=True)
    batch = ContinuousBatch(c2i, settings, slots=4)
    calls = []

    def check(*args, **kw):
        calls.append(args)
        if len(calls) >= 3:  # the running plan's and the first group's pass; then none
            raise LanternError("needs about 9 GiB")

    monkeypatch.setattr(c2i, "check_memory", check)
    images = [({"classes": [c]}, c, c) for c in range(3)]
    assert batch.admit_many(images) == 2 and batch.running == 2
    with pytest.raises(LanternError, match="GiB"):
        batch.admit_many(images[2:])
    monkeypatch.undo()
    assert batch.admit_many(images[2:]) == 1
    got = {}
    while batch.running:
        got.update((f.tag, f.tokens) for f in batch.step())
    for condition, seed, tag in images:
        np.testing.assert_array_equal(got[tag], c2i.generate(settings, **condition, seed=seed).tokens)
