"""Proposers: what fills a step's static block of drafts before the target verifies it (the seam
of docs/step.md). The decoding loop (lantern.runtime.generator) owns the block's buffers and
asks its proposer, once per step:

    start(d, prefill_out)                 after prefill drew the first token
    propose(d, active, race)              fill d.node_tokens [N, M] (node 0 the root, the token
                                          the last step emitted) and q: d.cand_ids / d.cand_probs
                                          [N, M, K], per node the distribution its children were
                                          drawn from (sparse ids and probabilities; K = the view's
                                          columns for a dense q)
    commit(d, active, outcome, emitted, emit, rows, cols, out, logits)
                                          keep what the next step needs, after acceptance and
                                          the target cache's commit
    adopt(other, image, n)                image `image` of another proposer's state (a joiner
                                          prefilled on its own: lantern.runtime.continuous) as
                                          this one's image n

A proposer fixes the block's structure (`tree`: parents, depths, mask; a constant of the plan),
whether the plan makes drafter calls (`drafter`), and how many uniforms per node it reads from
the images' streams (`candidates`). Acceptance is the rule's, whatever proposed: `exact` stays
lossless because q is the distribution each draft was actually drawn from.

Proposers: `tree`, the drafter's static tree (LANTERN/EAGLE; this module), and `jacobi`, a
drafter-free window (lantern.runtime.jacobi). `ar` is the step with no drafts: the root-only
tree under `tree`.
"""
import numpy as np

from lantern.runtime.errors import LanternError
from lantern.runtime.jacobi import JacobiWindow


class DraftTree:
    """The drafter's static tree. One drafter call per depth above the leaves:
      draft0   over the pairs the last step accepted, (h_t, x_{t+1}) with the target's own hidden
               states, ending with the root, whose candidates fill depth 1
      draft{d} over depth d's nodes (fed the drafter's own hidden states)
    Each node's children are the drafter's top candidates (greedy) or drawn from them without
    replacement (sampling), so q is the drafter's top-K probabilities per node."""

    name = "tree"
    drafter = True

    def __init__(self, tree, manifest):
        self.tree = tree
        self.candidates = manifest.candidates if tree.depth else 0  # AR: no drafts, no candidates
        self.pending = None  # [N]: draft0's real pairs per image

    def q_buffers(self, images, view):
        """q sparse: the drafter's top-K ids (as view columns) and probabilities per node."""
        shape = (images, self.tree.num_nodes, self.candidates)
        return np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.float32)

    def start(self, d, prefill_out):
        self.pending = np.ones(d.N, dtype=np.int64)
        if self.tree.depth:  # the first pair: the last prefix token's hidden state with the first image token
            C = d.plan.prefix.tokens
            self.set_pending(d, prefill_out["hidden"], np.full((d.B, 1), C - 1), d.tokens[:, :1],
                             np.ones(d.N, np.int64))

    def adopt(self, other, image, n):
        """draft0's pairs live in the plan's feeds (copied with its rows); here only their count."""
        self.pending[n] = other.pending[image]

    def set_pending(self, d, hidden, cols, tokens, counts):
        """draft0's feeds for the next step: pairs (hidden[b, cols[b, j]], tokens[n, j]) for
        j < counts[n], padded to the call's fixed width with rows that see only themselves. Pair j
        takes the position of its token, whose cache slot is (root slot - counts + 1 + j)."""
        call = d.plan.calls["draft0"]
        W, B = call.tokens, d.B
        real = np.arange(W)[None, :] < counts[:, None]  # [N, W]
        padded = np.zeros((B, W), dtype=np.int64)
        padded[:, : cols.shape[1]] = cols
        d.backend.gather(hidden, np.broadcast_to(np.arange(B)[:, None], (B, W)), padded, call.feeds["target_hidden"])
        ids = np.zeros((d.N, W), dtype=np.int64)
        ids[:, : tokens.shape[1]] = tokens
        call.feeds["input_ids"][:] = np.where(real, ids, 0)[d.image_of_row]
        first = d.plan.target_cache.length - counts[d.image_of_row] + 1
        call.feeds["position_ids"][:] = d.positions(first[:, None] + np.arange(W)[None, :])
        call.block[:] = np.tril(np.ones((W, W), dtype=bool))[None] & real[d.image_of_row][:, None, :] | np.eye(W, dtype=bool)
        self.pending = counts

    def propose(self, d, active, race):
        """The tree's drafts and every node's candidates; race [N, M, K]: the uniforms that draw
        each node's children."""
        tree, plan, N, B = self.tree, d.plan, d.N, d.B
        d.node_tokens[:, 0] = d.tokens[np.arange(N), d.count - 1]
        if not tree.depth:
            return
        cache = plan.drafter_cache
        if d.cfg and d.cfg_interval >= 0:
            # Past the interval an image drafts from its conditional logits alone: its rows become
            # their own CFG partners (l + s * (l - l) = l), image by image, so batch mates never
            # change its drafts. The buffer is shared by every drafter call.
            late = (d.count >= d.cfg_interval)[d.image_of_row]
            plan.settings["cfg_pair"][:] = np.where(late, np.arange(B), plan.cfg_partners)
        call = plan.calls["draft0"]
        cache.mask_into(call)
        out = d.call("draft0")
        rows = np.flatnonzero(active[d.image_of_row])
        cache.append(call, out, rows,
                     np.broadcast_to(np.arange(call.tokens), (len(rows), call.tokens)), self.pending[d.image_of_row[rows]])
        last = self.pending - 1
        self.take_candidates(d, out, [0], last[:, None])
        parent_ids = d.sampler.children(d.cand_ids[:, :1], d.cand_probs[:, :1], tree.levels[0].width, race[:, :1])
        hidden, parent_cols = out["hidden_out"], last[d.image_of_row][:, None]
        root_slot = plan.target_cache.length
        for level in tree.levels:
            d.node_tokens[:, level.nodes] = d.view.ids(parent_ids[:, level.slots, level.ranks])
            self.force_drafts(d, level)
            if level.depth == tree.depth:
                break
            call = plan.calls[f"draft{level.depth}"]
            T = call.tokens
            cols = np.broadcast_to(parent_cols if level.depth == 1 else level.slots[None, :], (B, T))
            d.backend.gather(hidden, np.broadcast_to(np.arange(B)[:, None], (B, T)), cols, call.feeds["target_hidden"])
            call.feeds["input_ids"][:] = d.node_tokens[:, level.nodes][d.image_of_row]
            call.feeds["position_ids"][:] = d.positions(np.broadcast_to(root_slot[:, None] + level.depth, (B, T)))
            cache.mask_into(call, plan.scratch_ancestors[level.depth])
            out = d.call(call.regime)
            cache.write(call, out, np.repeat(np.arange(B), T), np.tile(np.arange(T), B),
                        np.tile(plan.scratch + level.nodes - 1, B))
            self.take_candidates(d, out, level.nodes, np.arange(T)[None, :])
            parent_ids = d.sampler.children(d.cand_ids[:, level.nodes], d.cand_probs[:, level.nodes],
                                            tree.levels[level.depth].width, race[:, level.nodes])
            hidden = out["hidden_out"]

    @staticmethod
    def take_candidates(d, out, nodes, cols):
        """The drafter's top-K (as view columns) of the conditional rows at columns cols [N, n]."""
        n = np.arange(d.N)[:, None]
        d.cand_ids[:, nodes] = d.view.columns(d.backend.numpy(out["topk_ids"])[n, cols])
        d.cand_probs[:, nodes] = d.backend.numpy(out["topk_probs"])[n, cols]

    @staticmethod
    def force_drafts(d, level):
        """Where a depth's body index has a forced token, every draft there is that token, drawn
        by the drafter with probability 1, so acceptance takes it outright."""
        column = d.view.forced_at(d.count - 1 + level.depth)
        images = np.flatnonzero(column >= 0)
        if images.size == 0:
            return
        d.node_tokens[images[:, None], level.nodes[None, :]] = d.view.ids(column[images])[:, None]
        parents = np.unique(level.parents)[None, :]
        d.cand_ids[images[:, None], parents] = column[images][:, None, None]
        d.cand_probs[images[:, None], parents] = 0.0
        d.cand_probs[images[:, None], parents, 0] = 1.0

    def commit(self, d, active, outcome, emitted, emit, rows, cols, out, logits):
        """The accepted path's (hidden state, token) pairs feed the next draft0; finished images
        keep a dummy pair, never committed."""
        if not self.tree.depth:
            return
        a = np.flatnonzero(active)
        counts = np.ones(d.N, dtype=np.int64)
        counts[a] = np.maximum(emit, 1)
        tokens = np.zeros((d.N, self.tree.depth + 1), dtype=np.int64)
        tokens[a] = emitted
        all_cols = np.zeros((d.B, self.tree.depth + 1), dtype=np.int64)
        all_cols[rows] = cols
        self.set_pending(d, out["hidden"], all_cols, tokens, counts)


PROPOSERS = ("tree", "jacobi")


def proposer_for(name, tree, manifest, settings):
    """The proposer a generation runs: `tree` over the drafter's static tree (the root-only tree
    for ar), `jacobi` over a window of settings.window slots."""
    if name == "tree":
        return DraftTree(tree, manifest)
    if name == "jacobi":
        return JacobiWindow(settings.window, settings.init, manifest)
    raise LanternError(f"unknown proposer {name!r}; valid: {', '.join(PROPOSERS)}")
