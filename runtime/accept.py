"""Acceptance for static-tree speculative decoding: exact, LANTERN (k, delta), LANTERN++ (k, lam).

Public API
    Rule(mode="exact" | "lantern" | "lantern++", k=0, delta=0.0, lam=1.0)
    accept_greedy(tree, tokens, target_logits, rule, neighbours=None) -> Acceptance
    accept_sampling(tree, tokens, target_logits, draft_probs, rule, rng, neighbours=None, *,
                    temperature=1.0, top_k=0, top_p=1.0) -> Acceptance
    filtered_probs(logits, temperature=1.0, top_k=0, top_p=1.0) -> probabilities, float64
    Acceptance(nodes, tokens, next_token, depth), .accept_length

Inputs (N = tree.num_nodes, V = vocabulary size):
    tokens         [N] int: node i's token; tokens[0] is the root, already emitted.
    target_logits  [N, V] float, CFG-combined: row i is the target's prediction for the token
                   after node i. -inf is allowed (masked tokens); NaN and +inf are errors.
    draft_probs    [N, V]: row i is the drafter's distribution over node i's children, filtered
                   like the target (`filtered_probs` is the one definition); rows of leaves unused.
    neighbours     [V, Kn] int: each token's latent neighbours, nearest first, itself excluded.
                   Only its first k columns are read; exact mode needs none.

Relaxation (REFERENCE.md section 1). At a node whose target distribution is p, for a draft x let
S_j be the sum of p over x's j nearest neighbours (j <= k). Take the largest j with
S_j <= bound, bound = delta (lantern) or (lam - 1) * p(x) (lantern++), inclusive, and
p~(x) = p(x) + S_j. S_j never decreases with j, so "largest j" is a count. lam = 1 or delta = 0
admit only neighbours of zero probability, so S_j = 0 and p~(x) = p(x) bit for bit; under
lantern++ p(x) = 0 gives bound 0 and p~(x) stays 0.

Greedy. As in the public LANTERN code, greedy runs without a logits processor: the target is
softmax(logits) with no temperature, top-k or top-p. A node is accepted when its parent is and
its token x is the argmax of the parent's target with p(x) replaced by p~(x) (other entries
unchanged, no renormalisation, ties to the lowest token id). The deepest accepted node wins,
ties to the lowest node index (the highest-ranked path); the next token is the argmax of the
unmodified target there. Work is done on weights w = exp(l - max l) in float64: the argmax and
the lantern++ bound do not change under normalisation, so a full-row sum (for delta) is the only
vocabulary-wide work besides one argmax per row. "Accepted" means x == argmax, or S_j > 0 and x
beats the argmax with p~(x): with S_j = 0 the decision is the exact one, independent of rounding.
Depths are evaluated one at a time, over the children of accepted nodes only.

Sampling. The target at a node is filtered_probs(logits, temperature, top_k, top_p): logits / T,
keep the top-k (ties with the k-th value kept, as LlamaGen does), keep the nucleus (the smallest
set, by decreasing probability, whose mass reaches top_p), renormalise. Multi-draft recursive
rejection sampling; the drafts are assumed drawn from q without replacement, in rank order:
    at node n: p = target at n, q = draft_probs[n] (renormalised)
    for each child c of n in rank order, token x:
        q(x) == 0: skip c (it cannot have been drawn from q: padding past q's support, or a
                   repeated token); p, q and the random stream are untouched
        p~(x) from the current p; draw u ~ U[0, 1); accept iff u * q(x) < p~(x)
                   (probability min(1, p~(x) / q(x)))
        rejected:  p <- normalise(max(p~_x - q, 0)); q <- q without x, renormalised
    a child accepted: continue from it with its own p and q; none accepted, or a leaf: the
    next token is drawn from the current (residual) p.
p~_x is the relaxed distribution of the LANTERN paper: p with x raised to p~(x) and the j
neighbours whose mass moved set to 0 (its total-variation distance to p is S_j). How the public
code treats the residual after a relaxed rejection: its dynamic-tree path zeroes the target at
x's first k + 1 neighbours (whatever j was), its static-tree path zeroes q there instead, and
both do it whenever some j >= 1 qualified, even with S_j = 0, which breaks lam = 1 == exact
when filtered probabilities are zero. We take the residual of p~_x, which zeroes exactly the
neighbours that lent mass and is p itself when S_j = 0, so lam = 1 and delta = 0 make the same
decisions as exact from the same random numbers. Like the public code we relax against the
current residual p (later siblings see neighbour mass the earlier rejections left). A residual
of zero mass (only through rounding, when p~_x == q) falls back to p~_x. The public code divides
by the drafter's unconditional q(x); here q is renormalised over the untried siblings, which is
what makes `exact` lossless for drafts drawn without replacement. Exactness needs each node's
children to have ranks 0..w-1 (Tree.contiguous); accept_sampling refuses other trees.
Random numbers come only from the Generator passed in: one rng.random() per tried child and one
for the final token.
"""
import math
from dataclasses import dataclass

import numpy as np

from lantern.runtime.errors import LanternError

MODES = ("exact", "lantern", "lantern++")


@dataclass(frozen=True)
class Rule:
    """How drafts are accepted. exact: lossless; lantern: k neighbours, additive bound delta in
    [0, 1]; lantern++: k neighbours, multiplicative bound lam >= 1. k = 0 relaxes nothing."""

    mode: str = "exact"
    k: int = 0
    delta: float = 0.0
    lam: float = 1.0

    def __post_init__(self):
        if self.mode not in MODES:
            raise LanternError(f"unknown acceptance mode {self.mode!r}; valid: {', '.join(MODES)}")
        if isinstance(self.k, (bool, np.bool_)) or not isinstance(self.k, (int, np.integer)) or self.k < 0:
            raise LanternError(f"k must be an integer >= 0 (neighbours per draft), got {self.k!r}")
        if self.mode != "lantern" and self.delta != 0.0:
            raise LanternError(f"delta applies to mode 'lantern' only, not {self.mode!r}")
        if self.mode != "lantern++" and self.lam != 1.0:
            raise LanternError(f"lam applies to mode 'lantern++' only, not {self.mode!r}")
        if self.mode == "exact" and self.k != 0:
            raise LanternError("k applies to modes 'lantern' and 'lantern++' only, not 'exact'")
        if not (isinstance(self.delta, (int, float, np.floating)) and 0.0 <= self.delta <= 1.0):
            raise LanternError(f"delta must be in [0, 1], got {self.delta!r}")
        if not (isinstance(self.lam, (int, float, np.floating)) and 1.0 <= self.lam < math.inf):
            raise LanternError(f"lam must be >= 1 and finite, got {self.lam!r}")

    @property
    def relaxes(self):
        return self.mode != "exact" and self.k > 0


@dataclass(frozen=True)
class Acceptance:
    """One step's outcome: the accepted nodes (root first) and their tokens (root excluded),
    the token sampled after them, and the depth of the last accepted node."""

    nodes: tuple
    tokens: tuple
    next_token: int
    depth: int  # equals accept_length: a tree path gains one depth per accepted draft

    @property
    def accept_length(self):
        """Accepted draft tokens; the step emits accept_length + 1 tokens."""
        return len(self.tokens)


# ---------------------------------------------------------------------------------------------
# Greedy


def accept_greedy(tree, tokens, target_logits, rule, neighbours=None):
    """Greedy acceptance over the whole tree; see the module docstring for the semantics."""
    tokens, logits, neighbours = _check_inputs(tree, tokens, target_logits, rule, neighbours)
    top = np.argmax(logits, axis=1)  # ties -> lowest id; NaN/+inf/all -inf rows caught below
    rowmax = _check_rows(tree, logits, top)

    accepted = np.zeros(tree.num_nodes, dtype=bool)
    accepted[0] = True
    for level in tree.levels:
        live = accepted[level.parents]
        if not live.any():
            break
        nodes, parents = level.nodes[live], level.parents[live]
        x = tokens[nodes]
        ok = x == top[parents]
        if rule.relaxes:
            ok |= _relaxed_argmax(logits, rowmax, parents, x, top[parents], neighbours, rule)
        accepted[nodes[ok]] = True

    reached = np.flatnonzero(accepted)
    last = int(reached[np.argmax(tree.depths[reached])])  # first of the deepest = lowest index
    return _result(tree, tokens, last, int(top[last]))


def _relaxed_argmax(logits, rowmax, parents, x, top, neighbours, rule):
    """Per draft x at row `parents`: with S_j > 0, does p~(x) make x the argmax? (x == top, the
    exact case, is decided by the caller.)"""
    m = rowmax[parents]
    wx = np.exp(logits[parents, x] - m)  # weights relative to the row max, so w(top) == 1 exactly
    near = _neighbour_slice(neighbours, x, rule.k, logits.shape[1])
    cum = np.cumsum(np.exp(logits[parents[:, None], near] - m[:, None]), axis=1)
    if rule.mode == "lantern++":
        bound = (rule.lam - 1.0) * wx
    else:  # delta bounds probabilities: S_j / Z <= delta  <=>  S_j <= delta * Z
        rows, inverse = np.unique(parents, return_inverse=True)
        z = np.exp(logits[rows] - rowmax[rows, None]).sum(axis=1)
        bound = rule.delta * z[inverse]
    _, s = _moved_mass(cum, bound)
    pt = wx + s
    return (s > 0) & ((pt > 1.0) | ((pt == 1.0) & (x < top)))


def _moved_mass(cum, bound):
    """(j, S_j) for the largest j with S_j <= bound, per row of cumulative sums [n, k]; S_0 = 0."""
    j = (cum <= bound[:, None]).sum(axis=1)
    if cum.shape[1] == 0:
        return j, np.zeros(len(bound))
    return j, np.where(j > 0, cum[np.arange(len(j)), np.maximum(j - 1, 0)], 0.0)


# ---------------------------------------------------------------------------------------------
# Sampling


def accept_sampling(tree, tokens, target_logits, draft_probs, rule, rng, neighbours=None, *,
                    temperature=1.0, top_k=0, top_p=1.0):
    """Recursive rejection sampling down the tree; see the module docstring for the semantics."""
    tokens, logits, neighbours = _check_inputs(tree, tokens, target_logits, rule, neighbours)
    _check_filters(temperature, top_k, top_p)
    _check_rows(tree, logits, np.argmax(logits, axis=1))
    if not isinstance(rng, np.random.Generator):
        raise LanternError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    draft_probs = np.asarray(draft_probs)
    if draft_probs.shape != logits.shape:
        raise LanternError(f"draft_probs has shape {draft_probs.shape}, expected {logits.shape} "
                           "(nodes x vocabulary, like target_logits)")
    if not tree.contiguous:
        raise LanternError(f"tree {tree.name!r} has a node whose children skip a rank; sampling "
                           "needs ranks 0..w-1 at every node (the skipped drafts are unknown)")
    vocab = logits.shape[1]

    node = 0
    p = _filter_row(logits[0], temperature, top_k, top_p)
    while tree.children[node]:
        q = _draft_row(draft_probs, node, tree)
        chosen = None
        for child in tree.children[node]:
            x = int(tokens[child])
            if q[x] <= 0.0:
                continue
            pt, lent = _relax(p, x, rule, neighbours, vocab)
            if rng.random() * q[x] < pt:
                chosen = child
                break
            p = _residual(p, x, pt, lent, q)
            q[x] = 0.0
            total = q.sum()
            if total > 0:
                q /= total
        if chosen is None:
            break
        node = chosen
        p = _filter_row(logits[node], temperature, top_k, top_p)
    return _result(tree, tokens, node, _draw(p, rng))


def _relax(p, x, rule, neighbours, vocab):
    """(p~(x), neighbours that lent mass) against the current distribution p."""
    if not rule.relaxes:
        return p[x], None
    near = _neighbour_slice(neighbours, np.array([x]), rule.k, vocab)[0]
    cum = np.cumsum(p[near])
    bound = rule.delta if rule.mode == "lantern" else (rule.lam - 1.0) * p[x]
    j, s = _moved_mass(cum[None, :], np.array([bound]))
    if s[0] == 0.0:  # nothing moved (also zero-probability neighbours): p~ is p itself
        return p[x], None
    return p[x] + s[0], near[:j[0]]


def _residual(p, x, pt, lent, q):
    """normalise(max(p~_x - q, 0)) after rejecting x; p~_x == p when nothing was lent."""
    if lent is not None:
        p = p.copy()
        p[lent] = 0.0
        p[x] = pt
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    return r / total if total > 0 else p


def _draw(p, rng):
    """Inverse-CDF draw; zero-probability tokens are never returned."""
    cdf = np.cumsum(p)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(i, int(np.flatnonzero(p)[-1]))


def _draft_row(draft_probs, node, tree):
    q = draft_probs[node].astype(np.float64)  # a copy: removals below must not touch the input
    if not np.isfinite(q).all() or (q < 0).any():
        raise LanternError(f"draft_probs row {node} (node path {list(tree.paths[node])}) has "
                           "negative or non-finite entries")
    total = q.sum()
    return q / total if total > 0 else q


def filtered_probs(logits, temperature=1.0, top_k=0, top_p=1.0):
    """Probabilities [..., V] (float64) from logits [V] or [R, V]: logits / temperature, keep the
    top_k (0 = all; ties with the k-th value kept), keep the smallest set of highest
    probabilities whose mass reaches top_p (1 = all), renormalise. The target in accept_sampling
    uses exactly this; filter the drafter's distribution with it too."""
    _check_filters(temperature, top_k, top_p)
    logits = np.asarray(logits)
    if logits.ndim == 1:
        return _filter_row(logits, temperature, top_k, top_p)
    return np.stack([_filter_row(row, temperature, top_k, top_p) for row in logits])


def _filter_row(row, temperature, top_k, top_p):
    z = row.astype(np.float64) / temperature
    vocab = z.shape[0]
    if 0 < top_k < vocab:
        kth = np.partition(z, vocab - top_k)[vocab - top_k]
        z = np.where(z >= kth, z, -np.inf)
    m = z.max()
    if not np.isfinite(m):
        raise LanternError("logits contain NaN or +inf, or are all -inf")
    p = np.exp(z - m)
    p /= p.sum()
    if top_p < 1.0:
        kept = np.flatnonzero(p)  # sort only what top-k left
        order = kept[np.argsort(-p[kept], kind="stable")]  # stable: equal probabilities by id
        before = np.concatenate(([0.0], np.cumsum(p[order])[:-1]))  # mass strictly above
        p[order[before >= top_p]] = 0.0
        p /= p.sum()
    return p


# ---------------------------------------------------------------------------------------------
# Shared checks and result


def _check_inputs(tree, tokens, target_logits, rule, neighbours):
    if not isinstance(rule, Rule):
        raise LanternError(f"rule must be a Rule, got {type(rule).__name__}")
    logits = np.asarray(target_logits)
    n = tree.num_nodes
    if logits.ndim != 2 or logits.shape[0] != n or logits.shape[1] < 1:
        raise LanternError(f"target_logits has shape {logits.shape}, expected ({n}, V): one row "
                           f"per node of tree {tree.name!r}")
    if not np.issubdtype(logits.dtype, np.floating):
        raise LanternError(f"target_logits must be floating point, got {logits.dtype}")
    vocab = logits.shape[1]
    tokens = np.asarray(tokens)
    if tokens.shape != (n,) or not np.issubdtype(tokens.dtype, np.integer):
        raise LanternError(f"tokens must be {n} integers (one per node, root first), got "
                           f"shape {tokens.shape} dtype {tokens.dtype}")
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab))
    if bad.size:
        i = int(bad[0])
        raise LanternError(f"token {int(tokens[i])} at node {i} (path {list(tree.paths[i])}) is "
                           f"outside the vocabulary [0, {vocab})")
    if neighbours is not None:
        neighbours = np.asarray(neighbours)
        if neighbours.ndim != 2 or neighbours.shape[0] != vocab:
            raise LanternError(f"neighbour table has shape {neighbours.shape}, expected ({vocab}, "
                               f"Kn): one row per token of the {vocab}-token vocabulary")
        if not np.issubdtype(neighbours.dtype, np.integer):
            raise LanternError(f"neighbour table must hold integer token ids, got {neighbours.dtype}")
    if rule.mode != "exact":
        if rule.k > vocab - 1:
            raise LanternError(f"k = {rule.k} is out of range [0, {vocab - 1}] for a "
                               f"{vocab}-token vocabulary")
        if rule.k > 0 and neighbours is None:
            raise LanternError(f"mode {rule.mode!r} with k = {rule.k} needs a neighbour table")
        if rule.k > 0 and rule.k > neighbours.shape[1]:
            raise LanternError(f"k = {rule.k} exceeds the neighbour table's width "
                               f"{neighbours.shape[1]}")
    return tokens, logits, neighbours


def _check_rows(tree, logits, top):
    """Each row's max (float64), or LanternError: NaN and +inf win np.argmax and an all -inf row
    has -inf there, so the argmax pass checks every row."""
    best = logits[np.arange(logits.shape[0]), top].astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(best))
    if bad.size:
        i = int(bad[0])
        what = "NaN" if np.isnan(best[i]) else "+inf" if best[i] > 0 else "only -inf"
        raise LanternError(f"target_logits row {i} (node path {list(tree.paths[i])}) contains "
                           f"{what}")
    return best


def _check_filters(temperature, top_k, top_p):
    if not (isinstance(temperature, (int, float, np.floating)) and 0 < temperature < math.inf):
        raise LanternError(f"temperature must be > 0 and finite, got {temperature!r}")
    if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise LanternError(f"top_k must be an integer >= 0 (0 = no top-k), got {top_k!r}")
    if not (isinstance(top_p, (int, float, np.floating)) and 0 < top_p <= 1):
        raise LanternError(f"top_p must be in (0, 1] (1 = no nucleus filter), got {top_p!r}")


def _neighbour_slice(neighbours, x, k, vocab):
    near = np.asarray(neighbours[x, :k], dtype=np.int64)
    if near.size and (near.min() < 0 or near.max() >= vocab):
        raise LanternError(f"neighbour table holds ids outside the vocabulary [0, {vocab})")
    return near


def _result(tree, tokens, last, next_token):
    nodes = []
    i = last
    while i >= 0:
        nodes.append(int(i))
        i = int(tree.parents[i])
    nodes.reverse()
    return Acceptance(nodes=tuple(nodes), tokens=tuple(int(t) for t in tokens[nodes[1:]]),
                      next_token=int(next_token), depth=int(tree.depths[last]))
