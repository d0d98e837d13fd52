"""What `lantern-run tune` measures on the engine (lantern.tools.tune runs it): the loop's
steps as it pays them (StepTimer, whole generations in turns), the engine calls alone (verification
of T tokens and drafter calls of width w, on a grid of sizes), and the latency model fitted to them:
host time a + b * nodes + c * drafter calls by non-negative least squares over what the engine-call
curves leave of each measured step. Also the clock a run times on and the machine it ran on, which
the report records.
"""
import datetime
import os
import platform

import numpy as np

from lantern.runtime.cli import device_of
from lantern.runtime.tree import build_tree
from lantern.tools.latency import CLOCKS, default_condition, draft_latency, draft_tree, verify_latency, verify_tree
from lantern.tools.latency_model import LatencyModel


class StepTimer:
    """An observer timing the loop's steps on a clock (latency.CLOCKS): the time between
    consecutive records is one whole step as the loop pays it (the loop builds each record in
    microseconds; an inner observer's own time is left out)."""

    def __init__(self, clock="wall", inner=None):
        self.now, self.inner = CLOCKS[clock], inner
        self.times, self.last = [], None

    def __call__(self, record):
        t = self.now()
        if self.last is not None:
            self.times.append(t - self.last)
        if self.inner is not None:
            self.inner(record)
        self.last = self.now()

    @property
    def step_ms(self):
        """Mean milliseconds per step, the first step (which follows the prefill) left out."""
        return 1000.0 * float(np.mean(self.times)) if self.times else float("nan")


def latency_sizes(largest):
    """Every size up to 8, then steps of about 25 %, and `largest` itself."""
    sizes, x = list(range(1, min(largest, 8) + 1)), 8
    while x < largest:
        x = min(largest, max(x + 1, int(round(x * 1.25))))
        sizes.append(x)
    return sizes


def fit_trees(candidates, budget, depth, calibration):
    """Trees whose whole generations fix the host terms: different node counts and depths, the
    calibration tree the largest (every one within the budget, depth and candidates)."""
    flat = min(8, candidates, budget - 1)
    specs = [("chain-1", None), (f"chain-{min(4, depth)}", None), ([[r] for r in range(flat)], f"flat-{flat + 1}"),
             (f"kary-2-{min(3, depth)}", None), (calibration, None)]
    out, seen = [], set()
    for spec, name in specs:
        tree = build_tree(spec, name=name)
        if tree.num_nodes <= budget and tree.depth <= depth and tree.max_width <= candidates and tree.paths not in seen:
            seen.add(tree.paths)
            out.append(tree)
    return out


def nnls(X, y):
    """Non-negative least squares for a few columns: the best of the unconstrained fits over
    every subset of columns whose coefficients are all >= 0."""
    X, y = np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.float64)
    best, best_err = np.zeros(X.shape[1]), float(np.sum(y ** 2))
    for mask in range(1, 2 ** X.shape[1]):
        cols = [j for j in range(X.shape[1]) if mask >> j & 1]
        coef, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
        if (coef >= 0).all():
            err = float(np.sum((X[:, cols] @ coef - y) ** 2))
            if err < best_err:
                best, best_err = np.zeros(X.shape[1]), err
                best[cols] = coef
    return best


def call_latency(engine, settings, images, budget, depth, repeats=5, seed=0, clock="wall"):
    """(verify_ms, draft_ms): engine calls alone for `images` images, timed through real step
    plans at a mid-generation cache length, the fastest of `repeats` runs per size."""
    cfg = settings.cfg_scale
    prefix = engine.condition.prefix(cfg > 1, **default_condition(engine.manifest, 1))
    context = prefix.tokens + engine.manifest.image.tokens // 2  # mid-generation
    verify = verify_latency(engine, latency_sizes(budget), images, cfg, context, repeats, seed, "min", clock)
    draft = draft_latency(engine, latency_sizes(max(budget - 1, depth + 1)), images, cfg, context, repeats, seed,
                          "min", clock)
    return {T: 1000 * s for T, s in verify.items()}, {w: 1000 * s for w, s in draft.items()}


def check_memory(engine, settings, calib, budget, depth, batches):
    """Refuse up front (one line, before minutes of calibration) a batch whose largest plan the
    machine cannot hold: the calibration tree and the latency model's widest calls."""
    widest = [calib, verify_tree(max(latency_sizes(budget))), draft_tree(max(latency_sizes(max(budget - 1, depth + 1))))]
    for images in batches:
        prefix = engine.condition.prefix(settings.cfg, **default_condition(engine.manifest, images))
        for tree in widest:
            engine.check_memory(tree, prefix)


def loop_step_ms(engine, call, settings, trees, runs=3, seed=0, clock="wall"):
    """{tree paths: the loop's milliseconds per step} for each tree (root_only(): AR), as it pays:
    the mean over a whole generation of `call`'s images, the fastest of `runs` generations. The
    trees take turns, so a change in what else runs on the machine touches them alike."""
    best = {tree.paths: np.inf for tree in trees}
    for r in range(runs):
        for tree in trees:
            ar = tree.depth == 0
            timer = StepTimer(clock)
            engine.generate(**call, settings=settings.replace(mode="ar") if ar else settings, seed=seed + r,
                            tree=None if ar else tree, observer=timer)
            best[tree.paths] = min(best[tree.paths], timer.step_ms)
    return best


def fit_latency(verify_ms, draft_ms, ar_ms, measured):
    """LatencyModel from the engine-call curves plus host terms fitted to whole-loop steps.
    measured: [(Tree, loop ms per step, source)]. What the calls leave of each measured step is
    host time a + b * nodes + c * drafter calls (non-negative least squares). Returns (model,
    per-tree fit rows, {a, b, c})."""
    engine_only = LatencyModel(verify_ms, draft_ms)
    X = [[1.0, tree.num_nodes, tree.depth] for tree, _, _ in measured]
    y = [ms - engine_only.step_ms(tree) for tree, ms, _ in measured]
    a, b, c = nnls(X, y)
    T = max(verify_ms)
    latency = LatencyModel(verify_ms, draft_ms, host_ms={1: a + b, T: a + b * T}, ar_ms=ar_ms, draft_host_ms=c)
    fit = [{"tree": tree.name, "nodes": tree.num_nodes, "depth": tree.depth, "source": source,
            "measured_step_ms": ms, "engine_calls_ms": engine_only.step_ms(tree),
            "model_step_ms": latency.step_ms(tree), "error": latency.step_ms(tree) / ms - 1.0}
           for tree, ms, source in measured]
    fit.append({"tree": "ar", "nodes": 1, "depth": 0, "source": "generation", "measured_step_ms": ar_ms,
                "engine_calls_ms": verify_ms[1], "model_step_ms": ar_ms, "error": 0.0})
    return latency, fit, {"per_step_ms": a, "per_node_ms": b, "per_drafter_call_ms": c}


def default_clock(threads, device):
    """"cpu" for a single-threaded run on the CPU (its CPU time is its wall time on an idle
    machine, and stays put while other processes share the cores), else "wall"."""
    return "cpu" if threads == 1 and device == "cpu" else "wall"


def clock_of(args):
    """The clock the command's --clock names, for the device its runner runs on (as generate's)."""
    return default_clock(args.threads, device_of(args)) if args.clock == "auto" else args.clock


def fit_table(fit, host):
    lines = ["  host fit: %.3f ms per step + %.4f ms per node + %.3f ms per drafter call"
             % (host["per_step_ms"], host["per_node_ms"], host["per_drafter_call_ms"]),
             "  tree                       nodes depth  measured ms  engine calls ms  model ms  error"]
    for r in fit:
        lines.append(f"  {r['tree'][:26]:<26} {r['nodes']:>5} {r['depth']:>5} {r['measured_step_ms']:>12.3f} "
                     f"{r['engine_calls_ms']:>16.3f} {r['model_step_ms']:>9.3f} {100 * r['error']:>5.1f}%")
    return "\n".join(lines)


def machine():
    info = {"platform": platform.platform(), "cpus": os.cpu_count(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    return info
