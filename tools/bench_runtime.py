"""Runtime benchmark on a GPT-B-shaped engine (random weights), ONNX Runtime CPU. Prints JSON.

  python -m lantern.tools.bench_runtime [--model GPT-B] [--threads 2] [--engine DIR]

Measures, in one run on one machine:
  latency_curve   target engine latency L(T) for T new tokens at a context of ~256 cached tokens
                  (median of repeats), and L(T) / L(1);
  cache_scaling   a one-token step at different cache fill levels and capacities: the runtime
                  passes the preallocated cache in place, so time must not grow with how full it
                  is, and only attention's own cost grows with capacity;
  generation      one image with `ar` and with `exact` (greedy) through the real decoding loop:
                  time per phase, engine time vs host time (goal: host <= 10% of a step).
Random weights make drafts rarely accepted, so speedups here mean nothing; the demo engine shows
those. The engine is exported once into --engine (default: a temporary directory).
"""
import argparse
import json
import os
import tempfile
import time

import numpy as np

from lantern.runtime.manifest import cache_feeds


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


def median_time(fn, repeats):
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def target_feeds(engine, T, filled, capacity, batch=1):
    e = engine
    dt = e.backend.float_dtype
    dim = e.config["dim"]
    cache = np.zeros((e.n_layer, batch, e.kv_heads, capacity, e.head_dim), dtype=dt)
    mask = np.zeros((batch, 1, T, capacity + T), dtype=bool)
    mask[..., :filled] = True
    mask[..., capacity:] = np.tril(np.ones((T, T), dtype=bool))
    return {"inputs_embeds": np.random.default_rng(0).normal(size=(batch, T, dim)).astype(dt) * 0.02,
            "position_ids": np.broadcast_to(np.minimum(filled + np.arange(T), e.max_positions - 1), (batch, T)).copy(),
            "attention_mask": mask, **cache_feeds(cache, cache.copy())}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="GPT-B")
    p.add_argument("--tree", default="naive_extend_57")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--engine", help="reuse or create the engine here")
    p.add_argument("--plot", help="also draw the latency curve L(T) and L(T)/L(1) to this PNG")
    args = p.parse_args(argv)

    from lantern.runtime.generator import Engine

    workdir = args.engine or tempfile.mkdtemp(prefix="lantern-bench-")
    engine_dir = os.path.join(workdir, "engine")
    export_seconds = None
    if not os.path.exists(os.path.join(engine_dir, "manifest.json")):
        engine_dir, export_seconds = build_engine(workdir, args.model, args.tree, args.threads)
    engine = Engine(engine_dir, threads=args.threads)
    run = engine.backend.run
    capacity = engine.cls + engine.block_size
    context = min(256, capacity - 64)

    curve = {}
    for T in (1, 2, 4, 8, 16, 26, 58):
        feeds = target_feeds(engine, T, context, capacity)
        curve[T] = median_time(lambda: run("target", feeds), args.repeats)
    base = curve[1]

    scaling = {}
    for filled in (16, 128, capacity - 1):
        feeds = target_feeds(engine, 1, filled, capacity)
        scaling[f"capacity_{capacity}_filled_{filled}"] = median_time(lambda: run("target", feeds), args.repeats)
    big = 4 * capacity
    feeds = target_feeds(engine, 1, 128, big)
    scaling[f"capacity_{big}_filled_128"] = median_time(lambda: run("target", feeds), args.repeats)

    generation = {}
    for mode in ("ar", "exact"):
        s = engine.generate(mode=mode, greedy=True, classes=[207]).stats
        steps = s["steps_per_image"]
        generation[mode] = {
            "seconds": round(s["seconds"], 3), "steps": steps, "mean_accepted_length": round(s["mean_accepted_length"], 3),
            "ms_per_step": round(1000 * s["seconds"] / (steps + 1), 2),
            "engine_seconds": round(s["engine_seconds"], 3), "engine_calls": s["engine_calls"],
            "host_seconds": round(s["host_overhead_seconds"], 3),
            "host_fraction_of_step": round(s["host_overhead_seconds"] / s["seconds"], 4),
            "phase_seconds": {k: round(v, 3) for k, v in s["phase_seconds"].items()},
        }
    report = {
        "benchmark": "lantern runtime, ONNX Runtime CPU",
        "model": args.model, "tree": args.tree, "threads": args.threads, "dtype": engine.manifest["dtype"],
        "random_weights": True, "export_seconds": export_seconds, "context": context, "cache_capacity": capacity,
        "latency_ms": {str(T): round(1000 * v, 2) for T, v in curve.items()},
        "latency_ratio_vs_T1": {str(T): round(v / base, 2) for T, v in curve.items()},
        "one_token_step_ms_by_cache": {k: round(1000 * v, 2) for k, v in scaling.items()},
        "generation_one_image": generation,
        "goal_host_fraction_max": 0.10,
        "host_goal_met": all(g["host_fraction_of_step"] <= 0.10 for g in generation.values()),
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
