"""Quantized graphs for TensorRT: ModelOpt's Q/DQ forms (fp8, int8, int4) of an engine's target and
drafter, calibrated on ONNX Runtime CPU with the inputs a real generation feeds them, then built
by TensorRT for RTX on this CPU for each compute capability. Prints JSON: per graph x scheme the
quantization record, the error against the fp32 graph on ONNX Runtime (int8 / int4; fp8 where
ONNX Runtime runs it), and per compute capability build success, plan bytes and seconds (or the
builder's first error).

  python -m lantern.tools.bench.quant_trt [--engine DIR | --model GPT-B] [--cc SM89,SM120]
                                          [--schemes fp8,int8,int4] [--graphs target,drafter]

The build is the minimal one (ONNX parser, strongly typed network, one optimization profile,
build_serialized_network); the real build with the step plan's profiles is
lantern.export.tensorrt_build. Needs `pip install 'lantern[trt-quant]' tensorrt-rtx-cu12`.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
from lantern.export.quantize import relative_errors
from lantern.export.quantize_qdq import quantize_qdq
from lantern.runtime.backends.tensorrt import error_logger
from lantern.runtime.generator import Engine
from lantern.runtime.manifest import read_manifest


class _Enough(Exception):
    """Raised from the recording backend once every graph has its calibration calls."""


class _Recording:
    """A backend that keeps copies of the inputs of the first `limit` calls per graph."""

    def __init__(self, backend, graphs, limit):
        self.backend, self.recorded, self.limit = backend, {g: [] for g in graphs}, limit

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def run(self, call):
        if call.graph in self.recorded and len(self.recorded[call.graph]) < self.limit:
            self.recorded[call.graph].append({k: np.array(v, copy=True) for k, v in call.feeds.items()})
        if all(len(r) >= self.limit for r in self.recorded.values()):
            raise _Enough
        return self.backend.run(call)


def record_feeds(engine_dir, graphs, calls, threads):
    """Copies of the inputs of `calls` target / drafter calls of a greedy `exact` generation with
    CFG (prefill, verification and every drafter depth), spread over the first 4 x calls."""

    engine = Engine(engine_dir, threads=threads)
    engine.backend = recorder = _Recording(engine.backend, graphs, 4 * calls)
    try:
        engine.generate(classes=[207 % engine.manifest.condition.num_classes], mode="exact", greedy=True, cfg_scale=4.0)
    except _Enough:
        pass
    return {g: r[:: max(1, len(r) // calls)][:calls] for g, r in recorder.recorded.items()}


def profile_sizes(manifest, graph):
    """min / opt / max of the symbolic dims for one profile covering 1 image with CFG (a typed
    Manifest): up to 64 new tokens over a cache of up to the condition + image tokens + 64."""
    capacity = (manifest.condition.tokens or 0) + manifest.image.tokens + 64
    return {"B": (1, 2, 2), "N": (1, 1, 1), "T": (1, 1, 64), "P": (1, capacity - 64, capacity)}


def build(trt, path, cc, sizes):
    """Parse + strongly typed build for one compute capability. Returns a result dict."""
    import onnx


    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in onnx.load(path, load_external_data=False).graph.input}
    logger = error_logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(path):
        return {"ok": False, "error": "parse: " + "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))}
    config = builder.create_builder_config()
    config.num_compute_capabilities = 1
    config.set_compute_capability(getattr(trt.ComputeCapability, cc), 0)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        if tensor.is_shape_tensor:  # cond_batch: the number of images
            profile.set_shape_input(tensor.name, *[[v] for v in sizes["N"]])
        shape = [_bounds(d, sizes) for d in dims[tensor.name]]
        profile.set_shape(tensor.name, *[[s[k] for s in shape] for k in range(3)])
    config.add_optimization_profile(profile)
    start = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    seconds = round(time.perf_counter() - start, 1)
    if plan is None:
        return {"ok": False, "seconds": seconds, "error": logger.first_error()}
    return {"ok": True, "plan_bytes": plan.nbytes, "seconds": seconds}


def _bounds(dim, sizes):
    if isinstance(dim, int):
        return (dim, dim, dim)
    if dim == "P+T":
        return tuple(p + t for p, t in zip(sizes["P"], sizes["T"]))
    return sizes[dim]


def ort_errors(reference_path, path, feeds, threads):
    """Worst relative error per output over the feeds, on ONNX Runtime CPU; None if ONNX Runtime
    cannot run the graph (its message instead)."""
    import onnxruntime as ort


    def run(p, level):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.graph_optimization_level = level
        s = ort.InferenceSession(p, options, providers=["CPUExecutionProvider"])
        names = [o.name for o in s.get_outputs()]
        return [dict(zip(names, s.run(None, f))) for f in feeds]

    reference = run(reference_path, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    failures = []
    # With FP8 weights behind a Q/DQ pair (ModelOpt without dq_only) ORT's optimizer fused them into
    # MatMulIntegerToFloat, which has no FP8 kernel; unoptimized, the Q/DQ kernels ran it.
    for level in ("ORT_ENABLE_ALL", "ORT_DISABLE_ALL"):
        try:
            quantized = run(path, getattr(ort.GraphOptimizationLevel, level))
        except Exception as e:  # ORT's own exception types
            failures.append(f"{level}: {str(e).splitlines()[0][:300]}")
            continue
        errors = [relative_errors(r, q) for r, q in zip(reference, quantized)]
        return {n: round(max(e[n] for e in errors), 4) for n in errors[0]}, failures
    return None, failures


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", help="an engine directory (default: export a random-weight --model engine)")
    p.add_argument("--model", default="GPT-B")
    p.add_argument("--cc", default="SM89,SM120", help="compute capabilities (TensorRT for RTX names)")
    p.add_argument("--schemes", default="fp32,fp8,int8,int4", help="fp32 is the unquantized graph")
    p.add_argument("--graphs", default="target,drafter")
    p.add_argument("--calibration-calls", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workdir", help="where engines and quantized graphs go (default: a temporary directory)")
    args = p.parse_args(argv)

    import tensorrt_rtx as trt


    work = args.workdir or tempfile.mkdtemp(prefix="lantern-quant-trt-")
    engine_dir = args.engine or _export(work, args.model, args.threads)
    manifest = read_manifest(engine_dir)
    graphs = [g for g in args.graphs.split(",") if g in manifest.graphs]
    feeds = record_feeds(engine_dir, graphs, args.calibration_calls, args.threads)
    ccs = args.cc.split(",")
    report = {"benchmark": "Q/DQ graphs for TensorRT (ModelOpt), built with TensorRT for RTX on the CPU",
              "note": "a shared 2-core machine; build seconds are indicative only",
              "engine": engine_dir, "tensorrt_rtx": trt.__version__, "calibration_calls": args.calibration_calls,
              "graphs": {}}
    for graph in graphs:
        src = os.path.join(engine_dir, manifest.graphs[graph].file)
        sizes = profile_sizes(manifest, graph)
        rows = report["graphs"][graph] = {}
        for scheme in args.schemes.split(","):
            if scheme == "fp32":
                rows[scheme] = {"bytes": _bytes(src), "builds": {cc: build(trt, src, cc, sizes) for cc in ccs}}
            else:
                rows[scheme] = _quantized_row(trt, src, os.path.join(work, f"{graph}-{scheme}.onnx"), scheme,
                                              feeds[graph], ccs, sizes, args.threads)
            print(json.dumps({graph: {scheme: rows[scheme].get("builds", rows[scheme])}}), flush=True,
                  file=sys.stderr)  # progress
    print(json.dumps(report, indent=2))


def _quantized_row(trt, src, dst, scheme, feeds, ccs, sizes, threads):
    """Quantize, compare on ONNX Runtime, build per compute capability; a failure is reported in
    the row (with its message) and the other schemes still run."""

    try:
        record = quantize_qdq(src, dst, scheme, feeds)
    except Exception as e:  # ModelOpt raises many types; the report says which and why
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    errors, failures = ort_errors(src, dst, feeds[-2:], threads)
    return {"record": {k: record[k] for k in ("quantized", "weight_matmuls", "skipped", "head", "block", "calibration",
                                              "high_precision", "bytes", "seconds", "tool")},
            "onnxruntime_errors": errors, "onnxruntime_failures": failures,
            "builds": {cc: build(trt, dst, cc, sizes) for cc in ccs}}


def _export(work, model, threads):
    import torch

    from lantern.export import checkpoints, llamagen
    from lantern.export.onnx_export import export_engine

    out = os.path.join(work, "engine")
    if os.path.isfile(os.path.join(out, "manifest.json")):
        return out
    torch.set_num_threads(threads)
    args = llamagen.make_config(model)
    checkpoints.save_llamagen_pt(llamagen.init_random(llamagen.Transformer(args)), os.path.join(work, "gpt.pt"))
    checkpoints.save_drafter(llamagen.init_random(llamagen.Drafter(llamagen.DrafterArgs.for_target(args)), seed=1),
                             os.path.join(work, "drafter"), fmt="safetensors")
    export_engine(out, os.path.join(work, "gpt.pt"), target_options={"name": model}, drafter=os.path.join(work, "drafter"),
                  tree="naive_extend_57", candidates=16)
    return out


def _bytes(path):
    return os.path.getsize(path) + (os.path.getsize(path + ".data") if os.path.exists(path + ".data") else 0)


if __name__ == "__main__":
    main()
