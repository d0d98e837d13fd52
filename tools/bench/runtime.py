"""What only this measures: that a step's time and host allocations stay flat as the cache fills,
and IOBinding against plain session.run, on a GPT-B-shaped engine (random weights), ONNX Runtime
CPU. Prints JSON. A step's phases, L(T) and the speed-up over ar are `lantern-run profile`'s.

  python -m lantern.tools.bench.runtime [--model GPT-B] [--threads 2] [--engine DIR] [--plot PNG]

Measures, in one run on one machine:
  latency_curve   the target's verification call L(T) for T new tokens at a context of ~256
                  cached tokens (median of repeats, through real step plans), and L(T) / L(1);
  cache_fill      a one-token step at different cache fill levels: the plan's buffers are read in
                  place, so time must not grow with how full the cache is;
  generation      one image with `ar` and `exact` (greedy, --tree) through the real decoding
                  loop, on ONNX Runtime with IOBinding (bound plan buffers) and without (plain
                  session.run): time per phase, engine calls per step, host time outside engine
                  calls as a share of the run (goal: <= 5%), and the peak bytes a step allocates
                  on the host after warm-up (tracemalloc; goal: nothing that grows with the cache
                  or the vocabulary).
Random weights make drafts rarely accepted, so speedups here mean nothing; the demo engine shows
those. The engine is exported once into --engine (default: a temporary directory).
"""
import argparse
import json
import os
import tempfile
import time
import tracemalloc

import numpy as np

from lantern.runtime.generator import Engine
from lantern.tools.latency import verify_latency


def build_engine(directory, model, tree, threads):
    import torch

    from lantern.export import checkpoints, llamagen
    from lantern.export.onnx_export import export_engine

    torch.set_num_threads(threads)
    args = llamagen.make_config(model)
    src = os.path.join(directory, "src")
    os.makedirs(src, exist_ok=True)
    target = llamagen.init_random(llamagen.Transformer(args))
    checkpoints.save_llamagen_pt(target, os.path.join(src, "gpt.pt"))
    drafter = llamagen.init_random(llamagen.Drafter(llamagen.DrafterArgs.for_target(args)), seed=1)
    checkpoints.save_drafter(drafter, os.path.join(src, "drafter"), fmt="safetensors")
    del target, drafter
    out = os.path.join(directory, "engine")
    t = time.perf_counter()
    export_engine(out, os.path.join(src, "gpt.pt"), target_options={"name": model}, drafter=os.path.join(src, "drafter"),
                  tree=tree, candidates=16, progress=True)
    return out, time.perf_counter() - t


class StepAllocations:
    """Observer: the host's peak traced allocation between consecutive steps (tracemalloc)."""

    def __init__(self):
        self.peaks = []

    def __call__(self, record):
        current, peak = tracemalloc.get_traced_memory()
        if record.step > 0:
            self.peaks.append(peak - self.base)
        tracemalloc.reset_peak()
        self.base = current


def generation(engine, mode, tree, cfg):
    kw = dict(mode=mode, greedy=True, classes=[207 % engine.manifest.condition.num_classes], cfg_scale=cfg, tree=tree)
    engine.generate(**kw)  # warm up (plan, bindings, sessions)
    s = engine.generate(**kw).stats
    allocations = StepAllocations()
    tracemalloc.start()
    engine.generate(observer=allocations, **kw)
    tracemalloc.stop()
    steps = s["steps_per_image"]
    peaks = allocations.peaks[3:]
    return {
        "seconds": round(s["seconds"], 3), "steps": steps, "mean_accepted_length": round(s["mean_accepted_length"], 3),
        "ms_per_step": round(1000 * s["seconds"] / steps, 2),
        "engine_calls_per_step": round(s["engine_calls_per_step"], 2),
        "engine_seconds": round(s["engine_seconds"], 3), "host_seconds": round(s["host_overhead_seconds"], 3),
        "host_fraction": round(s["host_overhead_seconds"] / s["seconds"], 4),
        "phase_seconds": {k: round(v, 3) for k, v in s["phase_seconds"].items()},
        "step_host_peak_bytes_median": int(np.median(peaks)) if peaks else None,
        "step_host_peak_bytes_max": int(max(peaks)) if peaks else None,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="GPT-B")
    p.add_argument("--tree", default="mc_sim_7b_63", help="tree of the `exact` generation (default mc_sim_7b_63)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--cfg-scale", type=float, default=1.0, help="CFG scale of the generations (batch 2 rows when > 1)")
    p.add_argument("--engine", help="reuse or create the engine here")
    p.add_argument("--plot", help="also draw the latency curve L(T) and L(T)/L(1) to this PNG")
    args = p.parse_args(argv)


    workdir = args.engine or tempfile.mkdtemp(prefix="lantern-bench-")
    engine_dir = os.path.join(workdir, "engine")
    export_seconds = None
    if not os.path.exists(os.path.join(engine_dir, "manifest.json")):
        engine_dir, export_seconds = build_engine(workdir, args.model, "mc_sim_7b_63", args.threads)
    engine = Engine(engine_dir, threads=args.threads)
    capacity = (engine.manifest.condition.tokens or 8) + engine.manifest.image.tokens
    context = min(256, capacity - 65)

    curve = verify_latency(engine, (1, 2, 4, 8, 16, 26, 58), context=context, repeats=args.repeats)
    base = curve[1]
    fill = {f"filled_{n}": verify_latency(engine, (1,), context=n, repeats=args.repeats)[1]
            for n in (16, 128, capacity - 1)}

    generations = {}
    for binding in (True, False):
        e = engine if binding else Engine(engine_dir, threads=args.threads, io_binding=False)
        generations["iobinding" if binding else "plain"] = {
            mode: generation(e, mode, args.tree if mode != "ar" else None, args.cfg_scale) for mode in ("ar", "exact")}
    report = {
        "benchmark": "lantern runtime, ONNX Runtime CPU",
        "model": args.model, "tree": args.tree, "threads": args.threads, "dtype": engine.manifest.dtype,
        "cfg_scale": args.cfg_scale, "random_weights": True, "export_seconds": export_seconds, "context": context,
        "cache_capacity": capacity,
        "latency_ms": {str(T): round(1000 * v, 2) for T, v in curve.items()},
        "latency_ratio_vs_T1": {str(T): round(v / base, 2) for T, v in curve.items()},
        "one_token_step_ms_by_fill": {k: round(1000 * v, 2) for k, v in fill.items()},
        "generation_one_image": generations,
        "goal_host_fraction_max": 0.05,
        "host_goal_met": all(g["host_fraction"] <= 0.05 for g in generations["iobinding"].values()),
    }
    print(json.dumps(report, indent=2))
    if args.plot:
        _plot(args.plot, curve, report)


def _plot(path, curve, report):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = sorted(curve)
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(tokens, [1000 * curve[t] for t in tokens], marker="o")
    ax.set_xlabel("tokens per target call (T): 1 = AR step, root + tree nodes = verification")
    ax.set_ylabel("target step (ms)")
    base = 1000 * curve[1]
    right = ax.secondary_yaxis("right", functions=(lambda ms: ms / base, lambda r: r * base))
    right.set_ylabel("L(T) / L(1): accepted length to break even")
    ax.set_title(f"{report['model']} on ONNX Runtime CPU, {report['threads']} threads, context {report['context']}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
