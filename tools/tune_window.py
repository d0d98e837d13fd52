"""`lantern-run tune --proposer jacobi`: the Jacobi window that is fastest on this machine, for given
generation settings, measured on the engine itself.

A window's step has one shape (W tokens verified, no drafter calls) and its acceptance depends
on the target alone, so there is nothing to model: each candidate window, and AR, runs whole
generations of the calibration conditions at each batch size, in turns (a change in what else
runs on the machine touches them alike), and the fastest per batch (seconds per image, the best
of two rounds) is recorded for these settings with the window left open (the settings'
key without a window). `generate --proposer jacobi` without --window then runs it and says so;
where AR was fastest it runs AR.
"""
import json
import os
import time

import numpy as np

from lantern.runtime.errors import LanternError
from lantern.runtime.jacobi import check_window

WINDOWS = (2, 3, 4, 6, 8, 12, 16)  # candidates: every small width, then steps of about 1.5x


def check_windows(windows):
    for w in windows:
        check_window(w, "random")
    if not windows or len(set(windows)) != len(windows):
        raise LanternError(f"--windows takes distinct window sizes, got {list(windows)}")
    return tuple(sorted(windows))


def tune_windows(engine, settings, calls_per_batch, windows=WINDOWS, rounds=2, seed=0, trees=None, log=print):
    """({batch: report}, {batch: chosen window, or None for AR, or the drafter's tree}). settings:
    resolved, window None (the drafter's settings when `trees` is given); calls_per_batch: {batch
    size: [generate() condition dicts of that many images]}; trees: {batch: the Tree tune chose
    for the drafter}, measured beside the windows (tune --also-jacobi: between proposers)."""
    jacobi = settings.replace(proposer="jacobi", window=None)
    reports, chosen = {}, {}
    for images, calls in sorted(calls_per_batch.items()):
        t0 = time.perf_counter()
        candidates = [("ar", settings.replace(mode="ar", proposer="tree", window=None), None, None)]
        tree = (trees or {}).get(images)
        if tree is not None and tree.depth:
            candidates.append((f"tree {tree.name}", settings, tree, tree))
        candidates += [(f"jacobi-{w}", jacobi.replace(window=w), None, w) for w in check_windows(windows)]
        for _, s, t, _ in candidates:  # plans made and sessions warmed outside the clock
            engine.generate(s, **calls[0], seed=seed, tree=t)
        seconds = {name: np.inf for name, *_ in candidates}
        steps = {}
        for r in range(rounds):
            for name, s, t, _ in candidates:
                start, taken = time.perf_counter(), []
                for i, call in enumerate(calls):
                    out = engine.generate(s, **call, seed=seed + 1000 * r + i * images, tree=t)
                    taken.append(out.stats["steps_per_image"])
                seconds[name] = min(seconds[name], time.perf_counter() - start)
                steps[name] = float(np.mean(taken))
        n = images * len(calls)
        rows = [{"candidate": name, "window": s.window, "seconds_per_image": seconds[name] / n,
                 "steps_per_image": steps[name], "speedup_vs_ar": seconds["ar"] / seconds[name]}
                for name, s, _, _ in candidates]
        best = min(rows, key=lambda row: row["seconds_per_image"])
        chosen[images] = {name: pick for name, _, _, pick in candidates}[best["candidate"]]
        reports[images] = {"images": images, "generations": len(calls), "rounds": rounds, "candidates": rows,
                           "chosen": best, "seconds": time.perf_counter() - t0}
        log(f"  {images} image(s) per call: " + ", ".join(
            f"{row['candidate']} {1000 * row['seconds_per_image']:.0f} ms/image ({row['steps_per_image']:.1f} steps)"
            for row in rows) + f" -> {best['candidate']}")
    return reports, chosen


def markdown(report):
    lines = [f"# Jacobi window tuned for `{report['key']}`", "",
             f"Engine `{report['engine']}`, backend {report['backend']}, {report['threads']} thread(s); "
             f"conditions: {report['conditions']}. Whole generations, in turns, the best of "
             f"{next(iter(report['batches'].values()))['rounds']} rounds.", ""]
    for images, r in report["batches"].items():
        lines += [f"## {images} image(s) per call: {r['chosen']['candidate']}", "",
                  "| candidate | ms per image | steps per image | speed-up over ar |", "|---|---|---|---|"]
        lines += [f"| {row['candidate']} | {1000 * row['seconds_per_image']:.1f} | {row['steps_per_image']:.1f} | "
                  f"{row['speedup_vs_ar']:.2f}x |" for row in r["candidates"]]
        lines.append("")
    return "\n".join(lines) + "\n"


def write_report(directory, report):
    """report.json and report.md into `directory`; returns their names."""
    with open(os.path.join(directory, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(directory, "report.md"), "w") as f:
        f.write(markdown(report))
    return ["report.json", "report.md"]
