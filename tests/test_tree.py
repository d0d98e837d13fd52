"""Tree specs and buffers: presets, invariants checked against independent computations, errors."""
import json

import numpy as np
import pytest

from lantern.runtime.errors import LanternError
from lantern.runtime.tree import MAX_DEPTH, MAX_WIDTH, build_tree, preset_names

# (nodes without the root, depth), counted by hand from the public choices.py
PRESETS = {
    "mc_sim_7b_63": (25, 5),
    "naive_extend_57": (57, 5),
    "mc_sim_7b_63_balanced": (25, 5),
    "medusa_2_7b_63": (63, 4),
    "reverse_balanced_25": (25, 5),
    "chain": (5, 5),
    "chain-1": (1, 1),
    "chain-7": (7, 7),
    "kary-3-2": (12, 2),
    "kary-2-4": (30, 4),
    "kary-1-3": (3, 3),
}

# Typed in from REFERENCE.md section 2, not from the code under test.
MC_SIM_7B_63 = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
                [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
                [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]
NAIVE_EXTEND_57 = [
    [0], [1], [2], [3], [4], [0, 0], [0, 1], [0, 2], [0, 3], [1, 0], [1, 1], [1, 2], [2, 0], [2, 1],
    [2, 2], [3, 0], [3, 1], [4, 0], [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 3], [0, 1, 0], [0, 1, 1],
    [0, 1, 2], [0, 2, 0], [0, 2, 1], [0, 2, 2], [0, 3, 0], [0, 3, 1], [1, 0, 0], [1, 0, 1], [1, 1, 0],
    [2, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 3], [0, 0, 1, 0], [0, 0, 1, 1],
    [0, 0, 1, 2], [0, 0, 2, 0], [0, 0, 2, 1], [0, 0, 3, 0], [0, 1, 0, 0], [0, 1, 0, 1], [0, 1, 1, 0],
    [0, 2, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1],
    [0, 0, 1, 0, 0], [0, 0, 1, 0, 1], [0, 0, 1, 1, 0], [0, 0, 2, 0, 0]]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_sizes(name):
    tree = build_tree(name)
    nodes, depth = PRESETS[name]
    assert tree.num_nodes == nodes + 1
    assert tree.depth == depth
    assert tree.name == name


def test_reference_lists():
    assert build_tree("mc_sim_7b_63").choices == sorted(MC_SIM_7B_63, key=lambda p: (len(p), p))
    assert sorted(map(tuple, build_tree("naive_extend_57").choices)) == sorted(map(tuple, NAIVE_EXTEND_57))


def _check_buffers(tree):
    paths = list(tree.paths)
    n = len(paths)
    assert paths[0] == ()
    # order: depth, then lexicographic; parents before children
    keys = [(len(p), p) for p in paths]
    assert keys == sorted(keys) and len(set(paths)) == n
    for i, p in enumerate(paths):
        assert tree.depths[i] == len(p)
        if i == 0:
            assert tree.parents[0] == -1 and tree.ranks[0] == -1
        else:
            assert paths[tree.parents[i]] == p[:-1]
            assert tree.ranks[i] == p[-1]

    # mask == ancestor-or-self relation, from the paths alone
    expected = np.array([[paths[i][:len(paths[j])] == paths[j] for j in range(n)] for i in range(n)])
    np.testing.assert_array_equal(tree.mask, expected)
    assert tree.mask.dtype == bool

    # leaf paths: one row per leaf, every prefix in order, -1 after the leaf
    leaves = [i for i, p in enumerate(paths) if not any(q[:len(p)] == p and len(q) > len(p) for q in paths)]
    assert tree.leaf_paths.shape == (len(leaves), tree.depth + 1)
    last = [row[row >= 0][-1] for row in tree.leaf_paths]
    assert last == leaves
    for row in tree.leaf_paths:
        leaf = paths[row[row >= 0][-1]]
        for d in range(tree.depth + 1):
            assert row[d] == (paths.index(leaf[:d]) if d <= len(leaf) else -1)

    # depth groups: a fake drafter output per depth, where entry [slot, rank] names the child
    # (parent path + rank), filled through the documented gather, lands on the right node
    assert len(tree.levels) == tree.depth
    prev = [0]
    names = {}
    tokens = {0: ()}
    for d, level in enumerate(tree.levels, start=1):
        assert level.depth == d
        at_d = [i for i, p in enumerate(paths) if len(p) == d]
        assert list(level.nodes) == at_d
        assert list(level.parents) == [tree.parents[i] for i in at_d]
        assert list(level.ranks) == [paths[i][-1] for i in at_d]
        assert level.width == max(paths[i][-1] for i in at_d) + 1 == tree.widths[d - 1]
        assert [prev[s] for s in level.slots] == list(level.parents)
        topk = np.empty((len(prev), level.width), dtype=object)
        for s, parent in enumerate(prev):
            for r in range(level.width):
                topk[s, r] = tokens[parent] + (r,)
        for node, value in zip(level.nodes, topk[level.slots, level.ranks]):
            names[node] = value
            tokens[node] = value
        prev = at_d
    assert all(names[i] == paths[i] for i in range(1, n))

    # children in rank order, consistent with parents
    for i in range(n):
        kids = [j for j in range(1, n) if tree.parents[j] == i]
        assert list(tree.children[i]) == kids
        assert [paths[j][-1] for j in kids] == sorted(paths[j][-1] for j in kids)

    for a in (tree.parents, tree.depths, tree.ranks, tree.mask, tree.leaf_paths):
        assert not a.flags.writeable


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_buffers(name):
    tree = build_tree(name)
    _check_buffers(tree)
    assert tree.contiguous


def test_custom_tree_with_gap_and_shuffled_input():
    spec = [[2, 0], [0], [2], [0, 1], [0, 0, 0], [0, 0]]
    tree = build_tree(spec)
    _check_buffers(tree)
    assert tree.paths == ((), (0,), (2,), (0, 0), (0, 1), (2, 0), (0, 0, 0))
    assert not tree.contiguous  # [2] without [1]
    assert tree.widths == (3, 2, 1)
    assert tree.name == "custom"


def test_kary_is_full():
    tree = build_tree("kary-3-3")
    assert tree.num_nodes == 1 + 3 + 9 + 27
    assert set(tree.paths) == {()} | {(a,) for a in range(3)} | {(a, b) for a in range(3) for b in range(3)} \
        | {(a, b, c) for a in range(3) for b in range(3) for c in range(3)}


def test_chain():
    tree = build_tree("chain-4")
    assert tree.paths == ((), (0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
    assert tree.leaf_paths.tolist() == [[0, 1, 2, 3, 4]]


def test_round_trip_json_and_forms(tmp_path):
    tree = build_tree("mc_sim_7b_63")
    data = json.loads(json.dumps(tree.to_json()))
    assert data["name"] == "mc_sim_7b_63"
    again = build_tree(data)
    assert again == tree and again.paths == tree.paths

    f = tmp_path / "my_tree.json"
    f.write_text(json.dumps(tree.choices))
    from_list_file = build_tree(str(f))
    assert from_list_file.paths == tree.paths and from_list_file.name == "my_tree"
    g = tmp_path / "named.json"
    g.write_text(json.dumps(tree.to_json()))
    assert build_tree(g) == tree

    as_tuples = build_tree([tuple(np.int64(r) for r in p) for p in MC_SIM_7B_63], name="x")
    assert as_tuples.paths == tree.paths and as_tuples.name == "x"
    assert build_tree(tree) is tree


@pytest.mark.parametrize("spec, words", [
    ([[0], [0, 1, 2]], ["[0, 1, 2]", "prefix [0, 1]"]),
    ([[1, 0]], ["[1, 0]", "prefix [1]"]),
    ([[0], [1], [0]], ["[0]", "twice"]),
    ([[0], [-1]], ["[-1]", "negative"]),
    ([[0], [1.0]], ["1.0", "not an integer"]),
    ([[0], [True]], ["True", "not an integer"]),
    ([[0], "01"], ["'01'", "not a list"]),
    ([], ["empty"]),
    ([[0], []], ["[]", "root is implicit"]),
    ([[0], [MAX_WIDTH]], [str(MAX_WIDTH), "width limit"]),
    ([[0] * d for d in range(1, MAX_DEPTH + 2)], [f"depth {MAX_DEPTH + 1}", f"limit {MAX_DEPTH}"]),
    ({"name": "x"}, ["'paths'"]),
    (5, ["list of paths"]),
])
def test_errors(spec, words):
    with pytest.raises(LanternError) as e:
        build_tree(spec)
    for w in words:
        assert w in str(e.value)
    assert isinstance(e.value, ValueError)


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(LanternError) as e:
        build_tree("mc_sim_7b_64")
    msg = str(e.value)
    assert "mc_sim_7b_64" in msg
    for name in preset_names():
        assert name in msg


@pytest.mark.parametrize("name, words", [
    ("chain-0", ["1..16"]),
    (f"chain-{MAX_DEPTH + 1}", ["1..16"]),
    ("kary-0-2", ["width", "1..64"]),
    ("kary-65-1", ["width", "1..64"]),
    ("kary-2-17", ["depth", "1..16"]),
    ("kary-4-7", ["21844 nodes", "4096"]),
])
def test_generated_limits(name, words):
    with pytest.raises(LanternError) as e:
        build_tree(name)
    for w in words:
        assert w in str(e.value)


def test_unreadable_json(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[[0], [1")
    with pytest.raises(LanternError, match="cannot read tree file .*bad.json"):
        build_tree(str(bad))
    with pytest.raises(LanternError, match="cannot read tree file .*missing.json"):
        build_tree(str(tmp_path / "missing.json"))
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps([[0], [0, 0, 0]]))
    with pytest.raises(LanternError, match=r"\[0, 0, 0\] needs its prefix \[0, 0\]"):
        build_tree(wrong)
