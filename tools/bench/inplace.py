"""Plain against in-place graphs of one GPT-B-shaped model (random weights), on ONNX
Runtime CPU, and TensorRT-RTX builds of the in-place fp16 graphs. Prints JSON.

  python -m lantern.tools.bench.inplace [--model GPT-B] [--threads 2] [--workdir DIR] [--trt 89]

Measures, in one run on one machine, for the same checkpoints exported twice (fp32,
`--attention plain` and `--attention inplace --max-tree-nodes 58`):
  latency_ms      the target's verification call L(T), T = 1, 26, 58, at a context of 192
                  cached tokens (median of --repeats rounds, the two forms' calls interleaved in
                  each round, through real bound step plans): plain attends
                  over its cache (condition + image tokens: 257 slots) plus the T new tokens,
                  in place over its whole static cache (1 + 256 + 58 = 315 slots, the new tokens
                  among them) and writes their K/V into it;
  generation      one image, `ar` and `exact` (greedy, mc_sim_7b_63, no CFG) through the real
                  decoding loop with bound plans, forms interleaved, medians over --repeats / 3
                  rounds: per step, the engine calls' time, the host's
                  time outside them, and the commit phase (plain: copies of the accepted K/V on
                  the host; inplace: the commit graph, also an engine run, counted in the phase);
--trt CC also exports the in-place graphs in fp16 and builds target, drafter and commit plans for
that compute capability with TensorRT-RTX (one exact profile per call regime of a one-image CFG
step plan): build seconds, plan bytes, fused layers per graph. Random weights: acceptance is
meaningless here, the per-step costs are not.
"""
import argparse
import json
import os
import tempfile
import time

import numpy as np

from lantern.export.tensorrt_build import build_plan, exact_profile
from lantern.runtime.generator import Engine
from lantern.runtime.plan import StepPlan
from lantern.tools.latency import plan_for, verify_tree


def write_checkpoints(directory, model):
    import torch

    from lantern.export import checkpoints, llamagen

    src = os.path.join(directory, "src")
    if os.path.exists(os.path.join(src, "drafter")):
        return src
    os.makedirs(src, exist_ok=True)
    torch.manual_seed(0)
    args = llamagen.make_config(model)
    target = llamagen.init_random(llamagen.Transformer(args))
    checkpoints.save_llamagen_pt(target, os.path.join(src, "gpt.pt"))
    drafter = llamagen.init_random(llamagen.Drafter(llamagen.DrafterArgs.for_target(args)), seed=1)
    checkpoints.save_drafter(drafter, os.path.join(src, "drafter"), fmt="safetensors")
    return src


def export(directory, name, src, model, **options):
    from lantern.export.onnx_export import export_engine

    out = os.path.join(directory, name)
    if os.path.exists(os.path.join(out, "manifest.json")):
        return out, None
    t = time.perf_counter()
    export_engine(out, os.path.join(src, "gpt.pt"), target_options={"name": model}, drafter=os.path.join(src, "drafter"),
                  tree="mc_sim_7b_63", candidates=16, **options)
    return out, round(time.perf_counter() - t, 1)


def verify_calls(engines, tokens, context, rng):
    """{(form, T): (engine, bound verify call)} with `context` cache slots filled."""
    calls = {}
    for form, engine in engines.items():
        for T in tokens:
            plan = plan_for(engine, verify_tree(T), 1, 1.0, context)
            call = plan.calls["verify"]
            call.feeds["input_ids"][:] = rng.integers(0, engine.manifest.vocabulary.size, call.feeds["input_ids"].shape)
            call.feeds["position_ids"][:] = np.minimum(plan.target_cache.length[:, None] + np.arange(T),
                                                       engine.manifest.max_positions - 1)
            plan.target_cache.mask_into(call)
            engine.backend.run(call)  # warm-up
            calls[(form, T)] = (engine, call)
    return calls


def interleaved_latency(calls, rounds):
    """Median seconds per (form, T), the forms' runs interleaved round by round so that a shared
    machine's changing load falls on both alike."""
    times = {key: [] for key in calls}
    for _ in range(rounds):
        for key, (engine, call) in calls.items():
            t = time.perf_counter()
            engine.backend.run(call)
            engine.backend.synchronize()
            times[key].append(time.perf_counter() - t)
    return {key: float(np.median(v)) for key, v in times.items()}


def interleaved_generation(engines, modes, rounds):
    """Per form and mode, the medians over rounds of one image's per-step costs (forms interleaved)."""
    samples = {}
    for form, engine in engines.items():
        for mode in modes:
            engine.generate(mode=mode, greedy=True, classes=[207])  # warm-up: plan, bindings
    for _ in range(rounds):
        for mode in modes:
            for form, engine in engines.items():
                s = engine.generate(mode=mode, greedy=True, classes=[207]).stats
                steps = s["steps_per_image"]
                samples.setdefault((form, mode), []).append(
                    (s["seconds"] / steps, s["engine_seconds"] / steps, s["host_overhead_seconds"] / steps,
                     s["phase_seconds"]["commit"] / steps, steps, s["engine_calls_per_step"]))
    out = {}
    for (form, mode), rows in samples.items():
        med = np.median(np.array(rows), axis=0)
        out.setdefault(form, {})[mode] = {
            "ms_per_step": round(1000 * med[0], 2), "engine_ms_per_step": round(1000 * med[1], 2),
            "host_ms_per_step": round(1000 * med[2], 3), "commit_ms_per_step": round(1000 * med[3], 3),
            "steps": int(med[4]), "engine_calls_per_step": round(float(med[5]), 2)}
    return out


def trt_builds(engine_dir, cc):
    engine = Engine(engine_dir, threads=1)
    prefix = engine.condition.prefix(True, classes=[207])
    plan = StepPlan(engine.manifest, engine.backend, engine.tree, prefix,
                    dict(cfg_scale=4.0, temperature=1.0, top_k=0, top_p=1.0))
    out = {}
    for graph in ("target", "drafter", "commit"):
        profiles = [exact_profile(shapes) for g, shapes in plan.shapes().values() if g == graph]
        try:
            blob, record = build_plan(os.path.join(engine_dir, f"{graph}.onnx"), profiles, flavor="tensorrt-rtx",
                                      compute_capabilities=[cc])
            out[graph] = {"built": True, "profiles": len(profiles), "build_seconds": record["build_seconds"],
                          "plan_bytes": len(blob), "fused_layers": record["fused_layers"]}
        except Exception as e:  # report the failure, measure the rest
            out[graph] = {"built": False, "error": str(e)[:300]}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="GPT-B")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--workdir", help="keep (and reuse) checkpoints and engines here")
    p.add_argument("--trt", metavar="CC", help="also build the in-place fp16 graphs for this compute capability")
    args = p.parse_args(argv)

    import torch


    torch.set_num_threads(args.threads)
    workdir = args.workdir or tempfile.mkdtemp(prefix="lantern-inplace-")
    src = write_checkpoints(workdir, args.model)
    report = {"benchmark": "plain vs in-place graphs, ONNX Runtime CPU (forms interleaved)", "model": args.model,
              "threads": args.threads, "random_weights": True, "context": 192, "export_seconds": {}}
    forms = {"plain": dict(), "inplace": dict(attention="inplace", max_tree_nodes=58)}
    engines = {}
    for form, options in forms.items():
        engine_dir, seconds = export(workdir, f"{form}-fp32", src, args.model, **options)
        report["export_seconds"][form] = seconds
        engines[form] = Engine(engine_dir, threads=args.threads)
    report["inplace_cache"] = engines["inplace"].manifest.inplace_cache.__dict__
    tokens = (1, 26, 58)
    latency = interleaved_latency(verify_calls(engines, tokens, 192, np.random.default_rng(0)), args.repeats)
    report["latency_ms"] = {form: {str(T): round(1000 * latency[(form, T)], 2) for T in tokens} for form in forms}
    report["inplace_over_plain"] = {str(T): round(latency[("inplace", T)] / latency[("plain", T)], 3) for T in tokens}
    report["generation_one_image"] = interleaved_generation(engines, ("ar", "exact"), max(1, args.repeats // 3))
    engines.clear()
    if args.trt:
        engine_dir, seconds = export(workdir, "inplace-fp16", src, args.model, dtype="fp16", attention="inplace")
        report["tensorrt_rtx"] = {"compute_capability": args.trt, "export_seconds": seconds,
                                  "graphs": trt_builds(engine_dir, args.trt)}
    print(json.dumps(report, indent=2, default=lambda v: v.item() if isinstance(v, np.generic) else str(v)))


if __name__ == "__main__":
    main()
