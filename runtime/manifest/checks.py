"""What the manifest's records must agree on: within a record (its fields; a field's own range is
its rule in records.py), and across the manifest (the modes' graphs, the files, the caches, the
plans). Every failure is one LanternError line through the reader, naming the field and the fix.
"""
import dataclasses

from lantern.runtime.contracts import ACCEPT_CONTRACTS, ACCEPT_PHASES, GRAPHS, IN_PLACE_CONTRACTS, STEP_VERSION, graph_io
from lantern.runtime.errors import LanternError
from lantern.runtime.manifest.records import (QUANT_SCHEMES, QUANTIZABLE, READD_ACCEPTANCE, READD_STEP, READD_WINDOW,
                                              REBUILD_PLANS, RETUNE, AcceptanceGraphs, CacheBudget, Condition, Graph,
                                              Quantization, Shape, StepGraphs, TunedSettings, TunedTree, Vocabulary,
                                              WindowGraphs, window_name)
from lantern.runtime.manifest.schema import Reader, file_references, record_check
from lantern.runtime.tree import build_tree


# ---------------------------------------------------------------------------------------------
# What a record's fields must agree on (a field's own range is its rule)


@record_check(Shape)
def _check_shape(s, r):
    if s.query_heads % s.kv_heads:
        r.fail("query_heads", f"({s.query_heads}) is not a multiple of kv_heads ({s.kv_heads})")


@record_check(Condition)
def _check_condition(c, r):
    if c.kind != "prompt" and c.tokens is None:
        r.fail("tokens", "is missing")
    if c.kind == "class" and c.num_classes is None:
        r.fail("num_classes", "is missing (class-conditional engine)")
    if c.kind == "caption" and c.caption_dim is None:
        r.fail("caption_dim", "is missing (caption-conditional engine)")
    if c.kind == "prompt" and c.style is None:
        r.fail("style", "is missing (prompt-conditional engine)")


@record_check(Vocabulary)
def _check_vocabulary(v, r):
    if not v.image_start < v.image_end <= v.size:
        r.fail("image_end", f"range [{v.image_start}, {v.image_end}) does not fit {v.size} ids")


@record_check(Graph)
def _check_graph(g, r):
    """A quantization only where it applies; inputs and outputs as the contract has them (ranks included: buffers are sized from these
    shapes), put in the contract's order whatever order the file kept."""
    q, name = g.quantization, r.key
    if q is not None:
        if name not in QUANTIZABLE:
            r.fail("quantization", f"quantizes the {name} graph; only {' and '.join(QUANTIZABLE)} are quantized")
        if g.dtype != "fp32":
            r.fail("quantization", f"is on a {g.dtype} graph; weight-only quantization starts from fp32")
    expected = graph_io(g.contract, max(g.layers, 1))
    if set(g.inputs) != set(expected["inputs"]) or set(g.outputs) != set(expected["outputs"]):
        r.fail("inputs", f"do not follow the {g.contract!r} contract of this lantern version")
    for side in ("inputs", "outputs"):
        for k, spec in getattr(g, side).items():
            want = expected[side][k][1]
            if len(spec.shape) != len(want):
                r.fail(f"{side}.{k}.shape", f"is {list(spec.shape)}, of rank {len(spec.shape)}; the {g.contract!r} "
                                            f"contract has {list(want)}")
    return dataclasses.replace(g, inputs={k: g.inputs[k] for k in expected["inputs"]},
                               outputs={k: g.outputs[k] for k in expected["outputs"]})


@record_check(Quantization)
def _check_quantization(q, r):
    if q.bits != QUANT_SCHEMES[q.scheme]:
        r.fail("bits", f"is {q.bits!r}, expected {QUANT_SCHEMES[q.scheme]} (scheme {q.scheme})")
    if q.head == "float" and not set(q.head_nodes) <= set(q.skipped):
        r.fail("skipped", f"lacks the float head {', '.join(q.head_nodes)}")


@record_check(TunedTree)
def _check_tuned_tree(t, r):
    if t.window is not None:  # a jacobi window: no file, its slots are its nodes
        if t.file is not None or (t.nodes, t.depth, t.name) != (t.window, t.window - 1, f"jacobi-{t.window}"):
            r.fail("window", f"{t.window} needs file null, nodes {t.window}, depth {t.window - 1} and name "
                             f"'jacobi-{t.window}'")
    elif (t.file is None) != (t.nodes == 1):
        r.fail("file", "must be given for a tree with drafts and null for AR (nodes 1)")


@record_check(TunedSettings)
def _check_tuned_settings(t, r):
    if t.settings.key != r.key:
        r.fail("", f"is keyed {r.key!r} but its settings make the key {t.settings.key!r}")
    if t.settings.proposer == "jacobi" and any(tree.window is None and tree.nodes > 1 for tree in t.trees):
        r.fail("trees", "of the jacobi proposer's settings are windows or AR, not drafter trees")


@record_check(CacheBudget)
def _check_cache_budget(s, r):
    if s.target != s.prefix + s.image_tokens + s.tree_nodes or s.drafter != s.image_tokens + s.tree_nodes:
        r.fail("", f"{s} does not add up (target = prefix + image_tokens + tree_nodes, "
                   f"drafter = image_tokens + tree_nodes)")


@record_check(AcceptanceGraphs)
def _check_acceptance(a, r):
    """Legacy acceptance-only graphs (an older engine's; see AcceptanceGraphs): a draft tree keyed
    by its name, and graphs of the acceptance contracts without weights."""
    try:
        tree = build_tree(a.tree)
    except LanternError as err:
        r.fail("tree", f"is not a draft tree ({err})")
    if tree.name != r.key or tree.depth == 0:
        r.fail("tree", f"is named {tree.name!r} with depth {tree.depth}; the entry is keyed {r.key!r} and needs drafts")
    for kind in ("greedy", "sampling"):
        g = getattr(a, kind)
        if g is not None and (g.contract != f"accept_{kind}" or g.dtype != "fp32" or g.external_data is not None):
            r.fail(f"{kind}.contract", f"is {g.contract!r} ({g.dtype}); expected 'accept_{kind}', fp32, no weights file")


@record_check(StepGraphs)
def _check_step_graphs(s, r):
    """A tree keyed by its name (AR: the root-only tree 'ar'), with a file for each phase its step
    runs, greedy and sampling."""
    try:
        tree = build_tree(s.tree) if s.tree.get("paths") != [] else None
    except (LanternError, AttributeError) as err:
        r.fail("tree", f"is not a draft tree ({err})")
    name, depth = (tree.name, tree.depth) if tree is not None else (s.tree.get("name"), 0)
    if name != r.key or (depth == 0 and name != "ar"):
        r.fail("tree", f"is named {name!r} with depth {depth}; the entry is keyed {r.key!r} (AR's is 'ar')")
    if s.version != STEP_VERSION:  # another lantern's phases: read as they are, refused by the runners
        return                     # with the command that re-exports them
    greedy = {"begin", "accept"} | {f"level{d}" for d in range(1, depth + 1)}
    for kind, phases in (("greedy", greedy), ("sampling", greedy | set(ACCEPT_PHASES))):
        if set(getattr(s, kind)) != phases:
            r.fail(kind, f"has phases {', '.join(sorted(getattr(s, kind)))}; tree {name!r} runs "
                         f"{', '.join(sorted(phases))}")


@record_check(WindowGraphs)
def _check_window_graphs(w, r):
    """A window keyed by its window and init, with a file for each phase its step runs (begin and
    accept: no drafter calls), greedy and sampling."""
    if window_name(w.window, w.init) != r.key:
        r.fail("window", f"is {w.window} with init {w.init!r}; the entry is keyed {r.key!r} (expected "
                         f"{window_name(w.window, w.init)!r})")
    if w.version != STEP_VERSION:  # read as they are, refused by the runners with the re-export command
        return
    for kind, phases in (("greedy", {"begin", "accept"}), ("sampling", {"begin"} | set(ACCEPT_PHASES))):
        if set(getattr(w, kind)) != phases:
            r.fail(kind, f"has phases {', '.join(sorted(getattr(w, kind)))}; a window runs {', '.join(sorted(phases))}")


# ---------------------------------------------------------------------------------------------
# What the records must agree on across the manifest


def check_consistency(m, r):
    """What the modes promise must be there: a drafter, a tree and candidates for speculative
    modes, a neighbor table for relaxed ones; every file a record names listed in `files`."""
    if "target" not in m.graphs:
        r.fail("graphs", "has no target graph")
    _check_inplace_cache(m, r)
    wants = "target_ids" if m.condition.kind == "prompt" else "target"
    if m.inplace_cache is not None:
        wants = IN_PLACE_CONTRACTS[wants]
    if m.graphs["target"].contract != wants:
        r.fail("graphs.target.contract", f"is {m.graphs['target'].contract!r}; a {m.condition.kind} engine "
                                         f"{'with' if m.inplace_cache else 'without'} a static cache has {wants!r}")
    if m.vocabulary.size != m.graphs["target"].outputs["logits"].shape[-1]:
        r.fail("vocabulary.size", f"({m.vocabulary.size}) differs from the target's logits width")
    if m.graphs["target"].layers != m.target.layers:
        r.fail("target.layers", f"({m.target.layers}) differs from the target graph's cache inputs")
    for path, name, fix in file_references(m):
        if name not in m.files:
            Reader({}, r.where, fix=fix).fail(path, f"names {name}, which `files` does not list")
    for name, g in m.graphs.items():
        if g.contract in ACCEPT_CONTRACTS:
            r.fail(f"graphs.{name}.contract", f"is {g.contract!r}; acceptance graphs are recorded per tree in `acceptance`")
    _check_acceptance_dims(m, Reader({}, r.where, "acceptance.", READD_ACCEPTANCE))
    _check_step_entries(m, Reader({}, r.where, "step_graphs.", READD_STEP), m.step_graphs)
    _check_step_entries(m, Reader({}, r.where, "window_graphs.", READD_WINDOW), m.window_graphs)
    if "ar" not in m.modes:
        r.fail("modes", "lacks 'ar' (every engine serves it)")
    speculative = [mode for mode in m.modes if mode != "ar"]
    if speculative:
        if "drafter" not in m.graphs or m.drafter is None:
            r.fail("modes", f"lists {', '.join(speculative)} but the engine has no drafter graph")
        if m.tree is None:
            r.fail("tree", f"is missing; modes {', '.join(speculative)} need the default draft tree")
        if m.candidates is None:
            r.fail("candidates", f"is missing; modes {', '.join(speculative)} need the drafter's top-k width")
        if m.candidates != m.graphs["drafter"].outputs["topk_ids"].shape[-1]:
            r.fail("candidates", f"({m.candidates}) differs from the drafter graph's top-k width")
        tree = build_tree(m.tree)
        if max(tree.widths) > m.candidates:
            r.fail("tree", f"{tree.name!r} needs {max(tree.widths)} children per node; the drafter returns {m.candidates}")
    if {"lantern", "lantern++"} & set(m.modes) and m.neighbors is None:
        r.fail("neighbors", "is missing; modes lantern and lantern++ need a neighbor table")
    if m.condition.kind == "class" and "condition" not in m.graphs:
        r.fail("graphs", "has no condition graph for a class-conditional engine")
    tuned = Reader({}, r.where, "tuned_trees.", RETUNE)
    for key, entry in m.tuned_trees.items():
        if entry.settings.proposer == "tree" and entry.settings.mode not in m.modes:
            tuned.fail(key, f"is for mode {entry.settings.mode!r}, which the engine does not serve")
    for key, plans in (m.tensorrt or {}).items():
        _check_plans(m, plans, Reader({}, r.where, f"tensorrt.{key}.", REBUILD_PLANS))


def _check_plans(m, t, r):
    """Plans of graphs the engine has, with profiles that range over the graph's inputs at
    their ranks. A step graph's plan is keyed by its file (step/TREE-HASH/KIND.PHASE.onnx); the
    manifest records no inputs of those, so only its label is checked (TensorRT's load checks the
    plan itself against the graph's file)."""
    graphs = m.all_graphs()  # an older engine's plans of its acceptance-only graphs: accept_<kind>@TREE
    steps = m.step_files()
    for graph, plan in t.plans.items():
        if graph in steps:
            continue
        if graph not in graphs:
            r.fail(f"plans.{graph}", "is a plan for a graph the engine does not have")
        inputs = graphs[graph].inputs
        for i, profile in enumerate(plan.profiles):
            for name, rng in profile.shapes.items():
                at = f"plans.{graph}.profiles[{i}].shapes.{name}"
                if name not in inputs:
                    r.fail(at, f"is not an input of the {graphs[graph].contract} graph")
                dims = [rng[k] for k in ("min", "opt", "max")]
                if not (len(dims[0]) == len(dims[1]) == len(dims[2]) == len(inputs[name].shape)) or not all(
                        a <= b <= c for a, b, c in zip(*dims)):
                    r.fail(at, f"needs min <= opt <= max of the input's rank, got {dims}")


def _check_inplace_cache(m, r):
    """An in-place engine: every graph in its in-place form, with caches of the budget's length,
    and a commit graph when it drafts; a plain engine has none of these."""
    s = m.inplace_cache
    in_place = {name: g for name, g in m.graphs.items() if "aliases" in GRAPHS[g.contract]}
    if s is None:
        if in_place:
            r.fail("inplace_cache", f"is missing; graphs {', '.join(sorted(in_place))} update static caches in place")
        return
    if s.image_tokens < m.image.tokens:
        r.fail("inplace_cache.image_tokens", f"({s.image_tokens}) is less than the engine's grid makes ({m.image.tokens})")
    slots = {"target": s.target, "commit": s.target, "drafter": s.drafter}
    for name, want in slots.items():
        if name in m.graphs:
            g = m.graphs[name]
            if "aliases" not in GRAPHS[g.contract]:
                r.fail(f"graphs.{name}.contract", f"is {g.contract!r}, not an in-place contract, in an engine with a "
                                                  f"static cache")
            if g.inputs["past_keys_0"].shape[2] != want:
                r.fail(f"graphs.{name}.inputs.past_keys_0", f"has {g.inputs['past_keys_0'].shape[2]} slots; the static "
                                                            f"cache gives it {want}")
    if "drafter" in m.graphs and "commit" not in m.graphs:
        r.fail("graphs", "has no commit graph (an in-place engine with a drafter commits accepted paths with it)")
    if "commit" in m.graphs and m.graphs["commit"].layers != m.target.layers:
        r.fail("graphs.commit", f"moves {m.graphs['commit'].layers} layers' caches; the target has {m.target.layers}")
    if m.tree is not None and build_tree(m.tree).num_nodes > s.tree_nodes:
        r.fail("inplace_cache.tree_nodes", f"({s.tree_nodes}) is less than the default tree's nodes")


def _check_step_entries(m, r, entries):
    """The step graphs' files (entries: m.step_graphs or m.window_graphs) are listed in `files`
    (so they are confined and hashed), their forced ids no image tokens, and their trees fit the
    drafter."""
    v = m.vocabulary
    for name, s in entries.items():
        if any(v.image_start <= i < v.image_end or i >= v.size for i in s.forced_ids):
            r.fail(f"{name}.forced_ids", "holds an image token id or one past the vocabulary")
        for kind in ("greedy", "sampling"):
            for phase, file in getattr(s, kind).items():
                if file not in m.files:
                    r.fail(f"{name}.{kind}.{phase}", f"names {file}, which `files` does not list")
        if isinstance(s, StepGraphs) and s.tree["paths"] and m.candidates is not None and build_tree(s.tree).max_width > m.candidates:
            r.fail(f"{name}.tree", f"needs {build_tree(s.tree).max_width} children per node; the drafter returns "
                                   f"{m.candidates}")


def _check_acceptance_dims(m, r):
    """An older engine's acceptance-only graphs: their fixed dims fit their tree, the vocabulary
    and the token space (the codes, then the forced ids, which are no image tokens)."""
    for name, a in m.acceptance.items():
        v = m.vocabulary
        if any(v.image_start <= i < v.image_end or i >= v.size for i in a.forced_ids):
            r.fail(f"{name}.forced_ids", "holds an image token id or one past the vocabulary")
        tree = build_tree(a.tree)
        for kind in ("greedy", "sampling"):
            g = getattr(a, kind)
            if g is None:
                continue
            want = {"M": tree.num_nodes, "V": m.vocabulary.size, "W": m.vocabulary.codes + len(a.forced_ids),
                    "depth+1": tree.depth + 1}
            dims = {"M": g.inputs["tokens"].shape[1], "V": g.inputs["logits"].shape[2],
                    "W": g.inputs["neighbors"].shape[0], "depth+1": g.outputs["path"].shape[1]}
            if kind == "sampling":
                want["K"], dims["K"] = m.candidates, g.inputs["draft_ids"].shape[2]
            if dims != want:
                r.fail(f"{name}.{kind}.inputs", f"have dims {dims}; tree {name!r} and the engine make {want}")
