"""Acceptance rules: validation, greedy against brute force, exactness of sampling (chi-square),
reduction of lam = 1 / delta = 0 to exact, monotonicity, and hand-worked bound cases."""
import numpy as np
import pytest
from scipy import stats

from lantern.runtime.accept import (Acceptance, Exact, Lantern, LanternPP, accept_greedy, accept_greedy_batch,
                                    accept_sampling, accept_sampling_batch, rule_for)
from lantern.runtime.errors import LanternError
from lantern.runtime.filtering import filtered_probs
from lantern.runtime.tree import build_tree

NEG = -np.inf


def neighbor_table(rng, vocab, width=None):
    """Random latent neighbors: each row a permutation of the other tokens."""
    width = vocab - 1 if width is None else width
    table = np.empty((vocab, width), dtype=np.int64)
    for v in range(vocab):
        others = np.array([u for u in range(vocab) if u != v])
        table[v] = rng.permutation(others)[:width]
    return table


def drafted_tokens(tree, logits, rng, hit=0.6):
    """Node tokens that often equal the parent's argmax, so paths get deep."""
    vocab = logits.shape[1]
    tokens = np.zeros(tree.num_nodes, dtype=np.int64)
    tokens[0] = rng.integers(vocab)
    for i in range(1, tree.num_nodes):
        parent_top = int(np.argmax(logits[tree.parents[i]]))
        tokens[i] = parent_top if rng.random() < hit else rng.integers(vocab)
    return tokens


# ---------------------------------------------------------------------------------------------
# Independent references


def ref_filter(logits, temperature=1.0, top_k=0, top_p=1.0):
    """Plain-loop version of temperature / top-k / nucleus filtering."""
    z = np.array(logits, dtype=np.float64) / temperature
    if 0 < top_k < len(z):
        kth = sorted(z, reverse=True)[top_k - 1]
        z = np.array([v if v >= kth else NEG for v in z])
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1:
        keep, mass = [], 0.0
        for i in sorted(range(len(p)), key=lambda i: (-p[i], i)):
            if mass >= top_p or p[i] == 0:
                break
            keep.append(i)
            mass += p[i]
        p = np.array([p[i] if i in keep else 0.0 for i in range(len(p))])
        p /= p.sum()
    return p


def ref_greedy(tree, tokens, logits, rule, table):
    """Node by node with full softmaxes: accepted iff every prefix's draft is the argmax of its
    parent's target after raising p(x) to p~(x); longest path, then lowest index."""
    paths = list(tree.paths)
    index = {p: i for i, p in enumerate(paths)}

    def local_ok(i):
        row = logits[index[paths[i][:-1]]].astype(np.float64)
        p = np.exp(row - row.max())
        p /= p.sum()
        x = int(tokens[i])
        moved = 0.0
        if rule.name != "exact":
            bound = rule.delta if rule.name == "lantern" else (rule.lam - 1) * p[x]
            for n in table[x, :rule.k]:
                if moved + p[n] > bound:
                    break
                moved += p[n]
        raised = p.copy()
        raised[x] = p[x] + moved
        return int(np.argmax(raised)) == x

    ok = {i: local_ok(i) for i in range(1, len(paths))}
    full = [i for i in range(len(paths)) if all(ok[index[paths[i][:d]]] for d in range(1, len(paths[i]) + 1))]
    best = min(full, key=lambda i: (-len(paths[i]), i))
    return best, int(np.argmax(logits[best]))


def brute_force_exact(spec_paths, tree, tokens, logits):
    """Over root-to-leaf paths of the spec: the longest prefix whose every draft is the argmax."""
    paths = [tuple(p) for p in spec_paths]
    leaves = [p for p in paths if not any(len(q) > len(p) and q[:len(p)] == p for q in paths)]
    index = {p: i for i, p in enumerate(tree.paths)}
    best = None  # (-length, node index), minimised
    for leaf in leaves:
        node, length = 0, 0
        for d in range(1, len(leaf) + 1):
            child = index[leaf[:d]]
            if tokens[child] != np.argmax(logits[node]):
                break
            node, length = child, d
        if best is None or (-length, node) < best:
            best = (-length, node)
    node = best[1]
    return node, int(np.argmax(logits[node]))


# ---------------------------------------------------------------------------------------------
# Rule and input validation


@pytest.mark.parametrize("kwargs, words", [
    (dict(mode="medusa"), ["medusa", "exact, lantern, lantern++"]),
    (dict(mode="lantern++", k=4, lam=0.5), ["lam must be >= 1", "0.5"]),
    (dict(mode="lantern++", k=4, lam=float("nan")), ["lam must be >= 1"]),
    (dict(mode="lantern++", k=4, lam=float("inf")), ["lam must be >= 1 and finite"]),
    (dict(mode="lantern++", k=4, lam=None), ["lam must be >= 1"]),
    (dict(mode="lantern", k=4, delta=-0.1), ["delta must be in [0, 1]", "-0.1"]),
    (dict(mode="lantern", k=4, delta=1.5), ["delta must be in [0, 1]", "1.5"]),
    (dict(mode="lantern", k=4, delta=float("nan")), ["delta must be in [0, 1]"]),
    (dict(mode="lantern", k=-1, delta=0.1), ["k must be an integer >= 0", "-1"]),
    (dict(mode="lantern", k=2.5, delta=0.1), ["k must be an integer >= 0", "2.5"]),
    (dict(mode="lantern", k=True, delta=0.1), ["k must be an integer >= 0"]),
])
def test_rule_errors(kwargs, words):
    with pytest.raises(LanternError) as e:
        rule_for(**kwargs)
    for w in words:
        assert w in str(e.value)


def test_each_rule_has_its_own_bound():
    p_x, total = np.array([0.1, 0.3]), np.array([1.0, 2.0])
    np.testing.assert_array_equal(Exact().bound(p_x, total), [0.0, 0.0])
    np.testing.assert_allclose(LanternPP(k=3, lam=3.0).bound(p_x, total), [0.2, 0.6])
    np.testing.assert_allclose(Lantern(k=3, delta=0.25).bound(p_x, total), [0.25, 0.5])
    assert not Exact().relaxes and not LanternPP(k=0, lam=9.0).relaxes and Lantern(k=1, delta=0.1).relaxes


@pytest.fixture
def small():
    rng = np.random.default_rng(0)
    tree = build_tree("kary-2-2")
    vocab = 8
    logits = rng.normal(size=(tree.num_nodes, vocab))
    tokens = rng.integers(vocab, size=tree.num_nodes)
    q = filtered_probs(rng.normal(size=(tree.num_nodes, vocab)))
    return tree, tokens, logits, q, neighbor_table(rng, vocab)


def _greedy_error(small, words, rule=LanternPP(k=3, lam=2.0), **change):
    tree, tokens, logits, q, table = small
    args = dict(tree=tree, tokens=tokens, target_logits=logits, rule=rule, neighbors=table)
    args.update(change)
    with pytest.raises(LanternError) as e:
        accept_greedy(**args)
    for w in words:
        assert w in str(e.value)
    return e


def test_input_errors(small):
    tree, tokens, logits, q, table = small
    _greedy_error(small, ["k = 8", "[0, 7]"], rule=LanternPP(k=8, lam=2.0))
    _greedy_error(small, ["k = 5", "width 4"], neighbors=table[:, :4], rule=Lantern(k=5, delta=0.1))
    _greedy_error(small, ["shape (7, 7)", "(8, Kn)"], neighbors=table[:7])
    _greedy_error(small, ["integer token ids"], neighbors=table.astype(float))
    bad = table.copy()
    bad[:, 0] = 8
    _greedy_error(small, ["outside the vocabulary [0, 8)"], neighbors=bad)
    _greedy_error(small, ["needs a neighbor table"], neighbors=None)
    for value, what in [(np.nan, "NaN"), (np.inf, "+inf")]:
        broken = logits.copy()
        broken[4, 3] = value
        _greedy_error(small, ["row 4", "path [0, 1]", what], target_logits=broken)
    broken = logits.copy()
    broken[2] = NEG
    _greedy_error(small, ["row 2", "only -inf"], target_logits=broken)
    for t in (-1, 8):
        wrong = tokens.copy()
        wrong[3] = t
        _greedy_error(small, [f"token {t} at node 3", "[0, 8)"], tokens=wrong)
    _greedy_error(small, ["tokens must be 7 integers"], tokens=tokens[:6])
    _greedy_error(small, ["tokens must be 7 integers"], tokens=tokens.astype(float))
    _greedy_error(small, ["shape (6, 8)", "(7, V)"], target_logits=logits[:6])
    _greedy_error(small, ["rule must be Exact, Lantern or LanternPP"], rule="exact")

    rng = np.random.default_rng(1)
    exact = Exact()

    def sampling(words, tree=tree, q=q, rng=rng, **filters):
        with pytest.raises(LanternError) as e:
            accept_sampling(tree, tokens[:tree.num_nodes], logits[:tree.num_nodes], q[:tree.num_nodes],
                            exact, rng, **filters)
        for w in words:
            assert w in str(e.value)

    sampling(["draft_probs has shape (6, 8)"], q=q[:6])
    negative = q.copy()
    negative[0, 1] = -0.1
    sampling(["draft probabilities of node 0", "negative or non-finite"], q=negative)
    sampling(["temperature must be > 0"], temperature=0.0)
    sampling(["top_k must be an integer >= 0"], top_k=-1)
    sampling(["top_p must be in (0, 1]"], top_p=0.0)
    sampling(["top_p must be in (0, 1]"], top_p=1.5)
    sampling(["rng must be a numpy.random.Generator"], rng=np.random)
    sampling(["skip a rank"], tree=build_tree([[0], [2], [0, 0]]))
    with pytest.raises(LanternError, match="NaN"):
        filtered_probs(np.array([0.0, np.nan]))


# ---------------------------------------------------------------------------------------------
# Greedy


@pytest.mark.parametrize("name", ["mc_sim_7b_63", "naive_extend_57", "kary-3-3", "medusa_2_7b_63", "chain-4"])
def test_greedy_exact_is_longest_argmax_prefix(name):
    tree = build_tree(name)
    rng = np.random.default_rng(sum(map(ord, name)))
    vocab = 32
    depths_seen = set()
    for _ in range(60):
        logits = rng.normal(size=(tree.num_nodes, vocab)).astype(np.float32)
        tokens = drafted_tokens(tree, logits, rng)
        got = accept_greedy(tree, tokens, logits, Exact())
        node, nxt = brute_force_exact(tree.choices, tree, tokens, logits)
        assert got.nodes[-1] == node and got.next_token == nxt
        assert got.nodes == tuple(i for i in range(tree.num_nodes) if tree.mask[node, i])
        assert got.tokens == tuple(int(tokens[i]) for i in got.nodes[1:])
        assert got.depth == got.accept_length == tree.depths[node]
        depths_seen.add(got.accept_length)
    assert len(depths_seen) >= 3  # the cases are not all trivially short


def test_greedy_tie_between_paths_prefers_lowest_index():
    tree = build_tree("kary-3-1")
    logits = np.zeros((4, 5))
    logits[0, 2] = 1.0
    got = accept_greedy(tree, np.array([0, 2, 2, 2]), logits, Exact())
    assert got.nodes == (0, 1) and got.next_token == 0  # all-zero row: lowest id wins


@pytest.mark.parametrize("rule", [LanternPP(k=4, lam=2.0), LanternPP(k=12, lam=6.0),
                                  Lantern(k=4, delta=0.12), Lantern(k=12, delta=0.3)])
def test_greedy_relaxed_matches_reference(rule):
    tree = build_tree("mc_sim_7b_63")
    rng = np.random.default_rng(7)
    vocab = 24
    table = neighbor_table(rng, vocab)
    relaxed_beyond_exact = 0
    for _ in range(40):
        logits = rng.normal(scale=1.0, size=(tree.num_nodes, vocab))
        tokens = drafted_tokens(tree, logits, rng, hit=0.4)
        got = accept_greedy(tree, tokens, logits, rule, table)
        node, nxt = ref_greedy(tree, tokens, logits, rule, table)
        assert (got.nodes[-1], got.next_token) == (node, nxt)
        relaxed_beyond_exact += got.accept_length > accept_greedy(tree, tokens, logits, Exact()).accept_length
    assert relaxed_beyond_exact > 0


def test_greedy_monotone_in_lam_delta_k():
    tree = build_tree("naive_extend_57")
    rng = np.random.default_rng(3)
    vocab = 48
    table = neighbor_table(rng, vocab, width=20)
    grids = [
        [LanternPP(k=10, lam=lam) for lam in (1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 10.0, 100.0)],
        [Lantern(k=10, delta=d) for d in (0.0, 0.01, 0.03, 0.1, 0.2, 0.4, 1.0)],
        [LanternPP(k=k, lam=4.0) for k in (0, 1, 2, 4, 8, 16, 20)],
        [Lantern(k=k, delta=0.2) for k in (0, 1, 2, 4, 8, 16, 20)],
    ]
    grew = 0
    for _ in range(40):
        logits = rng.normal(scale=1.5, size=(tree.num_nodes, vocab))
        tokens = drafted_tokens(tree, logits, rng, hit=0.3)
        for grid in grids:
            lengths = [accept_greedy(tree, tokens, logits, r, table).accept_length for r in grid]
            assert lengths == sorted(lengths), (grid, lengths)
            grew += lengths[-1] > lengths[0]
    assert grew > 10


def filtered_case(rng, tree, vocab, keep=5):
    """Logits with most tokens at -inf; every draft's nearest neighbors are zero-probability
    tokens first, so j >= 1 qualifies with S_j = 0 under lam = 1 / delta = 0."""
    logits = np.full((tree.num_nodes, vocab), NEG)
    for i in range(tree.num_nodes):
        allowed = rng.choice(vocab, size=keep, replace=False)
        logits[i, allowed] = rng.normal(size=keep)
    table = neighbor_table(rng, vocab)
    return logits, table


def test_greedy_lam1_delta0_equal_exact_with_filtered_zeros():
    tree = build_tree("naive_extend_57")
    rng = np.random.default_rng(11)
    vocab = 16
    differs = 0
    for _ in range(60):
        logits, table = filtered_case(rng, tree, vocab)
        tokens = drafted_tokens(tree, logits, rng, hit=0.5)
        exact = accept_greedy(tree, tokens, logits, Exact())
        for rule in (LanternPP(k=15, lam=1.0), Lantern(k=15, delta=0.0)):
            assert accept_greedy(tree, tokens, logits, rule, table) == exact
        differs += accept_greedy(tree, tokens, logits, LanternPP(k=15, lam=3.0), table) != exact
    assert differs > 0  # the relaxed rule does act on these cases


# ---------------------------------------------------------------------------------------------
# Hand-worked bound cases (dyadic: every sum below is exact in binary floating point)


def uniform_row(vocab, allowed):
    row = np.full(vocab, NEG)
    row[list(allowed)] = 0.0  # p = 1 / len(allowed) exactly on the allowed tokens
    return row


def test_greedy_bound_is_inclusive():
    # root allows tokens 0..7 with p = 1/8 each; argmax (ties) = token 0; the draft is token 5.
    # Neighbors of 5: 6 (p = 1/8), then 9 (p = 0). S_1 = S_2 = 1/8.
    tree = build_tree("chain-1")
    vocab = 16
    logits = np.stack([uniform_row(vocab, range(8)), uniform_row(vocab, [3])])
    table = neighbor_table(np.random.default_rng(0), vocab)
    table[5, :3] = [6, 9, 10]
    tokens = np.array([1, 5])
    assert accept_greedy(tree, tokens, logits, Exact()).accept_length == 0
    # lantern++: bound (lam - 1) * p(x) = 1/8 == S_1 -> p~ = 2/8 > 1/8: accepted
    assert accept_greedy(tree, tokens, logits, LanternPP(k=3, lam=2.0), table).accept_length == 1
    assert accept_greedy(tree, tokens, logits, LanternPP(k=3, lam=2.0 - 2**-40), table).accept_length == 0
    # lantern: bound delta = 1/8 == S_1
    got = accept_greedy(tree, tokens, logits, Lantern(k=3, delta=0.125), table)
    assert got.accept_length == 1 and got.next_token == 3
    assert accept_greedy(tree, tokens, logits, Lantern(k=3, delta=0.125 - 2**-50), table).accept_length == 0


def test_greedy_tie_after_raise_goes_to_lowest_id_and_zero_stays_zero():
    # tokens 4 and 9 at p = 1/2, the draft x has p(x) = 0 and neighbor 9 first.
    # lantern, delta = 1/2: p~(x) = 0 + 1/2 ties the max: accepted iff x < 4.
    tree = build_tree("chain-1")
    vocab = 12
    logits = np.stack([uniform_row(vocab, [4, 9]), uniform_row(vocab, [0])])
    table = neighbor_table(np.random.default_rng(1), vocab)
    for x, expected in [(2, 1), (6, 0)]:
        table[x, 0] = 9
        tokens = np.array([0, x])
        assert accept_greedy(tree, tokens, logits, Lantern(k=2, delta=0.5), table).accept_length == expected
        # lantern++ cannot lift a zero-probability draft, however large lam is
        assert accept_greedy(tree, tokens, logits, LanternPP(k=11, lam=1e6), table).accept_length == 0


def test_sampling_bound_is_inclusive():
    # target at the root: p = 1/4 on tokens {1, 5, 6, 7}; draft x = 5 with q(5) = 3/4.
    # neighbors of 5: 6 (p = 1/4), then 0 (p = 0). accept iff u * 3/4 < p~(5):
    # exact p~ = 1/4 (u < 1/3); at the bound p~ = 1/2 (u < 2/3).
    tree = build_tree("chain-1")
    vocab = 8
    logits = np.stack([uniform_row(vocab, [1, 5, 6, 7]), uniform_row(vocab, [2])])
    q = np.zeros((2, vocab))
    q[0, 5], q[0, 2] = 0.75, 0.25
    table = neighbor_table(np.random.default_rng(2), vocab)
    table[5, :2] = [6, 0]
    # uniforms are drawn up front, one per node: node 1 (the draft) is decided by the second
    seed = next(s for s in range(100) if 1 / 3 < np.random.default_rng(s).random(2)[1] < 2 / 3)

    def run(rule):
        return accept_sampling(tree, np.array([0, 5]), logits, q, rule, np.random.default_rng(seed), table)

    assert run(Exact()).accept_length == 0
    assert run(LanternPP(k=2, lam=2.0)).accept_length == 1
    assert run(LanternPP(k=2, lam=2.0 - 2**-40)).accept_length == 0
    got = run(Lantern(k=2, delta=0.25))
    assert got.accept_length == 1 and got.next_token == 2
    assert run(Lantern(k=2, delta=0.25 - 2**-50)).accept_length == 0


def test_sampling_residual_after_relaxed_rejection():
    # Rejected x = 5 that borrowed neighbor 6's mass: the residual is max(p~_x - q, 0) with
    # p~_x = (p(5) + p(6) at 5, 0 at 6): token 6 can no longer be drawn, only 1 and 7.
    tree = build_tree("chain-1")
    vocab = 8
    logits = np.stack([uniform_row(vocab, [1, 5, 6, 7]), uniform_row(vocab, [2])])
    q = np.zeros((2, vocab))
    q[0, 5] = 1.0
    table = neighbor_table(np.random.default_rng(2), vocab)
    table[5, :2] = [6, 0]
    seen = {Exact(): set(), LanternPP(k=2, lam=2.0): set()}
    for seed in range(400):
        for rule, out in seen.items():
            got = accept_sampling(tree, np.array([0, 5]), logits, q, rule, np.random.default_rng(seed), table)
            if got.accept_length == 0:
                out.add(got.next_token)
    assert seen[Exact()] == {1, 6, 7}
    assert seen[LanternPP(k=2, lam=2.0)] == {1, 7}


# ---------------------------------------------------------------------------------------------
# Sampling: exactness


class ToyModels:
    """A target and a drafter over a small vocabulary whose next-token logits depend on the
    whole context (tuples of up to 3 tokens), tabulated so trials are cheap."""

    def __init__(self, vocab, seed):
        rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.p = [rng.normal(scale=1.3, size=(vocab,) * n + (vocab,)) for n in range(4)]
        # the drafter is a noisy copy of the target, so drafts are often (not always) accepted
        self.q = [lp + rng.normal(scale=0.8, size=lp.shape) for lp in self.p]

    def draft_tables(self, draft_filter, longest):
        """The drafter's filtered distribution for every context up to `longest` tokens, by length."""
        return [np.apply_along_axis(draft_filter, -1, lq) for lq in self.q[:longest + 1]]

    def steps(self, tree, context, rule, rng, table, filters, q_tables):
        """One step for each row of context [N, c]: draft the tree from the drafter (Gumbel
        top-k = without replacement, in rank order), then accept all rows in one batch call.
        Returns the emitted tokens' first two per row ([N, 2], -1 where a row emitted one)."""
        n, m, vocab = len(context), tree.num_nodes, self.vocab
        ctx = [context] + [None] * (m - 1)  # each node's context: the step's plus its path
        tokens = np.zeros((n, m), dtype=np.int64)
        logits = np.empty((n, m, vocab))
        q = np.zeros((n, m, vocab))
        for i in range(m):  # parents come before their children
            if i:
                ctx[i] = np.concatenate([ctx[tree.parents[i]], tokens[:, i:i + 1]], axis=1)
            index = tuple(ctx[i].T)
            logits[:, i] = self.p[ctx[i].shape[1]][index]
            kids = tree.children[i]
            if kids:
                q[:, i] = q_tables[ctx[i].shape[1]][index]
                with np.errstate(divide="ignore"):
                    keys = np.log(q[:, i]) + rng.gumbel(size=(n, vocab))
                ranked = np.argsort(-keys, axis=1, kind="stable")
                for rank, child in enumerate(kids):
                    tokens[:, child] = ranked[:, rank]
        ids = np.broadcast_to(np.arange(vocab), (n, m, vocab))
        out = accept_sampling_batch(tree, tokens, logits, ids, q, rule, rng.random((n, m)), table, **filters)
        rows = np.arange(n)
        drafts = [np.where(out.accepted > d, tokens[rows, np.maximum(out.path[:, d + 1], 0)], -1) for d in range(2)]
        first = np.where(out.accepted > 0, drafts[0], out.next_token)
        second = np.where(out.accepted > 1, drafts[1], np.where(out.accepted == 1, out.next_token, -1))
        return np.stack([first, second], axis=1)

    def joint(self, target_filter):
        """Exact distribution of the first two emitted tokens."""
        first = target_filter(self.p[0][()])
        return np.array([first[a] * target_filter(self.p[1][a]) for a in range(self.vocab)])


def first_two(models, tree, rule, trials, seed, filters, table=None):
    """Counts [V, V] of the first two tokens emitted from an empty context over `trials`
    independent generations, all trials at once (accept_sampling_batch's rows are independent)."""
    rng = np.random.default_rng(seed)
    # a node drafts from the step's context (at most one token) plus its path (at most depth - 1)
    q_tables = models.draft_tables(lambda lg: ref_filter(lg, **filters), tree.depth)  # the target's filter
    out = models.steps(tree, np.zeros((trials, 0), dtype=np.int64), rule, rng, table, filters, q_tables)
    short = np.flatnonzero(out[:, 1] < 0)  # one token this step: the next step starts from it
    out[short, 1] = models.steps(tree, out[short, :1], rule, rng, table, filters, q_tables)[:, 0]
    counts = np.zeros((models.vocab, models.vocab))
    np.add.at(counts, (out[:, 0], out[:, 1]), 1)
    return counts


def chi_square(counts, joint):
    """(statistic, p-value) of observed counts against the joint, pooling cells expected < 5;
    tokens the filters remove must never appear."""
    total = counts.sum()
    assert counts[joint == 0].sum() == 0
    expected = (joint * total).ravel()
    observed = counts.ravel()
    live = expected > 0
    small = live & (expected < 5)
    big = live & ~small
    f_obs = np.append(observed[big], observed[small].sum())
    f_exp = np.append(expected[big], expected[small].sum())
    if f_exp[-1] == 0:
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
    return stats.chisquare(f_obs, f_exp)


@pytest.mark.parametrize("filters", [dict(), dict(temperature=0.8, top_k=5, top_p=0.8)],
                         ids=["plain", "top-k-top-p"])
def test_sampling_exact_preserves_target_distribution(filters):
    vocab = 8
    models = ToyModels(vocab, seed=5)
    tree = build_tree("kary-3-2")
    counts = first_two(models, tree, Exact(), trials=20000, seed=17, filters=filters)
    joint = models.joint(lambda lg: ref_filter(lg, **filters))
    result = chi_square(counts, joint)
    assert result.pvalue > 1e-3, result


def test_filtered_probs_matches_reference():
    rng = np.random.default_rng(4)
    for _ in range(200):
        vocab = int(rng.integers(2, 40))
        row = rng.normal(scale=2, size=vocab)
        row[rng.random(vocab) < 0.2] = NEG
        row[int(rng.integers(vocab))] = 0.0
        if rng.random() < 0.3:
            row[:] = np.round(row)  # ties
        filters = dict(temperature=float(rng.uniform(0.3, 2)), top_k=int(rng.integers(0, vocab + 2)),
                       top_p=float(rng.choice([1.0, rng.uniform(0.05, 1)])))
        np.testing.assert_allclose(filtered_probs(row, **filters), ref_filter(row, **filters),
                                   rtol=0, atol=1e-12)


def test_sampling_lam1_delta0_equal_exact_same_random_numbers():
    tree = build_tree("mc_sim_7b_63")
    vocab = 16
    rng = np.random.default_rng(9)
    differs = 0
    for trial in range(150):
        logits, table = filtered_case(rng, tree, vocab, keep=int(rng.integers(2, 8)))
        filters = [dict(), dict(top_k=3), dict(top_p=0.6), dict(temperature=1.7, top_k=4, top_p=0.9)][trial % 4]
        q = np.stack([ref_filter(row + rng.normal(scale=0.5, size=vocab), **filters) for row in logits])
        tokens = np.zeros(tree.num_nodes, dtype=np.int64)
        for i in range(1, tree.num_nodes):  # drafts: likely tokens of q, repeats allowed
            tokens[i] = rng.choice(vocab, p=q[tree.parents[i]])
        exact = accept_sampling(tree, tokens, logits, q, Exact(), np.random.default_rng(trial), **filters)
        for rule in (LanternPP(k=15, lam=1.0), Lantern(k=15, delta=0.0)):
            got = accept_sampling(tree, tokens, logits, q, rule, np.random.default_rng(trial), table, **filters)
            assert got == exact
        relaxed = accept_sampling(tree, tokens, logits, q, LanternPP(k=15, lam=4.0),
                                  np.random.default_rng(trial), table, **filters)
        differs += relaxed != exact
    assert differs > 0


def test_sampling_skips_drafts_outside_q_support():
    # q has one token; the other two children are padding (q = 0) and must never be accepted,
    # even where the target likes them, and must not consume random numbers.
    tree = build_tree("kary-3-1")
    vocab = 6
    logits = np.zeros((4, vocab))
    logits[0, 4] = 5.0
    q = np.zeros((4, vocab))
    q[0, 1] = 1.0
    tokens = np.array([0, 1, 4, 4])
    for seed in range(50):
        got = accept_sampling(tree, tokens, logits, q, Exact(), np.random.default_rng(seed))
        assert got.nodes in [(0,), (0, 1)]
        u = np.random.default_rng(seed).random(4)[1]  # the uniform of node 1, the only q-supported child
        accepted = u * 1.0 < np.exp(0) / (np.exp(5) + 5)
        assert got.accept_length == int(accepted)


def test_acceptance_type():
    tree = build_tree("chain-2")
    logits = np.zeros((3, 4))
    logits[:, 1] = 1.0
    got = accept_greedy(tree, np.array([0, 1, 1]), logits, Exact())
    assert got == Acceptance(nodes=(0, 1, 2), tokens=(1, 1), next_token=1, depth=2)
    assert got.accept_length == 2


# ---------------------------------------------------------------------------------------------
# Batched acceptance (what the decoding loop runs) against one image at a time


def batch_case(rng, tree, n, vocab, k):
    """Logits with some filtered (-inf) entries, each node's k distinct candidates with random
    probabilities (some zero), drafts drawn mostly from the candidates, uniforms per node."""
    m = tree.num_nodes
    logits = rng.normal(scale=1.5, size=(n, m, vocab))
    logits[rng.random((n, m, vocab)) < 0.15] = NEG
    logits[:, :, 0] = 0.0  # keep every row finite
    ids = np.stack([[rng.permutation(vocab)[:k] for _ in range(m)] for _ in range(n)])
    probs = rng.random((n, m, k)) ** 3
    probs[rng.random((n, m, k)) < 0.1] = 0.0
    probs /= probs.sum(axis=2, keepdims=True)
    tokens = rng.integers(vocab, size=(n, m))
    for i in range(1, m):
        parent = tree.parents[i]
        pick = rng.random(n) < 0.8
        tokens[pick, i] = ids[pick, parent, tree.ranks[i] % k]
    top = np.argmax(logits, axis=2)
    greedy_hit = rng.random((n, m)) < 0.5
    for i in range(1, m):
        tokens[greedy_hit[:, i], i] = top[greedy_hit[:, i], tree.parents[i]]
    return logits, tokens, ids, probs, rng.random((n, m))


RULES_UNDER_TEST = [Exact(), LanternPP(k=4, lam=3.0), Lantern(k=4, delta=0.2), LanternPP(k=1, lam=1.0)]


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampling"])
def test_batched_acceptance_equals_per_image(greedy):
    rng = np.random.default_rng(21)
    vocab, k, n = 20, 6, 5
    table = neighbor_table(rng, vocab)
    seen_lengths = set()
    for trial in range(40):
        tree = build_tree(["mc_sim_7b_63", "kary-3-3", "chain-4"][trial % 3])
        rule = RULES_UNDER_TEST[trial % len(RULES_UNDER_TEST)]
        filters = [dict(), dict(temperature=0.7, top_k=6, top_p=0.8)][trial % 2]
        logits, tokens, ids, probs, uniforms = batch_case(rng, tree, n, vocab, k)

        def run(rows):
            if greedy:
                return accept_greedy_batch(tree, tokens[rows], logits[rows], rule, table)
            return accept_sampling_batch(tree, tokens[rows], logits[rows], ids[rows], probs[rows], rule,
                                         uniforms[rows], table, **filters)

        batch = run(slice(None))
        for i in range(n):
            one = run(slice(i, i + 1))
            for field in ("path", "accepted", "next_token", "decisions"):
                np.testing.assert_array_equal(getattr(batch, field)[i], getattr(one, field)[0],
                                              err_msg=f"trial {trial} image {i} {field}")
        seen_lengths.update(batch.accepted.tolist())
        # the record is consistent: the path's nodes are exactly the decisions marked 1
        for i in range(n):
            on_path = set(batch.path[i][batch.path[i] >= 0].tolist())
            assert on_path == set(np.flatnonzero(batch.decisions[i] == 1).tolist())
            assert len(on_path) == batch.accepted[i] + 1
    assert len(seen_lengths) >= 3  # the cases reach several depths


def test_sparse_candidates_equal_the_dense_distribution():
    """Sampling acceptance over the drafter's sparse top-K equals the same q written densely."""
    rng = np.random.default_rng(5)
    vocab, k = 16, 5
    table = neighbor_table(rng, vocab)
    tree = build_tree("kary-2-3")
    for trial in range(60):
        rule = RULES_UNDER_TEST[trial % len(RULES_UNDER_TEST)]
        logits, tokens, ids, probs, uniforms = batch_case(rng, tree, 1, vocab, k)
        dense = np.zeros((1, tree.num_nodes, vocab))
        np.put_along_axis(dense, ids, probs, axis=2)
        all_ids = np.broadcast_to(np.arange(vocab), dense.shape)
        a = accept_sampling_batch(tree, tokens, logits, ids, probs, rule, uniforms, table)
        b = accept_sampling_batch(tree, tokens, logits, all_ids, dense, rule, uniforms, table)
        for field in ("path", "accepted", "next_token", "decisions"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=f"trial {trial} {field}")
