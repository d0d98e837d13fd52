"""Acceptance statistics for the tree search (lantern.tools.tree_search): AcceptanceCounts, per
depth d and child rank r, how often the rank-r child was on the accepted path (`accepted`) out of
the steps in which its parent was (`trials`), counted from the decoding loop's per-step records
(`add(record)`, or the counts object itself as the observer). `count_accepted_paths` is the direct
count from accepted node paths. `acceptance_vectors` turns counts into the per-depth positional
acceptance vectors p[d - 1, r] the search uses; `expected_accept_length` is a tree's expected
accepted drafts under them. What the positional model assumes: tree_search's docstring.

Pooling rule for sparse cells: p[d, r] = (accepted + m * prior) / (trials + m), m the prior
strength in pseudo-observations (default 10), prior = the same rank's estimate one depth up
(itself pooled), and 0 at depth 1: a rank never observed at the top is assumed useless, and a
depth never observed inherits the deepest observed one. A row whose pooled entries sum above 1
is scaled to sum 1.
"""
import functools
from dataclasses import dataclass, field

import numpy as np

from lantern.runtime.errors import LanternError
from lantern.runtime.tree import MAX_DEPTH, MAX_WIDTH, build_tree

DEFAULT_PRIOR_STRENGTH = 10.0


def _field(record, name):
    return record[name] if isinstance(record, dict) else getattr(record, name)


@dataclass(eq=False)
class AcceptanceCounts:
    """accepted[d - 1, r] of trials[d - 1, r]: steps in which a rank-r child at depth d was on
    the accepted path, out of steps in which its parent was (rows of a batch count separately).
    Arrays cover every depth and rank a tree may have; `extent()` is the observed part."""

    accepted: np.ndarray = field(default_factory=lambda: np.zeros((MAX_DEPTH, MAX_WIDTH), np.int64))
    trials: np.ndarray = field(default_factory=lambda: np.zeros((MAX_DEPTH, MAX_WIDTH), np.int64))
    steps: int = 0  # active (row, step) pairs seen
    accepted_drafts: int = 0  # sum of the records' `accepted` over them

    def add(self, record):
        """Count one step's record: a dict or object with `tree`, `decisions` int [N, nodes]
        (1 on the accepted path, 0 tried and rejected, -1 never evaluated), `accepted` [N]
        drafts accepted and `active` bool [N] (the loop's StepRecord). The root is on the path of every active row."""
        tree = build_tree(_field(record, "tree"))
        decisions = np.asarray(_field(record, "decisions"))
        active = np.asarray(_field(record, "active"), dtype=bool).reshape(-1)
        accept_length = np.asarray(_field(record, "accepted")).reshape(-1)
        on = _path_matrix(tree, decisions, active, accept_length)
        on[:, 0] = True
        parent_on = on[:, tree.parents[1:]]  # [rows, nodes - 1]
        counted = parent_on & _countable(tree)[None, 1:]
        d, r = tree.depths[1:] - 1, tree.ranks[1:]
        np.add.at(self.trials, (d, r), counted.sum(0))
        np.add.at(self.accepted, (d, r), (counted & on[:, 1:]).sum(0))
        self.steps += len(on)
        self.accepted_drafts += int(accept_length[active].sum())

    __call__ = add  # the counts object can be handed to the loop as its observer

    def extent(self):
        """(depth, width): the deepest depth and widest rank with any trials."""
        d, r = np.nonzero(self.trials)
        return (int(d.max()) + 1, int(r.max()) + 1) if len(d) else (0, 0)

    def mean_accept_length(self):
        """Measured mean accepted drafts per active row-step (the loop's own count)."""
        return self.accepted_drafts / self.steps if self.steps else 0.0

    def to_json(self):
        depth, width = self.extent()
        return {"accepted": self.accepted[:depth, :width].tolist(),
                "trials": self.trials[:depth, :width].tolist(),
                "steps": self.steps, "accepted_drafts": self.accepted_drafts}

    @classmethod
    def from_json(cls, data):
        counts = cls()
        accepted, trials = _int_grid(data.get("accepted"), "accepted"), _int_grid(data.get("trials"), "trials")
        if accepted.shape != trials.shape:
            raise LanternError(f"acceptance counts: 'accepted' {accepted.shape} and 'trials' {trials.shape} "
                               "must have the same shape")
        if (accepted < 0).any() or (accepted > trials).any():
            raise LanternError("acceptance counts: need 0 <= accepted <= trials in every cell")
        d, w = accepted.shape
        counts.accepted[:d, :w] = accepted
        counts.trials[:d, :w] = trials
        counts.steps = int(data.get("steps", 0))
        counts.accepted_drafts = int(data.get("accepted_drafts", 0))
        return counts


def _int_grid(rows, name):
    try:
        a = np.array(rows, dtype=np.int64)
    except (TypeError, ValueError):
        a = None
    if a is None or a.ndim != 2 or a.shape[0] > MAX_DEPTH or a.shape[1] > MAX_WIDTH:
        raise LanternError(f"acceptance counts: '{name}' must be a list of per-depth lists of integers "
                           f"(at most {MAX_DEPTH} x {MAX_WIDTH})")
    return a


@functools.lru_cache(maxsize=16)  # one calibration tree serves every step
def _countable(tree):
    """Per node: all lower-ranked siblings are in the tree, so its rank means "tried after ranks
    0..r-1" as in the trees the search builds."""
    present = set(tree.paths)
    out = np.array([i == 0 or all(p[:-1] + (s,) in present for s in range(p[-1]))
                    for i, p in enumerate(tree.paths)], dtype=bool)
    out.flags.writeable = False
    return out


def _path_matrix(tree, decisions, active, accept_length):
    """decisions[active] == 1 as a bool [rows, nodes], checked to be one root-to-node path."""
    n_rows = len(active)
    if decisions.shape != (n_rows, tree.num_nodes):
        raise LanternError(f"acceptance record: decisions has shape {decisions.shape}, expected "
                           f"({n_rows}, {tree.num_nodes}) for {n_rows} rows and tree {tree.name!r}")
    if not np.isin(decisions, (-1, 0, 1)).all():
        raise LanternError("acceptance record: decisions must be -1, 0 or 1")
    if accept_length.shape != (n_rows,):
        raise LanternError(f"acceptance record: accepted has shape {accept_length.shape}, expected ({n_rows},)")
    on = decisions[active] == 1
    on[:, 0] = True
    orphan = on[:, 1:] & ~on[:, tree.parents[1:]]
    if orphan.any():
        raise LanternError(f"acceptance record: node {int(np.nonzero(orphan)[1][0]) + 1} is on the accepted "
                           "path but its parent is not")
    per_depth = np.stack([on[:, tree.depths == d].sum(1) for d in range(tree.depth + 1)], 1)
    if (per_depth > 1).any():
        raise LanternError("acceptance record: two nodes of one depth are on the accepted path")
    if not (on[:, 1:].sum(1) == accept_length[active]).all():
        raise LanternError("acceptance record: accepted differs from the number of nodes on the path")
    return on


def count_accepted_paths(tree, accepted_paths):
    """The direct count: AcceptanceCounts from accepted node paths alone (each a sequence of node
    indices, root first, e.g. `Acceptance.nodes`), one per active row-step. Every child of every
    node on a path is a trial of its (depth, rank); the next node on the path is its success."""
    tree = build_tree(tree)
    counts = AcceptanceCounts()
    countable = _countable(tree)
    for path in accepted_paths:
        path = [int(i) for i in path]
        if not path or path[0] != 0:
            raise LanternError(f"accepted path {path} must start at the root (node 0)")
        for here, nxt in zip(path, path[1:] + [None]):
            if nxt is not None and int(tree.parents[nxt]) != here:
                raise LanternError(f"accepted path {path}: node {nxt} is not a child of node {here}")
            for child in tree.children[here]:
                if countable[child]:
                    d, r = tree.depths[child] - 1, tree.ranks[child]
                    counts.trials[d, r] += 1
                    counts.accepted[d, r] += child == nxt
        counts.steps += 1
        counts.accepted_drafts += len(path) - 1
    return counts


def acceptance_vectors(counts, depth=None, width=None, prior_strength=DEFAULT_PRIOR_STRENGTH):
    """p [depth, width] float64: p[d - 1, r] the probability that the rank-r child at depth d is
    on the accepted path given its parent is, pooled as the module docstring says. depth and
    width default to the counts' observed extent."""
    obs_depth, obs_width = counts.extent()
    depth = obs_depth if depth is None else depth
    width = obs_width if width is None else width
    if not (1 <= depth <= MAX_DEPTH and 1 <= width <= MAX_WIDTH):
        raise LanternError(f"acceptance vectors need depth 1..{MAX_DEPTH} and width 1..{MAX_WIDTH} "
                           f"(got {depth} x {width}; are the counts empty?)")
    if prior_strength < 0:
        raise LanternError(f"prior strength must be >= 0, got {prior_strength}")
    p = np.zeros((depth, width))
    prior = np.zeros(width)
    for d in range(depth):
        a = counts.accepted[d, :width].astype(np.float64)
        t = counts.trials[d, :width].astype(np.float64)
        denom = t + prior_strength
        row = np.where(denom > 0, (a + prior_strength * prior) / np.where(denom > 0, denom, 1), prior)
        if row.sum() > 1.0:
            row = row / row.sum()
        p[d] = row
        prior = row
    return p


def check_vectors(p):
    """p as float64 [depth, width], or LanternError: entries in [0, 1], each row summing to <= 1."""
    try:
        p = np.array(p, dtype=np.float64)
    except (TypeError, ValueError):
        raise LanternError("acceptance vectors must be a list of per-depth lists of numbers") from None
    if p.ndim == 1:
        p = p[None, :]
    if p.ndim != 2 or p.size == 0 or p.shape[0] > MAX_DEPTH or p.shape[1] > MAX_WIDTH:
        raise LanternError(f"acceptance vectors must be [depth <= {MAX_DEPTH}, rank <= {MAX_WIDTH}], "
                           f"got shape {p.shape}")
    if not np.isfinite(p).all() or (p < 0).any() or (p > 1).any():
        raise LanternError("acceptance probabilities must be in [0, 1]")
    if (p.sum(1) > 1 + 1e-9).any():
        d = int(np.argmax(p.sum(1) > 1 + 1e-9)) + 1
        raise LanternError(f"acceptance vector of depth {d} sums to {p[d - 1].sum():.4f} > 1: at most one "
                           "child of a node is on the accepted path")
    return p


def expected_accept_length(tree, p):
    """Expected accepted drafts per step of `tree` under p (positional model): the sum over nodes
    of the product of p along the node's path. Ranks or depths beyond p count as 0."""
    tree, p = build_tree(tree), check_vectors(p)
    reach = np.zeros(tree.num_nodes)
    reach[0] = 1.0
    for i in range(1, tree.num_nodes):  # parents precede children
        d, r = tree.depths[i] - 1, tree.ranks[i]
        reach[i] = reach[tree.parents[i]] * (p[d, r] if d < p.shape[0] and r < p.shape[1] else 0.0)
    return float(reach[1:].sum())
