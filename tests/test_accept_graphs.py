"""The acceptance modules (lantern.export.accept_graphs, the step graphs' accept rule) against the
numpy specification (lantern.runtime.accept) on random cases with ties, -inf entries, forced
tokens, CFG and every rule; the same modules exported to ONNX (export_rule, as the step graphs
are: TorchScript, opset 18) and run on ONNX Runtime in float32, as a runner runs them."""
import warnings
import zlib
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest
import torch

from lantern.export.accept_graphs import INPUTS, OUTPUTS, GreedyAcceptance, SamplingAcceptance, contract_inputs
from lantern.runtime.contracts import resolved_io
from lantern.runtime import accept as acceptance, filtering
from lantern.runtime.sampling import Sampling
from lantern.runtime.tree import build_tree, root_only
from lantern.runtime.vocabulary import VocabularyView

torch.set_grad_enabled(False)
torch.set_num_threads(1)  # tiny tensors: more threads only contend for the shared cores

START, CODES, VOCAB = 3, 40, 48  # ids 0..2 and 43..47 are not image codes; 44 and 46 can be forced
FORCED_IDS = (44, 46)


def export_rule(kind, tree, columns, path, candidates=None):
    """One acceptance module of `kind` alone as an ONNX graph at `path`, its I/O the contract
    accept_<kind>'s: images, rows, body length and neighbor width dynamic, traced at distinct
    sizes above 1 (so none is taken for another or for a constant)."""
    module = (GreedyAcceptance if kind == "greedy" else SamplingAcceptance)(tree, columns, CODES).eval()
    io = resolved_io(f"accept_{kind}", {"M": tree.num_nodes, "V": VOCAB, "W": len(columns), "depth+1": tree.depth + 1,
                                        "K": candidates}, "float32")
    trace_dims = {"B": 4, "N": 2, "F": 7, "Kn": 3}
    args, dynamic = [], {}
    for name, entry in io["inputs"].items():
        value = torch.zeros([trace_dims.get(d, d) for d in entry["shape"]], dtype=getattr(torch, entry["dtype"]))
        if name in ("cfg_interval", "forced_columns"):  # off, as a generation without them feeds them
            value -= 1
        if name in ("temperature", "top_p", "cfg_scale", "lam"):
            value += 1
        args.append(value)
        dynamic[name] = {i: d for i, d in enumerate(entry["shape"]) if isinstance(d, str)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on the tree's Python constants
        torch.onnx.export(module, tuple(args), path, input_names=list(io["inputs"]), output_names=list(io["outputs"]),
                          dynamic_axes={n: d for n, d in dynamic.items() if d}, opset_version=18, dynamo=False)


def stable_seed(*parts):
    """A seed of its parts that every process agrees on (hash() of a string changes per process)."""
    return zlib.crc32("/".join(map(str, parts)).encode())


def view_for(forced):
    return VocabularyView(SimpleNamespace(image_start=START, codes=CODES), forced)


def spec_logits(view, raw, cond_rows, uncond_rows, scale, interval, body):
    """The host loop's combination (decoding.Decoding.combined_logits) in numpy."""
    gathered = view.gather(raw).astype(np.float32)
    cond, uncond = gathered[cond_rows], gathered[uncond_rows]
    out = cond.copy() if (cond_rows == uncond_rows).all() else uncond + np.float32(scale) * (cond - uncond)
    if interval >= 0:
        late = body >= interval
        out[late] = cond[late]
    return view.force(out, body)


def random_case(rng, tree, rule, *, images=3, cfg=False, forced=False, tie_scale=2):
    M = tree.num_nodes
    length = 30
    forced_ids = np.full(length, -1)
    if forced:
        forced_ids[rng.choice(length, 8, replace=False)] = rng.choice(FORCED_IDS, 8)
    view = view_for(forced_ids)
    rows = 2 * images if cfg else images
    # small integers: many exact ties; some -inf
    raw = rng.integers(-3 * tie_scale, 3 * tie_scale, size=(rows, M, VOCAB)).astype(np.float32) / tie_scale
    # -inf entries (masked tokens; with CFG only finite ones: -inf - -inf has no combination)
    raw[rng.random(raw.shape) < 0.1] = -50.0 if cfg else -np.inf
    for i in (START,) + FORCED_IDS:  # every row keeps a finite image logit, forced ids theirs
        raw[..., i] = np.maximum(raw[..., i], -1.0)
    cond_rows = np.arange(images)
    uncond_rows = cond_rows + images if cfg else cond_rows
    scale, interval = (3.0, int(rng.integers(-1, 6))) if cfg else (1.0, -1)
    count = rng.integers(1, length - tree.depth, size=images)
    body = count[:, None] + tree.depths[None, :]
    with np.errstate(invalid="ignore"):
        logits = spec_logits(view, raw, cond_rows, uncond_rows, scale, interval, body)
    table = np.stack([rng.permutation(np.delete(np.arange(view.size), c)) for c in range(view.size)])[:, :6]
    neighbors = view.neighbors(table[:CODES] % CODES) if forced else table
    # drafts: often the parent's argmax or one of its neighbors, so paths get long
    top = np.argmax(logits, axis=2)
    tokens = rng.integers(0, view.size, size=(images, M))
    parent = np.maximum(tree.parents, 0)
    pick = rng.random((images, M))
    tokens = np.where(pick < 0.45, top[:, parent], tokens)
    near = neighbors[top[:, parent], rng.integers(0, 3, size=(images, M))]
    tokens = np.where((pick >= 0.45) & (pick < 0.8), near, tokens)
    tokens[:, 0] = rng.integers(0, CODES, size=images)
    feeds = dict(logits=raw, cond_rows=cond_rows, uncond_rows=uncond_rows,
                 cfg_scale=np.array([scale], np.float32), cfg_interval=np.array([interval]), count=count,
                 forced_columns=view.forced_column, tokens=tokens, neighbors=neighbors.astype(np.int64),
                 **rule_feeds(rule))
    return feeds, logits, view


def rule_feeds(rule):
    return dict(k=np.array([rule.k]), lam=np.array([getattr(rule, "lam", 1.0)], np.float32),
                delta=np.array([getattr(rule, "delta", 0.0)], np.float32))


def run_module(module, feeds):
    out = module(*(torch.as_tensor(feeds[name]) for name in INPUTS))
    return dict(zip(OUTPUTS, (o.numpy() for o in out)))


def assert_outcome(got, want, where):
    np.testing.assert_array_equal(got["accepted"], want.accepted, err_msg=where)
    np.testing.assert_array_equal(got["next_token"], want.next_token, err_msg=where)
    np.testing.assert_array_equal(got["path"], want.path, err_msg=where)
    np.testing.assert_array_equal(got["decisions"], want.decisions, err_msg=where)
    assert not got["invalid"].any(), where


RULES = [acceptance.Exact(), acceptance.LanternPP(k=4, lam=1.0), acceptance.LanternPP(k=3, lam=2.0),
         acceptance.LanternPP(k=6, lam=5.0), acceptance.Lantern(k=4, delta=0.0), acceptance.Lantern(k=6, delta=0.1),
         acceptance.Lantern(k=2, delta=0.4)]


@pytest.mark.parametrize("tree_name", ["mc_sim_7b_63", "kary-3-2", "chain-4"])
@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.name}-{r.k}")
def test_the_graph_equals_the_numpy_rules(tree_name, rule):
    tree = build_tree(tree_name)
    rng = np.random.default_rng(stable_seed(tree_name, rule.name, rule.k))
    checked = long_paths = 0
    for case in range(40):
        cfg, forced = case % 2 == 1, case % 4 >= 2
        feeds, logits, view = random_case(rng, tree, rule, cfg=cfg, forced=forced, tie_scale=1 + case % 3)
        module = GreedyAcceptance(tree, np.concatenate([np.arange(START, START + CODES), view.extra]), CODES)
        if len(view.extra) != len(FORCED_IDS) and forced:
            continue  # the module's columns are fixed per engine: cases whose forced ids differ are skipped
        want = acceptance.accept_greedy_batch(tree, feeds["tokens"], logits, rule, feeds["neighbors"])
        assert_outcome(run_module(module, feeds), want, f"case {case} cfg {cfg} forced {forced}")
        checked += 1
        long_paths += int((want.accepted >= 2).sum())
    assert checked >= 30 and long_paths > 0


def test_lam_one_and_delta_zero_are_exact():
    tree = build_tree("mc_sim_7b_63")
    rng = np.random.default_rng(3)
    module = GreedyAcceptance(tree, np.arange(START, START + CODES), CODES)
    for case in range(20):
        feeds, _, _ = random_case(rng, tree, acceptance.Exact(), cfg=case % 2 == 1)
        exact = run_module(module, feeds)
        for rule in (acceptance.LanternPP(k=6, lam=1.0), acceptance.Lantern(k=6, delta=0.0)):
            got = run_module(module, {**feeds, **rule_feeds(rule)})
            for name in OUTPUTS:
                np.testing.assert_array_equal(got[name], exact[name], err_msg=f"{rule} {name}")


def test_a_tie_lifted_by_tiny_neighbor_mass_is_decided_as_float64_decides():
    """A draft tying the row max at a higher id, its neighbors lending 1e-11: float64's
    1 + s > 1 accepts it (LANTERN++, lam 2); float32's 1 + s == 1 would not."""
    tree = build_tree("chain-1")
    logits = np.full((1, 2, 8), -30.0, dtype=np.float32)
    logits[0, 0, [2, 5]] = 0.0  # argmax 2 (lowest id); the draft 5 ties it
    logits[0, 0, 6] = -25.0  # 5's nearest neighbor lends exp(-25) ~ 1.4e-11
    neighbors = np.array([[(c + 1) % 8, (c + 2) % 8] for c in range(8)])
    tokens = np.array([[0, 5]])
    rule = acceptance.LanternPP(k=1, lam=2.0)
    want = acceptance.accept_greedy_batch(tree, tokens, logits, rule, neighbors)
    assert want.accepted[0] == 1
    module = GreedyAcceptance(tree, np.arange(8), 8)
    feeds = dict(logits=logits, cond_rows=np.array([0]), uncond_rows=np.array([0]),
                 cfg_scale=np.ones(1, np.float32), cfg_interval=np.array([-1]), count=np.array([1]),
                 forced_columns=np.full(4, -1), tokens=tokens, neighbors=neighbors, **rule_feeds(rule))
    assert_outcome(run_module(module, feeds), want, "tie")
    exact = acceptance.accept_greedy_batch(tree, tokens, logits, acceptance.Exact(), neighbors)
    assert_outcome(run_module(module, {**feeds, **rule_feeds(acceptance.Exact())}), exact, "tie exact")
    assert exact.accepted[0] == 0


def test_rows_without_a_finite_max_are_flagged():
    tree = build_tree("kary-2-2")
    rng = np.random.default_rng(0)
    feeds, _, _ = random_case(rng, tree, acceptance.Exact(), images=3)
    feeds["logits"] = feeds["logits"].copy()
    feeds["logits"][1, 4] = -np.inf
    feeds["logits"][2, 0, START + 1] = np.nan
    got = run_module(GreedyAcceptance(tree, np.arange(START, START + CODES), CODES), feeds)
    assert got["invalid"].tolist() == [False, True, True]


def test_ar_takes_the_root_targets_argmax():
    """The root-only tree (AR, the device step's `ar`) skips the verification (a short path of
    the module): the outcome is still the numpy rules' (the CFG-combined, forced argmax, ties to
    the lowest column; nothing accepted), with CFG, forced tokens and exact ties, and void rows
    are still flagged."""
    tree = root_only()
    rng = np.random.default_rng(5)
    module = GreedyAcceptance(tree, np.concatenate([np.arange(START, START + CODES), FORCED_IDS]), CODES)
    for case in range(24):
        cfg, forced = case % 2 == 1, case % 4 >= 2
        feeds, logits, view = random_case(rng, tree, acceptance.Exact(), cfg=cfg, forced=forced, tie_scale=1 + case % 3)
        if len(view.extra) != len(FORCED_IDS) and forced:
            continue
        want = acceptance.accept_greedy_batch(tree, feeds["tokens"], logits, acceptance.Exact(), feeds["neighbors"])
        assert_outcome(run_module(module, feeds), want, f"case {case} cfg {cfg} forced {forced}")
    feeds["logits"] = feeds["logits"].copy()
    feeds["logits"][1, 0, START + 1] = np.nan
    assert run_module(module, feeds)["invalid"].tolist() == [False, True, False]


@pytest.fixture(scope="module")
def onnx_graph(tmp_path_factory):
    tree = build_tree("mc_sim_7b_63")
    columns = np.concatenate([np.arange(START, START + CODES), FORCED_IDS])
    path = str(tmp_path_factory.mktemp("accept") / "accept_greedy.onnx")
    export_rule("greedy", tree, columns, path)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return tree, columns, ort.InferenceSession(path, options, providers=["CPUExecutionProvider"]), path


@pytest.mark.parametrize("rule", [acceptance.Exact(), acceptance.LanternPP(k=6, lam=3.0),
                                  acceptance.Lantern(k=4, delta=0.2)], ids=lambda r: r.name)
def test_the_onnx_graph_on_onnx_runtime_equals_the_numpy_rules(onnx_graph, rule):
    tree, columns, session, _ = onnx_graph
    rng = np.random.default_rng(7)
    checked = 0
    for case in range(24):
        images = 1 + case % 4
        feeds, logits, view = random_case(rng, tree, rule, images=images, cfg=case % 2 == 1, forced=True)
        if len(view.extra) != len(FORCED_IDS):
            continue
        got = dict(zip(OUTPUTS, session.run(list(OUTPUTS), feeds)))
        want = acceptance.accept_greedy_batch(tree, feeds["tokens"], logits, rule, feeds["neighbors"])
        assert_outcome(got, want, f"case {case}")
        checked += 1
    assert checked >= 16


@pytest.mark.parametrize("cc", ["SM89", "SM120"])
def test_tensorrt_rtx_builds_the_acceptance_graph(onnx_graph, tmp_path, cc):
    """The graph parses and builds for RTX GPUs on this CPU (no float64, no int8 constants, ties
    without ArgMax); running it needs a GPU."""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'lantern[tensorrt-rtx]')")
    from lantern.export import tensorrt_build as tb

    tree, columns, _, path = onnx_graph
    M, S = tree.num_nodes, len(columns)
    shapes = {"logits": (2, M, VOCAB), "cond_rows": (1,), "uncond_rows": (1,), "count": (1,), "forced_columns": (30,),
              "tokens": (1, M), "neighbors": (S, 6)}
    plan, record = tb.build_plan(path, [tb.exact_profile(shapes)], flavor="tensorrt-rtx", compute_capabilities=[cc])
    assert len(plan) == record["plan_bytes"] > 0
    assert set(record["io"]["outputs"]) == set(OUTPUTS)


def test_tensorrt_rtx_parses_the_sampling_graph(sampling_graph):
    """The sampling graph's ops (TopK of 3840 at most, ScatterElements with unique indices, CumSum,
    no float64, no int8 constants) parse, with the contract's I/O. Building its plan is left to
    `lantern-export trt`: on this project's loaded 2-core machines a plan of even a 7-node tree's
    sampling graph took over 20 minutes, past what the suite can spend."""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'lantern[tensorrt-rtx]')")
    from lantern.export import tensorrt_build as tb

    _, session, path = sampling_graph
    io = tb.network_io(path, flavor="tensorrt-rtx")
    assert list(io["inputs"]) == list(SAMPLING) and list(io["outputs"]) == list(OUTPUTS)
    assert {v["dtype"] for v in io["inputs"].values()} == {"float32", "int64"}


def test_the_device_acceptance_section_runs_and_agrees_on_the_cpu():
    """gpu_check's device-path section (tools/bench/device_step.device_acceptance) on the CPU at
    a small vocabulary: the module and the numpy host path decide the same."""
    from lantern.tools.bench.device_step import device_acceptance

    results = device_acceptance("cpu", batches=(1, 3), repeats=1, vocab=256, table=32)
    assert len(results) == 6 and all(r["same_outcome"] for r in results)
    assert all(r["device_path"]["bytes_device_to_host"] < r["host_path"]["bytes_device_to_host"] for r in results)


# ---------------------------------------------------------------------------------------------
# Sampling: SamplingAcceptance against accept_sampling_batch, with the drafts made as the loop
# makes them (children drawn from q without replacement, forced drafts with q = 1)

SAMPLING = contract_inputs("sampling")
FILTERS = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 12, 0.6)]  # temperature, top_k, top_p
CANDIDATES = 6


def sampling_case(rng, tree, rule, filters, *, images=3, cfg=False, forced=False):
    """random_case's logits and neighbors with the drafter's candidates per node (its target's
    argmax among them, so paths get long), children drawn from them by the exponential race,
    forced depths drafted as the loop drafts them, and the step's uniforms."""
    feeds, logits, view = random_case(rng, tree, rule, images=images, cfg=cfg, forced=forced)
    N, M = feeds["tokens"].shape
    top = logits.argmax(axis=2)
    ids = np.stack([[np.concatenate([[top[n, i]], rng.choice(np.delete(np.arange(view.size), top[n, i]),
                                                             CANDIDATES - 1, replace=False)])
                     for i in range(M)] for n in range(N)])
    probs = rng.dirichlet(np.full(CANDIDATES, 0.7), size=(N, M)).astype(np.float32)
    probs[rng.random(probs.shape) < 0.15] = 0.0
    tokens = feeds["tokens"].copy()
    race = rng.random((N, M, CANDIDATES))
    count = feeds["count"]
    for level in tree.levels:
        drawn = Sampling().children(ids[:, level.parents], probs[:, level.parents], level.width,
                                    race[:, level.parents])
        tokens[:, level.nodes] = drawn[:, np.arange(len(level.nodes)), level.ranks]
        column = view.forced_at(count - 1 + level.depth)  # decoding.Decoding.force_drafts
        for n in np.flatnonzero(column >= 0):
            tokens[n, level.nodes] = column[n]
            ids[n, level.parents] = column[n]
            probs[n, level.parents] = np.eye(CANDIDATES, dtype=np.float32)[0]
    temperature, top_k, top_p = filters
    feeds.update(tokens=tokens, draft_ids=ids, draft_probs=probs, uniforms=rng.random((N, M)),
                 temperature=np.array([temperature], np.float32), top_k=np.array([top_k]),
                 top_p=np.array([top_p], np.float32))
    want = acceptance.accept_sampling_batch(tree, tokens, logits, ids, probs, rule, feeds["uniforms"],
                                            feeds["neighbors"], temperature=temperature, top_k=top_k, top_p=top_p)
    return feeds, want, view


def float64_feeds(feeds):
    """The feeds in float64 where the contract has float32, the uniforms as drawn (the spec's)."""
    return {name: torch.as_tensor(feeds[name]).to(torch.float64) if np.asarray(feeds[name]).dtype.kind == "f"
            else torch.as_tensor(feeds[name]) for name in SAMPLING}


def float32_feeds(feeds):
    return {name: np.asarray(feeds[name], np.float32) if np.asarray(feeds[name]).dtype.kind == "f" else feeds[name]
            for name in SAMPLING}


def as_outcome(outputs):
    return dict(zip(OUTPUTS, outputs))


SAMPLING_RULES = [acceptance.Exact(), acceptance.LanternPP(k=3, lam=2.0), acceptance.LanternPP(k=6, lam=1.0),
                  acceptance.Lantern(k=4, delta=0.2), acceptance.Lantern(k=4, delta=0.0)]


@pytest.mark.parametrize("tree_name", ["mc_sim_7b_63", "kary-3-2"])
@pytest.mark.parametrize("rule", SAMPLING_RULES, ids=lambda r: f"{r.name}-{r.k}")
def test_the_sampling_module_in_float64_equals_the_numpy_rules(tree_name, rule):
    tree = build_tree(tree_name)
    rng = np.random.default_rng(stable_seed(tree_name, rule.name, rule.k, "sampling"))
    checked = long_paths = 0
    for case in range(40):  # 10 cases, more until one accepted two drafts (exact on random logits rarely does)
        if case >= 10 and long_paths:
            break
        feeds, want, view = sampling_case(rng, tree, rule, FILTERS[case % 4], cfg=case % 2 == 1, forced=case % 3 == 2)
        if len(view.extra) not in (0, len(FORCED_IDS)):
            continue
        module = SamplingAcceptance(tree, np.concatenate([np.arange(START, START + CODES), view.extra]), CODES)
        t = float64_feeds(feeds)
        got = {k: v.numpy() for k, v in as_outcome(module(*(t[n] for n in SAMPLING))).items()}
        assert_outcome(got, want, f"case {case}")
        checked += 1
        long_paths += int((want.accepted >= 2).sum())
    assert checked >= 6 and long_paths > 0


@pytest.mark.parametrize("ties", [False, True])
def test_the_modules_filters_equal_filtered_probs(ties):
    """Temperature, top-k (ties with the k-th kept) and top-p (the smallest kept probability by
    bisection, ties at it in column order) against lantern.runtime.filtering.filtered_probs, in
    float64, on rows of many distinct values or many ties."""
    rng = np.random.default_rng(int(ties))
    tree = build_tree("chain-1")
    module = SamplingAcceptance(tree, np.arange(300), 300)
    logits = rng.normal(size=(4, 2, 300)) * 2
    if ties:
        logits = np.round(logits * 2) / 2
    logits[rng.random(logits.shape) < 0.1] = -np.inf
    for temperature, top_k, top_p in [(1.0, 0, 0.9), (0.7, 40, 1.0), (1.3, 250, 0.5), (1.0, 0, 0.05), (0.9, 7, 0.97),
                                      (1.0, 300, 0.999)]:
        got = module.filtered(torch.as_tensor(logits), torch.tensor([temperature], dtype=torch.float64),
                              torch.tensor([top_k]), torch.tensor([top_p], dtype=torch.float64)).numpy()
        want = filtering.filtered_probs(logits, temperature, top_k, top_p)
        np.testing.assert_array_equal(got > 0, want > 0, err_msg=f"{temperature} {top_k} {top_p}")
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


@pytest.fixture(scope="module")
def sampling_graph(tmp_path_factory):
    tree = build_tree("mc_sim_7b_63")
    columns = np.concatenate([np.arange(START, START + CODES), FORCED_IDS])
    path = str(tmp_path_factory.mktemp("accept") / "accept_sampling.onnx")
    export_rule("sampling", tree, columns, path, candidates=CANDIDATES)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return tree, ort.InferenceSession(path, options, providers=["CPUExecutionProvider"]), path


def test_the_sampling_graph_on_onnx_runtime_in_float32_takes_the_specs_paths(sampling_graph):
    """float32 (what TensorRT runs) against the float64 specification on the same streams: the
    accepted paths agree but for rounding at a decision's edge; the final inverse-CDF draw is
    compared as a distribution below."""
    tree, session, _ = sampling_graph
    rng = np.random.default_rng(11)
    images = paths_differ = tokens_differ = 0
    for case in range(24):
        rule = SAMPLING_RULES[case % len(SAMPLING_RULES)]
        feeds, want, view = sampling_case(rng, tree, rule, FILTERS[case % 4], images=4, cfg=case % 2 == 1, forced=True)
        if len(view.extra) != len(FORCED_IDS):
            continue
        got = as_outcome(session.run(list(OUTPUTS), float32_feeds(feeds)))
        assert not got["invalid"].any()
        same_path = (got["path"] == want.path).all(axis=1)
        images += len(same_path)
        paths_differ += int((~same_path).sum())
        tokens_differ += int((same_path & (got["next_token"] != want.next_token)).sum())
    print(f"float32 ONNX Runtime vs float64 spec: {paths_differ}/{images} paths, {tokens_differ}/{images} next tokens differ")
    assert images >= 60 and paths_differ <= 0.05 * images and tokens_differ <= 0.2 * images


def test_sampling_lam_one_and_delta_zero_are_exact_on_onnx_runtime(sampling_graph):
    tree, session, _ = sampling_graph
    rng = np.random.default_rng(5)
    checked = 0
    for case in range(8):
        feeds, _, view = sampling_case(rng, tree, acceptance.Exact(), FILTERS[case % 4], cfg=case % 2 == 1, forced=True)
        if len(view.extra) != len(FORCED_IDS):
            continue
        checked += 1
        exact = session.run(list(OUTPUTS), float32_feeds(feeds))
        for rule in (acceptance.LanternPP(k=6, lam=1.0), acceptance.Lantern(k=6, delta=0.0)):
            got = session.run(list(OUTPUTS), float32_feeds({**feeds, **rule_feeds(rule)}))
            for name, a, b in zip(OUTPUTS, got, exact):
                np.testing.assert_array_equal(a, b, err_msg=f"{rule} {name}")
    assert checked >= 4


def _first_tokens(tree, tokens, outcome):
    """Each image's first emitted token: the first accepted draft, or the drawn token."""
    first = tokens[np.arange(len(tokens)), np.maximum(outcome["path"][:, 1], 0)]
    return np.where(outcome["accepted"] > 0, first, outcome["next_token"])


@pytest.mark.parametrize("rule, filters", [(acceptance.Exact(), (1.0, 0, 1.0)), (acceptance.LanternPP(k=2, lam=1.0),
                                                                                  (0.8, 30, 0.9)),
                                           (acceptance.LanternPP(k=3, lam=3.0), (1.0, 0, 1.0)),
                                           (acceptance.Lantern(k=3, delta=0.3), (0.9, 0, 0.95))],
                         ids=["exact", "lam1-filtered", "lam3", "delta"])
def test_the_sampling_graph_emits_the_host_paths_distribution(sampling_graph, rule, filters):
    """Many images of one step (same logits and candidates, their own race and uniforms): the
    first emitted token's counts from the float32 graph and from the host path agree
    (chi-square), and for exact and lam = 1 both follow the filtered target (lossless)."""
    from scipy import stats

    tree, session, _ = sampling_graph
    rng = np.random.default_rng(3)
    while True:  # forced ids in the body (the graph's token space), none at this step's depths
        feeds, _, view = sampling_case(rng, tree, rule, filters, images=1, forced=True)
        body = feeds["count"][:, None] + tree.depths[None, :]
        if len(view.extra) == len(FORCED_IDS) and (view.forced_at(body - 1) < 0).all():
            break
    n = 2000
    one = {k: v for k, v in feeds.items()}
    batch = {name: np.repeat(np.asarray(one[name]), n, axis=0) if name in ("logits", "tokens", "count", "draft_ids",
                                                                           "draft_probs") else one[name]
             for name in SAMPLING}
    batch["cond_rows"] = batch["uncond_rows"] = np.arange(n)
    # each image draws its own children from the same candidates, and its own uniforms
    ids, probs, tokens = batch["draft_ids"], batch["draft_probs"], batch["tokens"].copy()
    race = rng.random(ids.shape)
    for level in tree.levels:
        drawn = Sampling().children(ids[:, level.parents], probs[:, level.parents], level.width, race[:, level.parents])
        tokens[:, level.nodes] = drawn[:, np.arange(len(level.nodes)), level.ranks]
    batch.update(tokens=tokens, uniforms=rng.random((n, tree.num_nodes)))
    logits = spec_logits(view, batch["logits"], np.arange(n), np.arange(n), 1.0, -1, np.repeat(body, n, axis=0))
    host = acceptance.accept_sampling_batch(tree, tokens, logits, ids, probs, rule, batch["uniforms"],
                                            batch["neighbors"], temperature=filters[0], top_k=filters[1],
                                            top_p=filters[2])
    graph = as_outcome(session.run(list(OUTPUTS), float32_feeds(batch)))
    got = np.bincount(_first_tokens(tree, tokens, graph), minlength=view.size)
    want = np.bincount(_first_tokens(tree, tokens, host.__dict__), minlength=view.size)
    seen = (got + want) > 0
    _, p_two, _, _ = stats.chi2_contingency(np.stack([got[seen], want[seen]]))
    assert p_two > 1e-3, (got[seen], want[seen])
    if rule.name == "exact" or getattr(rule, "lam", None) == 1.0:
        target = filtering.filtered_probs(logits[0, 0], *filters)
        assert (got[target == 0] == 0).all()
        keep = target > 0
        p_fit = stats.chisquare(got[keep], target[keep] * n).pvalue
        assert p_fit > 1e-3, (got[keep], np.round(target[keep] * n))


def test_sampling_flags_rows_without_a_finite_max_and_takes_forced_drafts_at_any_uniform():
    """Forced drafts (q = 1, target one-hot) are accepted whatever the uniform, also one that
    rounded up to 1.0 in float32; rows with NaN or only -inf void the image's outcome."""
    tree = build_tree("chain-2")
    rng = np.random.default_rng(2)
    feeds, _, view = sampling_case(rng, tree, acceptance.Exact(), FILTERS[0], images=3, forced=True)
    while len(view.extra) != len(FORCED_IDS):
        feeds, _, view = sampling_case(rng, tree, acceptance.Exact(), FILTERS[0], images=3, forced=True)
    module = SamplingAcceptance(tree, np.concatenate([np.arange(START, START + CODES), view.extra]), CODES)
    forced = view.forced_column.copy()
    forced[:] = -1
    column = CODES  # the first forced id's column, forced at body index count (node 1's token)
    count = feeds["count"]
    forced[count] = column
    tokens, ids, probs = feeds["tokens"].copy(), feeds["draft_ids"].copy(), feeds["draft_probs"].copy()
    tokens[:, 1], ids[:, 0], probs[:, 0] = column, column, np.eye(CANDIDATES, dtype=np.float32)[0]
    run = {**float32_feeds(feeds), "forced_columns": forced, "tokens": tokens, "draft_ids": ids, "draft_probs": probs,
           "uniforms": np.ones_like(feeds["uniforms"], dtype=np.float32)}  # 1.0: a float64 uniform rounded up
    out = as_outcome(o.numpy() for o in module(*(torch.as_tensor(run[n]) for n in SAMPLING)))
    assert (out["accepted"] >= 1).all() and (out["path"][:, 1] == 1).all() and not out["invalid"].any()
    logits = run["logits"].copy()
    logits[1, 0] = np.nan
    logits[2, 1, :] = -np.inf
    out = as_outcome(o.numpy() for o in module(*(torch.as_tensor({**run, "logits": logits}[n]) for n in SAMPLING)))
    assert out["invalid"].tolist() == [False, True, True]
