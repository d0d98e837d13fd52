"""The drafter-free proposer: speculative Jacobi decoding (SJD) over a static window.

Each step verifies a window of W slots in one target call: slot 0 is the root (the token the last
step emitted), slots 1..W-1 drafts for the next W-1 body indices, causal among themselves (a
chain). Nothing but the target runs, so an engine exported without a drafter serves it.

Where the drafts come from (q is always the distribution a draft was actually drawn from, so
`exact` is lossless: greedy gives AR's tokens, sampling the target's distribution):
  re-drafts  after acceptance stopped at slot a, the verification's rows a+1..W-1 predicted the
             next body indices (on a context that held rejected drafts): each is drawn from that
             row's processed p (greedy: its argmax) and offered again one step later, q = that p
  fresh      the slots no row predicted (all of them after a fully accepted window):
               random   a uniform random image code, q one-hot at it (SJD)
               uniform  the same draw, q uniform over the image codes (SJD-PAC)
               spatial  the code one grid row above (left on the first row), q one-hot at it
  forced     a body index with a forced token (Lumina-mGPT's line ends) drafts it with q one-hot,
             so acceptance takes it outright
Random numbers come from each image's own stream, two uniforms per slot per step ([.., 0] a
fresh draft, [.., 1] a re-draft's draw), so an image's tokens depend on its seed and settings
only, and each image advances by its own accepted length.
"""
import numpy as np

from lantern.runtime.filtering import filtered_probs, inverse_cdf_draw
from lantern.runtime.errors import LanternError
from lantern.runtime.sampling import Greedy
from lantern.runtime.tree import build_tree, MAX_DEPTH

INITS = ("random", "uniform", "spatial")
# Measured (tools/bench/jacobi.py and the closing note of this change): on 2 CPU cores at GPT-B's
# cost, one image, a 6-slot window was the fastest (exact 1.09x, lantern++ 1.27x over AR; 8 slots
# 0.99x / 1.12x, 16 slots 0.58x / 0.75x: the CPU computes every verified token). On a GPU, where
# a 16-token verification costs about one token's, 16 slots save more steps (2.0x against 1.8x).
DEFAULT_WINDOW = 6
MIN_WINDOW, MAX_WINDOW = 2, MAX_DEPTH + 1


def check_window(window, init):
    if isinstance(window, (bool, np.bool_)) or not isinstance(window, (int, np.integer)) \
            or not MIN_WINDOW <= window <= MAX_WINDOW:
        raise LanternError(f"window must be an integer in [{MIN_WINDOW}, {MAX_WINDOW}] (slots per verification, the "
                           f"root included), got {window!r}")
    if init not in INITS:
        raise LanternError(f"unknown window initialisation {init!r}; valid: {', '.join(INITS)}")


class JacobiWindow:
    name = "jacobi"
    drafter = False  # no drafter calls: the plan's only step call is the target's verification
    candidates = 2  # uniforms per slot per step

    def __init__(self, window, init, manifest):
        check_window(window, init)
        self.window, self.init = int(window), init
        self.tree = build_tree(f"chain-{self.window - 1}")

    def q_buffers(self, images, view):
        """q dense over the view's columns: ids are every column (a read-only view, no copy)."""
        M, S = self.window, view.size
        return np.broadcast_to(np.arange(S), (images, M, S)), np.zeros((images, M, S))

    def start(self, d, prefill_out):
        W = self.window
        self.drafts = np.zeros((d.N, W - 1), dtype=np.int64)  # columns of the re-drafts
        self.q = np.zeros((d.N, W - 1, d.view.size))  # their q
        self.kept = np.zeros(d.N, dtype=np.int64)  # re-drafts per image (slots 1..kept)
        h = d.plan.prefix.grid[0]
        self.stride = max(d.length // max(h, 1), 1)  # body tokens per grid row (Lumina counts its line ends)

    def adopt(self, other, image, n):
        """Image `image` of another window's state (re-drafts, their q, how many) as image n."""
        self.drafts[n], self.q[n], self.kept[n] = other.drafts[image], other.q[image], other.kept[image]

    def propose(self, d, active, race):
        """Node tokens and q for the window: re-drafts first, fresh drafts after, forced
        tokens where the grammar puts them."""
        N, W, view, codes = d.N, self.window, d.view, d.view.codes
        root = d.count - 1
        d.node_tokens[:, 0] = d.tokens[np.arange(N), root]
        self.race = race
        slot = np.arange(1, W)[None, :]  # [1, W-1]
        redraft = slot <= self.kept[:, None]
        fresh = np.minimum((race[:, 1:, 0] * codes).astype(np.int64), codes - 1)
        if self.init == "spatial":
            fresh = self._spatial(d, redraft, fresh)
        cols = np.where(redraft, self.drafts, fresh)
        q = d.cand_probs  # node i holds the q of slot i + 1 (the distribution node i's child was drawn from)
        q[:, :-1] = np.where(redraft[:, :, None], self.q, 0.0)  # every row rewritten: no buffer-wide clear
        q[:, -1] = 0.0
        n, i = np.nonzero(~redraft)
        if self.init == "uniform":
            q[n, i, :codes] = 1.0 / codes
        else:
            q[n, i, cols[n, i]] = 1.0
        forced = view.forced_at(root[:, None] + slot)
        n, i = np.nonzero(forced >= 0)
        cols[n, i] = forced[n, i]
        q[n, i] = 0.0
        q[n, i, forced[n, i]] = 1.0
        d.node_tokens[:, 1:] = view.ids(cols)

    def _spatial(self, d, redraft, fresh):
        """The code one grid row above each slot (left on the first row), from the emitted tokens
        or from the window's slots before it; a random code where that is not an image code."""
        view, W = d.view, self.window
        body = d.count[:, None] - 1 + np.arange(1, W)[None, :]  # each slot's body index
        source = np.where(body >= self.stride, body - self.stride, body - 1)
        cols = fresh.copy()
        rows = np.arange(d.N)
        for i in range(W - 1):
            s = source[:, i]
            emitted = s < d.count
            from_window = np.clip(s - d.count, 0, W - 2)  # slot s sits at window column s - count
            seen = np.where(emitted, view.columns(d.tokens[rows, np.clip(s, 0, d.length - 1)]),
                            np.where(redraft[rows, from_window], self.drafts[rows, from_window], cols[rows, from_window]))
            ok = (s >= 0) & (seen >= 0) & (seen < view.codes)
            cols[:, i] = np.where(ok, seen, fresh[:, i])
        return cols

    def commit(self, d, active, outcome, emitted, emit, rows, cols, out, logits):
        """Re-drafts for the next window: row a + i of this verification predicted slot i of the
        next one (a: the image's accepted drafts), drawn from its processed p (greedy: argmax)."""
        a = np.flatnonzero(active)
        W = self.window
        later = logits[a, 1:]  # rows 1..W-1 of the active images [n, W-1, S]
        if isinstance(d.sampler, Greedy):
            draws = np.argmax(later, axis=-1)
            p = None
        else:
            s = d.sampler
            p = filtered_probs(later, s.temperature, s.top_k, s.top_p)
            draws = inverse_cdf_draw(p.reshape(-1, p.shape[-1]), self.race[a, 1:, 1].reshape(-1)).reshape(p.shape[:-1])
        row = outcome.accepted[:, None] + np.arange(1, W)[None, :]  # [n, W-1]: rows 1..W-1 as the next slots
        valid = row <= W - 1
        take = np.clip(row - 1, 0, W - 2)
        picked = np.take_along_axis(draws, take, axis=1)
        self.kept[a] = valid.sum(axis=1)
        self.drafts[a] = np.where(valid, picked, 0)
        if p is None:  # greedy reads no q; keep one-hot rows so the buffers stay a distribution
            self.q[a] = 0.0
            n, i = np.nonzero(valid)
            self.q[a[n], i, picked[n, i]] = 1.0
        else:
            self.q[a] = np.where(valid[:, :, None], np.take_along_axis(p, take[:, :, None], axis=1), 0.0)

