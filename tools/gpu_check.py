"""GPU check: one prepared command that tells a GPU host's first user whether lantern's GPU paths
work, as one JSON file.

  python -m lantern.tools.gpu_check [ENGINE ...] [--demo] [--gpt GPT-B[,GPT-XL]] [--demo-shape GPT-B]
                                    [--out gpu_check.json]
                                    [--budget-minutes 8] [--only SECTION,...] [--device cuda]

Engines: the engine directories given, random-weight LlamaGens of --gpt's shapes exported in
--dtype, the demo model embedded exactly in --demo-shape's shapes (lantern.export.embed: the demo's
trained drafts and acceptance at GPT-B's cost, so `throughput` measures a real speed-up over AR
beside the random engines' step costs) in --dtype, and/or the bundled demo model (--demo), in that
order, each exported just before its sections. For each engine, one section per backend, in this order (the whole step first: it is
what a short GPU window should measure before anything else):
  torch-cuda-step-graph / -eager         the whole step on the device (greedy, CFG 4; one CUDA graph
                                         per step, or eager) against the host step: ms per AR and
                                         speculative step, host share, batch 1 and the batch;
                                         step-graph also counts the kernels one step's graph
                                         replays per mode, by part (kernels_per_step)
  torch-cuda-graphs / torch-cuda-eager   the torch reference on CUDA, with and without CUDA graphs
  onnxruntime-cuda                       ONNX Runtime's CUDA execution provider
  onnxruntime-torch-cuda                 the same inside the torch backend: host step against the
                                         whole step on the device (ms per step, host share)
  tensorrt / tensorrt-rtx                full TensorRT and TensorRT for RTX: plans built here for
                                         this GPU (`lantern-export trt`), run with CUDA graphs on
                                         and off, and checked by Polygraphy (`check --against
                                         polygraphy-trt`, in a process of its own per flavor);
                                         step_paths: the host step against the device step (the
                                         greedy acceptance plan on the logits where they are) per
                                         mode and batch: ms, host ms, bytes each way, syncs, and
                                         tokens_sha1 (equal on both paths); tensorrt_torch: the
                                         same plans as the torch backend's modules (the whole
                                         step, TensorRT included, one CUDA graph), measured so
each measuring
  exactness       greedy `exact` == greedy `ar` token for token (CFG on), and token agreement
                  with ONNX Runtime on the CPU
  numerics        worst error per output against ONNX Runtime CPU over `check`'s cases
  latency         the target's verification call L(T) for T = 1 .. 64 at a mid-generation
                  cache (median of repeats, through real step plans)
  throughput      images/s, ms/step and host share for `ar`, `exact` and `lantern++` (sampling,
                  CFG 3) with the drafter's tree and with the drafter-free jacobi window (16
                  slots) at batch 1 and a batch, and what a speculative step costs in AR steps
A section that cannot run here says why ({"skipped": reason}); one that fails is one line
({"error": "..."}); the others still run. Sections past the time budget are skipped, so the
command ends within it. Without a GPU the GPU-less parts still run: the engines' export and
TensorRT-RTX plans built ahead of time for SM89 (build seconds, plan sizes).
--only runs the sections named (as above, "device_acceptance" too; the exports they need always
run): `--only torch-cuda-step-graph` measures the speculative step in AR steps and its host share
alone. --device cpu is a dry run of the torch sections: each (named torch-cpu-...,
onnxruntime-torch-cpu) runs its code on the CPU, which measures nothing about a GPU but shows,
before a GPU window is spent, that they work with the packages installed (use --dtype fp32
there: fp16 matmuls on a CPU crawl); the other sections run as they would without it.
It prints one JSON object per section as it goes (a run cut short still says what it measured),
rewrites --out after each, and prints the whole report at the end.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from lantern.export.check_cases import check_cases
from lantern.export.check_compare import _compare_float
from lantern.export.tensorrt_build import available_flavors, FLAVORS
from lantern.export.trt_export import build_engine_plans
from lantern.runtime.backends import ONNXRUNTIME, ONNXRUNTIME_TORCH, TENSORRT, TORCH
from lantern.runtime.backends.cuda import gpu_compute_capability
from lantern.runtime.backends.tensorrt_plans import rtx_targets
from lantern.runtime.backends.torch import TorchBackend
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.manifest import read_manifest
from lantern.runtime.plan import Call
from lantern.tools.bench.device_step import device_acceptance, step_backend, step_kernels, step_timing, whole_step
from lantern.tools.latency import default_condition, verify_latency

from lantern.tools.bench.device_step import export_gpt


def one_line(e):
    """An exception as the one line the report keeps."""
    return " ".join(f"{type(e).__name__}: {e}".split())[:2000]


class Skip(Exception):
    """A section that does not apply here; its message says why."""


class Report:
    """The report as it grows: one entry per section, written to `out` after each; sections
    started after the deadline are skipped."""

    def __init__(self, out, budget_seconds):
        self.out, self.data = out, {}
        self.deadline = time.monotonic() + budget_seconds

    def emit(self, key, value):
        self.data[key] = value
        print(json.dumps({key: value}), flush=True)
        if self.out:
            with open(self.out, "w") as f:
                json.dump(self.data, f, indent=2)

    def section(self, key, fn, *args):
        """Run one section: its dict, {"skipped": why} or {"error": one line}."""
        if time.monotonic() > self.deadline:
            self.emit(key, {"skipped": "time budget spent (--budget-minutes)"})
            return None
        start = time.perf_counter()
        try:
            value = fn(*args)
            value["seconds"] = round(time.perf_counter() - start, 1)
        except Skip as e:
            value = {"skipped": str(e)}
        except Exception as e:  # a broken backend must not hide the others' results
            value = {"error": one_line(e)}
        self.emit(key, value)
        return value


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


def environment(device):
    import importlib

    env = {"python": sys.version.split()[0], "gpu": cuda_visible(), "torch_device": device}
    for module in ("torch", "onnxruntime", "tensorrt", "tensorrt_rtx", "polygraphy", "cuda.bindings"):
        try:
            env[module] = getattr(importlib.import_module(module), "__version__", "installed")
        except ImportError:
            env[module] = None
    try:
        import onnxruntime as ort

        env["onnxruntime_providers"] = ort.get_available_providers()
    except ImportError:
        pass

    env["compute_capability"] = gpu_compute_capability()
    return env


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


def export_demo(root):
    from lantern.tools.demo import DEMO_DIR, demo_sources
    from lantern.export.onnx_export import export_engine

    src = demo_sources(DEMO_DIR)
    out = os.path.join(root, "demo")
    export_engine(out, src["target"], target_options={"config_file": src["target_config"]}, drafter=src["drafter"],
                  vq=src["vq"], tree="mc_sim_7b_63")
    return out


def export_demo_shape(root, shape, dtype):
    """The demo embedded in `shape` (checkpoints built in seconds), exported in `dtype`."""
    from lantern.export.embed import DEMO_DIR, write_embedded
    from lantern.export.onnx_export import export_engine

    src = write_embedded(DEMO_DIR, shape, os.path.join(root, f"demo-{shape}-checkpoints"))
    out = os.path.join(root, f"demo-{shape}-{dtype}")
    export_engine(out, src["target"], target_options={"config_file": src["target_config"]}, drafter=src["drafter"],
                  vq=src["vq"], tree="mc_sim_7b_63", dtype=dtype)
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


def _plan_copy(engine_dir, flavor, workdir, batches):
    """A copy of the engine with plans of `flavor` for this GPU (or SM89 ahead of time for
    tensorrt-rtx without one): (directory, build record)."""

    gpu = gpu_compute_capability()
    if flavor == "tensorrt-rtx" and gpu is not None and gpu not in rtx_targets():
        raise Skip(f"TensorRT for RTX does not target this GPU ({gpu}; it builds for {', '.join(sorted(rtx_targets()))})")
    cc = ["current"] if gpu is not None else ["89"]
    copy = os.path.join(workdir, f"{os.path.basename(os.path.normpath(engine_dir))}-{flavor}")
    if not os.path.isdir(copy):
        from lantern.export.accept_engine import add_acceptance_graphs  # torch: imported where it is needed

        shutil.copytree(engine_dir, copy)
        add_acceptance_graphs(copy, kinds=("greedy",))  # the device step's plan (kept if the engine has its own)
        start = time.perf_counter()
        build_engine_plans(copy, flavor=flavor, compute_capabilities=cc, batches=tuple(batches))
        seconds = time.perf_counter() - start
    else:
        seconds = None
    (key, build), = read_manifest(copy, verify=False).tensorrt.items()
    plans = {g: os.path.getsize(os.path.join(copy, p.file)) for g, p in build.plans.items()}
    return copy, {"plans": key, "version": build.version, "build_seconds": seconds and round(seconds, 1),
                  "plan_bytes": plans, "profiles": {g: len(p.profiles) for g, p in build.plans.items()}}


def tensorrt(engine_dir, reference, opts, flavor, workdir):
    if flavor not in available_flavors():
        raise Skip(f"{flavor} is not installed (pip install 'lantern[{flavor}]')")
    if flavor == "tensorrt" and gpu_compute_capability() is None:
        raise Skip("full TensorRT builds and runs on the GPU it serves; none is visible here")
    copy, out = _plan_copy(engine_dir, flavor, workdir, opts[1])
    if gpu_compute_capability() is None:
        out["run"] = "skipped: no NVIDIA GPU visible (the plans were built ahead of time for SM89; running one needs the GPU)"
        return out
    cpu = reference()

    for graphs in (True, False):
        label = "cuda_graphs" if graphs else "no_cuda_graphs"
        try:
            engine = Engine(copy, backend=TENSORRT.name, flavor=flavor, cuda_graphs=graphs)
            out[label] = measure(copy, engine, cpu, *opts, numerics_too=graphs)
        except Exception as e:
            out[label] = {"error": one_line(e)}
    try:  # host step vs the acceptance plan on the logits where they are (greedy, CFG 4): same tokens_sha1
        backend = Engine(copy, backend=TENSORRT.name, flavor=flavor).backend
        out["step_paths"] = whole_step(copy, batches=opts[1], samplings=(False,), backends={flavor: backend})
    except Exception as e:
        out["step_paths"] = {"error": one_line(e)}
    try:  # the plans as the torch backend's modules: the whole step, enqueues included, one CUDA graph
        from lantern.export.torch_backend import open_tensorrt_torch_backend  # torch: imported where needed

        backend = open_tensorrt_torch_backend(copy, flavor=flavor)
        engine = Engine(copy, backend=backend)
        out["tensorrt_torch"] = measure(copy, engine, cpu, *opts, numerics_too=False)
        engine.release()  # the plans' profiles go back to the backend for step_timing's engines
        out["tensorrt_torch"]["step_paths"] = step_timing(copy, batches=opts[1], backend=backend)
    except Exception as e:
        out["tensorrt_torch"] = {"error": one_line(e)}
    out["polygraphy"] = polygraphy_check(copy)
    out["polygraphy_inspect"] = inspect_plans(copy, flavor)
    return out


def inspect_plans(engine_dir, flavor):
    """`polygraphy inspect model PLAN` per plan: the engine's I/O per profile and its layers as
    TensorRT built them (which the manifest cannot say: what was fused, which tactics ran)."""

    (_, build), = read_manifest(engine_dir, verify=False).tensorrt.items()
    env = dict(os.environ, POLYGRAPHY_USE_TENSORRT_RTX="1" if flavor == "tensorrt-rtx" else "0")
    out = {}
    for graph, plan in build.plans.items():
        done = subprocess.run(["polygraphy", "inspect", "model", os.path.join(engine_dir, plan.file), "--model-type",
                               "engine", "--show", "layers"], capture_output=True, text=True, env=env, timeout=300)
        lines = (done.stdout or done.stderr).strip().splitlines()
        out[graph] = lines[:200] if done.returncode == 0 else {"error": " ".join(lines[-1:])[:2000]}
    return out


def polygraphy_check(engine_dir):
    """`lantern-export check --against polygraphy-trt` in a process of its own (Polygraphy binds
    one TensorRT flavor per process): ok, failures and the worst rows."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        done = subprocess.run([sys.executable, "-m", "lantern.export.cli", "check", engine_dir, "--against",
                               "polygraphy-trt", "--no-verify-hashes", "--json", f.name],
                              capture_output=True, text=True, timeout=600)
        if done.returncode not in (0, 1):
            return {"error": " ".join((done.stderr or done.stdout).strip().splitlines()[-1:])[:2000]}
        report = json.load(open(f.name))
    worst = {}
    for r in report["results"]:
        key = f"{r['graph']}/{r['output']} {r['case'].split(': ', 1)[-1]}"
        if "max_abs" in r and (key not in worst or r["max_abs"] > worst[key]["max_abs"]):
            worst[key] = {"max_abs": r["max_abs"], "bound": r["bound"], "ok": r["ok"]}
    return {"ok": report["ok"], "outputs_compared": len(report["results"]), "failures": report["failures"][:10],
            "worst": worst}


def section_names(device):
    """Each engine's sections in the order they run, for `device` (cuda, or cpu's dry run)."""
    t = f"{TORCH.name}-{device}"
    return [f"{t}-step-graph", f"{t}-step-eager", f"{t}-graphs", f"{t}-eager", f"{ONNXRUNTIME.name}-cuda",
            f"{ONNXRUNTIME_TORCH.name}-{device}", *FLAVORS]


def check_engine_dir(report, label, engine_dir, opts, cpu_threads, workdir, device="cuda", only=None):
    """One engine's sections (those in `only`, or all)."""
    opened = []

    def cpu():
        """ONNX Runtime's CPU provider on fp32/fp16 engines, the GPU backends' reference; opened at
        its first use (a section list without one never loads it), None for bf16."""
        if not opened:
            opened.append(Engine(engine_dir, threads=cpu_threads) if read_manifest(engine_dir).dtype != "bf16"
                          else None)
        return opened[0]

    step_graph, step_eager, graphs, eager, ort_cuda, ort_torch, trt, rtx = section_names(device)
    sections = {step_graph: (device_step_section, engine_dir, opts[1], True, device),
                step_eager: (device_step_section, engine_dir, opts[1], False, device),
                graphs: (torch_reference, engine_dir, cpu, opts, True, device),
                eager: (torch_reference, engine_dir, cpu, opts, False, device),
                ort_cuda: (onnxruntime_cuda, engine_dir, cpu, opts),
                ort_torch: (onnxruntime_torch, engine_dir, opts[1], device),
                trt: (tensorrt, engine_dir, cpu, opts, trt, workdir),  # named by their TensorRT flavors
                rtx: (tensorrt, engine_dir, cpu, opts, rtx, workdir)}
    for name, (fn, *args) in sections.items():
        if only is None or name in only:
            report.section(f"{label}/{name}", fn, *args)


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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engines", nargs="*", help="engine directories to check")
    p.add_argument("--demo", action="store_true", help="export and check the bundled demo model")
    p.add_argument("--gpt", help="export and check random-weight LlamaGens of these shapes (GPT-B, or GPT-B,GPT-XL) "
                                 "in --dtype")
    p.add_argument("--demo-shape", metavar="NAME",
                   help="export and check the demo model embedded exactly in this LlamaGen shape (GPT-B: trained "
                        "drafts at GPT-B's cost, a real speed-up over AR), in --dtype")
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--cpu-threads", type=int, default=8)
    p.add_argument("--budget-minutes", type=float, default=8.0,
                   help="sections that would start later are skipped (default 8)")
    p.add_argument("--out", help="write the report here as it grows")
    p.add_argument("--only", help="run only these sections, comma-separated (e.g. torch-cuda-step-graph)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="the torch sections' device (default cuda; cpu: a dry run of their code, measuring nothing)")
    args = p.parse_args(argv)
    known = section_names(args.device) + ["device_acceptance"]
    only = None if args.only is None else set(filter(None, args.only.split(",")))
    if only is not None and (not only or only - set(known)):
        p.error(f"--only: unknown section {', '.join(sorted(only - set(known))) or '(none given)'} "
                f"(sections with --device {args.device}: {', '.join(known)})")
    shapes = list(dict.fromkeys(g for g in (args.gpt or "").split(",") if g))
    if args.demo_shape is not None:
        from lantern.export.embed import DEMO_DIR, demo_sources, embedded_config
        from lantern.export.checkpoints import load_target

        src = demo_sources(DEMO_DIR)
        try:
            embedded_config(load_target(src["target"], config_file=src["target_config"])[0].args, args.demo_shape)
        except LanternError as e:
            p.error(f"--demo-shape: {e}")

    report = Report(args.out, 60 * args.budget_minutes)
    report.section("environment", environment, args.device)
    tokens = (1, 2, 4, 8, 16, 26, 32, 48, 58, 64)
    opts = (tokens, [int(b) for b in args.batches.split(",")], args.repeats)
    workdir = tempfile.mkdtemp(prefix="lantern-gpu-")
    try:
        # engines given, then the GPT shapes (the goal's), the embedded demo (a real speed-up at
        # their cost), then the demo: each exported just before
        # its sections, so a short GPU window measures the first target before exporting the next
        targets = [(os.path.basename(os.path.normpath(d)), d, None) for d in args.engines]
        targets += [(f"{shape}-{args.dtype}", None, lambda shape=shape: export_gpt(workdir, shape, args.dtype))
                    for shape in shapes]
        if args.demo_shape is not None:
            targets.append((f"demo-{args.demo_shape}-{args.dtype}", None,
                            lambda: export_demo_shape(workdir, args.demo_shape, args.dtype)))
        targets += [("demo", None, lambda: export_demo(workdir))] * args.demo
        for label, engine_dir, export in targets:
            if export is not None:
                engine_dir = (report.section(f"{label}/export", lambda: {"engine": export()}) or {}).get("engine")
            if engine_dir and os.path.isdir(engine_dir):
                check_engine_dir(report, label, engine_dir, opts, args.cpu_threads, workdir, args.device, only)
        if only is None or "device_acceptance" in only:
            report.section("device_acceptance", device_acceptance_section, opts[1], max(args.repeats, 10), args.device)
        skipped = {k: v["skipped"] for k, v in report.data.items() if isinstance(v, dict) and "skipped" in v}
        skipped.update({f"{k}/run": v["run"] for k, v in report.data.items()
                        if isinstance(v, dict) and str(v.get("run", "")).startswith("skipped")})
        report.emit("skipped", skipped)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(report.data, indent=2))
    return 0 if not any(isinstance(v, dict) and "error" in v for v in report.data.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
