"""GenerationSettings: validation once with one-line errors, k resolved against the engine, the
canonical form and key tuned trees are recorded under, and generate taking it or its keywords."""
import dataclasses

import numpy as np
import pytest

from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.settings import MODES, GenerationSettings


@pytest.mark.parametrize("fields, words", [
    (dict(mode="fast"), "unknown mode 'fast'; valid: ar, exact, lantern, lantern++"),
    (dict(mode="lantern++", lam=0.5), "lam must be >= 1"),
    (dict(mode="lantern", delta=1.5), "delta must be in [0, 1]"),
    (dict(mode="lantern", k=-1), "k must be an integer >= 0"),
    (dict(mode="lantern++", k=2.5), "k must be an integer >= 0"),
    (dict(cfg_scale=float("nan")), "cfg scale must be a finite number >= 0"),
    (dict(cfg_scale=-1.0), "cfg scale must be a finite number >= 0"),
    (dict(cfg_scale=2**70), "cfg scale must be <= 100"),  # an int past float64's exact range (and numpy's int64)
    (dict(cfg_interval=-2), "cfg interval must be an integer >= -1"),
    (dict(cfg_interval=1.5), "cfg interval must be an integer >= -1"),
    (dict(temperature=0.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
])
def test_bad_settings_are_refused_in_one_line(fields, words):
    with pytest.raises(LanternError) as e:
        GenerationSettings(**fields)
    assert words in str(e.value) and len(str(e.value).splitlines()) == 1


def test_parameters_of_other_modes_are_not_checked_or_keyed():
    s = GenerationSettings(mode="exact", lam=0.5, delta=7.0)  # lam/delta mean nothing to exact
    assert s.canonical() == {"mode": "exact", "sampling": "sample", "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                             "cfg_scale": 1.0, "cfg_interval": -1}
    assert GenerationSettings(mode="ar", greedy=True, top_k=5).key == "ar_greedy_nocfg"


def test_settings_are_frozen_and_mode_list_is_one():
    s = GenerationSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.mode = "ar"
    assert MODES == ("ar", "exact", "lantern", "lantern++", "gsd")
    assert s.replace(mode="ar").mode == "ar" and s.mode == "lantern++"


def test_relaxed_key_needs_k_resolved():
    with pytest.raises(LanternError, match="needs k; resolve"):
        GenerationSettings(mode="lantern++").key


def test_resolve_against_the_engine(c2i_engine):
    engine = Engine(c2i_engine, threads=1)
    width = 63  # the fixture's table lists every other code of 64
    assert engine.neighbors.shape[1] == width
    s = GenerationSettings(mode="lantern++", lam=3.0).resolve(engine.manifest, engine.directory)
    assert s.k == width  # the default k (100) capped by the table
    assert GenerationSettings(mode="lantern", k=3).resolve(engine.manifest).k == 3
    assert GenerationSettings(mode="exact").resolve(engine.manifest).k is None  # exact has no k
    with pytest.raises(LanternError, match=f"k = {width + 1} exceeds the engine's neighbor table"):
        GenerationSettings(mode="lantern", k=width + 1).resolve(engine.manifest)


def test_generate_takes_settings_or_their_keywords(c2i_engine):
    engine = Engine(c2i_engine, threads=1)
    keywords = dict(mode="lantern++", lam=3.0, k=4, cfg_scale=2.0, top_k=50)
    by_keywords = engine.generate(classes=[1, 2], seed=7, **keywords)
    by_settings = engine.generate(GenerationSettings(**keywords), classes=[1, 2], seed=7)
    assert np.array_equal(by_keywords.tokens, by_settings.tokens)
    # and the settings reached the generation: without CFG and top-k, hotter, the same seeds give other tokens
    plain = engine.generate(classes=[1, 2], seed=7, mode="lantern++", lam=3.0, k=4, temperature=2.0)
    assert not np.array_equal(plain.tokens, by_keywords.tokens)
    with pytest.raises(TypeError, match="not both"):
        engine.generate(GenerationSettings(), classes=[1], mode="ar")
    with pytest.raises(TypeError):
        engine.generate(classes=[1], cfg=3.0)  # not a setting's name
    with pytest.raises(LanternError, match="cfg scale must be"):
        engine.generate(classes=[1], cfg_scale=float("inf"))
