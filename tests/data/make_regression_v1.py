"""Made the regression data in regression_v1.npz with the decoding loop as it was at commit
c071357 (the loop before step plans). Kept to show how the data was made; it runs
only against that commit's API:  python tests/data/make_regression_v1.py
(That commit's build_engine made the near-uniform models build_engine(peaked=False) makes now.)"""
import itertools
import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from engines import build_engine, captions  # noqa: E402
from lantern.runtime.generator import Engine  # noqa: E402

MODES = {"ar": {}, "exact": {}, "lantern": dict(delta=0.1, k=8), "lantern++": dict(lam=3.0, k=8)}
SAMPLING = dict(temperature=1.0, top_k=20, top_p=0.95)


def settings():
    for kind, mode, greedy, cfg, batch in itertools.product(("c2i", "t2i"), MODES, (True, False), (1.0, 4.0), (1, 3)):
        yield dict(kind=kind, mode=mode, greedy=greedy, cfg=cfg, batch=batch)


def condition(kind, batch):
    if kind == "c2i":
        return dict(classes=[(3 * i + 1) % 10 for i in range(batch)])
    caption, mask = captions(batch)
    return dict(caption=caption, caption_mask=mask)


def kwargs(s):
    kw = dict(mode=s["mode"], greedy=s["greedy"], cfg_scale=s["cfg"], seed=5, **MODES[s["mode"]])
    if not s["greedy"]:
        kw.update(SAMPLING)
    return kw


def main():
    root = tempfile.mkdtemp()
    engines = {"c2i": Engine(build_engine(os.path.join(root, "c2i"), "c2i"), threads=2),
               "t2i": Engine(build_engine(os.path.join(root, "t2i"), "t2i", tree="naive_extend_57"), threads=2)}
    data, index = {}, []
    t = time.time()
    for i, s in enumerate(settings()):
        out = engines[s["kind"]].generate(**condition(s["kind"], s["batch"]), **kwargs(s))
        data[f"run{i}"] = out.tokens
        index.append(s)
    np.savez_compressed(os.path.join(HERE, "regression_v1.npz"), **data)
    with open(os.path.join(HERE, "regression_v1.json"), "w") as f:
        json.dump({"made_with": "c071357", "seed": 5, "modes": MODES, "sampling": SAMPLING, "runs": index}, f, indent=1)
    print(f"{len(index)} runs in {time.time() - t:.1f}s")


if __name__ == "__main__":
    main()
