"""The greedy acceptance graph (lantern.export.accept_graphs) against the numpy specification
(lantern.runtime.accept.accept_greedy_batch) on random cases with ties, -inf entries, forced
tokens, CFG and every rule; the same module exported to ONNX and run on ONNX Runtime."""
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest
import torch

from lantern.export.accept_graphs import INPUTS, OUTPUTS, GreedyAcceptance, export_acceptance
from lantern.runtime import accept as acceptance
from lantern.runtime.tree import build_tree
from lantern.runtime.vocabulary import VocabularyView

torch.set_grad_enabled(False)
torch.set_num_threads(1)  # tiny tensors: more threads only contend for the shared cores

START, CODES, VOCAB = 3, 40, 48  # ids 0..2 and 43..47 are not image codes; 44 and 46 can be forced
FORCED_IDS = (44, 46)


def view_for(forced):
    return VocabularyView(SimpleNamespace(image_start=START, codes=CODES), forced)


def spec_logits(view, raw, cond_rows, uncond_rows, scale, interval, body):
    """The host loop's combination (generator._Decoding.combined_logits) in numpy."""
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
    rng = np.random.default_rng(hash((tree_name, rule.name, rule.k)) % 2**32)
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


@pytest.fixture(scope="module")
def onnx_graph(tmp_path_factory):
    tree = build_tree("mc_sim_7b_63")
    columns = np.concatenate([np.arange(START, START + CODES), FORCED_IDS])
    path = str(tmp_path_factory.mktemp("accept") / "accept_greedy.onnx")
    export_acceptance(tree, columns, CODES, VOCAB, path)
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


def test_the_device_acceptance_section_runs_and_agrees_on_the_cpu():
    """gpu_check's device-path section (tools/bench/device_step.device_acceptance) on the CPU at
    a small vocabulary: the module and the numpy host path decide the same."""
    from lantern.tools.bench.device_step import device_acceptance

    results = device_acceptance("cpu", batches=(1, 3), repeats=1, vocab=256, table=32)
    assert len(results) == 6 and all(r["same_outcome"] for r in results)
    assert all(r["device_path"]["bytes_device_to_host"] < r["host_path"]["bytes_device_to_host"] for r in results)
