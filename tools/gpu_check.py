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
  tensorrt-graph-step / tensorrt-rtx-graph-step
                                         TensorRT's whole step (GraphStep on the greedy step
                                         graphs' plans, one CUDA graph per step parity, or per-call
                                         launches) against its host step: ms per step per mode and
                                         batch, device over host, tokens_equal per row
  torch-cuda-graphs / torch-cuda-eager   the torch reference on CUDA, with and without CUDA graphs
  onnxruntime-cuda                       ONNX Runtime's CUDA execution provider
  onnxruntime-torch-cuda                 the same inside the torch backend: host step against the
                                         whole step on the device (ms per step, host share)
  tensorrt / tensorrt-rtx                full TensorRT and TensorRT for RTX: plans built here for
                                         this GPU (`lantern-export trt`), run with CUDA graphs on
                                         and off, and checked by Polygraphy (`check --against
                                         polygraphy-trt`, in a process of its own per flavor);
                                         tensorrt_torch: the
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
import sys
import tempfile
import time

from lantern.export.tensorrt_build import FLAVORS
from lantern.runtime.backends import ONNXRUNTIME, ONNXRUNTIME_TORCH, TORCH
from lantern.runtime.backends.cuda import gpu_compute_capability
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.manifest import read_manifest
from lantern.tools.bench.device_step import export_gpt
from lantern.tools.gpu_sections import (cuda_visible, device_acceptance_section, device_step_section, one_line,
                                        onnxruntime_cuda, onnxruntime_torch, Skip, torch_reference)
from lantern.tools.gpu_tensorrt import tensorrt, tensorrt_graph_step


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


def section_names(device):
    """Each engine's sections in the order they run, for `device` (cuda, or cpu's dry run)."""
    t = f"{TORCH.name}-{device}"
    return [f"{t}-step-graph", f"{t}-step-eager", *(f"{f}-graph-step" for f in FLAVORS), f"{t}-graphs", f"{t}-eager",
            f"{ONNXRUNTIME.name}-cuda", f"{ONNXRUNTIME_TORCH.name}-{device}", *FLAVORS]


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

    step_graph, step_eager, trt_step, rtx_step, graphs, eager, ort_cuda, ort_torch, trt, rtx = section_names(device)
    sections = {step_graph: (device_step_section, engine_dir, opts[1], True, device),
                step_eager: (device_step_section, engine_dir, opts[1], False, device),
                trt_step: (tensorrt_graph_step, engine_dir, opts, trt, workdir),  # the plans built once (in
                rtx_step: (tensorrt_graph_step, engine_dir, opts, rtx, workdir),  # workdir) for both sections
                graphs: (torch_reference, engine_dir, cpu, opts, True, device),
                eager: (torch_reference, engine_dir, cpu, opts, False, device),
                ort_cuda: (onnxruntime_cuda, engine_dir, cpu, opts),
                ort_torch: (onnxruntime_torch, engine_dir, opts[1], device),
                trt: (tensorrt, engine_dir, cpu, opts, trt, workdir),  # named by their TensorRT flavors
                rtx: (tensorrt, engine_dir, cpu, opts, rtx, workdir)}
    for name, (fn, *args) in sections.items():
        if only is None or name in only:
            report.section(f"{label}/{name}", fn, *args)


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
