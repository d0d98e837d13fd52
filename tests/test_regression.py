"""The step-plan decoding loop against the loop before it, token for token.

tests/data/regression_v1.npz holds 64 generations made with the loop as it was at commit c071357
(tests/data/make_regression_v1.py): every mode x greedy/sampling x CFG on/off x c2i/t2i x
batch 1 and 3, on the tiny engines the test fixtures built then. The fixtures' models are peaked
since issue 30 (tests/tiny.py); this file builds those older near-uniform engines
(build_engine(peaked=False): init_random's std 0.02, a random drafter), whose tokens a position
slip does not change (tests/test_canary.py), so it guards the random streams and the rule
plumbing, not positions (tests/test_references.py does). The rebuilt loop must give the same
tokens wherever the random stream did not change by design:
  - greedy runs consume no random numbers: all must match;
  - `ar` sampling draws one uniform per image per step. Since per-image streams
    (lantern.runtime.streams) image i of a call with seed s draws from its own generator seeded
    s + i, where the old loop interleaved one generator over the batch: a single image keeps
    its stream, so batch-1 runs must match; in a batch of 3 only image 0 keeps its stream (seed
    s, class and caption as the batch-1 run's), so it must equal the old batch-1 run's tokens,
    and images 1 and 2 differ by design (their independence of the batch is tested in
    test_streams);
  - speculative sampling now draws each step's acceptance uniforms up front ([images, nodes],
    DESIGN.md's batched acceptance; the old loop drew them lazily, image by image), so those
    runs cannot match token for token; their exactness is tested statistically
    (test_generator.test_exact_sampling_matches_the_target_distribution) and batched ==
    per-image acceptance is tested in test_accept.
"""
import json
import os

import numpy as np
import pytest

from engines import build_engine, captions
from lantern.runtime.generator import Engine

DATA = os.path.join(os.path.dirname(__file__), "data")
with open(os.path.join(DATA, "regression_v1.json")) as f:
    INDEX = json.load(f)
RUNS = [dict(run, index=i) for i, run in enumerate(INDEX["runs"])]


def condition(kind, batch):
    if kind == "c2i":
        return dict(classes=[(3 * i + 1) % 10 for i in range(batch)])
    caption, mask = captions(batch)
    return dict(caption=caption, caption_mask=mask)


def comparable(run):
    return run["greedy"] or (run["mode"] == "ar" and run["batch"] == 1)


def alone(run):
    """The index of the batch-1 run with run's settings."""
    return next(r["index"] for r in RUNS if r == dict(run, batch=1, index=r["index"]))


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The engines regression_v1 was made on: the old models, exported as the fixtures are."""
    root = tmp_path_factory.mktemp("regression-v1")
    return {"c2i": Engine(build_engine(root / "c2i", "c2i", peaked=False), threads=2),
            "t2i": Engine(build_engine(root / "t2i", "t2i", tree="naive_extend_57", peaked=False), threads=2)}


def test_every_greedy_and_ar_run_gives_the_old_tokens(engines):
    old = np.load(os.path.join(DATA, "regression_v1.npz"))
    checked = 0
    for run in RUNS:
        first_only = run["mode"] == "ar" and not run["greedy"] and run["batch"] > 1
        if not (comparable(run) or first_only):
            continue
        kw = dict(mode=run["mode"], greedy=run["greedy"], cfg_scale=run["cfg"], seed=INDEX["seed"],
                  **INDEX["modes"][run["mode"]])
        if not run["greedy"]:
            kw.update(INDEX["sampling"])
        out = engines[run["kind"]].generate(**condition(run["kind"], run["batch"]), **kw)
        if first_only:
            np.testing.assert_array_equal(out.tokens[:1], old[f"run{alone(run)}"], err_msg=str(run))
        else:
            np.testing.assert_array_equal(out.tokens, old[f"run{run['index']}"], err_msg=str(run))
        checked += 1
    assert checked == 40  # 32 greedy + 4 ar sampling alone + 4 ar sampling batches' first images
