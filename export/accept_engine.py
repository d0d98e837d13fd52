"""An engine's acceptance graphs (the modules and their export: lantern.export.accept_graphs):
written into the engine directory per draft tree, accept/<tree>-<hash>.<kind>.onnx recorded in
Manifest.acceptance (`lantern-export accept`, add_acceptance_graphs), and checked on ONNX Runtime
against their torch modules and the numpy specification (`lantern-export check`,
check_acceptance). The same command writes the step graphs (lantern.export.step_export) of those
trees and of AR, step/<tree>-<hash>/<kind>.<phase>.onnx recorded in Manifest.step_graphs, and of
the Jacobi windows asked for (--window, --init), step/jacobi<W>-<init>/<kind>.<phase>.onnx recorded
in Manifest.window_graphs: what ONNX Runtime's device step runs."""
import contextlib
import os

import numpy as np
import torch

from lantern.export.accept_graphs import KINDS, OUTPUTS, contract_inputs, export_acceptance
from lantern.export.step_export import write_step_graphs
from lantern.runtime.errors import LanternError
from lantern.runtime import accept as acceptance, enginedir
from lantern.runtime.backends import ONNXRUNTIME, TORCH
from lantern.runtime.chameleon_prompts import forced_tokens
from lantern.runtime.enginedir import inside
from lantern.runtime.contracts import SAMPLING_FILTERS, STEP_VERSION
from lantern.runtime.jacobi import INITS, check_window
from lantern.runtime.manifest import (AcceptanceGraphs, Graph, StepGraphs, TensorSpec, WindowGraphs, describe_files,
                                      read_manifest, window_name)
from lantern.runtime.sampling import Sampling
from lantern.runtime.tree import build_tree, root_only
from lantern.runtime.vocabulary import VocabularyView

# ---------------------------------------------------------------------------------------------
# In the engine directory: accept/<tree>-<hash>.<kind>.onnx, recorded in Manifest.acceptance


def engine_forced_ids(manifest_condition, image):
    """The ids the engine's prompt style forces (ascending), which follow the codes in the
    acceptance graphs' token space; none for class and caption engines."""
    if manifest_condition.kind != "prompt":
        return ()
    forced = forced_tokens(manifest_condition.style, (image.grid_height, image.grid_width))
    return tuple(int(i) for i in np.unique(forced[forced >= 0]))


def _stem(tree):
    """A tree's name made safe for a file name, plus a hash of its paths (names may repeat)."""
    import hashlib
    import json
    import re

    digest = hashlib.sha256(json.dumps(tree.choices).encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', tree.name)[:64]}-{digest}"


def acceptance_file(tree, kind):
    """The file of a tree's acceptance graph of `kind`."""
    return f"accept/{_stem(tree)}.{kind}.onnx"


def write_acceptance_graphs(directory, tree, vocabulary, condition, image, candidates, kinds=tuple(KINDS),
                            opset=18, keep=None):
    """Export the acceptance graphs of `tree` into `directory` (a staging copy of the engine):
    (AcceptanceGraphs, [files written]). keep: {kind: Graph} of the tree's entry the entry keeps
    for the kinds not exported here (an entry always has its greedy graph)."""
    forced = engine_forced_ids(condition, image)
    columns = np.concatenate([np.arange(vocabulary.image_start, vocabulary.image_end), np.array(forced, dtype=np.int64)])
    enginedir.make_dirs(directory, "accept")
    graphs, files = {}, []
    for kind in kinds:
        name = acceptance_file(tree, kind)
        io_spec = export_acceptance(tree, columns, vocabulary.codes, vocabulary.size, os.path.join(directory, name),
                                    opset, kind, candidates)
        graphs[kind] = Graph(file=name, contract=f"accept_{kind}", dtype="fp32",
                             inputs={k: TensorSpec(v["dtype"], tuple(v["shape"])) for k, v in io_spec["inputs"].items()},
                             outputs={k: TensorSpec(v["dtype"], tuple(v["shape"])) for k, v in io_spec["outputs"].items()})
        files.append(name)
    return AcceptanceGraphs(tree=tree.to_json(), forced_ids=forced, **{**(keep or {}), **graphs}), files


def engine_trees(manifest, directory, specs=()):
    """The trees `lantern-export accept` covers: the given specs, else the default tree and every
    tuned tree (whatever backend it was tuned on), each once by its paths."""
    if manifest.tree is None:
        raise LanternError("this engine serves 'ar' only (no drafter): there is nothing to accept")
    if specs:
        trees = [build_tree(spec) for spec in specs]
    else:
        trees = [build_tree(manifest.tree)]
        for entry in manifest.tuned_trees.values():
            for t in entry.trees:
                if t.file is not None:
                    trees.append(build_tree(os.path.join(directory, t.file), name=os.path.basename(t.file)[:-len(".json")]))
    out, seen = [], set()
    for tree in trees:
        if tree.depth == 0:
            raise LanternError(f"tree {tree.name!r} has no drafts: AR needs no acceptance graph")
        if tree.max_width > manifest.candidates:
            raise LanternError(f"tree {tree.name!r} needs {tree.max_width} children per node but the drafter returns "
                               f"{manifest.candidates} candidates")
        if tree.paths not in seen:
            seen.add(tree.paths)
            out.append(tree)
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise LanternError(f"trees repeat a name with other paths: {', '.join(names)}")
    return out


def step_folder(tree):
    """The folder of a tree's step graphs (AR's too), named as its acceptance graphs are."""
    return f"step/{_stem(tree)}"


def engine_columns(manifest):
    """(forced ids, the token space's vocabulary ids: the image codes, then the forced ids)."""
    v = manifest.vocabulary
    forced = engine_forced_ids(manifest.condition, manifest.image)
    return forced, np.concatenate([np.arange(v.image_start, v.image_end), np.array(forced, dtype=np.int64)])


def write_engine_step_graphs(directory, manifest, tree, opset=18, progress=None):
    """Export the step graphs of `tree` (greedy and sampling) into `directory` (a staging copy of
    the engine): (StepGraphs, [files written])."""
    forced, columns = engine_columns(manifest)
    folder = step_folder(tree)
    enginedir.make_dirs(directory, folder)
    files = write_step_graphs(directory, folder, manifest, tree, columns, opset=opset, progress=progress,
                              cache=os.environ.get("LANTERN_GRAPH_CACHE") or None)  # as `lantern-export onnx`'s
    entry = StepGraphs(tree=tree.to_json(), forced_ids=forced, version=STEP_VERSION, greedy=files["greedy"],
                       sampling=files["sampling"])
    return entry, sorted(entry.files())


def write_engine_window_graphs(directory, manifest, window, init, opset=18, progress=None):
    """Export the step graphs of a Jacobi window of `window` slots and fresh drafts `init`
    (lantern.export.step_jacobi; greedy and sampling) into `directory` (a staging copy of the
    engine): (WindowGraphs, [files written]). The stride of the spatial init is an input: one
    entry serves every grid."""
    forced, columns = engine_columns(manifest)
    folder = f"step/{window_name(window, init)}"
    enginedir.make_dirs(directory, folder)
    files = write_step_graphs(directory, folder, manifest, build_tree(f"chain-{window - 1}"), columns, opset=opset,
                              progress=progress, proposer="jacobi", init=init,
                              cache=os.environ.get("LANTERN_GRAPH_CACHE") or None)
    entry = WindowGraphs(window=window, init=init, forced_ids=forced, version=STEP_VERSION, greedy=files["greedy"],
                         sampling=files["sampling"])
    return entry, sorted(entry.files())


def _windows(manifest, windows, inits, force):
    """The (window, init) pairs whose graphs to write: each window given with each init, and the
    windows the engine has (so --force, or another STEP_VERSION, re-exports them as it does the
    trees), less those whose graphs are there at this STEP_VERSION (unless force)."""
    asked = {(int(w), i) for w in windows for i in inits}
    for w, i in asked:
        check_window(w, i)
    asked |= {(e.window, e.init) for e in manifest.window_graphs.values()}
    out = []
    for w, i in sorted(asked):
        entry = manifest.window_graphs_for(w, i)
        if force or entry is None or entry.version != STEP_VERSION:
            out.append((w, i))
    return out


def _step_trees(manifest, trees, force):
    """The trees whose step graphs to write: those `accept` covers and AR, less the ones whose
    graphs are there at this STEP_VERSION (unless force: an old version is always re-exported)."""
    out = []
    for tree in list(trees) + [root_only()]:
        entry = manifest.step_graphs_for(tree)
        if force or entry is None or entry.version != STEP_VERSION:
            out.append(tree)
    return out


def add_acceptance_graphs(directory, specs=(), kinds=tuple(KINDS), force=False, opset=18, acceptance=True,
                          step=True, progress=False, windows=(), inits=("random",)):
    """`lantern-export accept`: export the acceptance graphs of the engine's trees and the step
    graphs of those trees and AR into it and record them; returns the merged manifest. Staged
    beside the engine's files, moved into accept/ and step/ and recorded under the engine's lock;
    trees that have graphs (step graphs: of this STEP_VERSION) are skipped unless force. Nothing
    changes when any step fails. acceptance / step: which of the two to write (the demo and the
    test engines write step graphs only). An engine without a drafter gets AR's step graphs.
    windows, inits: the Jacobi windows (slots, the root included) whose step graphs to add, each
    with each init (fresh drafts: random, uniform, spatial); the windows the engine has are
    re-exported as its trees are (force, another STEP_VERSION)."""
    directory = os.path.abspath(os.fspath(directory))
    manifest = read_manifest(directory, verify=True)
    covered = engine_trees(manifest, directory, specs) if manifest.tree is not None or specs else []
    trees = [t for t in covered if acceptance and (force or manifest.acceptance_for(t) is None or
             any(getattr(manifest.acceptance_for(t), k) is None for k in kinds))]
    step_trees = _step_trees(manifest, covered, force) if step else []
    todo_windows = _windows(manifest, windows, inits, force) if step else []
    if not trees and not step_trees and not todo_windows:
        return manifest
    enginedir.check_writable(directory, "lantern-export accept")
    enginedir.inside(directory, "accept")  # a planted link is refused before any work
    enginedir.inside(directory, "step")
    # per step tree: greedy's begin, levels and accept; sampling's begin, levels and an accept per filter set
    # per window: greedy's begin and accept; sampling's begin and an accept per filter set
    total = len(trees) * len(KINDS) + sum(2 * (t.depth + 1) + 1 + len(SAMPLING_FILTERS) for t in step_trees) + \
        len(todo_windows) * (3 + len(SAMPLING_FILTERS))
    bar = _progress(total, progress)
    with enginedir.staging(directory, "accept") as stage:
        built, steps = [], []
        for t in trees:
            # the tree's other kinds stay as they are; a tree without a greedy graph gets one (an
            # entry always has it)
            old = manifest.acceptance_for(t)
            keep = {k: getattr(old, k) for k in KINDS if old is not None and k not in kinds and getattr(old, k)}
            todo = tuple(k for k in KINDS if k in kinds or (k == "greedy" and "greedy" not in keep))
            bar.set_description(f"accept {t.name}")
            built.append(write_acceptance_graphs(stage, t, manifest.vocabulary, manifest.condition, manifest.image,
                                                 manifest.candidates, todo, opset, keep))
            bar.update(len(KINDS))
        for t in step_trees:
            bar.set_description(f"step {t.name}")
            steps.append(write_engine_step_graphs(stage, manifest, t, opset, lambda: bar.update(1)))
        for w, i in todo_windows:
            bar.set_description(f"step {window_name(w, i)}")
            steps.append(write_engine_window_graphs(stage, manifest, w, i, opset, lambda: bar.update(1)))
        bar.close()
        with enginedir.locked(directory, "lantern-export accept"):
            current = read_manifest(directory, verify=True)
            moved = []
            try:
                paths = {t.paths for t in trees}
                entries = {n: e for n, e in current.acceptance.items() if _paths(e) not in paths}
                paths = {t.paths for t in step_trees}
                step_entries = {n: e for n, e in current.step_graphs.items() if _step_paths(e) not in paths}
                names = {window_name(w, i) for w, i in todo_windows}
                window_entries = {n: e for n, e in current.window_graphs.items() if n not in names}
                for entry, files in built + steps:
                    for name in files:
                        enginedir.make_dirs(directory, os.path.dirname(name))
                        os.replace(os.path.join(stage, name), os.path.join(directory, name))
                        moved.append(name)
                    if isinstance(entry, WindowGraphs):
                        window_entries[window_name(entry.window, entry.init)] = entry
                    else:
                        (entries if isinstance(entry, AcceptanceGraphs) else step_entries)[entry.tree["name"]] = entry
                stale = (_files(current.acceptance) - _files(entries)) | (_step_files(current) - _step_files(
                    current.replace(step_graphs=step_entries, window_graphs=window_entries)))
                records = {k: v for k, v in current.files.items() if k not in stale}
                records.update(describe_files(directory, moved))
                merged = current.replace(acceptance=entries, step_graphs=step_entries, window_graphs=window_entries,
                                         files=dict(sorted(records.items())))
                merged.write(directory)
            except BaseException:
                for name in moved:
                    if name not in current.files:
                        with contextlib.suppress(OSError):
                            os.unlink(os.path.join(directory, name))
                raise
            for name in stale - set(moved):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))
    return merged


def _paths(entry):
    return build_tree(entry.tree).paths


def _step_paths(entry):
    return build_tree(entry.tree).paths if entry.tree["paths"] else root_only().paths


def _files(acceptance):
    return {g.file for e in acceptance.values() for g in (e.greedy, e.sampling) if g is not None}


def _step_files(manifest):
    return {f for e in list(manifest.step_graphs.values()) + list(manifest.window_graphs.values()) for f in e.files()}


class _NoBar:
    def update(self, n=1):
        pass

    def set_description(self, text):
        pass

    def close(self):
        pass


def _progress(total, enabled):
    if not enabled or not total:
        return _NoBar()
    import sys

    from tqdm import tqdm

    return tqdm(total=total, unit="graph", file=sys.stderr, bar_format="{desc:<26} {bar:20} {n}/{total} [{elapsed}]")


def add_parser(sub):
    p = sub.add_parser("accept", help="add the step graphs and acceptance graphs (the device step) to an engine",
                       description="Export, for the engine's default tree and its tuned trees (or the trees "
                                   "given), the acceptance graphs (greedy and sampling; exact, LANTERN and "
                                   "LANTERN++ in one graph per tree) into ENGINE/accept/, and the step graphs "
                                   "(the whole step between engine calls, greedy and sampling) of those trees and "
                                   "of AR into ENGINE/step/, and record them in the manifest. ONNX Runtime runs "
                                   "the step graphs (its device step, the default where the engine has them); a "
                                   "tree without them runs the host step. --window adds the step graphs of a "
                                   "Jacobi window (`lantern-run generate --proposer jacobi --window W --init "
                                   "INIT`; one set per window and init, any grid) into ENGINE/step/jacobiW-INIT/. "
                                   "Trees and windows that have graphs are skipped; step graphs of another "
                                   "lantern's step version are exported again.")
    p.add_argument("engine", help="engine directory")
    p.add_argument("--tree", action="append", default=[], help="a tree (preset name or JSON file); repeatable")
    p.add_argument("--window", action="append", type=int, default=[],
                   help="a Jacobi window's slots, the root included (as `lantern-run generate --window`): add its "
                        "step graphs, so ONNX Runtime runs that window on its device step; repeatable")
    p.add_argument("--init", action="append", choices=INITS, default=None,
                   help="the windows' fresh drafts (as `lantern-run generate --init`; default random); repeatable")
    p.add_argument("--force", action="store_true", help="export again trees and windows that have graphs")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args):
    import time

    start = time.perf_counter()
    if args.init and not args.window:
        raise LanternError("--init names the fresh drafts of the windows --window adds: give --window too")
    manifest = add_acceptance_graphs(args.engine, args.tree, force=args.force, progress=not args.no_progress,
                                     windows=args.window, inits=tuple(args.init or ("random",)))
    names = ", ".join(f"{n} ({'+'.join(k for k in ('greedy', 'sampling') if getattr(e, k) is not None)})"
                      for n, e in manifest.acceptance.items())
    print(f"acceptance graphs in {args.engine}: {names or 'none'}; step graphs: "
          f"{', '.join(list(manifest.step_graphs) + list(manifest.window_graphs)) or 'none'} "
          f"({time.perf_counter() - start:.1f}s)")
    return 0


# ---------------------------------------------------------------------------------------------
# `lantern-export check`: each acceptance graph on ONNX Runtime against its torch module and the
# numpy specification, on seeded random cases (ties, -inf, CFG, forced tokens, every rule)


def check_acceptance(directory, manifest, rng, cases=4, images=3, sampled_images=10):
    """Result rows in `check`'s format ({"graph", "case", "output", "ok", "note"}), one per graph,
    case and comparison. Greedy: ONNX Runtime == the module (float32) == the spec, exactly.
    Sampling: the module in float64 == the spec exactly (the module is right), and ONNX Runtime
    and the module in float32 take the spec's path in at least SAMPLING_AGREEMENT of the images
    (float32 rounding flips decisions at their edge; the emitted distribution is tested in
    tests/test_accept_graphs.py)."""
    import onnxruntime as ort

    table = None
    if manifest.neighbors is not None:
        table = np.load(inside(directory, manifest.neighbors.file, kind="file"), allow_pickle=False).astype(np.int64)
    rows = []
    for name, entry in manifest.acceptance.items():
        tree = build_tree(entry.tree)
        for kind in ("greedy", "sampling"):
            graph = getattr(entry, kind)
            if graph is None:
                continue
            options = ort.SessionOptions()
            options.intra_op_num_threads = 2
            session = ort.InferenceSession(inside(directory, graph.file, kind="file"), options,
                                           providers=["CPUExecutionProvider"])
            label = f"accept_{kind}@{name}"
            for case in range(cases):
                feeds, logits, view, rule, filters = _check_case(rng, manifest, entry, tree, table, case,
                                                                 images if kind == "greedy" else sampled_images, kind)
                got = dict(zip(graph.outputs, session.run(list(graph.outputs), feeds)))
                module = KINDS[kind](tree, np.concatenate([np.arange(manifest.vocabulary.image_start,
                                                                     manifest.vocabulary.image_end),
                                                           np.array(entry.forced_ids, dtype=np.int64)]),
                                     manifest.vocabulary.codes).eval()
                names = contract_inputs(kind)
                with torch.no_grad():
                    mine = dict(zip(OUTPUTS, (o.numpy() for o in module(*(torch.as_tensor(feeds[n]) for n in names)))))
                what = f"{rule.name}{' cfg' if (feeds['cond_rows'] != feeds['uncond_rows']).any() else ''}"
                if kind == "greedy":
                    want = acceptance.accept_greedy_batch(tree, feeds["tokens"], logits, rule, feeds["neighbors"])
                    rows += [_same_rows(label, what, ONNXRUNTIME.name, got, want),
                             _same_rows(label, what, TORCH.name, mine, want)]
                    continue
                temperature, top_k, top_p = filters
                want = acceptance.accept_sampling_batch(tree, feeds["tokens"], logits, feeds["draft_ids"],
                                                        feeds["draft_probs"], rule, feeds["uniforms"], feeds["neighbors"],
                                                        temperature=temperature, top_k=top_k, top_p=top_p)
                wide = {n: torch.as_tensor(feeds[n]).to(torch.float64) if feeds[n].dtype == np.float32
                        else torch.as_tensor(feeds[n]) for n in names}
                with torch.no_grad():
                    exact = dict(zip(OUTPUTS, (o.numpy() for o in module(*(wide[n] for n in names)))))
                what += f" T{temperature:g} top-k {top_k} top-p {top_p:g}"
                rows.append(_same_rows(label, what, "torch float64", exact, want))
                rows += [_agreement_row(label, what, who, out, want) for who, out in ((ONNXRUNTIME.name, got),
                                                                                      ("torch float32", mine))]
    return rows


SAMPLING_AGREEMENT = 0.8


def _same_rows(label, what, who, got, want):
    fields = ("accepted", "next_token", "path", "decisions")
    bad = [f for f in fields if not np.array_equal(got[f], getattr(want, f))] + (["invalid"] if got["invalid"].any() else [])
    return {"graph": label, "case": what, "output": f"{who} == spec", "ok": not bad,
            "note": f"{', '.join(bad)} differ from lantern.runtime.accept" if bad else "equal"}


def _agreement_row(label, what, who, got, want):
    same = (got["path"] == want.path).all(axis=1) & ~got["invalid"]
    share = float(same.mean())
    return {"graph": label, "case": what, "output": f"{who} paths", "ok": share >= SAMPLING_AGREEMENT,
            "note": f"{int(same.sum())}/{len(same)} images take the spec's path (needs {SAMPLING_AGREEMENT:.0%})"}


def _check_case(rng, manifest, entry, tree, table, case, images, kind):
    """One seeded case: (feeds, the spec's combined logits, view, rule, filters)."""
    voc = manifest.vocabulary
    M, V = tree.num_nodes, voc.size
    length = 4 * (tree.depth + 2)
    forced = np.full(length, -1, dtype=np.int64)
    if entry.forced_ids:  # every forced id somewhere, so the view's columns are the graph's
        spots = rng.choice(length, len(entry.forced_ids) + 2, replace=False)
        forced[spots] = np.resize(np.array(entry.forced_ids), len(spots))
    view = VocabularyView(voc, forced)
    cfg = case % 2 == 1
    rows = 2 * images if cfg else images
    raw = (rng.integers(-6, 6, size=(rows, M, V)) / (1 + case % 3)).astype(np.float32)  # ties
    raw[rng.random(raw.shape) < 0.1] = -50.0 if cfg else -np.inf
    raw[..., voc.image_start] = np.maximum(raw[..., voc.image_start], -1.0)  # a finite image logit per row
    for i in entry.forced_ids:
        raw[..., i] = np.maximum(raw[..., i], -1.0)
    cond_rows = np.arange(images)
    uncond_rows = cond_rows + images if cfg else cond_rows
    scale, interval = (3.0, int(rng.integers(-1, 6))) if cfg else (1.0, -1)
    count = rng.integers(1, length - tree.depth, size=images)
    body = count[:, None] + tree.depths[None, :]
    gathered = view.gather(raw).astype(np.float32)
    cond, uncond = gathered[cond_rows], gathered[uncond_rows]
    with np.errstate(invalid="ignore"):
        logits = cond.copy() if not cfg else uncond + np.float32(scale) * (cond - uncond)
    if interval >= 0:
        logits[body >= interval] = cond[body >= interval]
    logits = view.force(logits, body)
    width = 4 if table is None else table.shape[1]
    if table is None:
        neighbors = np.stack([np.delete(np.arange(view.size), c)[:width] for c in range(view.size)])
    else:
        neighbors = view.neighbors(table)
    k = min(4, width)
    rule = [acceptance.Exact(), acceptance.LanternPP(k=k, lam=2.0), acceptance.Lantern(k=k, delta=0.1),
            acceptance.LanternPP(k=k, lam=1.0)][case % 4]
    top = logits.argmax(axis=2)
    parent = np.maximum(tree.parents, 0)
    feeds = dict(logits=raw, cond_rows=cond_rows, uncond_rows=uncond_rows, cfg_scale=np.array([scale], np.float32),
                 cfg_interval=np.array([interval]), count=count, forced_columns=view.forced_column)
    filters = None
    if kind == "greedy":
        near = neighbors[top[:, parent], rng.integers(0, k, size=(images, M))]
        pick = rng.random((images, M))
        tokens = np.where(pick < 0.5, top[:, parent], np.where(pick < 0.8, near, rng.integers(0, view.size, (images, M))))
        feeds["tokens"] = tokens
    else:
        K = manifest.candidates
        ids = np.stack([[np.concatenate([[top[n, i]], rng.permutation(np.delete(np.arange(view.size), top[n, i]))[:K - 1]])
                         for i in range(M)] for n in range(images)])
        probs = rng.dirichlet(np.full(K, 0.5), size=(images, M)).astype(np.float32)
        tokens = np.zeros((images, M), dtype=np.int64)
        race = rng.random((images, M, K))
        for level in tree.levels:
            drawn = Sampling().children(ids[:, level.parents], probs[:, level.parents], level.width, race[:, level.parents])
            tokens[:, level.nodes] = drawn[:, np.arange(len(level.nodes)), level.ranks]
            column = view.forced_at(count - 1 + level.depth)  # forced drafts as the loop makes them
            for n in np.flatnonzero(column >= 0):
                tokens[n, level.nodes] = column[n]
                ids[n, level.parents] = column[n]
                probs[n, level.parents] = np.eye(K, dtype=np.float32)[0]
        filters = [(1.0, 0, 1.0), (0.8, 8, 1.0), (1.2, 0, 0.8), (1.0, 16, 0.7)][case % 4]
        feeds.update(tokens=tokens, draft_ids=ids, draft_probs=probs,
                     uniforms=rng.random((images, M)).astype(np.float32).astype(np.float64))
    tokens[:, 0] = rng.integers(0, voc.codes, size=images)
    feeds.update(neighbors=neighbors.astype(np.int64), k=np.array([rule.k]),
                 lam=np.array([getattr(rule, "lam", 1.0)], np.float32),
                 delta=np.array([getattr(rule, "delta", 0.0)], np.float32))
    if kind == "sampling":
        feeds.update(temperature=np.array([filters[0]], np.float32), top_k=np.array([filters[1]]),
                     top_p=np.array([filters[2]], np.float32))
        feeds["uniforms"] = feeds["uniforms"].astype(np.float32)  # float32 values: the spec reads the same numbers
    return feeds, logits, view, rule, filters
