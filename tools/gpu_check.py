"""GPU check: everything a GPU host should confirm about lantern's GPU backends, as JSON.

  python -m lantern.tools.gpu_check [ENGINE ...] [--demo] [--gpt GPT-B] [--out report.json]

For every engine (the bundled demo model with --demo, a random-weight LlamaGen of --gpt's shape
exported in fp16, and/or engine directories given) and every GPU backend present here (torch on
CUDA with and without CUDA graphs; ONNX Runtime's CUDA provider and TensorRT when installed):
  exactness       greedy `exact` == greedy `ar` token for token (CFG on), and token agreement
                  with ONNX Runtime on the CPU
  numerics        worst error per output against ONNX Runtime CPU over `check`'s cases
  latency         the target's verification call L(T) for T = 1 .. 64 at a mid-generation
                  cache (median of repeats, through real step plans)
  throughput      images/s for `ar`, `exact` and `lantern++` (sampling, CFG 3) at batch 1
                  and a batch, with and without CUDA graphs, and what a speculative step costs
                  in AR steps
It prints one JSON object per section as it goes (so a run cut short still says what it
measured) and the whole report at the end. Prepared to fit in a few minutes on one GPU.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np


def emit(report, key, value, out):
    report[key] = value
    print(json.dumps({key: value}), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=2)


def gpu_backends(engine_dir):
    """{label: backend factory} for the GPU backends available on this host."""
    import torch

    from lantern.export.onnx_export import open_torch_backend

    found = {}
    if torch.cuda.is_available():
        found["torch-cuda-graphs"] = lambda: open_torch_backend(engine_dir, device="cuda")
        found["torch-cuda-eager"] = lambda: _torch_eager(engine_dir)
    try:
        import onnxruntime as ort

        if "CUDAExecutionProvider" in ort.get_available_providers():
            found["onnxruntime-cuda"] = lambda: "onnxruntime"
    except ImportError:
        pass
    return found


def _torch_eager(engine_dir):
    from lantern.export.onnx_export import load_graph_modules
    from lantern.runtime.backends.torch import TorchBackend
    from lantern.runtime.manifest import read_manifest

    manifest = read_manifest(engine_dir)
    modules = {name: module for name, (_, module) in load_graph_modules(manifest).items()}
    return TorchBackend(modules, manifest, device="cuda", cuda_graphs=False)


def open_engine(engine_dir, label, factory):
    from lantern.runtime.generator import Engine

    backend = factory()
    if label == "onnxruntime-cuda":
        return Engine(engine_dir, backend="onnxruntime", device="cuda")
    return Engine(engine_dir, backend=backend)


def classes_for(engine, n):
    """Condition inputs for n images (classes for LlamaGen c2i, else latency's defaults)."""
    from lantern.tools.latency import default_condition

    c = engine.manifest.condition
    if c.kind == "class":
        return {"classes": [(7 * i) % c.num_classes for i in range(n)]}
    return default_condition(engine, n)


def exactness(engine, cpu, n=4):
    kw = dict(**classes_for(engine, n), greedy=True, cfg_scale=3.0)
    ar = engine.generate(mode="ar", **kw).tokens
    exact = engine.generate(mode="exact", **kw).tokens
    cpu_ar = cpu.generate(mode="ar", **kw).tokens
    return {"greedy_exact_equals_ar": bool(np.array_equal(ar, exact)),
            "tokens_equal_fraction_vs_onnxruntime_cpu": float((ar == cpu_ar).mean()),
            "first_token_differing_vs_cpu": int(np.argmax((ar != cpu_ar).any(axis=0))) if (ar != cpu_ar).any() else None}


def numerics(engine, cpu):
    """Worst error per graph output against ONNX Runtime CPU over check's cases."""
    from lantern.export.check import _compare_float, check_cases
    from lantern.runtime.plan import Call

    rng = np.random.default_rng(0)
    worst = {}
    for graph in engine.manifest.graphs:
        for case, feeds in check_cases(graph, engine.manifest, rng):
            call = Call(graph, case, feeds)
            got = {k: engine.backend.numpy(v) for k, v in engine.backend.run(call).items()}
            want = {k: cpu.backend.numpy(v) for k, v in cpu.backend.run(call).items()}
            for name, value in want.items():
                if value.dtype == np.int64:
                    continue
                r = _compare_float(got[name], value, 0.0, 0.0)
                key = f"{graph}/{name}"
                if key not in worst or r["max_abs"] > worst[key]["max_abs"]:
                    worst[key] = {"max_abs": r["max_abs"], "max_rel": r["max_rel"], "case": case}
    return worst


def latency(engine, tokens, repeats):
    from lantern.tools.latency import verify_latency

    capacity = (engine.manifest.condition.tokens or 8) + engine.manifest.image.tokens
    curve = verify_latency(engine, tokens, images=1, context=min(256, capacity - max(tokens)), repeats=repeats)
    base = curve[tokens[0]]
    return {"ms": {str(t): round(1000 * v, 4) for t, v in curve.items()},
            "ratio_vs_T1": {str(t): round(v / base, 3) for t, v in curve.items()}}


def throughput(engine, batches, repeats, lam=5.0, k=20):
    out = {}
    modes = [("ar", {}), ("exact", {}), ("lantern++", dict(lam=lam, k=min(k, engine.neighbors.shape[1])))] \
        if engine.neighbors is not None else [("ar", {}), ("exact", {})]
    for batch in batches:
        row = {}
        for mode, extra in modes:
            kw = dict(**classes_for(engine, batch), cfg_scale=3.0, mode=mode, **extra)
            engine.generate(seed=99, **kw)  # warm up: plan, bindings, graph capture
            runs = [engine.generate(seed=s, **kw).stats for s in range(repeats)]
            seconds = float(np.median([s["seconds"] for s in runs]))
            steps = float(np.mean([s["steps_per_image"] for s in runs]))
            row[mode] = {"images_per_second": round(batch / seconds, 3), "seconds": round(seconds, 4),
                         "steps_per_image": round(steps, 2),
                         "mean_accepted_length": round(float(np.mean([s["mean_accepted_length"] for s in runs])), 3),
                         "ms_per_step": round(1000 * seconds / steps, 3),
                         "host_fraction": round(float(np.median([s["host_overhead_seconds"] / s["seconds"]
                                                                 for s in runs])), 3)}
        for mode in row:
            row[mode]["speedup_vs_ar"] = round(row["ar"]["seconds"] / row[mode]["seconds"], 3)
            row[mode]["step_cost_in_ar_steps"] = round(row[mode]["ms_per_step"] / row["ar"]["ms_per_step"], 3)
        out[f"batch{batch}"] = row
    return out


def export_demo(root):
    from lantern.tools.demo import DEMO_DIR, demo_sources
    from lantern.export.onnx_export import export_engine

    src = demo_sources(DEMO_DIR)
    out = os.path.join(root, "demo")
    export_engine(out, src["target"], target_options={"config_file": src["target_config"]}, drafter=src["drafter"],
                  vq=src["vq"], tree="mc_sim_7b_63")
    return out


def export_gpt(root, model, dtype):
    """A random-weight LlamaGen engine of `model`'s shape (weights don't matter for timings)."""
    import torch

    from lantern.export import checkpoints, llamagen
    from lantern.export.onnx_export import export_engine

    args = llamagen.make_config(model)
    src = os.path.join(root, "src")
    os.makedirs(src, exist_ok=True)
    checkpoints.save_llamagen_pt(llamagen.init_random(llamagen.Transformer(args)), os.path.join(src, "gpt.pt"))
    drafter = llamagen.init_random(llamagen.Drafter(llamagen.DrafterArgs.for_target(args)), seed=1)
    checkpoints.save_drafter(drafter, os.path.join(src, "drafter"), fmt="safetensors")
    out = os.path.join(root, model)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    export_engine(out, os.path.join(src, "gpt.pt"), target_options={"name": model},
                  drafter=os.path.join(src, "drafter"), tree="mc_sim_7b_63", dtype=dtype, candidates=64)
    return out


def check_engine_dir(label, engine_dir, report, out, tokens, batches, repeats, cpu_threads):
    from lantern.runtime.generator import Engine
    from lantern.runtime.manifest import read_manifest

    # ONNX Runtime's CPU provider runs fp32/fp16 engines: the reference for the GPU backends
    cpu = Engine(engine_dir, threads=cpu_threads) if read_manifest(engine_dir).dtype != "bf16" else None
    for name, factory in gpu_backends(engine_dir).items():
        key = f"{label}/{name}"
        try:
            t = time.perf_counter()
            engine = open_engine(engine_dir, name, factory)
            section = {"open_seconds": round(time.perf_counter() - t, 2)}
            if cpu is not None:
                section["exactness"] = exactness(engine, cpu)
                if name != "torch-cuda-eager":
                    section["numerics_vs_onnxruntime_cpu"] = numerics(engine, cpu)
            section["latency_verify"] = latency(engine, tokens, repeats)
            section["throughput"] = throughput(engine, batches, max(2, repeats // 2))
            emit(report, key, section, out)
        except Exception as e:  # a broken backend must not hide the others' results
            emit(report, key, {"error": f"{type(e).__name__}: {e}"}, out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engines", nargs="*", help="engine directories to check")
    p.add_argument("--demo", action="store_true", help="export and check the bundled demo model")
    p.add_argument("--gpt", help="export and check a random-weight LlamaGen of this shape (e.g. GPT-B) in --dtype")
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--cpu-threads", type=int, default=8)
    p.add_argument("--out", help="write the report here as it grows")
    args = p.parse_args(argv)

    import torch

    report = {}
    env = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        env.update(device=torch.cuda.get_device_name(0), capability=".".join(map(str, torch.cuda.get_device_capability(0))))
    emit(report, "environment", env, args.out)
    tokens = (1, 2, 4, 8, 16, 26, 32, 48, 58, 64)
    batches = [int(b) for b in args.batches.split(",")]
    root = tempfile.mkdtemp(prefix="lantern-gpu-")
    targets = [(os.path.basename(os.path.normpath(d)), d) for d in args.engines]
    if args.demo:
        t = time.perf_counter()
        targets.append(("demo", export_demo(root)))
        emit(report, "demo_export_seconds", round(time.perf_counter() - t, 1), args.out)
    if args.gpt:
        t = time.perf_counter()
        targets.append((f"{args.gpt}-{args.dtype}", export_gpt(root, args.gpt, args.dtype)))
        emit(report, "gpt_export_seconds", round(time.perf_counter() - t, 1), args.out)
    for label, engine_dir in targets:
        check_engine_dir(label, engine_dir, report, args.out, tokens, batches, args.repeats, args.cpu_threads)
    if torch.cuda.is_available():  # acceptance on the device vs logits to the host, GPT-B shapes
        from lantern.tools.bench.device_step import device_acceptance

        emit(report, "device_acceptance", device_acceptance("cuda", batches, max(args.repeats, 10)), args.out)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
