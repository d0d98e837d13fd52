"""Hardware-aware static trees: acceptance statistics, a latency model and Sequoia's tree search.

Three parts, each on plain arrays and dicts, so a tuner wires them to an engine in a few lines:

  acceptance  AcceptanceCounts: per depth d and child rank r, how often the rank-r child was on
              the accepted path (`accepted`) out of the steps in which its parent was (`trials`),
              counted from the decoding loop's per-step records (`add(record)`, or the counts
              object itself as the observer). `count_accepted_paths` is the direct count from
              accepted node paths. `acceptance_vectors` turns counts into the per-depth positional
              acceptance vectors p[d - 1, r] the search uses, with the pooling rule below.
  latency     LatencyModel: milliseconds of one verification of T tree tokens, one drafter call
              of width w, host work per step, one AR step; measured points, interpolated.
  search      search(p, latency, max_nodes, max_depth, candidates): for every depth limit and
              every node budget the DP's best tree, each priced with the latency model; the
              highest predicted tokens per second wins, AR (no drafting) included.

What is modelled, and what is assumed
-------------------------------------
* Positional acceptance (Sequoia, arXiv 2402.12374, section 3.1), per depth: given that a node
  at depth d - 1 is on the accepted path, its rank-r child is on the accepted path with
  probability p[d - 1, r], whatever happened elsewhere in the tree, in this step or before.
  At most one child of a node is on the path, so each row of p sums to at most 1. A node is on
  the path with the product of p along its path, and the expected accepted drafts of a tree is
  the sum of that product over its nodes. Sequoia uses one vector for all depths; here it
  depends on the depth: a drafter fed its own drafts gets worse deeper, and reaching a depth
  at all selects easy image regions (on the demo engine rank 0 went 0.65, 0.50, 0.50, 0.49,
  0.58, 0.65 over depths 1-6).
* Independence: the product rule treats the successive levels as independent given the ranks.
  Hard image regions (every depth rejected) and easy ones are averaged into one table; a tree
  that passes easy regions in fewer steps sees a slightly different mix of positions than the
  calibration tree did. The check against reality is predicted against measured tokens/s.
* What is measured is the record's event "on the accepted path", not "acceptable". Sampling
  (recursive rejection, children tried in rank order, first accepted wins) matches the model:
  the rank-r child is reached only after ranks 0..r-1 were rejected, whichever tree contains
  them. Relaxed greedy acceptance (LANTERN/LANTERN++) may find several acceptable children;
  the deepest accepted path wins (ties to the better-ranked path). The measured p then depends
  a little on the calibration tree's shape below each node, and the search treats a choice
  between branches as exclusive. Calibrate with a tree wider and deeper than anything the
  search may pick (`calibration_tree`).
* Only contiguous trees are built (a node's children have ranks 0..w-1, w <= the drafter's
  candidate count K): sampling needs them (Tree.contiguous), and a rank-r estimate is only
  counted where ranks 0..r-1 were present beside it.
* The bonus token: every step emits its accepted drafts plus one token from the target, so a
  tree yields E[accepted] + 1 tokens per step and AR yields 1.
* Step cost (the step plan's call regimes), for a tree of `nodes` tokens (root included), depth D and
  n_d nodes at depth d: drafter(D + 1) [depth-0 call over last step's accepted pairs, padded]
  + sum over d = 1..D-1 of drafter(n_d) + D * draft_host + verify(nodes) + host(nodes). AR: one
  target call of T = 1 plus its host work (`ar_ms` when measured). Drafter calls at depth D are
  not made (the leaves' children are never drafted). Measure each term as the loop pays it:
  a call's wall time with its feeding and synchronisation, draft_host the loop's own work per
  drafter call (gathers, masks, cache commits), host the rest of a step (acceptance, commit).
  Isolated engine calls plus one host figure can underpredict a loop's steps 2-4x (on the demo
  engine, mostly host work per drafter call).
* A batch's images advance unevenly and a call ends with its slowest image: with a generation
  (tokens per image, images per call) the search ranks trees by the call's tokens per second,
  steps estimated as the expected maximum over the images of a renewal count
  (`generation_steps`); without one, by one image's tokens per step. The DP itself maximises
  expected tokens per step for each size and depth limit.
* Not modelled: the end of an image (a step may emit fewer tokens than accepted), cache length
  growing during a generation (measure at a mid-generation cache length), prefill and decode.

Pooling rule for sparse cells: p[d, r] = (accepted + m * prior) / (trials + m), m the prior
strength in pseudo-observations (default 10), prior = the same rank's estimate one depth up
(itself pooled), and 0 at depth 1: a rank never observed at the top is assumed useless, and a
depth never observed inherits the deepest observed one. A row whose pooled entries sum above 1
is scaled to sum 1.

The DP (Sequoia's, with depth-dependent vectors). F[l][n]: the best expected number of path
nodes (root counted as 1) of a subtree of n nodes whose root sits at depth l, depth limit L:
    F[L][1] = 1; F[L][n > 1] impossible
    F[l][n] = 1 + max over k = 0..K and a_0..a_{k-1} >= 1 with sum a = n - 1 of
                  sum_r p[l, r] * F[l + 1][a_r]
the inner max a knapsack over ranks in order. F[0][n] = 1 + E[accepted drafts] = tokens per
step. Depth limit and budget are searched jointly, as in Sequoia's hardware-aware optimiser,
because the drafter's cost depends on the depth (one sequential call per depth) and the
verification's on the node count; here each drafter call is priced by its width too. For a
given budget and depth limit the DP maximises tokens per step, not tokens per second: among
trees of equal size and depth the per-level widths (drafter cost) are not traded against value.
"""
import functools
import json
import math
import os
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Optional

import numpy as np

from lantern.runtime.errors import LanternError
from lantern.runtime.tree import MAX_DEPTH, MAX_NODES, MAX_WIDTH, build_tree

DEFAULT_PRIOR_STRENGTH = 10.0


# ---------------------------------------------------------------------------------------------
# Acceptance statistics


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


# ---------------------------------------------------------------------------------------------
# Latency model


class Curve:
    """y(x) from measured points, made non-decreasing (least-squares isotonic fit: noise must not
    make a bigger call look cheaper) and interpolated linearly between them. Asking outside the
    measured range is an error, never an extrapolation."""

    def __init__(self, points, what):
        items = _points(points, what)
        self.what = what
        self.measured = items
        self.x = np.array([x for x, _ in items], dtype=np.float64)
        self.y = _isotonic(np.array([y for _, y in items], dtype=np.float64))

    @property
    def max_x(self):
        return int(self.x[-1])

    def covers(self, x):
        return self.x[0] <= x <= self.x[-1]

    def __call__(self, x):
        if not self.covers(x):
            raise LanternError(f"{self.what}: {x} is outside the measured range "
                               f"{int(self.x[0])}..{int(self.x[-1])}")
        return float(np.interp(x, self.x, self.y))

    def to_json(self):
        return {str(x): y for x, y in self.measured}


def _points(points, what):
    if not isinstance(points, dict) or not points:
        raise LanternError(f"{what}: expected a non-empty {{size: milliseconds}} mapping")
    items = []
    for k, v in points.items():
        try:
            x, y = int(k), float(v)
        except (TypeError, ValueError):
            raise LanternError(f"{what}: point {k!r}: {v!r} is not size (integer): milliseconds") from None
        if x < 1 or not math.isfinite(y) or y < 0:
            raise LanternError(f"{what}: point {k!r}: {v!r} needs size >= 1 and finite milliseconds >= 0")
        items.append((x, y))
    items.sort()
    if items[0][0] != 1:
        raise LanternError(f"{what}: needs a point at size 1 (the smallest call)")
    if len({x for x, _ in items}) != len(items):
        raise LanternError(f"{what}: a size appears twice")
    return items


def _isotonic(y):
    """Pool adjacent violators: the non-decreasing sequence closest to y in least squares."""
    blocks = []  # [mean, count]
    for v in y:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks[-2], blocks.pop()
            blocks[-1] = [(m2 * c2 + m1 * c1) / (c2 + c1), c2 + c1]
    return np.concatenate([np.full(c, m) for m, c in blocks])


class LatencyModel:
    """Milliseconds per call regime, from measured points (or a planning file).

    verify_ms   {T: ms}: one target call over T tree tokens (root included), T = 1 .. max.
    draft_ms    {w: ms}: one drafter call of width w; or None with draft_fraction, meaning
                draft(w) = draft_fraction * verify(w) (a planning shorthand).
    host_ms     ms of host work per speculative step besides drafting: a number, or {T: ms}
                by tree size (acceptance and commit grow with the node count).
    draft_host_ms  ms of the loop's own work per drafter call (a step of depth D makes D calls).
    ar_ms       one AR step, host work included; default verify(1) + host(1).
    """

    def __init__(self, verify_ms, draft_ms=None, host_ms=0.0, ar_ms=None, draft_fraction=None, draft_host_ms=0.0):
        self.verify = Curve(verify_ms, "verification latency")
        if (draft_ms is None) == (draft_fraction is None):
            raise LanternError("latency model: give drafter latency as points (draft_ms) or as "
                               "draft_fraction of a verification of the same width, not both or neither")
        self.draft_fraction = None if draft_fraction is None else float(draft_fraction)
        if self.draft_fraction is not None and not (0 <= self.draft_fraction < math.inf):
            raise LanternError(f"latency model: draft_fraction must be >= 0, got {draft_fraction!r}")
        self.draft = None if draft_ms is None else Curve(draft_ms, "drafter latency")
        self.host = Curve(host_ms if isinstance(host_ms, dict) else {1: host_ms}, "host time")
        self.draft_host_ms = float(draft_host_ms)
        if not (0 <= self.draft_host_ms < math.inf):
            raise LanternError(f"latency model: draft_host_ms must be >= 0, got {draft_host_ms!r}")
        self.ar_ms = None if ar_ms is None else float(ar_ms)
        if self.ar_ms is not None and not (0 < self.ar_ms < math.inf):
            raise LanternError(f"latency model: ar_ms must be a positive number, got {ar_ms!r}")

    def drafter_ms(self, width):
        if self.draft is None:
            return self.draft_fraction * self.verify(width)
        return self.draft(width)

    def host_step_ms(self, nodes):
        return self.host(min(nodes, self.host.max_x))  # a constant beyond the last point

    def ar_step_ms(self):
        return self.ar_ms if self.ar_ms is not None else self.verify(1) + self.host_step_ms(1)

    def covers(self, tree):
        """True when every call of the tree's step lies within the measured points."""
        tree = build_tree(tree)
        widths = [tree.depth + 1] + [len(level.nodes) for level in tree.levels[:-1]]
        draft = self.verify if self.draft is None else self.draft
        return self.verify.covers(tree.num_nodes) and all(draft.covers(w) for w in widths)

    def step_ms(self, tree):
        """One speculative step of `tree`: depth-0 drafter call of width depth + 1, one call per
        depth 1..depth-1 of that depth's width, one verification of num_nodes tokens, host work.
        A root-only tree is AR."""
        tree = build_tree(tree)
        if tree.num_nodes == 1:
            return self.ar_step_ms()
        draft = self.drafter_ms(tree.depth + 1)
        draft += sum(self.drafter_ms(len(level.nodes)) for level in tree.levels[:-1])
        draft += tree.depth * self.draft_host_ms
        return draft + self.verify(tree.num_nodes) + self.host_step_ms(tree.num_nodes)

    def to_json(self):
        data = {"verify_ms": self.verify.to_json(), "host_ms": self.host.to_json(),
                "draft_host_ms": self.draft_host_ms}
        if self.draft is None:
            data["draft_fraction"] = self.draft_fraction
        else:
            data["draft_ms"] = self.draft.to_json()
        if self.ar_ms is not None:
            data["ar_ms"] = self.ar_ms
        return data

    @classmethod
    def from_json(cls, data):
        """From a dict or a .json file with the constructor's keys ("verify_ms", "draft_ms" or
        "draft_fraction", "host_ms", "draft_host_ms", "ar_ms"); unknown keys are an error,
        "note" is allowed."""
        if isinstance(data, (str, os.PathLike)):
            data = _read_json(data, "latency model")
        if not isinstance(data, dict):
            raise LanternError("latency model: expected a JSON object")
        known = {"verify_ms", "draft_ms", "draft_fraction", "host_ms", "draft_host_ms", "ar_ms", "note"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise LanternError(f"latency model: unknown keys {unknown}; known: {sorted(known)}")
        if "verify_ms" not in data:
            raise LanternError("latency model: 'verify_ms' ({T: ms}) is required")
        return cls(data["verify_ms"], data.get("draft_ms"), data.get("host_ms", 0.0), data.get("ar_ms"),
                   data.get("draft_fraction"), data.get("draft_host_ms", 0.0))


def _read_json(path, what):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LanternError(f"cannot read {what} file {os.fspath(path)}: {e}") from None


# ---------------------------------------------------------------------------------------------
# The search


class TreeTable:
    """Sequoia's DP for one depth limit: value(n) = the best tokens per step (E[accepted] + 1)
    of a contiguous tree of exactly n nodes (root included), depth <= depth_limit, every node
    with at most `candidates` children; paths(n) = that tree as a list of paths."""

    def __init__(self, p, max_nodes, depth_limit, candidates):
        p = check_vectors(p)
        if depth_limit > p.shape[0]:
            p = np.vstack([p, np.zeros((depth_limit - p.shape[0], p.shape[1]))])
        nonzero = np.nonzero((p[:depth_limit] > 0).any(0))[0]
        # ranks past the last useful one only pad budgets; they never raise the value
        K = max(1, min(candidates, int(nonzero[-1]) + 1 if len(nonzero) else 1))
        self.max_nodes, self.depth_limit = max_nodes, depth_limit
        N = max_nodes + 1
        F = np.full((depth_limit + 1, N), -np.inf)
        F[depth_limit, 1] = 1.0
        self._kids = np.zeros((depth_limit, N), dtype=np.int64)
        self._split = np.zeros((depth_limit, K + 1, N), dtype=np.int64)
        m = np.arange(N)
        take = m[:, None] - m[None, :]  # G_prev index m - a for a child of a nodes
        valid = (take >= 0) & (m[None, :] >= 1)
        for level in range(depth_limit - 1, -1, -1):
            G = np.full(N, -np.inf)
            G[0] = 0.0
            best, kids = G.copy(), np.zeros(N, dtype=np.int64)
            sub = F[level + 1]
            for r in range(K):
                gain = np.where(np.isfinite(sub), p[level, r] * np.where(np.isfinite(sub), sub, 0.0), -np.inf)
                cand = np.where(valid, G[np.clip(take, 0, None)] + gain[None, :], -np.inf)
                a = np.argmax(cand, axis=1)
                G = cand[m, a]
                self._split[level, r + 1] = a
                better = G > best
                best[better], kids[better] = G[better], r + 1
            F[level, 1:] = 1.0 + best[:-1]  # n nodes = root + n - 1 below it
            self._kids[level, 1:] = kids[:-1]
        self._F = F

    def value(self, n):
        """Tokens per step of the best n-node tree; -inf when no such tree fits the limits
        (ranks whose p is 0 at every depth are left out: they could only pad a budget)."""
        return float(self._F[0, n])

    def paths(self, n):
        if not math.isfinite(self.value(n)):
            raise LanternError(f"no tree of {n} nodes fits depth {self.depth_limit} and the candidate count")
        out = []
        self._collect(0, n, (), out)
        return sorted(out, key=lambda path: (len(path), path))

    def _collect(self, level, n, prefix, out):
        if prefix:
            out.append(list(prefix))
        if level == self.depth_limit:
            return  # a leaf at the depth limit: n == 1
        k, m = int(self._kids[level, n]), n - 1
        sizes = []
        for r in range(k, 0, -1):
            a = int(self._split[level, r, m])
            sizes.append(a)
            m -= a
        for r, a in enumerate(reversed(sizes)):
            self._collect(level + 1, a, prefix + (r,), out)


@dataclass
class Candidate:
    """A tree priced under the models: tokens_per_step = E[accepted] + 1 per image; with a
    generation (tokens per image, images per call) also generation_tokens_per_step, the tokens
    per loop step of the whole call, which ends with its slowest image (`generation_steps`)."""

    name: str
    paths: list  # [] for AR
    nodes: int
    depth: int
    tokens_per_step: float
    step_ms: float
    ar_ms: float
    images: int = 1
    generation_tokens_per_step: Optional[float] = None

    @property
    def effective_tokens_per_step(self):
        return self.tokens_per_step if self.generation_tokens_per_step is None else self.generation_tokens_per_step

    @property
    def tokens_per_s(self):
        """Tokens per second of a call (all its images)."""
        return 1000.0 * self.images * self.effective_tokens_per_step / self.step_ms

    @property
    def speedup(self):
        """Predicted tokens per second over AR's, on the same model."""
        return self.effective_tokens_per_step * self.ar_ms / self.step_ms

    def to_json(self):
        return {"name": self.name, "nodes": self.nodes, "depth": self.depth,
                "expected_accepted": self.tokens_per_step - 1.0, "tokens_per_step": self.tokens_per_step,
                "generation_tokens_per_step": self.effective_tokens_per_step, "images": self.images,
                "step_ms": self.step_ms, "tokens_per_s": self.tokens_per_s, "speedup_vs_ar": self.speedup,
                "paths": self.paths}


def tokens_per_step_moments(tree, p):
    """(mean, variance) of the tokens one step emits for one image under p: 1 + A, A the accepted
    drafts = sum over depths d of R_d (the path reaches depth d). R_d implies R_{d-1}, so
    E[A^2] = sum_d (2d - 1) P(R_d)."""
    tree, p = build_tree(tree), check_vectors(p)
    reach = np.zeros(tree.num_nodes)
    reach[0] = 1.0
    for i in range(1, tree.num_nodes):
        d, r = tree.depths[i] - 1, tree.ranks[i]
        reach[i] = reach[tree.parents[i]] * (p[d, r] if d < p.shape[0] and r < p.shape[1] else 0.0)
    at_depth = np.array([reach[tree.depths == d].sum() for d in range(1, tree.depth + 1)])
    mean = float(at_depth.sum())
    second = float(((2 * np.arange(1, tree.depth + 1) - 1) * at_depth).sum())
    return 1.0 + mean, max(second - mean ** 2, 0.0)


def generation_steps(tree, p, tokens, images):
    """Expected loop steps of a call generating `tokens` tokens for each of `images` images: the
    call runs until its slowest image is done. One image needs the first n steps whose tokens
    reach `tokens` (a renewal count: mean (tokens - 1 + E[excess]) / mu, with the lattice excess
    E[X(X + 1)] / (2 mu), and variance tokens * var / mu^3; mu and var the per-step moments); the
    call takes the expected maximum of `images` of them, about normal (Blom's approximation of
    the normal's order statistics). Within 1-2 % of simulation for 64-256 tokens and 1-30
    images; AR takes exactly `tokens` steps."""
    mu, var = tokens_per_step_moments(tree, p)
    mean = (tokens - 1 + (var + mu * mu + mu) / (2 * mu)) / mu
    z = NormalDist().inv_cdf((images - 0.375) / (images + 0.25)) if images > 1 else 0.0
    return mean + z * math.sqrt(tokens * var / mu ** 3)


def price(tree, p, latency, name=None, generation=None):
    """Candidate for a given tree (a preset name, paths, a Tree): its predicted tokens per step,
    step time and speedup under p and the latency model; generation = (tokens per image, images
    per call) prices a whole call (see generation_steps)."""
    tree = build_tree(tree)
    return _candidate(name or tree.name, tree, 1.0 + expected_accept_length(tree, p), p, latency, generation)


def _candidate(name, tree, tokens_per_step, p, latency, generation):
    images, per_generation = 1, None
    if generation is not None:
        tokens, images = generation
        per_generation = tokens / generation_steps(tree, p, tokens, images)
    return Candidate(name=name, paths=tree.choices, nodes=tree.num_nodes, depth=tree.depth,
                     tokens_per_step=tokens_per_step, step_ms=latency.step_ms(tree), ar_ms=latency.ar_step_ms(),
                     images=images, generation_tokens_per_step=per_generation)


def ar_candidate(latency, generation=None):
    ar = latency.ar_step_ms()
    images = 1 if generation is None else generation[1]
    return Candidate(name="ar", paths=[], nodes=1, depth=0, tokens_per_step=1.0, step_ms=ar, ar_ms=ar, images=images,
                     generation_tokens_per_step=None if generation is None else 1.0)


@dataclass
class SearchResult:
    best: Candidate
    candidates: list  # every priced tree, AR first, then by depth limit and budget
    skipped: list  # (depth limit, nodes, why) for DP trees the latency model does not cover

    def best_per_budget(self):
        """{nodes: the fastest candidate of that size}, for plots and tables."""
        out = {}
        for c in self.candidates:
            if c.nodes not in out or c.tokens_per_s > out[c.nodes].tokens_per_s:
                out[c.nodes] = c
        return dict(sorted(out.items()))

    def to_json(self):
        return {"best": self.best.to_json(),
                "best_per_budget": {str(n): {k: v for k, v in c.to_json().items() if k != "paths"}
                                    for n, c in self.best_per_budget().items()},
                "skipped": [{"depth_limit": d, "nodes": n, "why": why} for d, n, why in self.skipped]}


def search(p, latency, max_nodes, max_depth, candidates, allowed=None, generation=None):
    """The tree with the highest predicted tokens per second, AR included.

    p           [depth, width] positional acceptance vectors (acceptance_vectors or given)
    latency     LatencyModel
    max_nodes   largest tree to consider, root included (the verification's T)
    max_depth   depth limit
    candidates  the drafter graph's top-K: no node gets more children
    allowed     optional tree -> None or the reason it cannot run (e.g. compiled plans whose
                profiles do not cover its shapes); such trees are skipped
    generation  optional (tokens per image, images per call): rank by a whole call's tokens per
                second, which ends with its slowest image (generation_steps), instead of one
                image's; the DP still picks each size's tree by expected tokens per step
    """
    p = check_vectors(p)
    for what, v, hi in (("max_nodes", max_nodes, MAX_NODES), ("max_depth", max_depth, MAX_DEPTH),
                        ("candidates", candidates, MAX_WIDTH)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= hi:
            raise LanternError(f"tree search: {what} must be an integer in 1..{hi}, got {v!r}")
    priced, skipped = [ar_candidate(latency, generation)], []
    for depth_limit in range(1, max_depth + 1):
        table = TreeTable(p, max_nodes, depth_limit, candidates)
        for n in range(2, max_nodes + 1):
            if not math.isfinite(table.value(n)):
                continue
            paths = table.paths(n)
            tree = build_tree(paths, name=f"tuned-{n}-d{depth_limit}")
            if tree.depth < depth_limit:
                continue  # the same tree as under a smaller limit
            if not latency.covers(tree):
                skipped.append((depth_limit, n, "outside the latency model's measured sizes"))
                continue
            why = allowed(tree) if allowed is not None else None
            if why:
                skipped.append((depth_limit, n, why))
                continue
            priced.append(_candidate(tree.name, tree, table.value(n), p, latency, generation))
    best = max(priced, key=lambda c: c.tokens_per_s)  # ties keep the earlier: AR, then smaller trees
    return SearchResult(best=best, candidates=priced, skipped=skipped)


def calibration_tree(p_guess, max_nodes, max_depth, width):
    """A tree to measure acceptance with: wide at every depth, and widest where the path goes.
    First the rank-0 spine is opened down to max_depth - 1 (so every depth has a parent with all
    `width` children), then further nodes in order of their reach under a guess of p (e.g. a flat
    [[0.5, 0.2, 0.1]] or a previous calibration's vectors), each opened node getting all `width`
    children, while the tree stays within max_nodes (root included). Returns a list of paths."""
    p = check_vectors(p_guess)
    spine = 1 + max_depth * width
    if not (1 <= width <= MAX_WIDTH and 1 <= max_depth <= MAX_DEPTH and spine <= max_nodes <= MAX_NODES):
        raise LanternError(f"calibration tree: need 1 <= width <= {MAX_WIDTH}, 1 <= max_depth <= {MAX_DEPTH} and "
                           f"1 + max_depth * width <= max_nodes <= {MAX_NODES} (the spine alone has "
                           f"{spine} nodes)")

    def p_at(d, r):  # depths and ranks beyond the guess reuse its last row, with a small floor
        row = p[min(d, p.shape[0] - 1)]
        return max(float(row[r]) if r < len(row) else 0.0, 1e-3)

    paths, reach, opened = [], {(): 1.0}, set()

    def open_node(node):
        opened.add(node)
        for r in range(width):
            child = node + (r,)
            paths.append(list(child))
            reach[child] = reach[node] * p_at(len(node), r)

    for d in range(max_depth):
        open_node((0,) * d)
    while 1 + len(paths) + width <= max_nodes:
        closed = [n for n in reach if n not in opened and len(n) < max_depth]
        if not closed:
            break
        open_node(max(closed, key=lambda n: (reach[n], [-r for r in n])))
    return paths


def tree_json(candidate):
    """The choices JSON `build_tree` (and `--tree`) reads; None for AR, which has no tree."""
    if not candidate.paths:
        return None
    return {"name": candidate.name, "paths": candidate.paths}
