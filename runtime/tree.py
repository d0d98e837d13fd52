"""Static draft trees: a tree spec (EAGLE/Medusa "choices") and the buffers one decoding step needs.

A spec is a list of paths. A path lists a child rank per depth (0 = the drafter's top choice at
that node); the root, the token sampled at the end of the previous step, is implicit. Every
prefix of a path must be in the tree too. `build_tree(spec)` takes a preset name, a JSON file, a
list of paths or the dict that `Tree.to_json()` writes, and returns an immutable `Tree` whose
arrays are derived once and never change.

Presets: the trees of the public EAGLE/LANTERN code (`models/drafters/choices.py`):
`mc_sim_7b_63` (25 nodes, depth 5; EAGLE-1's default), `naive_extend_57` (57 nodes, depth 5),
`mc_sim_7b_63_balanced` (25), `medusa_2_7b_63` (63, depth 4), `reverse_balanced_25` (25),
`chain` (= chain-5); and generated ones: `chain-N` (N nodes in a line) and `kary-W-D` (every
node has W children down to depth D).

Conventions (the rest of the runtime relies on them):
- Node order: the root is node 0 with path (); then nodes sorted by depth, then lexicographically
  by path, the order of the public code (`sorted(choices, key=lambda x: (len(x), x))`). A parent
  always precedes its children; siblings come in rank order; among nodes of equal depth a lower
  index means a higher-ranked path.
- parents[0] = -1, depths[0] = 0, ranks[0] = -1 (the root is nobody's child).
- mask[i, j] is True iff node j is node i or an ancestor of i (the tree part of the attention
  mask); node i sits at position past + depths[i].
- levels[d - 1] describes depth d (d = 1..depth): `nodes` (node indices), `parents` (node
  indices), `slots` (each parent's position in depth d-1's node list; the root is slot 0 of
  depth 0), `ranks`, `width` (max rank + 1). A drafter run over depth d-1's nodes, in node
  order, that returns top ids [n_{d-1}, >= width] fills depth d with one gather:
      tokens[level.nodes] = topk_ids[level.slots, level.ranks]
- leaf_paths [n_leaves, depth + 1]: the node indices from the root to each leaf, padded with -1,
  one row per leaf in node order.
- children[i]: node i's children in rank order; child_at[i, r]: node i's child of rank r, or -1.
- `root_only()` is the tree of AR decoding: the root alone, depth 0.
"""
import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lantern.runtime.enginedir import load_json
from lantern.runtime.errors import LanternError

MAX_DEPTH = 16  # longest path; positions past + 16 at most per step
MAX_WIDTH = 64  # ranks 0..63: no drafter top-k is wider than this
MAX_NODES = 4096  # the [N, N] mask and a verification step of N + 1 tokens stay reasonable

_PRESETS = {
    "mc_sim_7b_63": [
        [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
        [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
        [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
    ],
    "mc_sim_7b_63_balanced": [
        [0], [1], [2],
        [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2], [2, 0], [2, 1],
        [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [1, 0, 0], [1, 0, 1], [1, 1, 0],
        [1, 1, 1],
        [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
    ],
    "naive_extend_57": [
        [0], [1], [2], [3], [4],
        [0, 0], [0, 1], [0, 2], [0, 3], [1, 0], [1, 1], [1, 2], [2, 0], [2, 1], [2, 2], [3, 0],
        [3, 1], [4, 0],
        [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 3], [0, 1, 0], [0, 1, 1], [0, 1, 2], [0, 2, 0],
        [0, 2, 1], [0, 2, 2], [0, 3, 0], [0, 3, 1], [1, 0, 0], [1, 0, 1], [1, 1, 0], [2, 0, 0],
        [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 3], [0, 0, 1, 0], [0, 0, 1, 1],
        [0, 0, 1, 2], [0, 0, 2, 0], [0, 0, 2, 1], [0, 0, 3, 0], [0, 1, 0, 0], [0, 1, 0, 1],
        [0, 1, 1, 0], [0, 2, 0, 0],
        [0, 0, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1],
        [0, 0, 1, 0, 0], [0, 0, 1, 0, 1], [0, 0, 1, 1, 0], [0, 0, 2, 0, 0],
    ],
    "medusa_2_7b_63": [
        [0], [1], [2], [3], [4], [5], [6], [7], [8], [9],
        [0, 0], [0, 1], [0, 2], [0, 3], [0, 4], [0, 5], [0, 6], [0, 7], [0, 8], [0, 9], [1, 0],
        [1, 1], [1, 2], [1, 3], [1, 4], [2, 0], [2, 1], [3, 0], [3, 1], [4, 0], [5, 0], [6, 0],
        [7, 0],
        [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 3], [0, 0, 4], [0, 0, 5], [0, 0, 6], [0, 0, 7],
        [0, 0, 8], [0, 1, 0], [0, 1, 1], [0, 1, 2], [0, 1, 3], [0, 2, 0], [0, 2, 1], [0, 3, 0],
        [0, 4, 0], [0, 5, 0], [1, 0, 0], [1, 0, 1], [1, 0, 2], [1, 1, 0], [2, 0, 0],
        [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 3], [0, 0, 1, 0], [0, 0, 2, 0],
        [0, 1, 0, 0],
    ],
    "reverse_balanced_25": [
        [0], [1], [2],
        [0, 0], [0, 1], [1, 0], [2, 0],
        [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [1, 0, 0],
        [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0], [0, 0, 1, 1],
        [0, 0, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 0, 3], [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1], [0, 0, 0, 1, 2],
    ],
}
_PRESETS["chain"] = [[0] * d for d in range(1, 6)]

_GENERATED = re.compile(r"^(?:chain-(?P<n>\d+)|kary-(?P<w>\d+)-(?P<d>\d+))$")


def preset_names():
    """The valid preset names; `chain-N` and `kary-W-D` stand for their families."""
    return sorted(_PRESETS) + ["chain-N", "kary-W-D"]


@dataclass(frozen=True, eq=False)
class Level:
    """The nodes at one depth, as a drafter fills them (see the module docstring)."""

    depth: int
    nodes: np.ndarray  # [n_d] node indices
    parents: np.ndarray  # [n_d] node indices of the parents
    slots: np.ndarray  # [n_d] the parents' positions in depth d-1's node list
    ranks: np.ndarray  # [n_d] child rank at the parent
    width: int  # max rank + 1: the top-k a drafter must return at depth d-1


@dataclass(frozen=True, eq=False)
class Tree:
    """A static draft tree and its buffers; make it with `build_tree`. Arrays are read-only."""

    name: str
    paths: tuple  # per node, the path as a tuple of ranks; paths[0] == () is the root
    parents: np.ndarray  # [N] int64
    depths: np.ndarray  # [N] int64
    ranks: np.ndarray  # [N] int64
    mask: np.ndarray  # [N, N] bool
    levels: tuple  # Level per depth 1..depth
    leaf_paths: np.ndarray  # [n_leaves, depth + 1] int64, -1 padded
    children: tuple  # per node, a tuple of child node indices in rank order
    child_at: np.ndarray  # [N, max_width] int64: the child of rank r, or -1

    @property
    def num_nodes(self):
        """Nodes including the root: the number of tokens one verification step feeds."""
        return len(self.paths)

    @property
    def depth(self):
        return len(self.levels)

    @property
    def widths(self):
        """Per depth 1..depth, the top-k a drafter must return (max rank + 1)."""
        return tuple(level.width for level in self.levels)

    @property
    def max_width(self):
        """The widest node's child count: the drafter candidates the tree needs (0: root only)."""
        return max(self.widths, default=0)

    @property
    def choices(self):
        """The spec: the paths of all nodes but the root, in node order, as lists."""
        return [list(p) for p in self.paths[1:]]

    @functools.cached_property
    def contiguous(self):
        """True when every node's children have ranks 0..w-1 with no gap (sampling needs it)."""
        return all(tuple(int(self.ranks[c]) for c in kids) == tuple(range(len(kids)))
                   for kids in self.children)

    def to_json(self):
        """A JSON-ready dict for an engine manifest; `build_tree` reads it back."""
        return {"name": self.name, "paths": self.choices}

    def __eq__(self, other):
        if not isinstance(other, Tree):
            return NotImplemented
        return (self.name, self.paths) == (other.name, other.paths)

    def __hash__(self):
        return hash((self.name, self.paths))

    def __repr__(self):
        return f"Tree({self.name!r}, nodes={self.num_nodes}, depth={self.depth})"


def build_tree(spec, name=None):
    """Tree from a preset name, a .json file (a list of paths or {"name", "paths"}), a list of
    paths, a {"name", "paths"} dict, or a Tree (returned as is). `name` overrides the name
    recorded in manifests (default: the preset name, the file's "name" or stem, or "custom")."""
    if isinstance(spec, Tree):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        text = os.fspath(spec)
        if text in _PRESETS or _GENERATED.match(text):
            return _build(_preset(text), name or text)
        if text.endswith(".json") or os.path.isfile(text):
            data = _read_json(text)
            if isinstance(data, dict):
                return _build(_paths_of(data, text), name or data.get("name") or Path(text).stem)
            return _build(data, name or Path(text).stem)
        raise LanternError(f"unknown tree preset {text!r}; valid presets: "
                           f"{', '.join(preset_names())}, or a path to a .json file")
    if isinstance(spec, dict):
        return _build(_paths_of(spec, "tree dict"), name or spec.get("name") or "custom")
    return _build(spec, name or "custom")


def _preset(text):
    if text in _PRESETS:
        return _PRESETS[text]
    m = _GENERATED.match(text)
    if m.group("n") is not None:
        n = int(m.group("n"))
        if not 1 <= n <= MAX_DEPTH:
            raise LanternError(f"tree preset {text!r}: chain length must be 1..{MAX_DEPTH}")
        return [[0] * d for d in range(1, n + 1)]
    w, d = int(m.group("w")), int(m.group("d"))
    if not 1 <= w <= MAX_WIDTH:
        raise LanternError(f"tree preset {text!r}: width must be 1..{MAX_WIDTH}")
    if not 1 <= d <= MAX_DEPTH:
        raise LanternError(f"tree preset {text!r}: depth must be 1..{MAX_DEPTH}")
    count = sum(w ** i for i in range(1, d + 1))  # before building, so kary-64-16 fails fast
    if count + 1 > MAX_NODES:
        raise LanternError(f"tree preset {text!r} has {count} nodes + root; at most "
                           f"{MAX_NODES} nodes including the root are supported")
    paths = [[]]
    out = []
    for _ in range(d):
        paths = [p + [r] for p in paths for r in range(w)]
        out += paths
    return out


def _read_json(text):
    try:
        with open(text, encoding="utf-8") as f:
            return load_json(f, f"tree file {text}")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LanternError(f"cannot read tree file {text}: {e}") from None


def _paths_of(data, where):
    if "paths" not in data:
        raise LanternError(f"{where}: expected a list of paths or a dict with a 'paths' list")
    return data["paths"]


def _fmt(path):
    return "[" + ", ".join(str(r) for r in path) + "]"


def _validate(spec):
    """Paths as tuples of ints, in the given order, or LanternError naming the bad path."""
    if isinstance(spec, (str, bytes)) or not hasattr(spec, "__iter__"):
        raise LanternError(f"a tree is a list of paths (lists of child ranks), got {type(spec).__name__}")
    paths = []
    for raw in spec:
        if isinstance(raw, (str, bytes)) or not isinstance(raw, (list, tuple, np.ndarray)):
            raise LanternError(f"tree path {raw!r} is not a list of child ranks")
        for r in raw:
            # bool is an int subclass and 1.0 is not a rank: only true integers pass
            if isinstance(r, (bool, np.bool_)) or not isinstance(r, (int, np.integer)):
                raise LanternError(f"tree path {list(raw)!r}: rank {r!r} is not an integer")
        path = tuple(int(r) for r in raw)
        if not path:
            raise LanternError("tree path [] is empty; the root is implicit, list only its descendants")
        for r in path:
            if r < 0:
                raise LanternError(f"tree path {_fmt(path)}: rank {r} is negative (0 = top choice)")
            if r >= MAX_WIDTH:
                raise LanternError(f"tree path {_fmt(path)}: rank {r} exceeds the width limit "
                                   f"(ranks 0..{MAX_WIDTH - 1}, at most {MAX_WIDTH} children per node)")
        if len(path) > MAX_DEPTH:
            raise LanternError(f"tree path {_fmt(path)}: depth {len(path)} exceeds the depth limit "
                               f"{MAX_DEPTH}")
        paths.append(path)
    if not paths:
        raise LanternError("tree is empty: give at least one path, e.g. [[0]]")
    if len(paths) + 1 > MAX_NODES:
        raise LanternError(f"tree has {len(paths)} nodes + root; at most {MAX_NODES} nodes "
                           "including the root are supported")
    seen = set()
    for path in paths:
        if path in seen:
            raise LanternError(f"tree path {_fmt(path)} appears twice")
        seen.add(path)
    for path in paths:
        for cut in range(1, len(path)):
            if path[:cut] not in seen:
                raise LanternError(f"tree path {_fmt(path)} needs its prefix {_fmt(path[:cut])}, "
                                   "which is not in the tree")
    return paths


def _frozen(a):
    a.flags.writeable = False
    return a


def root_only():
    """The tree of AR decoding: the root alone, no drafts. The decoding loop runs `ar` as this
    tree: one verification of one token per step, no drafter calls."""
    return _from_paths([], "ar")


def _build(spec, name):
    return _from_paths(_validate(spec), name)


def _from_paths(valid_paths, name):
    paths = [()] + sorted(valid_paths, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(paths)}
    n = len(paths)
    parents = np.array([-1] + [index[p[:-1]] for p in paths[1:]], dtype=np.int64)
    depths = np.array([len(p) for p in paths], dtype=np.int64)
    ranks = np.array([-1] + [p[-1] for p in paths[1:]], dtype=np.int64)

    # Parents precede children, so each row is the parent's row plus the node itself.
    mask = np.zeros((n, n), dtype=bool)
    mask[0, 0] = True
    for i in range(1, n):
        mask[i] = mask[parents[i]]
        mask[i, i] = True

    depth = int(depths.max())
    levels = []
    slot = np.zeros(n, dtype=np.int64)  # each node's position within its own depth
    for d in range(1, depth + 1):
        nodes = np.flatnonzero(depths == d)
        slot[nodes] = np.arange(len(nodes))
        levels.append(Level(depth=d, nodes=_frozen(nodes), parents=_frozen(parents[nodes].copy()),
                            slots=_frozen(slot[parents[nodes]]), ranks=_frozen(ranks[nodes].copy()),
                            width=int(ranks[nodes].max()) + 1))

    children = [[] for _ in range(n)]
    for i in range(1, n):
        children[parents[i]].append(i)  # increasing index = rank order among siblings

    leaves = [i for i in range(n) if not children[i]]
    leaf_paths = np.full((len(leaves), depth + 1), -1, dtype=np.int64)
    for row, leaf in enumerate(leaves):
        i = leaf
        while i >= 0:
            leaf_paths[row, depths[i]] = i
            i = parents[i]

    child_at = np.full((n, max((len(c) and int(ranks[c[-1]]) + 1) for c in children)), -1, dtype=np.int64)
    for i in range(1, n):
        child_at[parents[i], ranks[i]] = i

    return Tree(name=str(name), paths=tuple(paths), parents=_frozen(parents), depths=_frozen(depths),
                ranks=_frozen(ranks), mask=_frozen(mask), levels=tuple(levels),
                leaf_paths=_frozen(leaf_paths), children=tuple(tuple(c) for c in children),
                child_at=_frozen(child_at))
