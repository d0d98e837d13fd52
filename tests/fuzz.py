"""Fuzzing helpers (hypothesis): arbitrary JSON, tree specs, mutations of a valid document, and
the CLI contract every input must meet (exit 0, or exit 2 with one line; never a traceback).

Made for tree specs now and for engine manifests next: `mutations(valid_manifest)` draws
manifests that differ from a valid one by deleted keys, replaced values at any depth (any JSON
type) and unknown keys; write each to a copy of an engine directory and hand the CLI to
`assert_cli_contract`.
"""
import json

from hypothesis import strategies as st

# Any JSON value, including what Python's json module reads beyond the standard (NaN, Infinity)
# and numbers far outside any sensible range.
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)), max_leaves=20)

# Tree specs: mostly near-valid lists of paths (small ranks and depths, so many are valid trees),
# then dicts with "paths", preset-like names, and anything at all.
small_ranks = st.integers(min_value=-2, max_value=70)
paths = st.lists(st.one_of(small_ranks, st.sampled_from([0, 0, 1, 2]), json_scalars), max_size=18)
tree_lists = st.lists(paths, max_size=30)
closed_trees = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), min_size=1, max_size=25).map(
    lambda ps: sorted({tuple(p[:cut]) for p in ps for cut in range(1, len(p) + 1)}, key=lambda p: (len(p), p)))
tree_specs = st.one_of(
    closed_trees.map(lambda ps: [list(p) for p in ps]),  # prefix-closed: valid unless limits are hit
    tree_lists,
    st.fixed_dictionaries({"paths": st.one_of(tree_lists, json_values)}, optional={"name": json_values}),
    st.builds(lambda w, d: f"kary-{w}-{d}", st.integers(0, 99), st.integers(0, 20)),
    st.builds(lambda n: f"chain-{n}", st.integers(0, 40)),
    json_values,
)


def to_json_text(value):
    """JSON text of a drawn value as a user's file might hold it (NaN and Infinity included)."""
    return json.dumps(value, allow_nan=True)


def _paths_in(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths_in(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths_in(v, prefix + (i,))


def _node(value, path):
    for key in path:
        value = value[key]
    return value


def _edited(document, path, edit):
    """A copy of `document` with edit(node) applied to the node at `path`."""
    copy = json.loads(json.dumps(document, allow_nan=True))
    edit(_node(copy, path))
    return copy


def mutations(document, max_changes=3):
    """`document` (a JSON-ready dict) with 1..max_changes random edits: delete a key or list
    item, replace a value by any JSON value, or add an unknown key to a dict. Edits that give
    back the document itself (a value replaced by its equal, edits that cancel) are not drawn."""
    same = to_json_text(document)
    return _edits(document, max_changes).filter(lambda edited: to_json_text(edited) != same)


@st.composite
def _edits(draw, document, max_changes):
    for _ in range(draw(st.integers(1, max_changes))):
        where = list(_paths_in(document))
        action = draw(st.sampled_from(["delete", "replace", "replace", "add"]))
        if action == "add":
            path = draw(st.sampled_from([p for p in where if isinstance(_node(document, p), dict)]))
            key, new = draw(st.text(min_size=1, max_size=8)), draw(json_values)
            document = _edited(document, path, lambda node: node.__setitem__(key, new))
        elif len(where) > 1:
            path = draw(st.sampled_from(where[1:]))
            if action == "delete":
                document = _edited(document, path[:-1], lambda node: node.pop(path[-1]))
            else:
                new = draw(json_values)
                document = _edited(document, path[:-1], lambda node: node.__setitem__(path[-1], new))
    return document


def assert_cli_contract(main, argv, capsys, prog):
    """Run a CLI main in-process: exit 0, or exit 2 with exactly one line on stderr. Any other
    exception propagates (the traceback a user would have seen fails the test)."""
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if not line.startswith("note: ")]
    if rc == 0:
        return rc
    assert rc == 2, (rc, err)
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    assert "Traceback" not in err
    return rc
