"""The per-draft arithmetic of the relaxed rules (LANTERN, LANTERN++, GSD): the neighbor mass a
draft borrows, GSD's groups, the residual a rejection leaves, and the greedy tests built on them.
lantern.runtime.accept walks the tree and decides; these are the questions it asks at a draft
(the inputs are checked there, the rule is one of its classes). Each works on the rows of the
drafts being judged: images, parent rows and draft tokens as index arrays of equal length.

Relaxation (REFERENCE.md section 1). At a node whose target distribution is p, for a draft x let
S_j be the sum of p over x's j nearest neighbors (j <= k). Take the largest j with
S_j <= bound — the rule's own bound: delta (LANTERN) or (lam - 1) * p(x) (LANTERN++), inclusive
— and p~(x) = p(x) + S_j. S_j never decreases with j, so "largest j" is a count. lam = 1 or
delta = 0 admit only neighbors of zero probability, so S_j = 0 and p~(x) = p(x) bit for bit;
under LANTERN++ p(x) = 0 gives bound 0 and p~(x) stays 0.

p~_x is the relaxed distribution of the LANTERN paper: p with x raised to p~(x) and the j
neighbors whose mass moved set to 0 (its total-variation distance to p is S_j). How the public
code treats the residual after a relaxed rejection: its dynamic-tree path zeroes the target at
x's first k + 1 neighbors (whatever j was), its static-tree path zeroes q there instead, and
both do it whenever some j >= 1 qualified, even with S_j = 0, which breaks lam = 1 == exact
when filtered probabilities are zero. We take the residual of p~_x, which zeroes exactly the
neighbors that lent mass and is p itself when S_j = 0, so lam = 1 and delta = 0 make the same
decisions as exact from the same random numbers. Like the public code we relax against the
current residual p (later siblings see neighbor mass the earlier rejections left). A residual
of zero mass (only through rounding, when p~_x == q) falls back to p~_x.
"""
import numpy as np

from lantern.runtime.errors import LanternError

# ---------------------------------------------------------------------------------------------
# Shared: S_j and the neighbors


def moved_mass(cum, bound):
    """(j, S_j) for the largest j with S_j <= bound, per row of cumulative sums [n, k]; S_0 = 0."""
    j = (cum <= bound[:, None]).sum(axis=1)
    if cum.shape[1] == 0:
        return j, np.zeros(len(bound))
    return j, np.where(j > 0, cum[np.arange(len(j)), np.maximum(j - 1, 0)], 0.0)


def neighbor_slice(neighbors, x, k, vocab):
    near = np.asarray(neighbors[x, :k], dtype=np.int64)
    if near.size and (near.min() < 0 or near.max() >= vocab):
        raise LanternError(f"neighbor table holds ids outside the vocabulary [0, {vocab})")
    return near


# ---------------------------------------------------------------------------------------------
# Greedy: on weights w = exp(l - max l) of the parents' rows


def relaxed_argmax(logits, rowmax, rows, parents, x, top, neighbors, rule):
    """Per draft x at (image, parent row): with S_j > 0, does p~(x) make x the argmax?"""
    m = rowmax[rows, parents]
    wx = np.exp(logits[rows, parents, x] - m)  # weights relative to the row max: w(top) == 1
    near = neighbor_slice(neighbors, x, rule.k, logits.shape[2])
    cum = np.cumsum(np.exp(logits[rows[:, None], parents[:, None], near] - m[:, None]), axis=1)
    total = None
    if rule.bound_reads_total:  # LANTERN's delta bounds probabilities: S_j / Z <= delta <=> S_j <= delta Z
        total = row_totals(logits, rowmax, rows, parents)
    _, s = moved_mass(cum, rule.bound(wx, total))
    pt = wx + s
    return (s > 0) & ((pt > 1.0) | ((pt == 1.0) & (x < top)))


def group_has_argmax(logits, rowmax, rows, parents, x, top, neighbors, rule):
    """GSD per draft x != argmax at (image, parent row): p and q are one-hot (the argmax, x), so
    the group's ratio is 1 iff the argmax is in G(x): one of x's k nearest neighbors with
    p(argmax) - p(x) < tau (p the softmax of the row), and 0 otherwise."""
    near = neighbor_slice(neighbors, x, rule.k, logits.shape[2])
    wx = np.exp(logits[rows, parents, x] - rowmax[rows, parents])  # w(top) == 1
    gap = (1.0 - wx) / row_totals(logits, rowmax, rows, parents)  # p(top) - p(x) >= 0
    return (near == top[:, None]).any(axis=1) & (gap < rule.tau)


def row_totals(logits, rowmax, rows, parents):
    """sum_v exp(l_v - max l) of each (image, parent) row, each distinct row summed once."""
    pairs, inverse = np.unique(rows * logits.shape[1] + parents, return_inverse=True)
    flat = logits.reshape(-1, logits.shape[2])
    return np.exp(flat[pairs] - rowmax.reshape(-1)[pairs, None]).sum(axis=1)[inverse]


# ---------------------------------------------------------------------------------------------
# Sampling: on the rows' current (residual) p and sparse q


def relax(p, x, rule, neighbors, vocab):
    """(p~(x) [n], lent [n, k]: the neighbors whose mass moved, -1 elsewhere) against the rows'
    current p."""
    px = p[np.arange(len(x)), x]
    if not rule.relaxes:
        return px, np.zeros((len(x), 0), dtype=np.int64)
    near = neighbor_slice(neighbors, x, rule.k, vocab)
    cum = np.cumsum(np.take_along_axis(p, near, axis=1), axis=1)
    j, s = moved_mass(cum, rule.bound(px, 1.0))
    lent = (np.arange(near.shape[1])[None, :] < j[:, None]) & (s[:, None] > 0)
    return px + s, np.where(lent, near, -1)


def group_mass(p, x, ids, q, rule, neighbors, vocab):
    """(P_G, Q_G): the mass of G(x) under the rows' current p and q. G(x) is x and those of its
    k nearest neighbors with |p(j) - p(x)| < tau; q is sparse (probabilities q over candidate
    ids), so a group member outside the candidates adds nothing to Q_G."""
    n = np.arange(len(x))
    near = neighbor_slice(neighbors, x, rule.k, vocab)
    close = np.abs(np.take_along_axis(p, near, axis=1) - p[n, x][:, None]) < rule.tau
    group = np.zeros(p.shape, dtype=bool)  # a mask over the vocabulary: repeated ids count once
    group[n, x] = True
    rows, cols = np.nonzero(close)
    group[rows, near[rows, cols]] = True
    p_g = np.where(group, p, 0.0).sum(axis=1)
    q_g = np.where(np.take_along_axis(group, ids, axis=1), q, 0.0).sum(axis=1)
    return p_g, q_g


def residual(p, x, pt, lent, ids, q):
    """normalise(max(p~_x - q, 0)) after rejecting x, per row; p~_x == p when nothing was lent
    (pt is read only in rows that lent). q is sparse: probabilities q over candidate ids."""
    p = p.copy()
    rows, cols = np.nonzero(lent >= 0)
    p[rows, lent[rows, cols]] = 0.0
    relaxed = (lent >= 0).any(axis=1)
    p[np.flatnonzero(relaxed), x[relaxed]] = pt[relaxed]
    r = p.copy()
    np.put_along_axis(r, ids, np.maximum(np.take_along_axis(p, ids, axis=1) - q, 0.0), axis=1)
    total = r.sum(axis=1, keepdims=True)
    return np.where(total > 0, r / np.where(total > 0, total, 1.0), p)
