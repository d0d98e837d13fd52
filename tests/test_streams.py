"""Per-image random streams: an image's tokens depend on its own seed and settings only, never on
the images that share its batch; the streams' layout (what a device path reads up front) is the
step-by-step one; drafting by exponential race draws without replacement from q."""
import numpy as np
import pytest
from scipy import stats

from engines import captions
from lantern.runtime.cli import _seeds
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.sampling import Sampling
from lantern.runtime.streams import RandomStreams, image_seeds


@pytest.fixture(scope="module")
def c2i(c2i_engine):
    return Engine(c2i_engine, threads=2)


@pytest.fixture(scope="module")
def t2i(t2i_engine):
    return Engine(t2i_engine, threads=2)


def test_an_int_seed_means_seed_plus_the_image_index():
    assert image_seeds(5, 3) == [5, 6, 7]
    assert image_seeds(np.int64(2), 1) == [2]
    assert image_seeds([9, 9, 0], 3) == [9, 9, 0]
    assert image_seeds((np.int32(4),), 1) == [4]


@pytest.mark.parametrize("seed, images, message", [
    (-1, 2, "seed must be an integer >= 0"),
    (True, 1, "seed must be an integer >= 0"),
    (1.5, 1, "one such integer per image"),
    ("7", 1, "one such integer per image"),
    ([1, 2], 3, "2 seeds given for 3 image"),
    ([1, -2], 2, "every seed must be an integer >= 0"),
    ([1, 2.0], 2, "every seed must be an integer >= 0"),
])
def test_bad_seeds_are_refused(seed, images, message):
    with pytest.raises(LanternError, match=message):
        image_seeds(seed, images)


def test_the_cli_takes_one_seed_or_one_per_image():
    assert _seeds("7") == 7
    assert _seeds("7,7,3") == [7, 7, 3]
    assert _seeds("7,") == [7]


def test_a_whole_table_holds_the_step_by_step_draws():
    """What a device path takes up front is what the host path draws step by step."""
    stepwise, upfront = RandomStreams([3, 8], nodes=5, candidates=4), RandomStreams([3, 8], nodes=5, candidates=4)
    np.testing.assert_array_equal(stepwise.first(), upfront.first())
    table = upfront.split(upfront.table(6))
    for s in range(6):
        draws = stepwise.step()
        np.testing.assert_array_equal(draws.accept, table.accept[:, s])
        np.testing.assert_array_equal(draws.race, table.race[:, s])
    assert draws.accept.shape == (2, 5) and draws.race.shape == (2, 5, 4)
    # image 1 reads default_rng(8) alone: one uniform, then blocks of 5 + 5 * 4, whatever image 0 is
    g = np.random.default_rng(8)
    g.random()
    blocks = g.random((6, 25))
    np.testing.assert_array_equal(table.accept[1], blocks[:, :5])
    np.testing.assert_array_equal(table.race[1], blocks[:, 5:].reshape(6, 5, 4))


def test_the_race_draws_children_without_replacement_from_q():
    """First and second child of a parent: P(a, b) = q_a q_b / (1 - q_a) (chi-square)."""
    q = np.array([0.4, 0.3, 0.2, 0.1, 0.0], dtype=np.float32)
    n = 40000
    rng = np.random.default_rng(0)
    ids = np.broadcast_to(np.arange(5), (n, 1, 5))
    picked = Sampling().children(ids, np.broadcast_to(q, (n, 1, 5)), 2, rng.random((n, 1, 5)))[:, 0]
    assert (picked[:, 0] != picked[:, 1]).all() and (picked != 4).all()
    counts = np.zeros((4, 4))
    np.add.at(counts, (picked[:, 0], picked[:, 1]), 1)
    p = np.array([[q[a] * q[b] / (1 - q[a]) if a != b else 0.0 for b in range(4)] for a in range(4)])
    keep = p > 0
    chi2 = ((counts[keep] - n * p[keep]) ** 2 / (n * p[keep])).sum()
    assert stats.chi2.sf(chi2, keep.sum() - 1) > 1e-3, chi2


SETTINGS = {
    "greedy lantern++": dict(mode="lantern++", lam=3.0, k=8, greedy=True),
    "sampling ar": dict(mode="ar", temperature=1.0, top_k=20),
    "sampling exact": dict(mode="exact", temperature=1.0, top_k=20, top_p=0.95),
    "sampling lantern++": dict(mode="lantern++", lam=3.0, k=8, temperature=1.0, top_k=20, top_p=0.95),
    "sampling lantern": dict(mode="lantern", delta=0.2, k=8, temperature=0.8),
    # images pass the CFG interval at different steps; each switches its own drafting
    "sampling lantern++ cfg_interval": dict(mode="lantern++", lam=3.0, k=8, top_k=20, cfg_interval=6),
}


@pytest.mark.parametrize("cfg", [1.0, 4.0])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_image_alone_equals_itself_in_a_batch_c2i(c2i, name, cfg):
    classes, seeds = [4, 1, 7], [11, 5, 11]
    kw = dict(SETTINGS[name], cfg_scale=cfg)
    batch = c2i.generate(classes=classes, seed=seeds, **kw)
    for i in range(3):
        alone = c2i.generate(classes=[classes[i]], seed=seeds[i], **kw)
        np.testing.assert_array_equal(batch.tokens[i], alone.tokens[0], err_msg=f"image {i}")
    # an int seed s is the seeds s, s + 1, s + 2
    np.testing.assert_array_equal(c2i.generate(classes=classes, seed=3, **kw).tokens,
                                  c2i.generate(classes=classes, seed=[3, 4, 5], **kw).tokens)


@pytest.mark.parametrize("name", ["greedy lantern++", "sampling lantern++"])
def test_each_image_alone_equals_itself_in_a_batch_t2i(t2i, name):
    caption, mask = captions(3)
    kw = dict(SETTINGS[name], cfg_scale=4.0)
    batch = t2i.generate(caption=caption, caption_mask=mask, seed=[2, 0, 1], **kw)
    for i, seed in enumerate([2, 0, 1]):
        alone = t2i.generate(caption=caption[i: i + 1], caption_mask=mask[i: i + 1], seed=seed, **kw)
        np.testing.assert_array_equal(batch.tokens[i], alone.tokens[0], err_msg=f"image {i}")


def test_the_same_seed_in_a_batch_gives_the_same_image_and_seeds_matter(c2i):
    kw = SETTINGS["sampling lantern++"]
    out = c2i.generate(classes=[2, 2, 2], seed=[6, 6, 7], **kw)
    np.testing.assert_array_equal(out.tokens[0], out.tokens[1])
    assert not np.array_equal(out.tokens[0], out.tokens[2])
