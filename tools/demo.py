"""`lantern-export demo`: the whole toolchain on the bundled demo model, in one command.

Exports the shipped checkpoints (real LlamaGen / LANTERN / VQ formats, see demo_model/MODEL_CARD.md)
to engines/demo, checks every graph against PyTorch, generates the same grid of images with `ar`,
`exact` and `lantern++` (on ONNX Runtime CPU; with --device auto, the default, on the torch
backend's device step where torch sees a CUDA GPU: it says which it used), tunes the draft tree
for this machine (`lantern-run tune`, small: see TUNE) and runs lantern++ with the tuned tree
beside the preset, prints a table and writes the images and a report (report.json, report.md
with plots) to engines/demo/report/.

Beside it, a quantized engine (--quantize, default int8) made from the exported one in a second or
two (`lantern-export quantize`, to engines/demo-int8): checked against PyTorch at its scheme's
tolerance, the same grid with `ar` and `lantern++` (the preset tree), its speed next to fp32's and
its fidelity (teacher-forced greedy agreement with fp32, the check's worst relative error). int8
because it is the scheme that keeps the fp32 model's choices (95% teacher-forced greedy agreement
on this model, int4 83%) while halving the one-token step of a GPT-B-sized model on a CPU; on this
tiny model a step is not bound by reading weights, so neither scheme is faster here
(lantern.export.quantize). `lantern-run quality engines/demo` compares fp32, int8 and int4 in
class accuracy and Fréchet distance as well.
"""
import dataclasses
import json
import os
import time

import numpy as np
import torch

from lantern.export.accept_engine import add_step_graphs
from lantern.export.check import check_engine
from lantern.export.checkpoints import load_target
from lantern.export.embed import DEMO_DIR, demo_sources, embedded_config, write_embedded  # noqa: F401 (gpu_check)
from lantern.export.onnx_export import export_engine
from lantern.export.placement import check_engine_destination
from lantern.export.quantize import TOLERANCES, QuantizeOptions, greedy_agreement, quantize_engine
from lantern.export.torch_backend import open_torch_backend
from lantern.runtime.backends import ONNXRUNTIME, ONNXRUNTIME_TORCH, TORCH
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.outdir import OutputDirectory, only_files
from lantern.runtime.png import image_grid, write_png
from lantern.runtime.settings import GenerationSettings
from lantern.tools import demo_report, tune, tune_measure, tune_record

REPORT_FILES = ("report.json", "report.md", "*.png")
DEFAULTS = dict(tree="mc_sim_7b_63", lam=5.0, k=20, cfg_scale=3.0, temperature=1.0, top_k=0, per_class=2, seed=0)
# The demo's tune run, cut to take ~10-20 s on a 2-core CPU: 8 calibration images (tune's default
# 16), budget 32 and depth 5 (64 and 6), 3 timed repeats per call size (5), one loop run per tree
# (3), batch sizes 1 and 8 only (the grid's 30 images use the batch-8 tree, the nearest tuned batch).
TUNE = dict(images=8, budget=32, depth=5, batches=(1, 8), repeats=3, loop_runs=1)
SHAPED_TREE = "chain-2"  # --shape's preset tree: on a CPU, verifying a GPT-B step of 63 tokens costs ~10 AR steps
QUANTIZED_RUNS = ("ar", "lantern++")  # the quantized engine's grid: the baseline and the demo's method


def add_parser(sub):
    p = sub.add_parser("demo", help="export, check and run the bundled demo model; write a report")
    p.add_argument("--out", help="engine directory (default engines/demo, engines/demo-gpt-b with --shape GPT-B)")
    p.add_argument("--model-dir", default=DEMO_DIR, help="the demo checkpoints (default: the bundled ones)")
    p.add_argument("--shape", metavar="NAME",
                   help="embed the demo exactly in a released LlamaGen shape first (GPT-B, GPT-L, GPT-XL, ...: "
                        "lantern.export.embed): the demo's tokens at that model's cost. Its checkpoints go to "
                        "OUT-checkpoints; with it the defaults are --batch 8, --threads 2, --quantize none")
    p.add_argument("--batch", type=int,
                   help="images per generate call for the grid (default: all at once; 8 with --shape)")
    p.add_argument("--tree", help=f"the preset rows' draft tree (default {DEFAULTS['tree']}; {SHAPED_TREE} with "
                                  f"--shape: a CPU verifies few tokens per step cheaply)")
    p.add_argument("--lam", type=float, default=DEFAULTS["lam"])
    p.add_argument("--k", type=int, default=DEFAULTS["k"])
    p.add_argument("--cfg-scale", type=float, default=DEFAULTS["cfg_scale"])
    p.add_argument("--per-class", type=int, default=DEFAULTS["per_class"], help="images per class in the grid")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where to generate: cuda runs the torch backend on the GPU with the whole step on the device "
                        "(one CUDA graph per step); cpu runs ONNX Runtime on the CPU; auto (default): cuda where "
                        "torch sees a CUDA device, else cpu")
    p.add_argument("--threads", type=int,
                   help="ONNX Runtime intra-op threads (default 1: the demo model is too small to gain from more; "
                        "2 with --shape)")
    p.add_argument("--no-tune", action="store_true", help="skip tuning the draft tree for this machine")
    p.add_argument("--quantize", choices=("none", "int8", "int4"),
                   help="also quantize the engine (weight-only) into OUT-SCHEME and report it beside fp32 "
                        "(default int8, none with --shape; none: skip)")
    p.set_defaults(func=run)


def demo_backend(device):
    """(backend, device) the demo generates on: ("torch", "cuda") where torch sees a CUDA device
    (the torch backend's whole step on the device, one CUDA graph per step), else
    ("onnxruntime", "cpu"); device "auto", "cpu" or "cuda" (a LanternError where there is none)."""
    if device == "cpu":
        return ONNXRUNTIME.name, "cpu"
    if torch.cuda.is_available():
        return TORCH.name, "cuda"
    if device == "cuda":
        raise LanternError("--device cuda: torch sees no CUDA device here (a CUDA build of torch and an NVIDIA driver "
                           "are needed); use --device cpu")
    return ONNXRUNTIME.name, "cpu"


def open_demo_engine(out, backend, device, threads):
    if backend == TORCH.name:
        return Engine(out, backend=open_torch_backend(out, device=device))
    return Engine(out, threads=threads)


def shape_defaults(args):
    """The options --shape changes, filled in where not given (in place)."""
    shaped = args.shape is not None
    name = "demo" + (f"-{args.shape.lower()}" if shaped else "")
    for option, demo_value, shaped_value in (("out", os.path.join("engines", name), os.path.join("engines", name)),
                                             ("threads", 1, 2), ("quantize", "int8", "none"), ("batch", None, 8),
                                             ("tree", DEFAULTS["tree"], SHAPED_TREE)):
        if getattr(args, option) is None:
            setattr(args, option, shaped_value if shaped else demo_value)
    if args.batch is not None and args.batch < 1:
        raise LanternError(f"--batch must be a positive number of images, got {args.batch}")
    return args


def run(args):

    start = time.perf_counter()
    args = shape_defaults(args)
    backend, device = demo_backend(args.device)  # before anything is written
    src = demo_sources(args.model_dir)
    out = os.path.abspath(args.out)
    if args.shape is not None:
        embedded_config(load_target(src["target"], config_file=src["target_config"])[0].args, args.shape)  # refuse early
    check_engine_destination(out, force=True)  # replaces an engine, never anything else
    first = 1 + (args.shape is not None)  # the export's step number
    steps = first + 3 + (not args.no_tune) + (args.quantize != "none")
    generating = first + 2 + (not args.no_tune)  # the step number of the generation
    embedding = None
    if args.shape is not None:
        print(f"[1/{steps}] embedding the demo model exactly in {args.shape}'s shapes ({out}-checkpoints)")
        t = time.perf_counter()
        src = write_embedded(args.model_dir, args.shape, f"{out}-checkpoints")
        embedding = {"shape": args.shape, "checkpoints": f"{out}-checkpoints", "seconds": time.perf_counter() - t}
        print(f"      built in {embedding['seconds']:.1f} s")
    print(f"[{first}/{steps}] exporting the demo model to {out}")
    export_engine(out, src["target"], target_options={"config_file": src["target_config"]}, drafter=src["drafter"],
                  vq=src["vq"], tree=args.tree, force=True, progress=True,
                  graph_cache=os.environ.get("LANTERN_GRAPH_CACHE") or None)  # as `lantern-export onnx` does
    # the step graphs of the demo's tree and of AR (`lantern-export accept`): ONNX
    # Runtime's default device step runs them from the first generation on
    t = time.perf_counter()
    add_step_graphs(out, progress=True)
    print(f"      step graphs of {args.tree} and ar added in {time.perf_counter() - t:.1f} s")
    print(f"[{first + 1}/{steps}] checking every graph on ONNX Runtime against PyTorch")
    report = check_engine(out)
    worst = max((r.get("max_abs", 0.0) for r in report["results"]), default=0.0)
    if not report["ok"]:
        raise LanternError(f"check failed: {report['failures'][0]}")
    print(f"      check passed ({len(report['results'])} outputs compared, worst abs error {worst:.2e})")

    engine = open_demo_engine(out, backend, device, args.threads)
    with open(os.path.join(args.model_dir, "classifier.json")) as f:
        class_names = json.load(f)["class_names"]
    classes = [c for c in range(len(class_names)) for _ in range(args.per_class)]
    common = dict(classes=classes, cfg_scale=args.cfg_scale, temperature=DEFAULTS["temperature"], top_k=DEFAULTS["top_k"],
                  seed=args.seed)
    tuned = None
    if not args.no_tune:
        tuned = _tune(engine, out, args, f"{first + 2}/{steps}", device)
        engine = open_demo_engine(out, backend, device, args.threads)  # reopened: generate finds the tuned trees
    # the preset rows name their tree, so a tree tuned for the same settings does not replace it
    runs = [("ar", {}), ("exact", {"tree": args.tree}), ("lantern++", dict(lam=args.lam, k=args.k, tree=args.tree)),
            # drafter-free speculative Jacobi decoding beside the drafter (the default window)
            ("exact jacobi", {"proposer": "jacobi"}), ("lantern++ jacobi", dict(lam=args.lam, k=args.k, proposer="jacobi"))]
    if tuned is not None:
        runs.append(("lantern++ tuned", dict(lam=args.lam, k=args.k)))  # generate picks the tuned tree
    print(f"[{generating}/{steps}] generating {len(classes)} images ({args.per_class} per class"
          + (f", {args.batch} per call" if args.batch else "") + ") with "
          + ", ".join(m for m, _ in runs) + f" (sampling, CFG {args.cfg_scale}, tree {args.tree}"
          + (", and the tuned tree" if tuned is not None else "") + ")")
    engine.generate(mode="exact", **{**common, "classes": classes[:2]})  # warm up the sessions
    results = {}
    for mode, extra in runs:
        results[mode] = generate_batches(engine, args.batch, mode=mode.split()[0], **common, **extra)
    # which step path ran (Engine(step=...)): on ONNX Runtime the device step, the engine's step
    # graphs (added above); on torch CUDA the device step; the host step where neither runs
    print(f"      {results['exact'].stats['step']} step on {engine.backend.name} ({device})"
          + (f" (the whole step runs on the device with lantern-run generate --backend {ONNXRUNTIME_TORCH.name} or "
             f"{TORCH.name} --step device)"
             if results['exact'].stats['step'] == "host" else ""))
    # One image per call, the setting of the paper's speedups: medians over a few classes.
    single, single_trees = {}, {}
    for mode, extra in runs:
        stats = [engine.generate(mode=mode.split()[0], **{**common, "classes": [c]}, **extra).stats
                 for c in range(0, len(class_names), max(1, len(class_names) // 5))]
        single[mode] = {key: float(np.median([_stat(st, key) for st in stats]))
                        for key in ("seconds", "steps_per_image", "engine_calls", "verify", "mean_accepted_length")}
        single_trees[mode] = stats[0]["tree"]

    quantized = None
    if args.quantize != "none":
        print(f"[{generating + 1}/{steps}] {args.quantize} engine: the demo engine's target and drafter quantized to "
              f"{out}-{args.quantize}, checked at the {args.quantize} tolerance, the same grid with "
              f"{' and '.join(QUANTIZED_RUNS)}")
        fp32, fp32_results = engine, results
        if backend != ONNXRUNTIME.name:  # the quantized graphs run on ONNX Runtime: fp32 beside them there too
            fp32 = Engine(out, threads=args.threads)
            fp32_results = {mode: fp32.generate(mode=mode, **common, **extra) for mode, extra in runs
                            if mode in QUANTIZED_RUNS}
        quantized = quantized_beside(out, args.quantize, fp32, common, runs, fp32_results, args.threads)
        print(f"      {quantized['check_line']}")
    print(f"[{steps}/{steps}] writing images and the report")
    rows = []
    ar_batch, ar_single = results["ar"].stats, single["ar"]
    report_dir = os.path.join(out, "report")
    with OutputDirectory(report_dir, force=True, replaceable=only_files(REPORT_FILES, "the demo"),
                         kind="report directory") as stage:
        for mode, r in results.items():
            s, one = r.stats, single[mode]
            images = engine.decode(r.tokens)
            images = images.repeat(3, axis=1).repeat(3, axis=2) if images.shape[1] < 128 else images  # easier to see
            name = mode.replace("+", "p").replace(" ", "_")
            write_png(os.path.join(stage, f"{name}.png"), image_grid(images, ncols=args.per_class * 3))
            rows.append({"mode": mode, "tree": s["tree"], "tree_batch1": single_trees[mode],
                         "steps_per_image": s["steps_per_image"],
                         "mean_accepted_length": s["mean_accepted_length"], "batch_seconds": s["seconds"],
                         "speedup_batch": ar_batch["seconds"] / s["seconds"],
                         # what one step costs against an AR step (the accepted length that breaks even),
                         # at the batch and at one image
                         "step_cost_vs_ar": (s["seconds"] / s["steps_per_image"])
                         / (ar_batch["seconds"] / ar_batch["steps_per_image"]),
                         "latency_batch1_seconds": one["seconds"], "speedup_batch1": ar_single["seconds"] / one["seconds"],
                         "steps_per_image_batch1": one["steps_per_image"],
                         "mean_accepted_length_batch1": one["mean_accepted_length"],
                         "step_cost_vs_ar_batch1": (one["seconds"] / one["steps_per_image"])
                         / (ar_single["seconds"] / ar_single["steps_per_image"]),
                         "engine_calls_per_step_batch1": one["engine_calls"] / one["steps_per_image"],
                         # what the verification of a step costs against the target call of an AR step
                         # (None on the device step: its phases are one engine call, not timed apart)
                         "verify_cost_vs_ar": _ratio(_stat(s, "verify") / s["steps_per_image"],
                                                     _stat(ar_batch, "verify") / ar_batch["steps_per_image"]),
                         "verify_cost_vs_ar_batch1": _ratio(one["verify"] / one["steps_per_image"],
                                                            ar_single["verify"] / ar_single["steps_per_image"]),
                         "accepted_histogram": s.get("accepted_histogram", []),
                         "acceptance_per_depth": acceptance_per_depth(s.get("accepted_histogram", [])),
                         "image": f"{name}.png", "phase_seconds": s["phase_seconds"],
                         # a tuned tree that is AR, or the preset itself, runs what an earlier row ran
                         "same_run_as": next((q["mode"] for q in rows if (q["ran"], q["tree"], q["tree_batch1"])
                                              == (s["mode"], s["tree"], single_trees[mode])), None),
                         "ran": s["mode"]})
        tree = engine.tree
        if quantized is not None:
            for mode, r in quantized.pop("generations").items():
                images = engine.decode(r.tokens)
                images = images.repeat(3, axis=1).repeat(3, axis=2) if images.shape[1] < 128 else images
                write_png(os.path.join(stage, f"{args.quantize}_{mode.replace('+', 'p')}.png"),
                          image_grid(images, ncols=args.per_class * 3))
        summary = {"engine": out, "settings": {**vars_of(args), "classes": len(class_names), "images": len(classes)},
                   "generated_on": {"backend": engine.backend.name, "device": device,
                                    "step": results["exact"].stats["step"]},
                   "tree": {"name": tree.name, "nodes": tree.num_nodes, "depth": tree.depth},
                   "check": {"ok": report["ok"], "worst_abs_error": worst}, "results": rows, "tuned": tuned,
                   "quantized": quantized, "embedding": embedding, "seconds_total": time.perf_counter() - start}
        summary["reading"] = demo_report.reading(summary)
        with open(os.path.join(stage, "report.json"), "w") as f:
            json.dump(summary, f, indent=2)
        demo_report.plots(stage, rows)
        demo_report.markdown(stage, summary, class_names)
    demo_report.print_table(rows)
    if quantized is not None:
        demo_report.print_quantized(quantized)
    print(summary["reading"])
    if tuned is not None:
        print(demo_report.tuned_line(tuned))
    print(f"report: {os.path.join(report_dir, 'report.md')}  ({summary['seconds_total']:.0f} s in all)")
    return 0


def _tune(engine, out, args, step, device):
    """`lantern-run tune` for the demo's lantern++ settings, small (TUNE), installed into the
    engine directory. Returns a summary for the report."""

    settings = tune.tuning_settings(engine, GenerationSettings(
        mode="lantern++", lam=args.lam, k=args.k, cfg_scale=args.cfg_scale, temperature=DEFAULTS["temperature"],
        top_k=DEFAULTS["top_k"]))
    key = settings.key
    conds, note = tune.conditions(engine, TUNE["images"])
    print(f"[{step}] tuning the draft tree for this machine ({key}: {TUNE['images']} calibration images, "
          f"budget {TUNE['budget']}, depth {TUNE['depth']}, batches {', '.join(map(str, TUNE['batches']))})")
    t = time.perf_counter()
    report, chosen = tune.tune(engine, settings, conds, budget=TUNE["budget"], depth=TUNE["depth"],
                               batches=TUNE["batches"], repeats=TUNE["repeats"], loop_runs=TUNE["loop_runs"],
                               seed=args.seed, note=note, threads=args.threads,
                               clock=tune_measure.default_clock(args.threads, device), log=lambda *a: None)
    entry = tune_record.install(out, chosen, report)
    batches = {}
    for images, r in report["batches"].items():
        preset = next((row for row in r["presets"] if row["name"] == args.tree and "skipped" not in row), None)
        batches[images] = {"tree": r["chosen"]["name"], "nodes": r["chosen"]["nodes"], "depth": r["chosen"]["depth"],
                           "predicted_speedup": r["chosen"]["speedup_vs_ar"],
                           "predicted_tokens_per_step": r["chosen"]["tokens_per_step"],
                           "preset": args.tree, "preset_predicted_speedup": preset and preset["speedup_vs_ar"]}
    return {"key": key, "seconds": time.perf_counter() - t, "report": os.path.join(out, entry.report),
            "batches": batches, "cut": TUNE}


def generate_batches(engine, batch, *, classes, seed, **settings):
    """engine.generate over `classes` in calls of `batch` images (None: one call), as one
    Generation: tokens in order, stats summed over the calls (seconds, engine calls, phases,
    histogram) or averaged per image (steps). Image i keeps seed + i, so its tokens are those of
    one call."""
    batch = batch or len(classes)
    parts = [engine.generate(classes=classes[i:i + batch], seed=seed + i, **settings)
             for i in range(0, len(classes), batch)]
    if len(parts) == 1:
        return parts[0]
    stats = dict(parts[0].stats)
    images = np.array([p.stats["images"] for p in parts])
    stats["images"] = int(images.sum())
    stats["steps_per_image"] = float(np.dot(images, [p.stats["steps_per_image"] for p in parts]) / images.sum())
    stats["mean_accepted_length"] = (stats["tokens_per_image"] - 1) / stats["steps_per_image"]
    for key in ("seconds", "engine_seconds", "engine_calls", "host_overhead_seconds", "steps"):
        stats[key] = sum(p.stats[key] for p in parts)
    stats["tokens_per_second"] = stats["images"] * stats["tokens_per_image"] / stats["seconds"]
    stats["phase_seconds"] = {k: sum(p.stats["phase_seconds"].get(k, 0.0) for p in parts)
                              for k in parts[0].stats["phase_seconds"]}
    if stats["accepted_histogram"]:
        stats["accepted_histogram"] = np.sum([p.stats["accepted_histogram"] for p in parts], axis=0).tolist()
    stats["batch"] = batch
    return dataclasses.replace(parts[0], tokens=np.concatenate([p.tokens for p in parts]), stats=stats,
                               body=np.concatenate([p.body for p in parts]))


def quantized_beside(out, scheme, engine, common, runs, results, threads):
    """The demo engine quantized to `scheme` in OUT-SCHEME (replacing an earlier one), checked,
    and the fp32 grid's ar and lantern++ runs repeated on it: speed next to fp32's, acceptance,
    teacher-forced greedy agreement with fp32 and the check's worst relative error."""

    path = f"{out}-{scheme}"
    t = time.perf_counter()
    quantize_engine(out, path, QuantizeOptions(scheme), force=True)
    seconds = time.perf_counter() - t
    report = check_engine(path)
    if not report["ok"]:
        raise LanternError(f"check of the {scheme} engine failed: {report['failures'][0]}")
    worst = max(r["rms_rel"] for r in report["results"] if "rms_rel" in r)
    q = Engine(path, threads=threads)
    q.generate(mode="exact", **{**common, "classes": common["classes"][:2]})  # warm up the sessions
    generations, rows = {}, []
    for mode, extra in runs:
        if mode in QUANTIZED_RUNS:
            generations[mode] = r = q.generate(mode=mode, **common, **extra)
            s, ref = r.stats, results[mode].stats
            rows.append({"mode": mode, "steps_per_image": s["steps_per_image"],
                         "mean_accepted_length": s["mean_accepted_length"],
                         "mean_accepted_length_fp32": ref["mean_accepted_length"], "batch_seconds": s["seconds"],
                         "batch_seconds_fp32": ref["seconds"], "speed_vs_fp32": ref["seconds"] / s["seconds"],
                         "image": f"{scheme}_{mode.replace('+', 'p')}.png"})
    classes = sorted(set(common["classes"]))
    agreement, _ = greedy_agreement(engine, {scheme: q}, classes, common["cfg_scale"])
    speed = float(np.median([r["speed_vs_fp32"] for r in rows]))
    reading = (f"{scheme} runs at {speed:.2f}x fp32's speed here: " +
               ("a step of a model this small is not bound by reading its weights, so weight-only quantization "
                "does not make it faster (on a GPT-B-sized model it does: `python -m lantern.tools.bench.quant`)"
                if speed < 1.1 else "the step reads fewer weight bytes"))
    why = {"int8": "int8 keeps the fp32 model's greedy choices best (int4's teacher-forced agreement on this model is "
                   "~83%, int8's ~95%) and halves the one-token step of a GPT-B-sized model on a CPU",
           "int4": "int4 has the smallest weights and the fastest GPT-B step on a CPU, but is coarser than int8"}[scheme]
    return {"scheme": scheme, "engine": path, "quantize_seconds": round(seconds, 2), "why": why,
            "check": {"ok": report["ok"], "tolerance": TOLERANCES[scheme], "worst_relative_rms": worst},
            "check_line": f"check passed at relative RMS <= {TOLERANCES[scheme]:g} per output (worst {worst:.3g}); "
                          f"quantized in {seconds:.1f} s",
            "teacher_forced_greedy_agreement": agreement[scheme], "greedy_images": len(classes), "results": rows,
            "reading": reading, "generations": generations}


def vars_of(args):
    return {k: v for k, v in vars(args).items() if k != "func"}


def acceptance_per_depth(histogram):
    """P(the draft at depth d is accepted | depth d-1 was), d = 1..depth, from the histogram of
    accepted drafts per step: steps that accepted >= d drafts over steps that accepted >= d-1."""
    h = np.asarray(histogram, dtype=float)
    if h.sum() == 0:
        return []
    reached = h[::-1].cumsum()[::-1]  # reached[d] = steps with >= d accepted drafts
    return [float(reached[d] / reached[d - 1]) if reached[d - 1] else 0.0 for d in range(1, len(h))]


def _ratio(a, b):
    """a / b, or None where b is not a positive number (a phase the step path does not time)."""
    return a / b if b > 0 else None


def _stat(stats, key):
    """A number from a generation's stats (a phase's seconds for 'verify'); NaN if absent."""
    value = stats.get("phase_seconds", {}).get(key) if key == "verify" else stats.get(key)
    return float("nan") if value is None else float(value)
