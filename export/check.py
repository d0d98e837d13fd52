"""`lantern-export check ENGINE [--backend B] [--against R]`: run every graph of an engine on two
backends over the same cases and compare them output by output (Polygraphy's Comparator is the
model: runners behind one interface, one comparison). Default: onnxruntime (the engine files)
against torch (the PyTorch graph modules rebuilt from the source checkpoints the manifest
records), so a wrong or changed engine is caught before it serves.

Cases per graph (seeded random inputs), in the shapes the decoding loop's step plans use:
  prefill  the condition tokens (ids >= V) and a few image tokens, causal, empty cache
  step     one token over a partly filled cache; unused slots hold large garbage, masked out
  tree     the manifest's draft tree (mc_sim_7b_63 for an `ar` engine) over a filled cache:
           mask = valid cache slots + tree mask, positions = past + depth
  draft0   the drafter's fixed-width first call: real pairs then padding that sees only itself
plus two batch sizes for the condition graph and two code grids for the VQ decoder. In-place
engines (--attention inplace) get the same cases in their static layout: the caches' S slots, the
new tokens written at write_index = the valid slots, the mask's block at those slots; their
updated caches are outputs like any other, and the commit graph gets random moves. With CFG
rows the drafter combines [cond; uncond] partners; its filters are exercised in one case.
A backend that serves fixed shapes only (tensorrt: the optimization profiles its plans were
built with) says which through `call_shapes(graph)`; the cases are then one per profile, in
exactly those shapes (causal blocks over a partly filled cache, CFG pairs on even batches).

The step graphs (`lantern-export accept`) are not compared here: tests/test_step_engine.py holds
them to the host step, and their accept phase's rule modules to lantern.runtime.accept
(tests/test_accept_graphs.py). An older engine's acceptance-only graphs (Manifest.acceptance,
accept/) are listed and hashed like any file but not run: nothing runs them any more.

--against polygraphy-trt (lantern.export.polygraphy_check, GPU only): the engine's TensorRT plans on
lantern's tensorrt backend and on Polygraphy's TrtRunner (NVIDIA's own runner), the first also
against --backend, over these cases in every profile, through Polygraphy's Comparator with the
tolerance rule below as its compare function.

Comparison per output: max |a - b| must be <= atol + rtol * max |reference| (the output's
scale). Defaults, stated in TOLERANCES:
  fp32  atol 1e-5, rtol 1e-4   (TensorRT plans are built with TF32 off unless `lantern-export trt
                                --tf32`, so fp32 plans compute in fp32; TF32 plans need rtol ~1e-2)
  fp16  atol 1e-3, rtol 1e-2   (backends round fp16 differently per op; TensorRT's fused fp16
                                kernels accumulate in fp32 like ONNX Runtime's)
  bf16  atol 1e-4, rtol 2e-3   ONNX Runtime's CPU EP has no bf16 kernels: the bf16 graphs run
        with their bf16 tensors upcast exactly to fp32 against the reference holding the same
        bf16 weights, run in fp32 — this checks the graph and its weights, not bf16 rounding.
VQ decoder images are compared with atol at least IMAGE_ATOL = 1e-3 (an eighth of an 8-bit
level): the deep convolution stacks round differently per backend (1.4e-4 seen on a 48x48 grid
in fp32), and the images are quantized to 8 bits anyway.
  bf16 on tensorrt  atol 1e-2, rtol 5e-2   TensorRT computes in bf16 (8-bit mantissa, ~0.4% per
        rounding) against that fp32 reference: a first bound, not yet measured on a GPU.
The drafter's top-k ids are compared only at ranks clear of a near-tie: the reference's gap in
log-probability to the neighboring ranks must exceed 4x the largest log-probability error
between the two backends (ranks of zero probability are not comparable and are skipped).

Quantized graphs (`lantern-export onnx --quantize`, the manifest's per-graph `quantization`
record) are first checked against their record (scheme, bits, block, accuracy level, head, which
MatMuls: lantern.export.quantize.verify_record; a mismatch is refused with a re-export line), then
compared with the scheme's tolerance, stated in the report: the relative RMS error
||a - b|| / ||b|| of each float output against the reference (the fp32 PyTorch modules),
lantern.export.quantize.TOLERANCES: int8 0.05, int4 0.25 (the quantization error is spread over
every element, so a norm bounds it where a max would be set by one unlucky element). A quantized
drafter's top-k ids are compared at the ranks clear of a near-tie by 4x their own row's measured
log-probability error (quantization errors are uneven: one global bound would leave no rank
comparable). --quant-tolerance overrides the scheme's tolerance.
"""
import collections
import json
import os
import shutil
import tempfile

import numpy as np

from lantern.export import polygraphy_check
from lantern.export.check_cases import check_cases
from lantern.export.check_compare import _compare_float, _compare_ids, _compare_ids_per_row, _compare_rms, \
    BF16_COMPUTED, IMAGE_ATOL, quantization_tolerances, TOLERANCES
from lantern.export.polygraphy_check import NAME as POLYGRAPHY
from lantern.runtime.backends import DEFAULT, names, open_backend, RUNNERS, runner, TENSORRT, TORCH
from lantern.runtime.backends.cuda import gpu_compute_capability
from lantern.runtime.backends.tensorrt import TensorRTBackend
from lantern.runtime.backends.torch import TorchBackend
from lantern.runtime.errors import LanternError
from lantern.runtime.manifest import describe_files, read_manifest
from lantern.runtime.plan import Call

THREADS = 2


# ---------------------------------------------------------------------------------------------
# Running two backends


def _upcast_engine(directory, manifest, tmp):
    """A copy of a bf16 engine whose graphs have every bf16 tensor, cast and I/O type made fp32
    (exact for values), so ONNX Runtime's CPU kernels can run it."""
    import onnx
    from onnx import numpy_helper

    bf16, fp32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT

    def fix_tensor(t):
        if t.data_type == bf16:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))

    def fix_graph(graph):
        for t in graph.initializer:
            fix_tensor(t)
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    fix_tensor(attr.t)
                elif attr.name in ("to", "dtype") and attr.i == bf16:
                    attr.i = fp32
                for sub in list(attr.graphs) + ([attr.g] if attr.HasField("g") else []):
                    fix_graph(sub)
        del graph.value_info[:]
        for v in list(graph.input) + list(graph.output):
            if v.type.tensor_type.elem_type == bf16:
                v.type.tensor_type.elem_type = fp32

    import dataclasses


    graphs, files = {}, []
    for name, g in manifest.graphs.items():
        model = onnx.load(os.path.join(directory, g.file))
        if g.dtype == "bf16":
            fix_graph(model.graph)
        onnx.save_model(model, os.path.join(tmp, g.file), save_as_external_data=True, location=g.file + ".data")
        files += [g.file, g.file + ".data"]
        graphs[name] = dataclasses.replace(g, dtype="fp32", external_data=g.file + ".data")
    if manifest.neighbors is not None:
        shutil.copy(os.path.join(directory, manifest.neighbors.file), tmp)
        files.append(manifest.neighbors.file)
    manifest.replace(dtype="fp32", graphs=graphs, files=describe_files(tmp, files)).write(tmp)
    return tmp


def open_backends(directory, manifest, backend, against, modules=None, tmp=None):
    """(tested, reference) backends for a check (see open_check_backend)."""
    return (open_check_backend(directory, manifest, backend, modules, tmp),
            open_check_backend(directory, manifest, against, modules, tmp))


def open_check_backend(directory, manifest, name, modules=None, tmp=None):
    """One backend for a check. torch runs the modules rebuilt from the sources (or `modules`
    given); a bf16 engine runs on ONNX Runtime through an fp32 upcast copy made in `tmp`."""

    if runner(name).reference:
        mods = modules
        if mods is None:
            from lantern.export.onnx_export import load_graph_modules

            mods = load_graph_modules(manifest)
        mods = {g: m for g, (_, m) in mods.items()}
        if manifest.dtype == "bf16":  # the same bf16 weights, run in fp32 like the upcast graphs
            mods = {g: m.float() for g, m in mods.items()}
            return TorchBackend(mods, manifest.replace(dtype="fp32"), threads=THREADS)
        return TorchBackend(mods, manifest, threads=THREADS)
    if manifest.dtype == "bf16" and runner(name).onnx and not runner(name).hybrid:  # ORT's CPU kernels run no bf16
        where = _upcast_engine(directory, manifest, tmp)
        return open_backend(name, where, read_manifest(where), threads=THREADS, io_binding=False)
    return open_backend(name, directory, manifest, threads=THREADS)


def check_engine(directory, *, backend=DEFAULT, against=TORCH.name, verify=True, atol=None, rtol=None, seed=0,
                 modules=None, quant_tolerance=None):
    """Compare every graph of an engine on two backends over the same cases.

    verify: check the sha256 of the engine files and the source checkpoints (sizes always).
    modules: {graph: (contract, module)} for the torch side instead of reloading the sources.
    quant_tolerance: relative RMS limit for quantized graphs (default: their scheme's).
    Returns {"engine", "dtype", "backend", "against", "atol", "rtol", "quantization": {graph:
    {"scheme", "tolerance"}}, "ok", "results": [per graph/case/output dicts], "failures": [one
    line each]}."""
    directory = os.fspath(directory)
    manifest = read_manifest(directory, verify=verify)
    quantized = quantization_tolerances(directory, manifest, quant_tolerance)
    if verify and runner(against).reference and modules is None:
        from lantern.export.onnx_export import verify_sources

        verify_sources(manifest)
    default_atol, default_rtol = TOLERANCES[manifest.dtype]
    if manifest.dtype == "bf16" and any(runner(n).plans for n in (backend, against)):
        default_atol, default_rtol = BF16_COMPUTED
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    rng = np.random.default_rng(seed)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tested, reference = open_backends(directory, manifest, backend, against, modules, tmp)
        for graph in manifest.graphs:
            shapes = next((s for s in (tested.call_shapes(graph), reference.call_shapes(graph)) if s is not None), None)
            for case, feeds in check_cases(graph, manifest, rng, shapes):
                # each backend its own copy: an in-place graph's run updates its cache inputs
                got = {k: tested.numpy(v) for k, v in tested.run(Call(graph, case, _copies(feeds))).items()}
                want = {k: reference.numpy(v) for k, v in reference.run(Call(graph, case, _copies(feeds))).items()}
                for name in manifest.graphs[graph].outputs:
                    if name == "topk_ids":
                        compare_ids = _compare_ids_per_row if graph in quantized else _compare_ids
                        result = compare_ids(got[name], want[name], got["topk_probs"], want["topk_probs"])
                    elif graph in quantized:
                        result = _compare_rms(got[name], want[name], quantized[graph][1])
                    else:
                        result = _compare_float(got[name], want[name], max(atol, IMAGE_ATOL) if graph == "vq_decoder"
                                                else atol, rtol)
                    results.append({"graph": graph, "case": case, "output": name, **result})
    failures = [f"{r['graph']}/{r['case']}/{r['output']}: " +
                (r.get("note") or (f"relative RMS error {r['rms_rel']:.3g} > tolerance {r['bound']:.3g}" if "rms_rel" in r
                                   else f"max abs error {r['max_abs']:.3g} > bound {r['bound']:.3g}"))
                for r in results if not r["ok"]]
    return {"engine": directory, "dtype": manifest.dtype, "backend": backend, "against": against, "atol": atol,
            "rtol": rtol, "quantization": {g: {"scheme": s, "tolerance": t} for g, (s, t) in quantized.items()},
            "ok": not failures, "results": results, "failures": failures}


def _copies(feeds):
    return {k: np.array(v, copy=True) for k, v in feeds.items()}


def format_report(report):
    width = max([9] + [len(r["case"]) + 1 for r in report["results"]])
    lines = [f"engine {report['engine']} ({report['dtype']}): {report['backend']} against {report['against']}, pass iff "
             f"max|a - b| <= {report['atol']:g} + {report['rtol']:g} * max|{report['against']}| per output",
             f"{'graph':<11}{'case':<{width}}{'output':<15}{'max abs':>10}{'max rel':>10}  result"]
    quantized = report.get("quantization", {})
    if quantized:  # in the header's place for those graphs
        lines[1:1] = [f"  except {g} ({q['scheme']} weight-only): pass iff ||a - b|| / ||{report['against']}|| <= "
                      f"{q['tolerance']:g} per output (relative RMS; the scheme's tolerance)" for g, q in quantized.items()]
    for r in report["results"]:
        row = f"{r['max_abs']:>10.2e}{r['max_rel']:>10.2e}" if "max_abs" in r else f"{'':>10}{'':>10}"
        note = r.get("note", "") if r["output"] == "topk_ids" or not r["ok"] else ""
        if "rms_rel" in r and "note" not in r:
            note = f"relative RMS {r['rms_rel']:.2e} {'<=' if r['ok'] else '>'} {r['bound']:g}"
        lines.append(f"{r['graph']:<11}{r['case']:<{width}}{r['output']:<15}{row}  {'ok' if r['ok'] else 'FAIL'}"
                     + (f" ({note})" if note else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# check --against polygraphy-trt: check's cases and tolerance rule through Polygraphy's Comparator


class ToleranceCompare:
    """A Polygraphy compare function holding `check`'s rule: called with two runners'
    IterationResults, returns {output: passed} and keeps one `check` result row per output in
    `rows` (graph, case, pair of runners, max abs / rel error, bound)."""

    def __init__(self, graph, atol, rtol, case_names):
        self.graph, self.atol, self.rtol = graph, atol, rtol
        self.case_names = list(case_names)  # one per iteration, in data-loader order
        self.rows = []
        self._calls = collections.Counter()

    def __call__(self, run0, run1):
        pair = (run0.runner_name, run1.runner_name)
        case = self.case_names[min(self._calls[pair], len(self.case_names) - 1)]
        self._calls[pair] += 1
        got = {k: polygraphy_check.as_numpy(v) for k, v in run0.items()}
        want = {k: polygraphy_check.as_numpy(v) for k, v in run1.items()}
        verdict = collections.OrderedDict()
        for output in want:
            if output not in got:
                result = {"ok": False, "note": f"{pair[0]} gave no {output}"}
            elif output == "topk_ids":
                result = _compare_ids(got[output], want[output], got["topk_probs"], want["topk_probs"])
            else:
                atol = max(self.atol, IMAGE_ATOL) if self.graph == "vq_decoder" else self.atol
                result = _compare_float(got[output].astype(np.float32), want[output].astype(np.float32), atol, self.rtol)
            self.rows.append({"graph": self.graph, "case": f"{case}: {pair[0]} vs {pair[1]}", "output": output, **result})
            verdict[output] = bool(result["ok"])
        return verdict


def check_engine_polygraphy(directory, *, backend=DEFAULT, verify=True, atol=None, rtol=None, seed=0):
    """Compare lantern's tensorrt backend, Polygraphy's TrtRunner on the same plans and `backend`
    over `check`'s cases in every profile of every plan. Needs an NVIDIA GPU (reading a plan
    does). Returns a report shaped like lantern.export.check.check_engine's."""
    import tempfile


    directory = os.fspath(directory)
    if backend == POLYGRAPHY or runner(backend).plans:
        raise LanternError(f"--against {POLYGRAPHY} compares lantern's {TENSORRT.name} backend and Polygraphy's "
                           f"TrtRunner; --backend names the third runner (one of {', '.join(names(plans=False))}), not "
                           f"{backend}")
    if gpu_compute_capability() is None:
        raise LanternError(f"--against {POLYGRAPHY} runs the engine's TensorRT plans, and reading a plan needs an NVIDIA GPU "
                           f"and driver; none is visible here (compare the ONNX graphs with `lantern-export check "
                           f"{directory}` instead)")
    manifest = read_manifest(directory, verify=verify)
    if not manifest.tensorrt:
        raise LanternError(f"{directory} has no TensorRT plans to check; build them with `lantern-export trt {directory}`")
    default_atol, default_rtol = BF16_COMPUTED if manifest.dtype == "bf16" else TOLERANCES[manifest.dtype]
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    trt_backend = TensorRTBackend(directory, manifest)
    polygraphy_check.load_polygraphy(trt_backend.plans.flavor)
    from polygraphy.backend.trt import TrtRunner

    class FeedsAsPlanTakes(TrtRunner):
        def infer(self, feed_dict, *args, **kwargs):
            return super().infer(polygraphy_check.trt_feeds(feed_dict, self.engine), *args, **kwargs)

    rng = np.random.default_rng(seed)
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        third = open_check_backend(directory, manifest, backend, tmp=tmp)
        for graph, plan_file in trt_backend.plans.plans.items():
            if graph not in trt_backend.engines:  # a step graph's plan (tests/test_tensorrt_backend runs the step)
                continue
            engine = trt_backend.engines[graph]  # the same deserialized plan for both TensorRT runners
            for index, profile in enumerate(plan_file.profiles):
                label = profile.serves[0] if profile.serves else f"profile{index}"
                points = ["opt"] + [k for k in ("min", "max") if any(r[k] != r["opt"] for r in profile.shapes.values())]
                shapes = [(label if p == "opt" else f"{label} {p}", {n: tuple(r[p]) for n, r in profile.shapes.items()})
                          for p in points]
                cases = check_cases(graph, manifest, rng, shapes)
                compare = ToleranceCompare(graph, atol, rtol, [name for name, _ in cases])
                runners = [polygraphy_check.backend_runner(trt_backend, graph, manifest, trt_backend.name),
                           FeedsAsPlanTakes(engine, name=POLYGRAPHY, optimization_profile=index, allocation_strategy="profile"),
                           polygraphy_check.backend_runner(third, graph, manifest, backend)]
                ok &= polygraphy_check.compare_runners(runners, [feeds for _, feeds in cases], compare, comparisons=[(0, 1), (0, 2)])
                rows += compare.rows
    failures = [f"{r['graph']}/{r['case']}/{r['output']}: " + (r.get("note") or f"max abs error {r['max_abs']:.3g} > "
                                                               f"bound {r['bound']:.3g}") for r in rows if not r["ok"]]
    return {"engine": directory, "dtype": manifest.dtype, "backend": trt_backend.name, "against": f"{POLYGRAPHY} and {backend}",
            "atol": atol, "rtol": rtol, "quantization": {}, "ok": ok and not failures, "results": rows,
            "failures": failures}


def add_parser(sub):
    p = sub.add_parser("check", help="compare an engine's graphs on two backends, output by output",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("engine", help="engine directory (engines/NAME)")
    p.add_argument("--backend", default=DEFAULT, choices=sorted(RUNNERS), help="the backend tested")
    p.add_argument("--against", default=TORCH.name, choices=sorted(RUNNERS) + [POLYGRAPHY],
                   help=f"the reference backend (default {TORCH.name}: the modules rebuilt from the source "
                        f"checkpoints); {POLYGRAPHY}: the engine's TensorRT plans on lantern's {TENSORRT.name} backend "
                        f"and on Polygraphy's "
                        "TrtRunner, each against the other and the first against --backend (needs a GPU)")
    p.add_argument("--verify-hashes", dest="verify", action="store_true", default=True,
                   help="check the sha256 of the engine files and the source checkpoints (default)")
    p.add_argument("--no-verify-hashes", dest="verify", action="store_false", help="check file sizes only")
    p.add_argument("--atol", type=float, help="absolute tolerance (default per dtype: " +
                   ", ".join(f"{k} {v[0]:g}" for k, v in TOLERANCES.items()) + ")")
    p.add_argument("--rtol", type=float, help="tolerance relative to each output's max |value| (default per dtype: " +
                   ", ".join(f"{k} {v[1]:g}" for k, v in TOLERANCES.items()) + ")")
    p.add_argument("--quant-tolerance", type=float,
                   help="relative RMS tolerance of quantized graphs (default per scheme: int8 0.05, int4 0.25)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--json", help="also write the full report to this JSON file")
    p.set_defaults(func=run)


def run(args):
    if args.backend == args.against:
        raise LanternError(f"--backend and --against are both {args.backend}; compare two different backends")
    for name, value in (("--atol", args.atol), ("--rtol", args.rtol), ("--quant-tolerance", args.quant_tolerance)):
        if value is not None and not (np.isfinite(value) and value >= 0):
            raise LanternError(f"{name} must be a finite number >= 0, got {value}")
    if args.against == POLYGRAPHY:
        report = check_engine_polygraphy(args.engine, backend=args.backend, verify=args.verify, atol=args.atol,
                                         rtol=args.rtol, seed=args.seed)
    else:
        report = check_engine(args.engine, backend=args.backend, against=args.against, verify=args.verify,
                              atol=args.atol, rtol=args.rtol, seed=args.seed, quant_tolerance=args.quant_tolerance)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if not report["ok"]:
        print(f"check FAILED: {len(report['failures'])} output(s) over tolerance: " + "; ".join(report["failures"][:5]))
        return 1
    print(f"check passed: {len(report['results'])} outputs within tolerance")
    return 0
