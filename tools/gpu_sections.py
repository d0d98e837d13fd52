"""The GPU check's sections (python -m lantern.tools.gpu_check runs them; its docstring lists
them): what is measured on one opened engine against ONNX Runtime on the CPU (exactness,
numerics, latency, throughput) and the per-backend sections that open it (the torch reference,
ONNX Runtime's CUDA provider, onnxruntime-torch, the whole step on the device). A section that
does not apply here raises Skip with the reason; a measurement that fails is one line
(`one_line`) and the others still run. The TensorRT sections: lantern.tools.gpu_tensorrt.
"""
import numpy as np

from lantern.export.check_cases import check_cases
from lantern.export.check_compare import _compare_float
from lantern.runtime.backends import ONNXRUNTIME
from lantern.runtime.backends.torch import TorchBackend
from lantern.runtime.generator import Engine
from lantern.runtime.manifest import read_manifest
from lantern.runtime.plan import Call
from lantern.tools.bench.device_step import device_acceptance, step_backend, step_kernels, step_timing
from lantern.tools.latency import default_condition, verify_latency


def one_line(e):
    """An exception as the one line the report keeps."""
    return " ".join(f"{type(e).__name__}: {e}".split())[:2000]


class Skip(Exception):
    """A section that does not apply here; its message says why."""


def cuda_visible():
    """The GPU torch sees ("NVIDIA H200, SM90"), or None."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return f"{torch.cuda.get_device_name(0)}, SM{major}{minor}"


def needs_device(device):
    """Skip unless torch can run on `device` (the CPU always can: --device cpu's dry run)."""
    if device == "cuda" and cuda_visible() is None:
        raise Skip("torch sees no CUDA device")


def classes_for(engine, n):
    """Condition inputs for n images (classes for LlamaGen c2i, else latency's defaults)."""

    c = engine.manifest.condition
    if c.kind == "class":
        return {"classes": [(7 * i) % c.num_classes for i in range(n)]}
    return default_condition(engine.manifest, n)


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

    rng = np.random.default_rng(0)
    worst = {}
    fixed = getattr(engine.backend, "call_shapes", None)  # tensorrt: only its profiles' shapes
    for graph in engine.manifest.graphs:
        for case, feeds in check_cases(graph, engine.manifest, rng, fixed(graph) if fixed else None):
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
    """L(T) of the target's verification call (tensorrt: the T its plans' profiles serve)."""

    plans = getattr(engine.backend, "plans", None)
    if plans is not None and "target" in plans.plans:  # exact profiles: the one-image T they were built for
        served = {p.shapes["input_ids"]["opt"][1] for p in plans.plans["target"].profiles
                  if p.shapes["input_ids"]["opt"][0] == 1}
        tokens = tuple(t for t in tokens if t in served) or tuple(sorted(served))
    capacity = (engine.manifest.condition.tokens or 8) + engine.manifest.image.tokens
    curve = verify_latency(engine, tokens, images=1, context=min(256, capacity - max(tokens)), repeats=repeats)
    base = curve[tokens[0]]
    return {"ms": {str(t): round(1000 * v, 4) for t, v in curve.items()},
            "ratio_vs_T1": {str(t): round(v / base, 3) for t, v in curve.items()}}


JACOBI_WINDOW = 16  # on a GPU a 16-token verification costs about one token's: the step compression is the speed-up


def throughput(engine, batches, repeats, lam=5.0, k=20):
    """Per batch, `ar`, `exact` and `lantern++` with the engine's drafter (where it has one), and
    the drafter-free jacobi proposer's `exact` and `lantern++` at JACOBI_WINDOW slots."""
    out = {}
    relaxed = dict(mode="lantern++", lam=lam, k=min(k, engine.neighbors.shape[1])) if engine.neighbors is not None \
        else None
    jacobi = dict(proposer="jacobi", window=JACOBI_WINDOW)
    modes = [("ar", dict(mode="ar"))]
    if "exact" in engine.manifest.modes:
        modes += [("exact", dict(mode="exact"))] + ([("lantern++", relaxed)] if relaxed else [])
    modes += [("jacobi exact", dict(mode="exact", **jacobi))] + ([("jacobi lantern++", dict(relaxed, **jacobi))]
                                                                 if relaxed else [])
    for batch in batches:
        row = {}
        for mode, extra in modes:
            kw = dict(**classes_for(engine, batch), cfg_scale=3.0, **extra)
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


def measure(engine_dir, engine, cpu, tokens, batches, repeats, numerics_too=True):
    """The measurements of one opened GPU engine against ONNX Runtime CPU (`cpu`, or None); a
    measurement that fails is one line and the others still run."""
    parts = {"latency_verify": lambda: latency(engine, tokens, repeats),
             "throughput": lambda: throughput(engine, batches, max(2, repeats // 2))}
    if cpu is not None:
        parts = {"exactness": lambda: exactness(engine, cpu),
                 **({"numerics_vs_onnxruntime_cpu": lambda: numerics(engine, cpu)} if numerics_too else {}), **parts}
    out = {}
    for name, fn in parts.items():
        try:
            out[name] = fn()
        except Exception as e:
            out[name] = {"error": one_line(e)}
    return out


def torch_reference(engine_dir, reference, opts, cuda_graphs, device):
    needs_device(device)
    from lantern.export.onnx_export import load_graph_modules
    from lantern.export.torch_backend import open_torch_backend

    if cuda_graphs:
        backend = open_torch_backend(engine_dir, device=device)
    else:
        manifest = read_manifest(engine_dir)
        modules = {name: module for name, (_, module) in load_graph_modules(manifest).items()}
        backend = TorchBackend(modules, manifest, device=device, cuda_graphs=False)
    return measure(engine_dir, Engine(engine_dir, backend=backend), reference(), *opts, numerics_too=cuda_graphs)


def _needs_ort_cuda():
    try:
        import onnxruntime as ort
    except ImportError:
        raise Skip("onnxruntime is not installed") from None
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise Skip("ONNX Runtime has no CUDAExecutionProvider here (pip install 'lantern[gpu]' instead of the CPU "
                   "wheel, on a host with an NVIDIA driver)")


def onnxruntime_cuda(engine_dir, reference, opts):
    _needs_ort_cuda()
    return measure(engine_dir, Engine(engine_dir, backend=ONNXRUNTIME.name, device="cuda"), reference(), *opts)


def onnxruntime_torch(engine_dir, batches, device):
    """ONNX Runtime inside the torch backend (onnxruntime-torch; its CUDA provider on CUDA): the
    host step against the whole step on the device, the sessions chained through torch's tensors."""
    needs_device(device)
    if device == "cuda":
        _needs_ort_cuda()
    from lantern.export.torch_backend import open_onnxruntime_torch_backend

    return step_timing(engine_dir, batches=batches, backend=open_onnxruntime_torch_backend(engine_dir, device=device))


def device_step_section(engine_dir, batches, cuda_graphs, device="cuda", modes=("ar", "exact", "lantern++"),
                        threads=None, **options):
    """The whole step on the device vs on the host, torch backend on `device` (tools/bench/
    device_step.step_timing): one CUDA graph per step (cuda_graphs) or the same step eagerly; ms
    per AR and speculative step, host share; with cuda_graphs, the kernels one step's graph
    replays per mode (step_kernels: with the ms, the cost per kernel). options (step_timing's):
    for tests on the CPU."""
    needs_device(device)
    backend = step_backend(engine_dir, device, cuda_graphs, threads)
    out = step_timing(engine_dir, batches=batches, modes=modes, backend=backend, **options)
    if cuda_graphs:  # a failed count must not cost the timings above
        try:
            out["kernels_per_step"] = step_kernels(engine_dir, backend, modes, images=batches[0])
        except Exception as e:
            out["kernels_per_step"] = {"error": one_line(e)}
    return out


def device_acceptance_section(batches, repeats, device="cuda"):
    """Acceptance on the device vs the logits copied to the host and numpy, GPT-B shapes."""
    needs_device(device)
    return {"runs": device_acceptance(device, batches, repeats)}
