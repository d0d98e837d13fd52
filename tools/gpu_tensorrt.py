"""The GPU check's TensorRT sections (python -m lantern.tools.gpu_check; tensorrt and
tensorrt-rtx): plans built for this GPU in a copy of the engine (`lantern-export trt`; TensorRT
for RTX ahead of time for SM89 without one), run with CUDA graphs on and off, the same plans as
the torch backend's modules, and checked and inspected by Polygraphy in processes of their own;
and (tensorrt-graph-step, tensorrt-rtx-graph-step) TensorRT's whole step on the step graphs'
plans against its host step.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from lantern.export.tensorrt_build import available_flavors
from lantern.export.trt_export import build_engine_plans
from lantern.runtime.backends import TENSORRT
from lantern.runtime.backends.cuda import gpu_compute_capability
from lantern.runtime.backends.tensorrt_plans import rtx_targets
from lantern.runtime.generator import Engine
from lantern.runtime.manifest import read_manifest
from lantern.tools.bench.device_step import step_timing, whole_step
from lantern.tools.gpu_sections import measure, one_line, Skip


def _plan_copy(engine_dir, flavor, workdir, batches):
    """A copy of the engine with plans of `flavor` for this GPU (or SM89 ahead of time for
    tensorrt-rtx without one): (directory, build record)."""

    gpu = gpu_compute_capability()
    if flavor == "tensorrt-rtx" and gpu is not None and gpu not in rtx_targets():
        raise Skip(f"TensorRT for RTX does not target this GPU ({gpu}; it builds for {', '.join(sorted(rtx_targets()))})")
    cc = ["current"] if gpu is not None else ["89"]
    copy = os.path.join(workdir, f"{os.path.basename(os.path.normpath(engine_dir))}-{flavor}")
    if not os.path.isdir(copy):
        from lantern.export.accept_engine import add_step_graphs  # torch: imported where it is needed

        shutil.copytree(engine_dir, copy)
        add_step_graphs(copy)  # the device step's graphs (kept if the engine has them)
        start = time.perf_counter()
        # the greedy step graphs' plans (sampling's top-p accept takes minutes per plan to build)
        build_engine_plans(copy, flavor=flavor, compute_capabilities=cc, batches=tuple(batches), step_kinds=("greedy",))
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


def tensorrt_graph_step(engine_dir, opts, flavor, workdir):
    """TensorRT's whole step (GraphStep on the greedy step graphs' plans) against its host step,
    with CUDA graphs (one per step parity) and without: per mode and batch, ms per step on each
    path, the device's over the host's, and whether both paths gave the same tokens (greedy,
    CFG 4). Plans as the tensorrt section builds them (the same copy, built once)."""
    if flavor not in available_flavors():
        raise Skip(f"{flavor} is not installed (pip install 'lantern[{flavor}]')")
    if gpu_compute_capability() is None:
        raise Skip("running TensorRT's step needs an NVIDIA GPU; none is visible here")
    copy, out = _plan_copy(engine_dir, flavor, workdir, opts[1])
    backends = {label: Engine(copy, backend=TENSORRT.name, flavor=flavor, cuda_graphs=graphs).backend
                for label, graphs in (("cuda_graphs", True), ("no_cuda_graphs", False))}
    rows = whole_step(copy, batches=opts[1], samplings=(False,), backends=backends)
    keep = ("backend", "mode", "images", "step", "ms_per_step", "host_ms_per_step", "syncs_per_step", "tokens_sha1",
            "skipped")
    out["runs"] = [{k: r[k] for k in keep if k in r} for r in rows]
    paths = {}
    for r in rows:
        paths.setdefault(f"{r['backend']} {r['mode']} n{r['images']}", {})[r["step"]] = r
    out["tokens_equal"] = {k: "tokens_sha1" in p["device"] and p["host"].get("tokens_sha1") == p["device"]["tokens_sha1"]
                           for k, p in paths.items() if {"host", "device"} <= set(p)}
    out["device_over_host"] = {k: round(p["device"]["ms_per_step"] / p["host"]["ms_per_step"], 3)
                               for k, p in paths.items() if "ms_per_step" in p.get("device", {})
                               and "ms_per_step" in p.get("host", {})}
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
