"""`lantern-export accept`: the step graphs (lantern.export.step_export) of the engine's draft
trees and of AR, step/<tree>-<hash>/<kind>.<phase>.onnx recorded in Manifest.step_graphs, and of
the Jacobi windows asked for (--window, --init), step/jacobi<W>-<init>/<kind>.<phase>.onnx recorded
in Manifest.window_graphs: what every runner's device step runs (add_step_graphs).

Engines written before the step graphs may also hold acceptance-only graphs (accept/*.onnx,
Manifest.acceptance): nothing runs them any more and nothing here writes them; this command
leaves such entries and their files as they are (they stay listed and hashed, so the engine
still verifies)."""
import contextlib
import hashlib
import json
import os
import re

import numpy as np

from lantern.export.step_export import write_step_graphs
from lantern.runtime.errors import LanternError
from lantern.runtime import enginedir
from lantern.runtime.chameleon_prompts import forced_tokens
from lantern.runtime.contracts import SAMPLING_FILTERS, STEP_VERSION
from lantern.runtime.jacobi import INITS, check_window
from lantern.runtime.manifest import StepGraphs, WindowGraphs, describe_files, read_manifest, window_name
from lantern.runtime.tree import build_tree, root_only


def engine_forced_ids(manifest_condition, image):
    """The ids the engine's prompt style forces (ascending), which follow the codes in the
    step graphs' token space; none for class and caption engines."""
    if manifest_condition.kind != "prompt":
        return ()
    forced = forced_tokens(manifest_condition.style, (image.grid_height, image.grid_width))
    return tuple(int(i) for i in np.unique(forced[forced >= 0]))


def _stem(tree):
    """A tree's name made safe for a file name, plus a hash of its paths (names may repeat)."""
    digest = hashlib.sha256(json.dumps(tree.choices).encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', tree.name)[:64]}-{digest}"


def engine_trees(manifest, directory, specs=()):
    """The trees `lantern-export accept` covers: the given specs, else the default tree and every
    tuned tree (whatever backend it was tuned on), each once by its paths."""
    if manifest.tree is None:
        raise LanternError("this engine serves 'ar' only (no drafter): it has no draft trees to add step graphs of")
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
            raise LanternError(f"tree {tree.name!r} has no drafts: AR's step graphs come with every tree's")
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
    """The folder of a tree's step graphs (AR's too): its name made safe, plus a hash of its paths."""
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


def add_step_graphs(directory, specs=(), force=False, opset=18, progress=False, windows=(), inits=("random",)):
    """`lantern-export accept`: export the step graphs of the engine's trees and of AR into it and
    record them; returns the merged manifest. Staged beside the engine's files, moved into step/
    and recorded under the engine's lock; trees whose step graphs are there at this STEP_VERSION
    are skipped unless force. Nothing changes when any step fails. An engine without a drafter
    gets AR's step graphs. windows, inits: the Jacobi windows (slots, the root included) whose
    step graphs to add, each with each init (fresh drafts: random, uniform, spatial); the windows
    the engine has are re-exported as its trees are (force, another STEP_VERSION). An old
    engine's acceptance-only graphs (Manifest.acceptance) are carried over untouched."""
    directory = os.path.abspath(os.fspath(directory))
    manifest = read_manifest(directory, verify=True)
    covered = engine_trees(manifest, directory, specs) if manifest.tree is not None or specs else []
    step_trees = _step_trees(manifest, covered, force)
    todo_windows = _windows(manifest, windows, inits, force)
    if not step_trees and not todo_windows:
        return manifest
    enginedir.check_writable(directory, "lantern-export accept")
    enginedir.inside(directory, "step")  # a planted link is refused before any work
    # per step tree: greedy's begin, levels and accept; sampling's begin, levels and an accept per filter set
    # per window: greedy's begin and accept; sampling's begin and an accept per filter set
    total = sum(2 * (t.depth + 1) + 1 + len(SAMPLING_FILTERS) for t in step_trees) + \
        len(todo_windows) * (3 + len(SAMPLING_FILTERS))
    bar = _progress(total, progress)
    with enginedir.staging(directory, "accept") as stage:
        steps = []
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
                paths = {t.paths for t in step_trees}
                step_entries = {n: e for n, e in current.step_graphs.items() if _step_paths(e) not in paths}
                names = {window_name(w, i) for w, i in todo_windows}
                window_entries = {n: e for n, e in current.window_graphs.items() if n not in names}
                for entry, files in steps:
                    for name in files:
                        enginedir.make_dirs(directory, os.path.dirname(name))
                        os.replace(os.path.join(stage, name), os.path.join(directory, name))
                        moved.append(name)
                    if isinstance(entry, WindowGraphs):
                        window_entries[window_name(entry.window, entry.init)] = entry
                    else:
                        step_entries[entry.tree["name"]] = entry
                stale = current.step_files(windows=True) - current.replace(
                    step_graphs=step_entries, window_graphs=window_entries).step_files(windows=True)
                records = {k: v for k, v in current.files.items() if k not in stale}
                records.update(describe_files(directory, moved))
                merged = current.replace(step_graphs=step_entries, window_graphs=window_entries,
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


def _step_paths(entry):
    return build_tree(entry.tree).paths if entry.tree["paths"] else root_only().paths


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
    p = sub.add_parser("accept", help="add the step graphs (the device step, acceptance included) to an engine",
                       description="Export the step graphs (the whole step between engine calls, acceptance "
                                   "included: greedy and sampling; exact, LANTERN and LANTERN++) of the engine's "
                                   "default tree and its tuned trees (or the trees given) and of AR into "
                                   "ENGINE/step/, and record them in the manifest. Every runner's device step runs "
                                   "them (the default where the engine has them; TensorRT from the plans "
                                   "`lantern-export trt` builds of them); a tree without them runs the host step. "
                                   "An older engine's acceptance-only graphs (ENGINE/accept/) are left as they "
                                   "are: nothing runs them. --window adds the step graphs of a "
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
    manifest = add_step_graphs(args.engine, args.tree, force=args.force, progress=not args.no_progress,
                               windows=args.window, inits=tuple(args.init or ("random",)))
    print(f"step graphs in {args.engine}: "
          f"{', '.join(list(manifest.step_graphs) + list(manifest.window_graphs)) or 'none'} "
          f"({time.perf_counter() - start:.1f}s)")
    return 0

