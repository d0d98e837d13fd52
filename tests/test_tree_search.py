"""Tree search: the DP against brute force, the latency model, acceptance statistics against direct
counts, predicted accepted length against Monte Carlo, and the what-if entry point."""
import itertools
import json

import numpy as np
import pytest

from lantern.runtime.errors import LanternError
from lantern.runtime.tree import build_tree
from lantern.tools import tree_report, tree_search
from lantern.tools.acceptance_stats import (AcceptanceCounts, acceptance_vectors, count_accepted_paths,
                                            expected_accept_length)
from lantern.tools.latency_model import Curve, LatencyModel
from lantern.tools.tree_search import TreeTable, calibration_tree, search, tree_json


def random_vectors(rng, depth, width):
    """Per-depth vectors with each row summing to < 1 (at most one child is on the path)."""
    raw = rng.random((depth, width + 1))
    return raw[:, :width] / raw.sum(1, keepdims=True)


def path_value(paths, p):
    """Tokens per step of a set of paths, written out independently: 1 (bonus) + sum over nodes of
    the product of p[depth - 1, rank] along the path."""
    return 1.0 + sum(np.prod([p[d, r] for d, r in enumerate(path)]) for path in paths)


def all_trees(max_nodes, depth, width):
    """Every prefix-closed set of paths (ranks < width, depth <= depth) with up to max_nodes - 1
    paths, grown one leaf at a time, contiguous or not."""
    level = {frozenset()}
    out = [frozenset()]
    for _ in range(max_nodes - 1):
        nxt = set()
        for tree in level:
            for parent in [()] + list(tree):
                if len(parent) < depth:
                    for r in range(width):
                        child = parent + (r,)
                        if child not in tree:
                            nxt.add(tree | {child})
        out += nxt
        level = nxt
    return out


def contiguous(paths):
    return all(p[:-1] + (s,) in paths for p in paths for s in range(p[-1]))


def max_width(paths):
    return max((p[-1] + 1 for p in paths), default=0)


# ---------------------------------------------------------------------------------------------
# The DP


@pytest.fixture(scope="module")
def small_trees():
    trees = all_trees(7, 3, 3)
    assert len(trees) > 1000  # the enumeration really is exhaustive, not a handful
    return trees


@pytest.mark.parametrize("seed", range(4))
def test_dp_matches_brute_force(seed, small_trees):
    rng = np.random.default_rng(seed)
    p = random_vectors(rng, 3, 3)
    for depth_limit, candidates in itertools.product((1, 2, 3), (1, 2, 3)):
        table = TreeTable(p, 7, depth_limit, candidates)
        for n in range(1, 8):
            fitting = [t for t in small_trees if len(t) == n - 1 and contiguous(t)
                       and max((len(q) for q in t), default=0) <= depth_limit and max_width(t) <= candidates]
            if not fitting:
                assert table.value(n) == -np.inf
                continue
            best = max(path_value(t, p) for t in fitting)
            assert table.value(n) == pytest.approx(best, abs=1e-12), (depth_limit, candidates, n)
            if n > 1:
                paths = table.paths(n)
                tree = build_tree(paths)
                assert tree.num_nodes == n and tree.depth <= depth_limit and max(tree.widths) <= candidates
                assert tree.contiguous
                assert path_value([tuple(q) for q in paths], p) == pytest.approx(best, abs=1e-12)


def test_contiguous_trees_lose_nothing_when_ranks_are_ordered(small_trees):
    """With p decreasing in rank (a drafter's ranks mean something), the best of all trees,
    gaps in ranks allowed, is a contiguous one: restricting the DP costs nothing."""
    rng = np.random.default_rng(11)
    p = -np.sort(-random_vectors(rng, 3, 3), axis=1)
    table = TreeTable(p, 7, 3, 3)
    for n in range(2, 8):
        best_any = max(path_value(t, p) for t in small_trees if len(t) == n - 1)
        assert table.value(n) == pytest.approx(best_any, abs=1e-12)


def test_expected_accept_length_by_hand():
    p = [[0.5, 0.2], [0.4, 0.1]]
    assert expected_accept_length([[0], [1], [0, 0]], p) == pytest.approx(0.5 + 0.2 + 0.5 * 0.4)
    # ranks and depths beyond the vectors count as never accepted
    assert expected_accept_length([[0], [2], [0, 0], [0, 0, 0]], p) == pytest.approx(0.5 + 0.5 * 0.4)


def simulate_paths(tree, p, rng, steps):
    """Accepted paths under the positional model, walked step by step: at a node on the path draw
    u once; the rank-r child is next if u falls in its slice of p[depth] (slices in rank order);
    past the children present, the path ends."""
    paths = []
    for _ in range(steps):
        node, path = 0, [0]
        while True:
            u, nxt = rng.random(), None
            for child in tree.children[node]:
                d, r = tree.depths[child] - 1, tree.ranks[child]
                low = sum(p[d][s] for s in range(r))  # ranks below r, present or not
                if low <= u < low + p[d][r]:
                    nxt = child
                    break
            if nxt is None:
                break
            node = nxt
            path.append(node)
        paths.append(path)
    return paths


@pytest.mark.parametrize("spec", ["mc_sim_7b_63", "kary-3-2", "chain-6", "tuned"])
def test_expected_accept_length_matches_monte_carlo(spec):
    rng = np.random.default_rng(5)
    p = random_vectors(rng, 6, 4) * 1.3  # rows up to 1.3 / (1 + a share): some rows near 1
    p /= np.maximum(1.0, p.sum(1, keepdims=True) + 0.01)
    tree = build_tree(TreeTable(p, 30, 5, 4).paths(30) if spec == "tuned" else spec)
    steps = 40000
    lengths = np.array([len(path) - 1 for path in simulate_paths(tree, p, rng, steps)])
    predicted = expected_accept_length(tree, p)
    stderr = lengths.std() / np.sqrt(steps)
    assert abs(lengths.mean() - predicted) < 4 * stderr + 1e-9, (lengths.mean(), predicted, stderr)


# ---------------------------------------------------------------------------------------------
# Acceptance statistics


def records_from_paths(tree, paths, rows, rng):
    """Loop-style records for the given accepted paths, `rows` images per step, a random row
    inactive now and then (its path is not consumed). Decisions follow sampling: children of a
    path node tried in rank order up to the accepted one are 0, later siblings -1."""
    records, used = [], []
    it = iter(paths)
    while len(used) < len(paths):
        active = rng.random(rows) > 0.2
        decisions = np.full((rows, tree.num_nodes), -1, dtype=np.int8)
        accept_length = np.zeros(rows, dtype=np.int64)
        for row in np.flatnonzero(active):
            path = next(it, None)
            if path is None:
                active[row:] = False  # the paths ran out in this step
                break
            used.append(path)
            decisions[row, path] = 1
            for here, nxt in zip(path, path[1:] + [None]):
                for child in tree.children[here]:
                    if child == nxt:
                        break
                    decisions[row, child] = 0
            accept_length[row] = len(path) - 1
        # inactive rows hold garbage the counts must ignore
        decisions[~active] = rng.integers(-1, 2, size=(int((~active).sum()), tree.num_nodes))
        records.append({"tree": tree, "decisions": decisions, "accepted": accept_length, "active": active})
    return records, used


def test_counts_by_hand():
    """Tree [0], [1], [0, 0]; nodes 0 root, 1 = [0], 2 = [1], 3 = [0, 0]. Step 1: row 0 accepts
    [0] then [0, 0]; row 1 accepts [1]; row 2 inactive. Step 2: row 0 accepts nothing."""
    tree = build_tree([[0], [1], [0, 0]])
    counts = AcceptanceCounts()
    counts.add({"tree": tree, "active": [True, True, False], "accepted": [2, 1, 0],
                "decisions": np.array([[1, 1, -1, 1], [1, 0, 1, -1], [1, 1, 1, 1]], dtype=np.int8)})
    counts.add({"tree": tree, "active": [True, False, False], "accepted": [0, 0, 0],
                "decisions": np.array([[1, 0, 0, -1], [1, 1, -1, -1], [1, -1, -1, -1]], dtype=np.int8)})
    assert counts.trials[:2, :2].tolist() == [[3, 3], [1, 0]]
    assert counts.accepted[:2, :2].tolist() == [[1, 1], [1, 0]]
    assert counts.trials.sum() == 7 and counts.accepted.sum() == 3
    assert counts.steps == 3 and counts.accepted_drafts == 3
    assert counts.extent() == (2, 2)
    direct = count_accepted_paths(tree, [[0, 1, 3], [0, 2], [0]])
    assert np.array_equal(direct.trials, counts.trials) and np.array_equal(direct.accepted, counts.accepted)


@pytest.mark.parametrize("spec", ["kary-3-3", "naive_extend_57"])
def test_counts_from_records_match_direct_count(spec):
    rng = np.random.default_rng(2)
    tree = build_tree(spec)
    p = random_vectors(rng, tree.depth, max(tree.widths)) * 1.5
    p /= np.maximum(1.0, p.sum(1, keepdims=True) + 0.01)
    records, used = records_from_paths(tree, simulate_paths(tree, p, rng, 3000), rows=3, rng=rng)
    counts = AcceptanceCounts()
    for record in records:
        counts(record)  # the counts object is the observer
    direct = count_accepted_paths(tree, used)
    assert np.array_equal(counts.trials, direct.trials) and np.array_equal(counts.accepted, direct.accepted)
    assert counts.steps == len(used) and counts.accepted_drafts == sum(len(u) - 1 for u in used)
    # every accepted draft is one success of some cell
    assert counts.accepted.sum() == counts.accepted_drafts
    # and the estimates recover the vectors that generated the steps
    est = acceptance_vectors(counts, prior_strength=0)
    enough = counts.trials[: tree.depth, : est.shape[1]] >= 400
    assert enough.sum() >= 4
    t = counts.trials[: tree.depth, : est.shape[1]]
    tol = 5 * np.sqrt(p * (1 - p) / np.maximum(t, 1)) + 1e-9
    assert (np.abs(est - p)[enough] < tol[enough]).all()


def test_chain_records():
    counts = AcceptanceCounts()
    counts.add({"tree": build_tree([[0]]), "active": [True, True], "accepted": [0, 1],
                "decisions": np.array([[1, 0], [1, 1]], dtype=np.int8)})
    assert counts.steps == 2 and counts.trials[0, 0] == 2 and counts.accepted[0, 0] == 1
    assert counts.trials.sum() == 2


def test_non_contiguous_ranks_are_not_counted():
    """A rank-2 child without a rank-1 sibling was tried second, not third: it is not evidence
    for rank 2 and neither count uses it."""
    tree = build_tree([[0], [2]])
    counts = AcceptanceCounts()
    counts.add({"tree": tree, "active": [True], "accepted": [1],
                "decisions": np.array([[1, 0, 1]], dtype=np.int8)})
    assert counts.trials[0, :3].tolist() == [1, 0, 0] and counts.accepted[0, :3].tolist() == [0, 0, 0]
    direct = count_accepted_paths(tree, [[0, 2]])
    assert np.array_equal(direct.trials, counts.trials)


def test_pooling_rule():
    counts = AcceptanceCounts()
    counts.accepted[0, :2], counts.trials[0, :2] = [600, 200], [1000, 1000]
    counts.accepted[1, 0], counts.trials[1, 0] = 5, 10  # sparse: shrunk toward depth 1's 0.6
    # depth 3: never observed; rank 2 never observed anywhere
    p = acceptance_vectors(counts, depth=3, width=3, prior_strength=10)
    assert p[0, 0] == pytest.approx(600 / 1010) and p[0, 1] == pytest.approx(200 / 1010)
    assert p[0, 2] == 0.0
    assert p[1, 0] == pytest.approx((5 + 10 * 600 / 1010) / 20)
    assert p[1, 1] == pytest.approx(p[0, 1])  # no trials: the same rank one depth up
    assert np.allclose(p[2], p[1])
    raw = acceptance_vectors(counts, depth=2, width=2, prior_strength=0)
    assert raw[0].tolist() == [0.6, 0.2] and raw[1, 0] == 0.5 and raw[1, 1] == 0.2


def test_pooled_rows_never_sum_above_one():
    counts = AcceptanceCounts()
    counts.accepted[0, :2], counts.trials[0, :2] = [100, 800], [1000, 1000]
    counts.accepted[1, 0], counts.trials[1, 0] = 950, 1000  # rank 1 at depth 2 inherits 0.8
    p = acceptance_vectors(counts, depth=2, width=2)
    assert p[1].sum() == pytest.approx(1.0)


def test_counts_json_round_trip():
    counts = count_accepted_paths("kary-2-2", [[0, 1, 3], [0, 2], [0]])
    back = AcceptanceCounts.from_json(json.loads(json.dumps(counts.to_json())))
    assert np.array_equal(back.trials, counts.trials) and np.array_equal(back.accepted, counts.accepted)
    assert back.steps == 3 and back.accepted_drafts == 3


@pytest.mark.parametrize("decisions, accept_length, message", [
    ([[1, 1, 0]], [1], "shape"),
    ([[1, 0, -1, 1]], [1], "parent"),
    ([[1, 1, 1, -1]], [2], "two nodes"),
    ([[1, 1, -1, 1]], [1], "accepted differs"),
    ([[1, 2, -1, -1]], [0], "-1, 0 or 1"),
])
def test_bad_records(decisions, accept_length, message):
    tree = build_tree([[0], [1], [0, 0]])
    with pytest.raises(LanternError, match=message):
        AcceptanceCounts().add({"tree": tree, "active": [True], "accepted": accept_length,
                                "decisions": np.array(decisions)})


# ---------------------------------------------------------------------------------------------
# Latency model


def test_curve_interpolates_and_stays_monotone():
    c = Curve({"1": 10, "5": 14, "9": 30}, "t")
    assert c(1) == 10 and c(3) == pytest.approx(12) and c(7) == pytest.approx(22)
    noisy = Curve({1: 10, 2: 8, 3: 12}, "t")  # a noisy dip is pooled, never a cheaper bigger call
    assert [noisy(x) for x in (1, 2, 3)] == [9, 9, 12]
    with pytest.raises(LanternError, match="outside the measured range"):
        c(10)
    with pytest.raises(LanternError, match="size 1"):
        Curve({2: 1.0}, "t")
    with pytest.raises(LanternError, match="milliseconds"):
        Curve({1: -1.0}, "t")


def test_step_cost_by_hand():
    """mc_sim_7b_63: 26 nodes, depth 5, 4/8/8/3/2 nodes at depths 1..5 (REFERENCE.md section 2).
    Drafter calls: depth 0 of width 6, depths 1..4 of widths 4, 8, 8, 3 -> 29 ms at 1 ms per
    token; verification of 26 tokens at 10 + (T - 1) ms -> 35 ms; host 0.5 ms."""
    lat = LatencyModel({1: 10, 64: 73}, draft_ms={1: 1, 64: 64}, host_ms=0.5, ar_ms=11)
    assert lat.step_ms("mc_sim_7b_63") == pytest.approx(29 + 35 + 0.5)
    assert lat.step_ms([[0]]) == pytest.approx(2 + 11 + 0.5)  # depth 1: only the depth-0 call
    assert lat.ar_step_ms() == 11
    assert LatencyModel({1: 10, 64: 73}, draft_fraction=0.1).step_ms([[0], [0, 0]]) == pytest.approx(
        0.1 * 12 + 0.1 * 10 + 12)  # depth-0 call of width 3 + depth-1 call of width 1 + verify(3)
    # the loop's own work per drafter call: mc_sim_7b_63 makes 5 drafter calls
    with_calls = LatencyModel({1: 10, 64: 73}, draft_ms={1: 1, 64: 64}, host_ms=0.5, draft_host_ms=0.25)
    assert with_calls.step_ms("mc_sim_7b_63") == pytest.approx(29 + 5 * 0.25 + 35 + 0.5)


def test_latency_json(tmp_path):
    path = tmp_path / "lat.json"
    path.write_text(json.dumps({"note": "x", "verify_ms": {"1": 20, "64": 21}, "draft_ms": {"1": 1, "64": 2},
                                "host_ms": {"1": 0.1, "64": 0.4}, "draft_host_ms": 0.2, "ar_ms": 20.5}))
    lat = LatencyModel.from_json(path)
    again = LatencyModel.from_json(lat.to_json())
    assert again.step_ms("kary-2-3") == lat.step_ms("kary-2-3")
    assert lat.host_step_ms(200) == pytest.approx(0.4)
    with pytest.raises(LanternError, match="unknown keys"):
        LatencyModel.from_json({"verify_ms": {"1": 1}, "draft_fraction": 0.1, "verfy": 1})
    with pytest.raises(LanternError, match="not both or neither"):
        LatencyModel.from_json({"verify_ms": {"1": 1}})


# ---------------------------------------------------------------------------------------------
# The search with the latency model


P_IMAGE = [[0.45, 0.15, 0.08, 0.05, 0.03], [0.40, 0.14, 0.07, 0.04, 0.02], [0.35, 0.12, 0.06, 0.03, 0.02],
           [0.30, 0.10, 0.05, 0.03, 0.02]]


def test_free_drafter_and_flat_verification_grow_with_budget():
    lat = LatencyModel({1: 10, 256: 10}, draft_ms={1: 0, 256: 0})
    chosen = [search(P_IMAGE, lat, n, 4, 5).best for n in range(1, 41)]
    values = [c.tokens_per_step for c in chosen]
    assert chosen[0].name == "ar"
    assert all(b > a for a, b in zip(values, values[1:])), values
    assert [c.nodes for c in chosen] == list(range(1, 41))  # the whole budget is used


def test_linear_verification_and_expensive_drafter_pick_ar():
    lat = LatencyModel({1: 10, 64: 640}, draft_ms={1: 10, 64: 640})
    result = search(P_IMAGE, lat, 64, 4, 5)
    assert result.best.name == "ar" and tree_json(result.best) is None
    assert result.best.speedup == 1.0
    # the same acceptance on flat hardware drafts: the AR choice above came from the costs
    flat = LatencyModel({1: 10, 64: 10}, draft_fraction=0.02)
    assert search(P_IMAGE, flat, 64, 4, 5).best.nodes > 1


def test_search_output_is_a_valid_tree_within_limits(tmp_path):
    lat = LatencyModel({1: 20, 64: 21, 128: 38}, draft_fraction=0.05, host_ms=0.5)
    result = search(P_IMAGE, lat, 100, 4, 3)
    best = result.best
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(tree_json(best)))
    tree = build_tree(str(path))
    assert tree.num_nodes == best.nodes and tree.depth <= 4 and max(tree.widths) <= 3 and tree.contiguous
    assert best.tokens_per_step == pytest.approx(1 + expected_accept_length(tree, P_IMAGE))
    assert best.step_ms == pytest.approx(lat.step_ms(tree))
    assert best.tokens_per_s == max(c.tokens_per_s for c in result.candidates)
    # no preset of the same size or smaller, priced the same way, beats it
    for row in tree_report.compare_presets(np.array(P_IMAGE), lat, 3):
        assert "skipped" in row or row["tokens_per_s"] <= best.tokens_per_s + 1e-9


def test_search_skips_trees_beyond_the_latency_model():
    lat = LatencyModel({1: 10, 16: 10}, draft_fraction=0.0)
    result = search(P_IMAGE, lat, 40, 4, 5)
    assert result.best.nodes == 16
    assert all(c.nodes <= 16 for c in result.candidates) and result.skipped


@pytest.mark.parametrize("kwargs, message", [
    ({"max_nodes": 0}, "max_nodes"), ({"max_depth": 17}, "max_depth"), ({"candidates": 0}, "candidates")])
def test_search_rejects_bad_limits(kwargs, message):
    args = {"max_nodes": 10, "max_depth": 3, "candidates": 3} | kwargs
    with pytest.raises(LanternError, match=message):
        search(P_IMAGE, LatencyModel({1: 1, 64: 1}, draft_fraction=0.1), **args)


def test_bad_vectors():
    lat = LatencyModel({1: 1, 64: 1}, draft_fraction=0.1)
    with pytest.raises(LanternError, match="sums to"):
        search([[0.7, 0.4]], lat, 10, 2, 2)
    with pytest.raises(LanternError, match=r"\[0, 1\]"):
        search([[1.2]], lat, 10, 2, 2)


# ---------------------------------------------------------------------------------------------
# Reports and the what-if entry point


def test_whatif_cli(tmp_path, capsys):
    lat = tmp_path / "lat.json"
    lat.write_text(json.dumps({"verify_ms": {"1": 20, "64": 21, "128": 38}, "draft_fraction": 0.05, "host_ms": 0.5}))
    steps = simulate_paths(build_tree("kary-4-3"), P_IMAGE, np.random.default_rng(0), 2000)
    counts = count_accepted_paths("kary-4-3", steps)
    acc = tmp_path / "acc.json"
    acc.write_text(json.dumps(counts.to_json()))
    out, rep, plots = tmp_path / "tree.json", tmp_path / "report.json", tmp_path / "plots"
    rc = tree_report.main(["--latency", str(lat), "--acceptance", str(acc), "--budget", "64", "--depth", "3",
                           "--candidates", "4", "--out", str(out), "--report", str(rep), "--plots", str(plots)])
    text = capsys.readouterr().out
    assert rc == 0
    assert text.startswith("PLANNING AID") and "nothing here was measured" in text
    assert "mc_sim_7b_63" in text and "(obs)" in text
    report = json.loads(rep.read_text())
    assert report["planning_aid"] is True
    tree = build_tree(str(out))
    assert tree.num_nodes == report["chosen"]["nodes"] > 1 and max(tree.widths) <= 4
    assert (plots / "acceptance.png").stat().st_size > 0 and (plots / "latency.png").stat().st_size > 0
    # naive_extend_57 needs 5 candidates: reported as skipped, not priced
    assert any(r["name"] == "naive_extend_57" and "skipped" in r for r in report["presets"])


def test_whatif_bad_input_is_one_line(tmp_path, capsys):
    lat = tmp_path / "lat.json"
    lat.write_text(json.dumps({"verify_ms": {"2": 20}, "draft_fraction": 0.05}))
    acc = tmp_path / "acc.json"
    acc.write_text(json.dumps({"p": [0.5, 0.2]}))
    rc = tree_report.main(["--latency", str(lat), "--acceptance", str(acc), "--out", str(tmp_path / "t.json")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "size 1" in err
    assert not (tmp_path / "t.json").exists()


def test_acceptance_table_lists_counts():
    counts = count_accepted_paths("kary-2-2", [[0, 1, 3], [0, 2], [0]])
    p = acceptance_vectors(counts, prior_strength=0)
    text = tree_report.acceptance_table(p, counts)
    lines = text.splitlines()
    assert len(lines) == 3 and "(3)" in lines[1] and "(2)" in lines[2]


def test_calibration_tree_covers_every_depth_and_rank():
    paths = calibration_tree([[0.4, 0.15, 0.08, 0.05]], 128, 8, 8)
    tree = build_tree(paths)
    assert tree.depth == 8 and tree.widths == (8,) * 8 and tree.contiguous
    assert 128 - 8 < tree.num_nodes <= 128
    assert all(len(kids) in (0, 8) for kids in tree.children)  # opened nodes get every rank
    # after the spine, the likeliest nodes are opened: the rank-1 child of the root before the
    # spine's deepest, whose reach is 0.4 ** 7
    assert [1, 0] in paths
    with pytest.raises(LanternError, match="spine"):
        calibration_tree([[0.5]], 20, 8, 8)


def test_report_checks_the_model_on_the_calibration_tree():
    """On steps drawn from the positional model itself, the calibration tree's predicted accepted
    drafts under the estimated vectors match the measured mean."""
    rng = np.random.default_rng(4)
    tree = build_tree(calibration_tree(P_IMAGE, 60, 4, 5))
    counts = count_accepted_paths(tree, simulate_paths(tree, P_IMAGE, rng, 4000))
    p = acceptance_vectors(counts)
    lat = LatencyModel({1: 20, 64: 21}, draft_fraction=0.05)
    _, report = tree_report.tune(p, lat, 60, 4, 5, counts, calibration=tree)
    check = report["calibration_check"]
    assert check["predicted_accepted"] == pytest.approx(check["measured_accepted"], rel=0.05)
    assert "predicted" in tree_report.format_report(report)


# ---------------------------------------------------------------------------------------------
# A batched call ends with its slowest image


def test_step_moments_and_batch_steps_match_monte_carlo():
    rng = np.random.default_rng(8)
    tree = build_tree("mc_sim_7b_63")
    p = np.array(P_IMAGE + [[0.3, 0.1, 0.05, 0.03, 0.02]])
    lengths = np.array([len(path) for path in simulate_paths(tree, p, rng, 40000)])  # tokens per step, bonus incl.
    mean, var = tree_search.tokens_per_step_moments(tree, p)
    assert mean == pytest.approx(1 + expected_accept_length(tree, p))
    assert lengths.mean() == pytest.approx(mean, abs=4 * lengths.std() / 200)
    assert lengths.var() == pytest.approx(var, rel=0.03)
    # calls of 8 images of 63 tokens: steps until the slowest image has its 63 tokens
    tokens, images, calls = 63, 8, 1500
    draws = iter(rng.choice(lengths, size=200000))  # steps drawn from the simulated ones

    def image_steps():
        done, steps = 0, 0
        while done < tokens:
            done, steps = done + next(draws), steps + 1
        return steps

    per_call = [max(image_steps() for _ in range(images)) for _ in range(calls // 8)]
    single = [image_steps() for _ in range(calls)]
    assert np.mean(per_call) == pytest.approx(tree_search.generation_steps(tree, p, tokens, images), rel=0.02)
    assert np.mean(single) == pytest.approx(tree_search.generation_steps(tree, p, tokens, 1), rel=0.02)
    assert tree_search.generation_steps("chain-1", [[0.0]], tokens, images) == tokens  # nothing accepted: AR
    lat = LatencyModel({1: 10, 64: 10}, draft_fraction=0.1)
    one = tree_search.price(tree, p, lat)
    batch = tree_search.price(tree, p, lat, generation=(tokens, images))
    assert batch.effective_tokens_per_step < one.tokens_per_step == batch.tokens_per_step
    assert batch.tokens_per_s == pytest.approx(1000 * images * batch.effective_tokens_per_step / batch.step_ms)
