"""`lantern-export trt ENGINE`: TensorRT plans for an engine directory's graphs.

    lantern-export trt engines/gptb --flavor tensorrt-rtx --compute-capability 89,120 --batch 1 4

One plan per graph (condition, target, drafter, vq_decoder) from the directory's ONNX files,
stored as plans/<flavor>-<compute capabilities>/<graph>.plan (e.g. plans/tensorrt-rtx-SM89_SM120/)
and recorded in the manifest (`Manifest.tensorrt`, with size and sha256 in `files`).

Profiles: one exact profile (min = opt = max) per call regime of the static step plans
(`StepPlan.shapes()`) for every requested batch, CFG setting and tree; AR (the root-only tree) is
always included, since every engine serves it. Within one step plan every regime has a profile of
its own even when shapes coincide (a c2i prefill and an AR verification both feed one token; two
tree depths of equal width): TensorRT lets one execution context hold a profile at a time, and
the backend gives each regime its own context, bound once, with its own CUDA graph. Regimes of
different step plans (another batch, CFG setting or tree) with equal shapes share a profile:
one step plan is bound at a time. The VQ decoder, run once per generation outside the step
plans, gets one profile spanning 1 .. the largest batch.
Why exact profiles and not one profile spanning all regimes: a static tree makes every call's
shape known before the generation starts; an exact profile lets TensorRT choose kernels for
exactly that shape (a spanning profile tunes them at its `opt` only: the one-token AR call and
the 26..60-token verification want different kernels), and it is what gives each regime an
execution context of its own whose shapes and addresses are set once and whose work is captured
once in a CUDA graph. The price is build time and plan size. Measured with TensorRT-RTX 1.7 for
SM89 on this project's 2-core CPU machine (shared, so times are rough; `python -m
lantern.tools.bench.trt_build`), GPT-B fp16 target (212 MiB of weights), batch 1, CFG on and off,
mc_sim_7b_63: 6 exact profiles 425 MiB, 39 s; one spanning profile 220 MiB, 15 s. The size is not
per profile: 3 exact profiles without CFG make 410 MiB, 6 with CFG at batches 1 and 4 only
242 MiB. A call of one token on one row (an M = 1 product: AR or a c2i prefill without CFG)
makes TensorRT keep a second layout of the weights; any other extra profile costs a few MiB
(the GPT-B drafter: 10 exact profiles 91 MiB against 67 MiB spanning; the demo engine's target
38 MiB for 6 against 13 MiB spanning).

Step graphs (`lantern-export accept`: step/TREE-HASH/KIND.PHASE.onnx, the phases the tensorrt
backend's device step runs between the engine calls) of the trees built for and AR get a plan
each, keyed by their file and stored under plans/KEY/step/, with two exact profiles per batch and
CFG setting (step_jobs: one per step parity). Greedy's by default; `--step-graphs greedy
sampling` adds sampling's, whose accepts with top-p took about 5 minutes each to build on this
project's 2-core machine (TensorRT-RTX 1.7; the greedy phases under a second each). TensorRT has no float64: its parser reads
the sampling graphs' float64 tensors as float32.

Full TensorRT builds for the GPU it runs on (`--compute-capability current`, the default); TensorRT
for RTX builds ahead of time for named GPUs on any machine (`--compute-capability 86,89,120`).
Networks are strongly typed: precision comes from the exported graphs (`lantern-export onnx
--dtype fp16|bf16`).

Atomic like `onnx`: the plans are built into a hidden temporary directory inside the engine,
moved to plans/KEY when all of them are built, and manifest.json is rewritten last; a failure at
any point leaves the engine as it was. An existing plans/KEY is replaced only with --force.
"""
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from lantern.export import tensorrt_build as tb
from lantern.runtime import enginedir
from lantern.runtime.backends import runs_plans
from lantern.runtime.backends.cuda import gpu_compute_capability
from lantern.runtime.conditions import condition_adapter
from lantern.runtime.errors import LanternError
from lantern.runtime.graph_step import table_steps
from lantern.runtime.jacobi import check_window
from lantern.runtime.manifest import (describe_files, PlanFile, PlanProfile, quantization_scheme, read_manifest,
                                      TensorRTPlans)
from lantern.runtime.plan import StepPlan
from lantern.runtime.tree import build_tree, root_only

STEP_KINDS = ("greedy", "sampling")
GRAPH_ORDER = ("condition", "target", "drafter", "commit", "vq_decoder")
_TREE_REGIMES = ("verify", "draft", "commit")  # regimes whose shapes depend on the tree (draft0, draft1, ...)


class _ShapesOnly:
    """A stand-in backend for laying out step plans: its buffers are zero-strided views that
    allocate nothing, so the plans of a large batch cost no memory."""

    name = "shapes"

    def __init__(self, float_dtype):
        self.float_dtype = float_dtype

    def zeros(self, shape):
        return np.broadcast_to(np.zeros((), dtype=self.float_dtype), shape)


PROMPT_TOKENS = 16  # a Chameleon prompt's text tokens in the plans' prefill shapes (prompts vary)


def _prefix(manifest, images, cfg, adapter):
    if manifest.condition.kind == "class":
        return adapter.prefix(cfg, classes=[0] * images)
    if manifest.condition.kind == "prompt":
        return adapter.prefix(cfg, prompt_ids=np.full((images, PROMPT_TOKENS), 100, dtype=np.int64))
    caption = np.zeros((images, manifest.condition.tokens, manifest.condition.caption_dim), dtype=np.float32)
    return adapter.prefix(cfg, caption=caption)


def call_shapes(manifest, batches, cfgs, trees, windows=()):
    """{graph: {label: (input shapes {input: shape}, occurrence)}}: every call the step plans make
    for these batches (images per call), CFG settings and trees (Tree objects; AR's root-only
    tree is added) and Jacobi windows (slots; their plans verify a chain with no drafter calls),
    labelled like "verify n1 cfg mc_sim_7b_63" or "verify n1 jacobi16"; occurrence counts the
    earlier calls of the same graph and shapes in the same step plan. Plus the VQ decoder's calls,
    one per batch."""
    adapter = condition_adapter(manifest, np.float32, directory=None)  # ids only: no tokenizer needed
    backend = _ShapesOnly(np.float32)
    settings = dict(cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0)
    out = {graph: {} for graph in GRAPH_ORDER if graph in manifest.graphs}
    for images in batches:
        for cfg in cfgs:
            prefix = _prefix(manifest, images, cfg, adapter)
            steps = [(t, True, t.name) for t in [root_only()] + [t for t in trees if t.depth]]
            steps += [(build_tree(f"chain-{w - 1}"), False, f"jacobi{w}") for w in windows]
            for tree, drafter, name in steps:
                plan = StepPlan(manifest, backend, tree, prefix, settings, drafter)
                seen = {}
                for regime, (graph, shapes) in plan.shapes().items():
                    label = f"{regime} n{images}{' cfg' if cfg else ''}"
                    if regime.startswith(_TREE_REGIMES):
                        label += f" {name}"
                    key = (graph, tuple(sorted(shapes.items())))
                    occurrence = seen[key] = seen.get(key, -1) + 1
                    out[graph].setdefault(label, (shapes, occurrence))
        if "vq_decoder" in out:
            img = manifest.image
            out["vq_decoder"][f"decode n{images}"] = ({"codes": (images, img.grid_height, img.grid_width)}, 0)
    return out


def graph_profiles(manifest, graph, calls):
    """The profiles of one graph's plan: [(labels served, {input: (min, opt, max)})], one exact
    profile per call shape and occurrence (dynamic inputs only, see call_shapes), in first-call
    order; the VQ decoder's one profile spans its calls."""
    dynamic = [name for name, spec in manifest.graphs[graph].inputs.items()
               if any(isinstance(d, str) for d in spec.shape)]
    if graph == "vq_decoder":
        return [(tuple(calls), tb.spanning_profile([{n: s[n] for n in dynamic} for s, _ in calls.values()]))]
    grouped = {}
    for label, (shapes, occurrence) in calls.items():
        key = (tuple((name, tuple(shapes[name])) for name in dynamic), occurrence)
        grouped.setdefault(key, []).append(label)
    return [(tuple(labels), tb.exact_profile(dict(key[0]))) for key, labels in grouped.items()]


def step_plan_dims(manifest, plan, width):
    """{dim name: size} of the step graphs' dynamic axes (lantern.export.step_export._example names
    them) for the generations of one step plan, as GraphStep binds them: images N, rows B, the
    caches' capacities St and Sd, the body length L, the neighbor table's width Kn and the streams'
    table (steps per upload, uniforms per step)."""
    images, tree = plan.images, plan.tree
    block = tree.num_nodes * (1 + (manifest.candidates if tree.depth else 0))  # RandomStreams.block
    dims = {"N": images, "B": plan.rows, "St": plan.target_cache.capacity, "L": len(plan.prefix.forced), "Kn": width,
            "block": block, "steps": table_steps(images, max(plan.image_tokens - 1, 1), block)}
    if plan.drafter_cache is not None:
        dims["Sd"] = plan.drafter_cache.capacity
    return dims


def graph_input_shapes(path):
    """{input: [int or dim name]} of an ONNX graph's inputs, read without its weights."""
    import onnx

    model = onnx.load(path, load_external_data=False)
    return {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}


def step_jobs(directory, manifest, batches, cfgs, trees, kinds=STEP_KINDS):
    """[(step graph file, profiles)] for the step graphs (Manifest.step_graphs) of the given trees
    and AR, in graph_profiles' form: one exact profile per (batch, CFG) shape of the step plans,
    every dynamic axis of a graph's inputs set as the step plan sets it (step_plan_dims), twice:
    GraphStep binds each phase twice (even and odd steps, with the two state buffers swapped) and
    a TensorRT context holds one set of addresses, a profile one context at a time, so each
    parity gets a profile (and context) of its own. Each file is its plan's label. kinds: the
    step graphs' kinds to build ("greedy", "sampling")."""
    adapter = condition_adapter(manifest, np.float32, directory=None)
    backend = _ShapesOnly(np.float32)
    settings = dict(cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0)
    width = manifest.neighbors.k if manifest.neighbors is not None else 1  # an exact-only engine feeds one column
    grouped = {}  # file -> {shapes: [labels]}
    for tree in [root_only()] + [t for t in trees if t.depth]:
        entry = manifest.step_graphs_for(tree)
        if entry is None:
            continue
        files = sorted(f for kind in kinds for f in getattr(entry, kind).values())
        inputs = {f: graph_input_shapes(os.path.join(directory, f)) for f in files}
        for images in batches:
            for cfg in cfgs:
                plan = StepPlan(manifest, backend, tree, _prefix(manifest, images, cfg, adapter), settings, True)
                dims = step_plan_dims(manifest, plan, width)
                for f in files:
                    shapes = {n: tuple(dims[d] if isinstance(d, str) else d for d in shape)
                              for n, shape in inputs[f].items() if any(isinstance(d, str) for d in shape)}
                    for parity in ("even", "odd"):
                        grouped.setdefault(f, {}).setdefault((tuple(sorted(shapes.items())), parity), []).append(
                            f"step n{images}{' cfg' if cfg else ''} {tree.name if tree.depth else 'ar'} {parity}")
    return [(f, [(tuple(labels), tb.exact_profile(dict(key))) for (key, _), labels in profiles.items()])
            for f, profiles in grouped.items()]


def plans_key(flavor, compute_capabilities):
    return f"{flavor}-{'_'.join(compute_capabilities)}"


def resolve_compute_capabilities(flavor, requested):
    """The compute capabilities a build targets, as recorded: 'SM89', ...; 'current' becomes the
    GPU's own (full TensorRT builds only for it)."""
    names = [tb.normalise_compute_capability(c) for c in requested]
    if len(set(names)) != len(names):
        raise LanternError(f"compute capabilities repeat: {', '.join(names)}")
    if flavor == "tensorrt" and names != ["current"]:
        raise LanternError("full TensorRT builds for the GPU it runs on: use --compute-capability current "
                           "(or --flavor tensorrt-rtx to build ahead of time for named GPUs)")
    if "current" in names:

        current = gpu_compute_capability()
        if current is None:
            raise LanternError("building for 'current' needs an NVIDIA GPU and driver, and none is visible here; "
                               "name the GPUs instead, e.g. --compute-capability 89,120 (TensorRT-RTX builds "
                               "ahead of time without a GPU)")
        names = [current if n == "current" else n for n in names]
    return sorted(set(names), key=names.index)


def _trees(manifest, specs, directory):
    if manifest.tree is None:
        if specs:
            raise LanternError("--tree needs an engine with a drafter; this one serves 'ar' only")
        return []
    trees = [build_tree(spec) for spec in specs] if specs else [build_tree(manifest.tree)] + _tuned(manifest, directory)
    for tree in trees:
        if tree.max_width > manifest.candidates:
            raise LanternError(f"tree {tree.name!r} needs {tree.max_width} children per node but the drafter returns "
                               f"{manifest.candidates} candidates")
    names = [t.name for t in trees]
    if len(set(names)) != len(names):
        raise LanternError(f"trees repeat: {', '.join(names)}")
    return trees


def _windows(windows):
    """Jacobi windows to build verification profiles for (slots per verification, root included)."""
    for w in windows:
        check_window(w, "random")
    if len(set(windows)) != len(windows):
        raise LanternError(f"windows repeat: {', '.join(map(str, windows))}")
    return tuple(windows)


def _tuned(manifest, directory):
    """The trees `lantern-run tune` chose on a backend that runs the plans (generate uses them there),
    so a rebuild of the plans keeps covering them; other backends' tuned trees never run on plans."""
    out, seen = [], {build_tree(manifest.tree).paths}
    for entry in manifest.tuned_trees.values():
        for t in entry.trees:
            if runs_plans(entry.backend) and t.file is not None:
                # named after its file (tuned/KEY.bN.json), which is unique
                tree = build_tree(os.path.join(directory, t.file), name=os.path.basename(t.file)[:-len(".json")])
                if tree.paths not in seen:
                    seen.add(tree.paths)
                    out.append(tree)
    return out


def _cfgs(manifest, cfg):
    """None: both where the engine can run CFG; True / False: only that."""
    can = manifest.condition.kind == "caption" or manifest.condition.null_class is not None
    if cfg is True and not can:
        raise LanternError("--cfg: this engine has no null class, so it never runs classifier-free guidance")
    if cfg is None:
        return (False, True) if can else (False,)
    return (bool(cfg),)


def build_engine_plans(directory, *, flavor="tensorrt-rtx", compute_capabilities=("current",), batches=(1,),
                       trees=(), windows=(), cfg=None, step_kinds=("greedy",), timing_cache=None, workspace_bytes=None,
                       tf32=False, force=False, progress=False):
    """Build the plans of every graph of an engine directory and record them in its manifest.
    Returns (key, TensorRTPlans, {graph: build record}). See the module docstring."""
    directory = os.path.abspath(os.fspath(directory))
    manifest = read_manifest(directory, verify=True)  # plans from exactly the graphs the manifest lists
    if (scheme := quantization_scheme(manifest)) != "none":  # TensorRT parses MatMulNBits only with fp16 inputs
        raise LanternError(f"{directory} has {scheme} weight-only graphs (ONNX Runtime's MatMulNBits on fp32), which "
                           f"TensorRT's parser refuses; build plans from the fp32 engine (TensorRT's quantized forms: "
                           f"lantern.export.quantize_qdq)")
    trt = tb.load_tensorrt(flavor)
    if not batches or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batches):
        raise LanternError(f"--batch takes positive integers (images per call), got {list(batches)}")
    batches = tuple(sorted(set(batches)))
    if timing_cache is not None and flavor != "tensorrt":
        raise LanternError("--timing-cache applies to full TensorRT only; TensorRT-RTX has none (its timing-cache "
                           "calls are no-ops: it compiles kernels at run time)")
    ccs = resolve_compute_capabilities(flavor, compute_capabilities)
    key = plans_key(flavor, ccs)
    tree_list = _trees(manifest, trees, directory)
    windows = _windows(windows)
    cfgs = _cfgs(manifest, cfg)
    if key in (manifest.tensorrt or {}) and not force:
        raise LanternError(f"{directory} already has plans/{key}; pass --force to rebuild them")

    enginedir.check_writable(directory, "lantern-export trt")  # before the builds, not after them
    enginedir.inside(directory, f"plans/{key}")  # a planted link there is refused before any work

    calls = call_shapes(manifest, batches, cfgs, tree_list, windows)
    jobs = [(graph, graph_profiles(manifest, graph, calls[graph])) for graph in calls]
    if any(k not in STEP_KINDS for k in step_kinds):
        raise LanternError(f"step graph kinds are {', '.join(STEP_KINDS)}, got {', '.join(step_kinds)}")
    jobs += step_jobs(directory, manifest, batches, cfgs, tree_list, step_kinds)
    files = {**{g: e.file for g, e in manifest.all_graphs().items()}, **{f: f for f in manifest.step_files()}}
    bar = _progress(jobs, progress)
    with enginedir.staging(directory, "trt") as stage:
        plans, records = {}, {}
        for graph, profiles in jobs:
            bar.set_description(f"{graph} ({len(profiles)} profile{'s' if len(profiles) > 1 else ''})")
            plan, record = tb.build_plan(
                os.path.join(directory, files[graph]), [p for _, p in profiles], flavor=flavor,
                compute_capabilities=None if flavor == "tensorrt" else ccs, timing_cache=timing_cache,
                workspace_bytes=workspace_bytes, tf32=tf32, progress=lambda phase, done, total: bar.set_postfix_str(
                    f"{phase} {done}/{total}"[:40], refresh=False))
            # target.plan, step/T-H/greedy.begin.plan (a step graph's plan keeps its file's path: they share names)
            plan_name = f"{(graph if graph == files[graph] else os.path.basename(files[graph]))[:-len('.onnx')]}.plan"
            enginedir.write_file(stage, plan_name, plan)
            records[graph] = record
            held = record["profiles"]  # the profiles as TensorRT holds them
            plans[graph] = PlanFile(file=f"plans/{key}/{plan_name}", profiles=tuple(
                PlanProfile(serves=labels, shapes=shapes) for (labels, _), shapes in zip(profiles, held)))
            bar.update()
        entry = TensorRTPlans(
            flavor=flavor, version=trt.__version__, compute_capabilities=tuple(ccs), plans=plans, batches=batches,
            cfg=cfgs, trees=tuple(t.name for t in tree_list),
            builder={**records[jobs[0][0]]["builder"], "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     # what each step graph's plan was built from: the runtime refuses a plan of a re-exported one
                     "step_files": {g: manifest.files[g].sha256 for g in plans if g in files and g == files[g]}})
        bar.close()
        _commit(directory, manifest, key, entry, stage, force)
    return key, entry, records


def _commit(directory, built_from, key, entry, stage, force):
    """Under the engine's lock: re-read the manifest (a tune may have added an entry meanwhile),
    check the graphs are still the ones the plans were built from, move the staged plans to
    plans/KEY (an old build aside first) and write the merged manifest; undo it all if any step
    fails."""
    with enginedir.locked(directory, "lantern-export trt"):
        manifest = read_manifest(directory, verify=True)
        now, then = manifest.all_graphs(), built_from.all_graphs()
        changed = sorted(g for g in set(now) | set(then)
                         if g not in now or now.get(g) != then.get(g)
                         or manifest.files.get(now[g].file) != built_from.files.get(now[g].file))
        changed += sorted(f for f in manifest.step_files() ^ built_from.step_files() | {
            f for f in manifest.step_files() if manifest.files.get(f) != built_from.files.get(f)})
        if changed:
            raise LanternError(f"{directory}: the graphs ({', '.join(changed)}) changed while the plans were built; "
                               f"run `lantern-export trt` again")
        if key in (manifest.tensorrt or {}) and not force:
            raise LanternError(f"{directory} got plans/{key} from another build meanwhile; pass --force to rebuild them")
        plans_dir = enginedir.inside(directory, "plans", kind="dir")
        final = enginedir.inside(directory, f"plans/{key}", kind="dir")
        made_plans_dir = not os.path.isdir(plans_dir)
        enginedir.make_dirs(directory, "plans")
        os.unlink(os.path.join(stage, enginedir.STAGE_OWNER))  # the plans directory holds plans only
        old = None
        if os.path.lexists(final):
            old = tempfile.mkdtemp(prefix=f"{enginedir.STAGE_PREFIX}{key}.old-", dir=plans_dir)
            os.rmdir(old)
            os.rename(final, old)
        try:
            os.rename(stage, final)
            prefix = f"plans/{key}/"
            files = {name: rec for name, rec in manifest.files.items() if not name.startswith(prefix)}
            files.update(describe_files(directory, [p.file for p in entry.plans.values()]))
            builds = {k: v for k, v in (manifest.tensorrt or {}).items() if k != key}
            builds[key] = entry
            manifest.replace(tensorrt=builds, files=dict(sorted(files.items()))).write(directory)
        except BaseException:
            if os.path.isdir(final):
                shutil.rmtree(final, ignore_errors=True)
            if old is not None:
                os.rename(old, final)
            if made_plans_dir:
                shutil.rmtree(plans_dir, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


class _NoBar:
    def set_description(self, _):
        pass

    def set_postfix_str(self, *_, **__):
        pass

    def update(self, n=1):
        pass

    def close(self):
        pass


def _progress(jobs, enabled):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=len(jobs), unit="plan", file=sys.stderr,
                bar_format="{desc:<26} {bar:20} {n}/{total} [{elapsed}]{postfix}")


# ---------------------------------------------------------------------------------------------
# CLI


def _capabilities(text):
    return [c for c in text.replace(" ", ",").split(",") if c]


def add_parser(sub):
    p = sub.add_parser("trt", help="build TensorRT plans for an engine directory's graphs",
                       description=__doc__.split("\n\n")[0] + " One exact optimization profile per call shape "
                                   "of the static step plans; written atomically into the engine directory.")
    p.add_argument("engine", help="engine directory (from lantern-export onnx)")
    p.add_argument("--flavor", default="tensorrt-rtx", choices=tuple(tb.FLAVORS),
                   help="tensorrt (full TensorRT: datacenter GPUs, builds for the GPU present) or tensorrt-rtx "
                        "(TensorRT for RTX: builds ahead of time, no GPU needed); default tensorrt-rtx")
    p.add_argument("--compute-capability", type=_capabilities, default=["current"],
                   help="GPUs to build for: current (the GPU here, the default) or a list like 86,89,120 "
                        "(tensorrt-rtx only)")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="images per call to build for (default 1)")
    p.add_argument("--tree", nargs="+", default=[], help="draft trees to build for, presets or JSON files "
                                                         "(default: the engine's tree and the trees tuned on the "
                                                         "tensorrt backend); AR is always included")
    p.add_argument("--window", type=int, nargs="+", default=[],
                   help="Jacobi windows to build for (slots per verification, e.g. 16: `lantern-run generate "
                        "--proposer jacobi --window 16` on the tensorrt backend); default none")
    cfg = p.add_mutually_exclusive_group()
    cfg.add_argument("--cfg", dest="cfg", action="store_true", default=None,
                     help="only with classifier-free guidance (default: with and without, where the engine can)")
    cfg.add_argument("--no-cfg", dest="cfg", action="store_false", help="only without classifier-free guidance")
    p.add_argument("--step-graphs", nargs="*", default=["greedy"], choices=STEP_KINDS, metavar="KIND",
                   help="the kinds of step graphs (lantern-export accept) to build plans of, for the tensorrt "
                        "backend's device step: greedy, sampling (default greedy: sampling's top-p accepts take "
                        "minutes each to build; none given: no step plans)")
    p.add_argument("--timing-cache", help="full TensorRT: a timing cache file, read if present and saved after")
    p.add_argument("--workspace-mib", type=int, help="the builder's workspace limit (default TensorRT's)")
    p.add_argument("--tf32", action="store_true", help="let fp32 products run in TF32 (off: fp32 graphs compute in fp32)")
    p.add_argument("--force", action="store_true", help="rebuild plans this engine already has for the same key")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args):
    start = time.perf_counter()
    if args.workspace_mib is not None and args.workspace_mib < 1:
        raise LanternError(f"--workspace-mib must be a positive integer, got {args.workspace_mib}")
    key, entry, records = build_engine_plans(
        args.engine, flavor=args.flavor, compute_capabilities=args.compute_capability, batches=args.batch,
        trees=args.tree, windows=args.window, cfg=args.cfg, step_kinds=tuple(args.step_graphs),
        timing_cache=args.timing_cache,
        workspace_bytes=None if args.workspace_mib is None else args.workspace_mib * 2**20, tf32=args.tf32,
        force=args.force,
        progress=not args.no_progress)
    steps = {g: r for g, r in records.items() if g.startswith("step/")}
    for graph, record in records.items():
        if graph not in steps:
            print(f"{graph:<11} {len(entry.plans[graph].profiles):>3} profile(s) {record['plan_bytes'] / 2**20:8.1f} "
                  f"MiB {record['build_seconds']:7.1f} s")
    if steps:
        print(f"{len(steps)} step graphs {sum(len(entry.plans[g].profiles) for g in steps):>3} profile(s) "
              f"{sum(r['plan_bytes'] for r in steps.values()) / 2**20:8.1f} MiB "
              f"{sum(r['build_seconds'] for r in steps.values()):7.1f} s")
    cfg = {(False,): "no CFG", (True,): "CFG", (False, True): "with and without CFG"}[entry.cfg]
    print(f"plans/{key}: {entry.flavor} {entry.version} for {', '.join(entry.compute_capabilities)}; batch "
          f"{', '.join(map(str, entry.batches))}, {cfg}, trees {', '.join(('ar',) + entry.trees)}; "
          f"{time.perf_counter() - start:.1f}s")
    return 0
