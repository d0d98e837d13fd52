"""GSD (grouped speculative decoding) acceptance: parameters, k = 0 == exact decision for decision,
an independent per-image reference over random trees with dense and sparse q, and hand-worked
cases for the group, tau and greedy."""
import numpy as np
import pytest

from lantern.runtime.accept import Exact, Gsd, accept_greedy_batch, accept_sampling_batch, rule_for
from lantern.runtime.errors import LanternError
from lantern.runtime.filtering import filtered_probs
from lantern.runtime.tree import build_tree

FIELDS = ("path", "accepted", "next_token", "decisions")


def neighbor_table(rng, vocab):
    """Random latent neighbors: each row the other tokens in a random order."""
    return np.stack([rng.permutation([u for u in range(vocab) if u != v]) for v in range(vocab)])


def random_case(rng, tree, n, vocab, k_cand, dense):
    """Logits with some -inf entries; q per node either dense [.., vocab] (random, or one-hot at a
    random token as a drafter-free proposer gives) or k_cand distinct candidates; drafts drawn
    mostly from q, some the parent's argmax, some anything; uniforms per node."""
    m = tree.num_nodes
    logits = rng.normal(scale=1.5, size=(n, m, vocab))
    logits[rng.random((n, m, vocab)) < 0.15] = -np.inf
    logits[:, :, 0] = 0.0  # every row finite
    if dense:
        probs = rng.random((n, m, vocab)) ** 3
        probs[rng.random((n, m, vocab)) < 0.2] = 0.0
        onehot = rng.random((n, m)) < 0.3
        probs[onehot] = np.eye(vocab)[rng.integers(vocab, size=onehot.sum())]
        probs[probs.sum(axis=2) == 0, 0] = 1.0
        ids = np.broadcast_to(np.arange(vocab), (n, m, vocab))
    else:
        ids = np.stack([[rng.permutation(vocab)[:k_cand] for _ in range(m)] for _ in range(n)])
        probs = rng.random((n, m, k_cand)) ** 3
        probs[rng.random((n, m, k_cand)) < 0.1] = 0.0
    probs = probs / probs.sum(axis=2, keepdims=True)
    top = np.argmax(logits, axis=2)
    tokens = rng.integers(vocab, size=(n, m))
    for b in range(n):
        for i in range(1, m):
            parent = tree.parents[i]
            r = rng.random()
            if r < 0.6 and probs[b, parent].sum() > 0:
                tokens[b, i] = ids[b, parent][rng.choice(ids.shape[2], p=probs[b, parent])]
            elif r < 0.85:
                tokens[b, i] = top[b, parent]
    return logits, tokens, ids, probs, rng.random((n, m))


def dense_q(ids, probs, vocab):
    q = np.zeros(ids.shape[:-1] + (vocab,))
    np.put_along_axis(q, ids, probs, axis=-1)
    return q


# ---------------------------------------------------------------------------------------------
# Independent references, straight from the definition, one image at a time


def ref_draw(p, u):
    """Inverse CDF: the first token whose cumulative mass exceeds u * total (never a zero)."""
    target, acc = u * sum(p), 0.0
    for i, v in enumerate(p):
        acc += v
        if v > 0 and acc > target:
            return i
    return max(i for i, v in enumerate(p) if v > 0)


def ref_gsd_sampling(tree, tokens, logits, q, k, tau, table, u, filters):
    """Recursive rejection sampling with the GSD test; q dense [M, V]. Returns (nodes on the
    path, next token, decisions)."""
    vocab = logits.shape[1]
    decisions = [-1] * tree.num_nodes
    path = [0]
    p = list(filtered_probs(logits[0], **filters))
    while tree.children[path[-1]]:
        qn = list(q[path[-1]])
        total = sum(qn)
        qn = [v / total for v in qn] if total > 0 else qn
        chosen = None
        for c in tree.children[path[-1]]:
            x = int(tokens[c])
            decisions[c] = 0
            if qn[x] == 0:
                continue  # not drawn from q
            group = {x} | {int(j) for j in table[x][:k] if abs(p[j] - p[x]) < tau}
            p_g = sum(p[g] for g in group)
            q_g = sum(qn[g] for g in group)
            if u[c] * q_g < p_g:
                chosen = c
                break
            r = [max(p[v] - qn[v], 0.0) for v in range(vocab)]
            if sum(r) > 0:
                p = [v / sum(r) for v in r]
            qn[x] = 0.0
            total = sum(qn)
            qn = [v / total for v in qn] if total > 0 else qn
        if chosen is None:
            break
        path.append(chosen)
        p = list(filtered_probs(logits[chosen], **filters))
    for i in path:
        decisions[i] = 1
    return path, ref_draw(p, u[0]), decisions


def ref_gsd_greedy(tree, tokens, logits, k, tau, table):
    """A node is locally accepted iff its draft is the parent's argmax, or the argmax is one of
    the draft's k nearest neighbors with p(argmax) - p(draft) < tau; the deepest fully accepted
    node wins, ties to the lowest index."""
    def local(i):
        row = logits[tree.parents[i]].astype(np.float64)
        p = np.exp(row - row.max())
        p /= p.sum()
        x, top = int(tokens[i]), int(np.argmax(row))
        return x == top or (top in table[x][:k] and p[top] - p[x] < tau)

    ok = [True] + [local(i) for i in range(1, tree.num_nodes)]
    full = [i for i in range(tree.num_nodes) if all(ok[j] for j in np.flatnonzero(tree.mask[i]))]
    best = min(full, key=lambda i: (-tree.depths[i], i))
    return best, int(np.argmax(logits[best]))


# ---------------------------------------------------------------------------------------------
# Parameters


@pytest.mark.parametrize("kwargs, words", [
    (dict(k=-1, tau=0.5), ["k must be an integer >= 0", "-1"]),
    (dict(k=2.5, tau=0.5), ["k must be an integer >= 0", "2.5"]),
    (dict(k=True, tau=0.5), ["k must be an integer >= 0"]),
    (dict(k=None, tau=0.5), ["k must be an integer >= 0"]),
    (dict(k=3, tau=0.0), ["tau must be in (0, 1]", "0.0"]),
    (dict(k=3, tau=-0.2), ["tau must be in (0, 1]", "-0.2"]),
    (dict(k=3, tau=1.5), ["tau must be in (0, 1]", "1.5"]),
    (dict(k=3, tau=float("nan")), ["tau must be in (0, 1]"]),
    (dict(k=3, tau=None), ["tau must be in (0, 1]"]),
    (dict(k=3, tau=True), ["tau must be in (0, 1]"]),
    (dict(k=3, tau="0.1"), ["tau must be in (0, 1]"]),
])
def test_bad_parameters_give_one_error_line(kwargs, words):
    for make in (lambda: Gsd(**kwargs), lambda: rule_for("gsd", **kwargs)):
        with pytest.raises(LanternError) as e:
            make()
        message = str(e.value)
        assert "\n" not in message
        for w in words:
            assert w in message


def test_rule_for_gsd():
    rule = rule_for("gsd", k=4, tau=0.15)
    assert rule == Gsd(k=4, tau=0.15) and rule.name == "gsd" and rule.relaxes
    assert rule_for("gsd", k=2, tau=1) == Gsd(2, 1)  # tau = 1: the closed end of (0, 1]
    assert not Gsd(k=0, tau=0.5).relaxes
    with pytest.raises(Exception):
        rule.k = 3  # frozen
    with pytest.raises(LanternError, match="gsd"):
        rule_for("grouped")  # the list of valid modes names gsd


def test_needs_a_neighbor_table_when_k_positive():
    rng = np.random.default_rng(0)
    tree, vocab = build_tree("chain-3"), 6
    logits, tokens, ids, probs, u = random_case(rng, tree, 2, vocab, 3, dense=False)
    for run in (lambda rule: accept_greedy_batch(tree, tokens, logits, rule, None),
                lambda rule: accept_sampling_batch(tree, tokens, logits, ids, probs, rule, u, None)):
        with pytest.raises(LanternError, match="mode 'gsd' with k = 2 needs a neighbor table"):
            run(Gsd(k=2, tau=1.0))
        run(Gsd(k=0, tau=1.0))  # nothing to look up
    with pytest.raises(LanternError, match="k = 6 is out of range"):
        accept_greedy_batch(tree, tokens, logits, Gsd(k=6, tau=1.0), neighbor_table(rng, vocab))
    with pytest.raises(LanternError, match="width 3"):
        accept_greedy_batch(tree, tokens, logits, Gsd(k=4, tau=1.0), neighbor_table(rng, vocab)[:, :3])


# ---------------------------------------------------------------------------------------------
# k = 0 is exact


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampling"])
def test_k0_makes_the_decisions_of_exact(greedy):
    vocab = 10
    for seed in range(12):
        rng = np.random.default_rng(seed)
        tree = build_tree(["chain-3", "mc_sim_7b_63", "kary-3-2"][seed % 3])
        dense = seed % 2 == 0
        logits, tokens, ids, probs, u = random_case(rng, tree, 4, vocab, 4, dense)
        table = neighbor_table(rng, vocab)
        filters = [dict(), dict(temperature=0.8, top_k=5, top_p=0.9)][seed % 2]
        for tau in (1.0, 0.15):
            if greedy:
                a = accept_greedy_batch(tree, tokens, logits, Exact())
                b = accept_greedy_batch(tree, tokens, logits, Gsd(k=0, tau=tau), table)
            else:
                a = accept_sampling_batch(tree, tokens, logits, ids, probs, Exact(), u, **filters)
                b = accept_sampling_batch(tree, tokens, logits, ids, probs, Gsd(k=0, tau=tau), u, table,
                                          **filters)
            for field in FIELDS:
                np.testing.assert_array_equal(getattr(a, field), getattr(b, field),
                                              err_msg=f"seed {seed} tau {tau} {field}")


# ---------------------------------------------------------------------------------------------
# Against the references


def test_sampling_matches_the_reference():
    rng = np.random.default_rng(7)
    vocab, n = 12, 3
    table = neighbor_table(rng, vocab)
    differs_from_exact, depths = 0, set()
    for trial in range(90):
        tree = build_tree(["chain-3", "mc_sim_7b_63"][trial % 2])
        dense = trial % 2 == 0 or trial % 5 == 0  # chain-3 always dense (the Jacobi shape)
        k = int(rng.integers(0, 6))
        tau = float([1.0, 0.15, 0.05, rng.uniform(0.01, 1.0)][trial % 4])
        filters = [dict(), dict(top_k=6), dict(temperature=1.4, top_p=0.8)][trial % 3]
        logits, tokens, ids, probs, u = random_case(rng, tree, n, vocab, 5, dense)
        rule = Gsd(k=k, tau=tau)
        got = accept_sampling_batch(tree, tokens, logits, ids, probs, rule, u, table, **filters)
        exact = accept_sampling_batch(tree, tokens, logits, ids, probs, Exact(), u, **filters)
        q = dense_q(ids, probs, vocab)
        for b in range(n):
            path, nxt, decisions = ref_gsd_sampling(tree, tokens[b], logits[b], q[b], k, tau, table, u[b],
                                                    filters)
            msg = f"trial {trial} image {b} (k {k} tau {tau:.3f})"
            assert got.path[b][got.path[b] >= 0].tolist() == path, msg
            assert got.accepted[b] == len(path) - 1, msg
            assert got.next_token[b] == nxt, msg
            assert got.decisions[b].tolist() == decisions, msg
            depths.add(len(path) - 1)
            differs_from_exact += any(not np.array_equal(getattr(got, f)[b], getattr(exact, f)[b]) for f in FIELDS)
    assert differs_from_exact >= 10  # the groups matter in these cases
    assert depths >= {0, 1, 2, 3}


def test_greedy_matches_the_reference():
    rng = np.random.default_rng(11)
    vocab, n = 8, 4
    table = neighbor_table(rng, vocab)
    differs_from_exact = 0
    for trial in range(60):
        tree = build_tree(["chain-3", "mc_sim_7b_63", "kary-2-3"][trial % 3])
        k, tau = int(rng.integers(0, 5)), float([1.0, 0.15, 0.05, 0.3][trial % 4])
        logits, tokens, _, _, _ = random_case(rng, tree, n, vocab, 4, dense=True)
        got = accept_greedy_batch(tree, tokens, logits, Gsd(k=k, tau=tau), table)
        exact = accept_greedy_batch(tree, tokens, logits, Exact())
        for b in range(n):
            best, nxt = ref_gsd_greedy(tree, tokens[b], logits[b], k, tau, table)
            last = got.path[b][got.accepted[b]]
            assert (last, got.next_token[b]) == (best, nxt), f"trial {trial} image {b}"
        differs_from_exact += int((got.accepted != exact.accepted).sum())
    assert differs_from_exact >= 10


# ---------------------------------------------------------------------------------------------
# Hand-worked cases (chain-1: the root and one draft)


P = np.array([0.1, 0.4, 0.35, 0.15])  # the root's target; draft x = 1


def one_draft(draft_ids, draft_probs, rule, u_draft, u_final, table):
    tree = build_tree("chain-1")
    logits = np.log(np.stack([P, P]))[None]
    tokens = np.array([[0, 1]])
    ids = np.array([draft_ids, draft_ids])[None]
    probs = np.array([draft_probs, draft_probs], dtype=float)[None]
    return accept_sampling_batch(tree, tokens, logits, ids, probs, rule, np.array([[u_final, u_draft]]), table)


TABLE = np.array([[1, 2, 3], [2, 3, 0], [1, 3, 0], [1, 2, 0]])  # token 1: nearest 2 (p 0.35), then 3 (0.15)


def test_a_neighbor_carries_the_mass_exact_rejects_gsd_accepts():
    # q one-hot at x = 1: exact accepts with p(1) = 0.4; GSD's group {1, 2} has P_G = 0.75, Q_G = 1
    onehot = ([1, 0, 2], [1.0, 0.0, 0.0])
    exact = one_draft(*onehot, Exact(), 0.6, 0.5, TABLE)
    gsd = one_draft(*onehot, Gsd(k=1, tau=1.0), 0.6, 0.5, TABLE)
    assert exact.accepted[0] == 0 and gsd.accepted[0] == 1
    assert exact.decisions[0].tolist() == [1, 0] and gsd.decisions[0].tolist() == [1, 1]
    # exact's residual is p without x: [0.1, 0, 0.35, 0.15] / 0.6, cdf [1/6, 1/6, 3/4, 1]: u 0.5 -> 2
    assert exact.next_token[0] == 2
    # both reject above the group's mass; the residual is the ordinary one (p unrelaxed)
    gsd = one_draft(*onehot, Gsd(k=1, tau=1.0), 0.8, 0.1, TABLE)
    assert gsd.accepted[0] == 0 and gsd.next_token[0] == 0  # cdf 1/6 > 0.1


def test_sparse_q_sums_only_the_group_members_among_the_candidates():
    # candidates 1, 3, 0 with q 0.5, 0.3, 0.2; token 2 is not a candidate (q(2) = 0)
    sparse = ([1, 3, 0], [0.5, 0.3, 0.2])
    # k = 2, tau = 1: G = {1, 2, 3}, P_G = 0.9, Q_G = 0.5 + 0.3 = 0.8: always accepted
    assert one_draft(*sparse, Gsd(k=2, tau=1.0), 0.999, 0.5, TABLE).accepted[0] == 1
    # k = 1: G = {1, 2}, P_G = 0.75, Q_G = 0.5: always accepted; exact: 0.4 / 0.5 = 0.8
    assert one_draft(*sparse, Gsd(k=1, tau=1.0), 0.999, 0.5, TABLE).accepted[0] == 1
    assert one_draft(*sparse, Exact(), 0.85, 0.5, TABLE).accepted[0] == 0
    # rejected (tau keeps G = {1}): residual max(p - q, 0) = [0, 0, 0.35, 0] -> token 2 whatever u
    out = one_draft(*sparse, Gsd(k=2, tau=0.01), 0.85, 0.01, TABLE)
    assert out.accepted[0] == 0 and out.next_token[0] == 2
    # the group's q counts too: candidates 1, 2, 0 with q 0.4, 0.5, 0.1 and G = {1, 2}:
    # P_G / Q_G = 0.75 / 0.9, so u = 0.85 rejects what exact (0.4 / 0.4) accepts
    heavy = ([1, 2, 0], [0.4, 0.5, 0.1])
    assert one_draft(*heavy, Exact(), 0.85, 0.5, TABLE).accepted[0] == 1
    assert one_draft(*heavy, Gsd(k=1, tau=1.0), 0.85, 0.5, TABLE).accepted[0] == 0
    assert one_draft(*heavy, Gsd(k=1, tau=1.0), 0.8, 0.5, TABLE).accepted[0] == 1


def test_tau_drops_a_neighbor_with_a_far_probability():
    # k = 2, q one-hot at 1: the neighbors 2 (|0.35 - 0.4| = 0.05) and 3 (|0.15 - 0.4| = 0.25)
    onehot = ([1, 0, 2], [1.0, 0.0, 0.0])
    accepted = {tau: [one_draft(*onehot, Gsd(k=2, tau=tau), u, 0.5, TABLE).accepted[0] for u in (0.5, 0.8)]
                for tau in (1.0, 0.2, 0.01)}
    assert accepted[1.0] == [1, 1]  # G = {1, 2, 3}: P_G = 0.9
    assert accepted[0.2] == [1, 0]  # G = {1, 2}: P_G = 0.75
    assert accepted[0.01] == [0, 0]  # G = {1}: P_G = 0.4, as exact


# ---------------------------------------------------------------------------------------------
# Greedy by hand: the argmax of the root is token 1 (p 0.4)


def greedy_one(draft, rule, table):
    tree = build_tree("chain-2")
    row = np.log(P)
    after = np.array([0.0, 0.0, 0.0, 3.0])  # the row after either draft: argmax 3
    logits = np.stack([row, after, after])[None]
    tokens = np.array([[0, draft, 3]])
    return accept_greedy_batch(tree, tokens, logits, rule, table)


def test_greedy_accepts_when_the_argmax_is_a_close_neighbor():
    table = np.array([[1, 2, 3], [2, 3, 0], [1, 3, 0], [2, 1, 0]])
    # draft 2: its nearest neighbor is the argmax 1, p(1) - p(2) = 0.05
    assert greedy_one(2, Exact(), table).accepted[0] == 0
    got = greedy_one(2, Gsd(k=1, tau=0.1), table)
    assert got.accepted[0] == 2 and got.path[0].tolist() == [0, 1, 2] and got.next_token[0] == 3
    assert got.decisions[0].tolist() == [1, 1, 1]
    assert greedy_one(2, Gsd(k=1, tau=0.04), table).accepted[0] == 0  # the gap is 0.05
    # draft 3: the argmax is its second neighbor, p(1) - p(3) = 0.25
    assert greedy_one(3, Gsd(k=1, tau=1.0), table).accepted[0] == 0  # beyond k
    assert greedy_one(3, Gsd(k=2, tau=0.2), table).accepted[0] == 0  # far
    assert greedy_one(3, Gsd(k=2, tau=0.3), table).accepted[0] == 2  # close enough
    # draft 0: the argmax is its nearest neighbor, p(1) - p(0) = 0.3
    assert greedy_one(0, Gsd(k=3, tau=0.29), table).accepted[0] == 0
    assert greedy_one(0, Gsd(k=3, tau=0.31), table).accepted[0] == 2
