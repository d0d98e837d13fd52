"""Hardware-aware static trees: Sequoia's tree search over acceptance statistics and a latency model.

Three parts, each on plain arrays and dicts, so a tuner wires them to an engine in a few lines:

  acceptance  AcceptanceCounts (lantern.tools.acceptance_stats): per depth d and child rank r,
              how often the rank-r child was on the accepted path (`accepted`) out of the steps
              in which its parent was (`trials`), counted from the decoding loop's per-step
              records. `acceptance_vectors` turns counts into the per-depth positional acceptance
              vectors p[d - 1, r] the search uses, with the pooling rule given there.
  latency     LatencyModel (lantern.tools.latency_model): milliseconds of one verification of T
              tree tokens, one drafter call of width w, host work per step, one AR step; measured
              points, interpolated.
  search      search(p, latency, max_nodes, max_depth, candidates), here: for every depth limit
              and every node budget the DP's best tree, each priced with the latency model; the
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
import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Optional

import numpy as np

from lantern.runtime.errors import LanternError
from lantern.runtime.tree import MAX_DEPTH, MAX_NODES, MAX_WIDTH, build_tree
from lantern.tools.acceptance_stats import check_vectors, expected_accept_length


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
