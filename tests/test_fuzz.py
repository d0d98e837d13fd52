"""Fuzzing (hypothesis, derandomized so a run is reproducible): no tree spec makes build_tree
raise anything but a LanternError, and no tree file makes `lantern-run generate --tree` print a
traceback, and no manifest makes `lantern-run generate` print one either (harness: fuzz.py)."""
import json
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from fuzz import assert_cli_contract, json_values, mutations, to_json_text, tree_specs
from lantern.runtime.errors import LanternError
from lantern.runtime.tree import MAX_DEPTH, MAX_NODES, MAX_WIDTH, Tree, build_tree

FAST = settings(max_examples=400, deadline=None, derandomize=True, database=None)
SLOW = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def check_tree(tree):
    """What every tree build_tree returns must satisfy (the conventions in its docstring)."""
    assert isinstance(tree, Tree)
    n = tree.num_nodes
    assert 2 <= n <= MAX_NODES and 1 <= tree.depth <= MAX_DEPTH
    assert tree.parents[0] == -1 and all(0 <= tree.parents[i] < i for i in range(1, n))
    assert all(0 <= r < MAX_WIDTH for r in tree.ranks[1:])
    assert not np.triu(tree.mask, 1).any() and tree.mask.diagonal().all()  # ancestors precede, self included
    assert all(tree.mask[i, tree.parents[i]] for i in range(1, n))
    assert sum(len(level.nodes) for level in tree.levels) == n - 1


@FAST
@given(tree_specs)
def test_build_tree_returns_a_tree_or_one_line(spec):
    try:
        tree = build_tree(spec)
    except LanternError as e:
        assert "\n" not in str(e)
        return
    check_tree(tree)
    assert build_tree(tree.to_json()) == tree  # what a manifest records reads back the same


@FAST
@given(st.one_of(tree_specs.map(to_json_text), st.text(max_size=40), st.binary(max_size=40).map(repr)))
def test_tree_files_give_a_tree_or_one_line(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("tree") / "tree.json"
    path.write_text(text)
    try:
        check_tree(build_tree(str(path)))
    except LanternError as e:
        assert "\n" not in str(e)


@pytest.fixture
def engine(demo_engine):
    return str(demo_engine)  # conftest.py: the demo's engine, built once per session


@SLOW
@given(st.one_of(tree_specs.map(to_json_text), st.text(max_size=30)))
def test_generate_with_any_tree_file_exits_cleanly(engine, tmp_path, capsys, text):
    from lantern.tools import run_cli

    tree = tmp_path / "tree.json"
    tree.write_text(text)
    out = tmp_path / "out"
    argv = ["generate", engine, "--tree", str(tree), "--mode", "exact", "--greedy", "--classes", "1",
            "--threads", "1", "--out", str(out)]
    rc = assert_cli_contract(run_cli.main, argv, capsys, "lantern-run")
    if rc == 0:
        assert np.load(out / "tokens.npy").shape == (1, 64)
        shutil.rmtree(out)
    else:
        assert not out.exists()


VALID = {"name": "t", "paths": [[0], [1], [0, 0]], "extra": {"a": [1, 2]}}


@FAST
@given(mutations(VALID))
def test_mutations_change_documents(document):
    """The manifest harness draws documents that differ from the valid one and stay JSON (their
    text reads back to the same text)."""
    text = to_json_text(document)
    assert isinstance(document, dict) and text != to_json_text(VALID)
    assert to_json_text(json.loads(text)) == text


@SLOW
@given(data=st.data())
def test_generate_with_any_manifest_exits_cleanly(engine, tmp_path, capsys, data):
    import shutil

    from lantern.tools import run_cli

    copy = tmp_path / "engine"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(engine, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(to_json_text(data.draw(mutations(manifest))))
    assert_cli_contract(run_cli.main, ["generate", str(copy), "--mode", "exact", "--greedy", "--classes", "1",
                                       "--threads", "1", "--out", str(tmp_path / "out")], capsys, "lantern-run")
    shutil.rmtree(tmp_path / "out", ignore_errors=True)


@pytest.mark.parametrize("kind", ["nan", "huge", "nested"])
def test_json_values_reach_the_awkward_cases(kind):
    """The strategy draws what broke things before: NaN, huge integers, nested containers. find()
    searches until one turns up (a fixed sample of draws missed NaN once inside the full run)."""
    hit = {"nan": lambda v: "NaN" in to_json_text(v),
           "huge": lambda v: any(isinstance(x, int) and not isinstance(x, bool) and abs(x) > 2**63 for x in _scalars(v)),
           "nested": lambda v: to_json_text(v).count("[") + to_json_text(v).count("{") > 1}[kind]
    find(json_values, hit, settings=settings(max_examples=5000, derandomize=True, database=None))


def _scalars(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _scalars(v)
    elif isinstance(value, list):
        for v in value:
            yield from _scalars(v)
    else:
        yield value

