"""Acceptance for static-tree speculative decoding, batched over the images of a step:
exact, LANTERN (k, delta), LANTERN++ (k, lam), GSD (k, tau), greedy or sampling.

Public API
    Exact(), Lantern(k, delta), LanternPP(k, lam), Gsd(k, tau)
                                                       the rules; rule_for(mode, ...) picks one
    accept_greedy_batch(tree, tokens, logits, rule, neighbors=None) -> Outcome
    accept_sampling_batch(tree, tokens, logits, draft_ids, draft_probs, rule, uniforms,
                          neighbors=None, *, temperature=1.0, top_k=0, top_p=1.0) -> Outcome
    accept_greedy / accept_sampling                    one image (tests, benchmarks) -> Acceptance

Inputs (N images, M = tree.num_nodes, V vocabulary, K drafter candidates):
    tokens       [N, M] int: node i's token; tokens[:, 0] is the root, already emitted.
    logits       [N, M, V] float, CFG-combined: row i is the target's prediction for the token
                 after node i. -inf is allowed (masked tokens); NaN and +inf are errors.
    draft_ids    [N, M, K], draft_probs [N, M, K]: node i's drafter candidates and their
                 probabilities (sparse, as the drafter graph returns them; rows of leaves unused).
                 A dense q is the case K = V with draft_ids = arange(V) in every row.
    uniforms     [N, M] in [0, 1), drawn up front: uniforms[n, i] decides node i when it is
                 tried as a child; uniforms[n, 0] draws the final token. An image's outcome
                 depends on its own row only, so a batch gives what each image would alone.
    neighbors   [V, Kn] int: each token's latent neighbors, nearest first, itself excluded.
Outcome: path [N, depth + 1] (node indices from the root, -1 past the end), accepted [N] (draft
tokens accepted), next_token [N], decisions [N, M] int8 (1: on the accepted path, 0: evaluated
and not on it, -1: never evaluated) — the record a profiler or tree tuner replays.

Relaxation: p~(x), a draft's probability raised by the mass S_j of its nearest neighbors within
the rule's bound, and the residual a relaxed rejection leaves are defined (and compared with the
public LANTERN code) in lantern.runtime.relaxation, which computes them.

Greedy. As in the public LANTERN code, greedy runs without a logits processor: the target is
softmax(logits) with no temperature, top-k or top-p. A node is accepted when its parent is and
its token x is the argmax of the parent's target with p(x) replaced by p~(x) (other entries
unchanged, no renormalisation, ties to the lowest token id). The deepest accepted node wins,
ties to the lowest node index (the highest-ranked path); the next token is the argmax of the
unmodified target there. Work is done on weights w = exp(l - max l) in float64: the argmax and
the LANTERN++ bound do not change under normalisation, so a full-row sum (for delta) is the only
vocabulary-wide work besides one argmax per row. "Accepted" means x == argmax, or S_j > 0 and x
beats the argmax with p~(x): with S_j = 0 the decision is the exact one, independent of rounding.

Sampling. The target at a node is filtered_probs(logits, temperature, top_k, top_p) (temperature,
top-k, nucleus; lantern.runtime.filtering). Multi-draft recursive rejection sampling; the drafts
are assumed drawn from q without replacement, in rank order:
    at node n: p = target at n, q = node n's candidate probabilities (renormalised)
    for each child c of n in rank order, token x:
        q(x) == 0: skip c (it cannot have been drawn from q: padding past q's support, or a
                   repeated token); p and q are untouched
        p~(x) from the current p; accept iff uniforms[c] * q(x) < p~(x)
                   (probability min(1, p~(x) / q(x)))
        rejected:  p <- normalise(max(p~_x - q, 0)); q <- q without x, renormalised
    a child accepted: continue from it with its own p and q; none accepted, or a leaf: the
    next token is drawn from the current (residual) p with uniforms[0].
p~_x is the relaxed distribution of the LANTERN paper (p with x raised to p~(x), the lending
neighbors zeroed), relaxed against the current residual p (lantern.runtime.relaxation). The
public code divides by the drafter's unconditional q(x); here q is renormalised over the untried
siblings, which is what makes `exact` lossless for drafts drawn without replacement. Exactness needs each node's
children to have ranks 0..w-1 (Tree.contiguous); sampling refuses other trees.

GSD (grouped speculative decoding, ICCV 2025; lossy). A draft x is judged with its group
G(x) = {x} + those of its k nearest neighbors j with |p(j) - p(x)| < tau (tau = 1 keeps all k;
the paper's further filters are not modelled): in the sampling loop above the test becomes
uniforms[c] * Q_G < P_G, P_G and Q_G the sums of the current p and q over G(x) (a member outside
sparse q's candidates adds 0 to Q_G). Nothing is lent, so a rejection leaves the ordinary
residual normalise(max(p - q, 0)) and q loses x, as for exact. Greedy (p, q one-hot at the
argmax and x) reduces to: accepted iff x is the argmax, or the argmax is one of x's k nearest
neighbors with p(argmax) - p(x) < tau, p the unfiltered softmax; the deepest-node and tie rules
are those above. k = 0 gives G(x) = {x}: the decisions of exact from the same random numbers.
"""
import math
from dataclasses import dataclass

import numpy as np

from lantern.runtime import relaxation
from lantern.runtime.filtering import check_filters, filtered_probs, inverse_cdf_draw
from lantern.runtime.errors import LanternError

# ---------------------------------------------------------------------------------------------
# Rules: the LANTERN ones each with its own bound on the neighbor mass S_j a draft may borrow;
# GSD with its group of close neighbors


def _check_k(k):
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or k < 0:
        raise LanternError(f"k must be an integer >= 0 (neighbors per draft), got {k!r}")


@dataclass(frozen=True)
class Exact:
    """Lossless speculative decoding: nothing is relaxed."""

    name = "exact"
    k = 0
    relaxes = False
    bound_reads_total = False

    def bound(self, p_x, total):
        return np.zeros_like(p_x)


@dataclass(frozen=True)
class Lantern:
    """LANTERN: borrow the mass of up to k neighbors while it stays <= delta (a probability)."""

    k: int
    delta: float
    name = "lantern"
    bound_reads_total = True  # bound() scales with the row's total mass (delta is a probability)

    def __post_init__(self):
        _check_k(self.k)
        if not (isinstance(self.delta, (int, float, np.floating)) and 0.0 <= self.delta <= 1.0):
            raise LanternError(f"delta must be in [0, 1], got {self.delta!r}")

    @property
    def relaxes(self):
        return self.k > 0

    def bound(self, p_x, total):
        """p_x and total in the same (possibly unnormalised) units: delta is a probability."""
        return self.delta * total + np.zeros_like(p_x)


@dataclass(frozen=True)
class LanternPP:
    """LANTERN++: borrow the mass of up to k neighbors while it stays <= (lam - 1) p(x)."""

    k: int
    lam: float
    name = "lantern++"
    bound_reads_total = False

    def __post_init__(self):
        _check_k(self.k)
        if not (isinstance(self.lam, (int, float, np.floating)) and 1.0 <= self.lam < math.inf):
            raise LanternError(f"lam must be >= 1 and finite, got {self.lam!r}")

    @property
    def relaxes(self):
        return self.k > 0

    def bound(self, p_x, total):
        return (self.lam - 1.0) * p_x


@dataclass(frozen=True)
class Gsd:
    """Grouped speculative decoding: accept a draft with the mass ratio of its group, x and those
    of its k nearest neighbors whose probability is within tau of p(x)."""

    k: int
    tau: float
    name = "gsd"

    def __post_init__(self):
        _check_k(self.k)
        if not (isinstance(self.tau, (int, float, np.floating)) and not isinstance(self.tau, bool)
                and 0.0 < self.tau <= 1.0):
            raise LanternError(f"tau must be in (0, 1] (a probability gap), got {self.tau!r}")

    @property
    def relaxes(self):
        return self.k > 0


RULES = {"exact": Exact, "lantern": Lantern, "lantern++": LanternPP, "gsd": Gsd}


def rule_for(mode, k=None, delta=None, lam=None, tau=None):
    """The rule a mode name stands for (the CLI's --mode), with its parameters."""
    if mode == "exact":
        return Exact()
    if mode == "lantern":
        return Lantern(k=k, delta=delta)
    if mode == "lantern++":
        return LanternPP(k=k, lam=lam)
    if mode == "gsd":
        return Gsd(k=k, tau=tau)
    raise LanternError(f"unknown acceptance mode {mode!r}; valid: {', '.join(RULES)}")


# ---------------------------------------------------------------------------------------------
# Outcomes


@dataclass(frozen=True)
class Outcome:
    """One step's acceptance for N images (see the module docstring)."""

    path: np.ndarray  # [N, depth + 1] int64, -1 padded
    accepted: np.ndarray  # [N] int64: accepted draft tokens
    next_token: np.ndarray  # [N] int64
    decisions: np.ndarray  # [N, M] int8


@dataclass(frozen=True)
class Acceptance:
    """One image's outcome: the accepted nodes (root first) and their tokens (root excluded),
    the token sampled after them, and the depth of the last accepted node."""

    nodes: tuple
    tokens: tuple
    next_token: int
    depth: int  # equals accept_length: a tree path gains one depth per accepted draft

    @property
    def accept_length(self):
        """Accepted draft tokens; the step emits accept_length + 1 tokens."""
        return len(self.tokens)


def _outcome(tree, last, next_token, decisions):
    """Paths from the root to each image's last accepted node (ancestors have lower indices)."""
    n = len(last)
    path = np.full((n, tree.depth + 1), -1, dtype=np.int64)
    rows, cols = np.nonzero(tree.mask[last])
    path[rows, tree.depths[cols]] = cols
    decisions[rows, cols] = 1
    return Outcome(path=path, accepted=tree.depths[last].astype(np.int64), next_token=next_token.astype(np.int64),
                   decisions=decisions)


def _single(tree, tokens, outcome):
    nodes = tuple(int(i) for i in outcome.path[0] if i >= 0)
    return Acceptance(nodes=nodes, tokens=tuple(int(t) for t in tokens[list(nodes[1:])]),
                      next_token=int(outcome.next_token[0]), depth=int(outcome.accepted[0]))


# ---------------------------------------------------------------------------------------------
# Greedy


def accept_greedy_batch(tree, tokens, logits, rule, neighbors=None):
    """Greedy acceptance over the whole tree for every image; see the module docstring."""
    tokens, logits, neighbors = _check_inputs(tree, tokens, logits, rule, neighbors)
    N, M, V = logits.shape
    top = np.argmax(logits, axis=2)  # ties -> lowest id; NaN/+inf/all -inf rows caught below
    rowmax = _check_rows(tree, logits, top)

    accepted = np.zeros((N, M), dtype=bool)
    accepted[:, 0] = True
    decisions = np.full((N, M), -1, dtype=np.int8)
    for level in tree.levels:
        live = accepted[:, level.parents]  # [N, n_d]
        if not live.any():
            break
        x = tokens[:, level.nodes]
        parent_top = top[:, level.parents]
        ok = live & (x == parent_top)
        if rule.relaxes:
            rows, j = np.nonzero(live & ~ok)
            if rows.size:
                parents = level.parents[j]
                test = relaxation.group_has_argmax if isinstance(rule, Gsd) else relaxation.relaxed_argmax
                ok[rows, j] = test(logits, rowmax, rows, parents, x[rows, j], parent_top[rows, j], neighbors, rule)
        accepted[:, level.nodes] = ok
        decisions[:, level.nodes] = np.where(live, 0, -1)

    # the deepest accepted node, ties to the lowest index
    score = np.where(accepted, tree.depths[None, :] * (M + 1) + (M - np.arange(M))[None, :], -1)
    last = score.argmax(axis=1)
    return _outcome(tree, last, top[np.arange(N), last], decisions)


def accept_greedy(tree, tokens, target_logits, rule, neighbors=None):
    """One image: tokens [M], target_logits [M, V]."""
    tokens, logits = _one_image(tree, tokens, target_logits)
    return _single(tree, tokens[0], accept_greedy_batch(tree, tokens, logits, rule, neighbors))


# ---------------------------------------------------------------------------------------------
# Sampling


def accept_sampling_batch(tree, tokens, logits, draft_ids, draft_probs, rule, uniforms, neighbors=None, *,
                          temperature=1.0, top_k=0, top_p=1.0):
    """Recursive rejection sampling down the tree for every image; see the module docstring."""
    tokens, logits, neighbors = _check_inputs(tree, tokens, logits, rule, neighbors)
    check_filters(temperature, top_k, top_p)
    N, M, V = logits.shape
    _check_rows(tree, logits, np.argmax(logits, axis=2))
    draft_ids, draft_probs = np.asarray(draft_ids), np.asarray(draft_probs)
    if draft_ids.shape != draft_probs.shape or draft_ids.shape[:2] != (N, M):
        raise LanternError(f"draft ids/probs have shapes {draft_ids.shape}/{draft_probs.shape}, expected "
                           f"({N}, {M}, K) each: K candidates per node")
    uniforms = np.asarray(uniforms, dtype=np.float64)
    if uniforms.shape != (N, M):
        raise LanternError(f"uniforms have shape {uniforms.shape}, expected ({N}, {M}): one per node")
    if not tree.contiguous:
        raise LanternError(f"tree {tree.name!r} has a node whose children skip a rank; sampling "
                           "needs ranks 0..w-1 at every node (the skipped drafts are unknown)")

    decisions = np.full((N, M), -1, dtype=np.int8)
    node = np.zeros(N, dtype=np.int64)
    p = filtered_probs(logits[:, 0], temperature, top_k, top_p)  # [N, V]
    going = np.ones(N, dtype=bool)
    for _ in range(tree.depth):
        going &= tree.child_at[node, 0] >= 0 if tree.child_at.shape[1] else False
        rows = np.flatnonzero(going)
        if rows.size == 0:
            break
        ids = draft_ids[rows, node[rows]]
        q = _draft_rows(draft_probs[rows, node[rows]], tree, node[rows])
        chosen = np.full(rows.size, -1, dtype=np.int64)
        for rank in range(tree.child_at.shape[1]):
            child = tree.child_at[node[rows], rank]
            t = np.flatnonzero((chosen < 0) & (child >= 0))
            if t.size == 0:
                break
            n, c = rows[t], child[t]
            x = tokens[n, c]
            hit = ids[t] == x[:, None]
            col = hit.argmax(axis=1)
            qx = np.where(hit.any(axis=1), q[t, col], 0.0)
            decisions[n, c] = 0
            live = qx > 0  # a draft outside q's support was not drawn from it: skip it
            t, n, c, x, col, qx = t[live], n[live], c[live], x[live], col[live], qx[live]
            num, den, lent = _trial(p[n], x, qx, ids[t], q[t], rule, neighbors, V)
            ok = uniforms[n, c] * den < num
            chosen[t[ok]] = c[ok]
            bad = ~ok
            if bad.any():
                p[n[bad]] = relaxation.residual(p[n[bad]], x[bad], num[bad], lent[bad], ids[t[bad]], q[t[bad]])
                q[t[bad], col[bad]] = 0.0
                rest = q[t[bad]]
                total = rest.sum(axis=1, keepdims=True)
                q[t[bad]] = np.divide(rest, total, out=rest, where=total > 0)
        moved = chosen >= 0
        going[rows[~moved]] = False
        down = rows[moved]
        node[down] = chosen[moved]
        if down.size:
            p[down] = filtered_probs(logits[down, node[down]], temperature, top_k, top_p)
    return _outcome(tree, node, inverse_cdf_draw(p, uniforms[:, 0]), decisions)


def _trial(p, x, qx, ids, q, rule, neighbors, vocab):
    """(numerator, denominator, lent) per row's draft x: accepted iff u * denominator < numerator.
    LANTERN rules: p~(x) / q(x), lent the neighbors whose mass moved into p~(x), so a rejection
    leaves the residual of p~_x. GSD: P_G / Q_G, nothing lent, so the residual is that of p."""
    if isinstance(rule, Gsd) and rule.relaxes:
        p_g, q_g = relaxation.group_mass(p, x, ids, q, rule, neighbors, vocab)
        return p_g, q_g, np.zeros((len(x), 0), dtype=np.int64)
    pt, lent = relaxation.relax(p, x, rule, neighbors, vocab)
    return pt, qx, lent


def _draft_rows(q, tree, nodes):
    q = q.astype(np.float64)  # a copy: removals below must not touch the input
    bad = ~(np.isfinite(q) & (q >= 0)).all(axis=1)
    if bad.any():
        node = int(nodes[np.argmax(bad)])
        raise LanternError(f"draft probabilities of node {node} (path {list(tree.paths[node])}) have "
                           "negative or non-finite entries")
    total = q.sum(axis=1, keepdims=True)
    return np.divide(q, total, out=q, where=total > 0)


def accept_sampling(tree, tokens, target_logits, draft_probs, rule, rng, neighbors=None, *,
                    temperature=1.0, top_k=0, top_p=1.0):
    """One image, with a dense draft distribution draft_probs [M, V] and the uniforms drawn from
    `rng` up front (rng.random(M): index 0 draws the final token, index i decides node i)."""
    tokens, logits = _one_image(tree, tokens, target_logits)
    draft_probs = np.asarray(draft_probs)
    if draft_probs.shape != logits.shape[1:]:
        raise LanternError(f"draft_probs has shape {draft_probs.shape}, expected {logits.shape[1:]} "
                           "(nodes x vocabulary, like target_logits)")
    if not isinstance(rng, np.random.Generator):
        raise LanternError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    vocab = logits.shape[2]
    ids = np.broadcast_to(np.arange(vocab), (1, tree.num_nodes, vocab))
    uniforms = rng.random((1, tree.num_nodes))
    out = accept_sampling_batch(tree, tokens, logits, ids, draft_probs[None], rule, uniforms, neighbors,
                                temperature=temperature, top_k=top_k, top_p=top_p)
    return _single(tree, tokens[0], out)


# ---------------------------------------------------------------------------------------------
# Shared checks


def _one_image(tree, tokens, target_logits):
    logits = np.asarray(target_logits)
    n = tree.num_nodes
    if logits.ndim != 2 or logits.shape[0] != n or logits.shape[1] < 1:
        raise LanternError(f"target_logits has shape {logits.shape}, expected ({n}, V): one row "
                           f"per node of tree {tree.name!r}")
    tokens = np.asarray(tokens)
    if tokens.shape != (n,) or not np.issubdtype(tokens.dtype, np.integer):
        raise LanternError(f"tokens must be {n} integers (one per node, root first), got "
                           f"shape {tokens.shape} dtype {tokens.dtype}")
    return tokens[None], logits[None]


def _check_inputs(tree, tokens, logits, rule, neighbors):
    if not isinstance(rule, (Exact, Lantern, LanternPP, Gsd)):
        raise LanternError(f"rule must be Exact, Lantern or LanternPP, or Gsd, got {type(rule).__name__}")
    logits = np.asarray(logits)
    m = tree.num_nodes
    if logits.ndim != 3 or logits.shape[1] != m or logits.shape[2] < 1:
        raise LanternError(f"target logits have shape {logits.shape}, expected (N, {m}, V): one row "
                           f"per node of tree {tree.name!r}")
    if not np.issubdtype(logits.dtype, np.floating):
        raise LanternError(f"target logits must be floating point, got {logits.dtype}")
    vocab = logits.shape[2]
    tokens = np.asarray(tokens)
    if tokens.shape != logits.shape[:2] or not np.issubdtype(tokens.dtype, np.integer):
        raise LanternError(f"tokens must be {logits.shape[:2]} integers (one per node, root first), got "
                           f"shape {tokens.shape} dtype {tokens.dtype}")
    bad = np.argwhere((tokens < 0) | (tokens >= vocab))
    if bad.size:
        n, i = (int(v) for v in bad[0])
        raise LanternError(f"token {int(tokens[n, i])} at node {i} (path {list(tree.paths[i])}) is "
                           f"outside the vocabulary [0, {vocab})")
    if neighbors is not None:
        neighbors = np.asarray(neighbors)
        if neighbors.ndim != 2 or neighbors.shape[0] != vocab:
            raise LanternError(f"neighbor table has shape {neighbors.shape}, expected ({vocab}, "
                               f"Kn): one row per token of the {vocab}-token vocabulary")
        if not np.issubdtype(neighbors.dtype, np.integer):
            raise LanternError(f"neighbor table must hold integer token ids, got {neighbors.dtype}")
    if rule.relaxes:
        if rule.k > vocab - 1:
            raise LanternError(f"k = {rule.k} is out of range [0, {vocab - 1}] for a "
                               f"{vocab}-token vocabulary")
        if neighbors is None:
            raise LanternError(f"mode {rule.name!r} with k = {rule.k} needs a neighbor table")
        if rule.k > neighbors.shape[1]:
            raise LanternError(f"k = {rule.k} exceeds the neighbor table's width "
                               f"{neighbors.shape[1]}")
    return tokens, logits, neighbors


def _check_rows(tree, logits, top):
    """Each row's max (float64), or LanternError: NaN and +inf win np.argmax and an all -inf row
    has -inf there, so the argmax pass checks every row."""
    best = np.take_along_axis(logits, top[..., None], axis=2)[..., 0].astype(np.float64)
    bad = np.argwhere(~np.isfinite(best))
    if bad.size:
        n, i = (int(v) for v in bad[0])
        what = "NaN" if np.isnan(best[n, i]) else "+inf" if best[n, i] > 0 else "only -inf"
        raise LanternError(f"target logits row {i} (node path {list(tree.paths[i])}) contains "
                           f"{what}" + (f" (image {n})" if logits.shape[0] > 1 else ""))
    return best

