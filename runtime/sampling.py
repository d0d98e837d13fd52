"""How tokens are chosen: greedy, or sampling with temperature / top-k / top-p. One object per
generation, chosen once; the decoding loop asks it to draw a token, to pick a node's children
from the drafter's candidates, and to run acceptance, and never checks which one it holds.

Random numbers come in as arrays of uniforms in [0, 1) from the images' own streams
(lantern.runtime.streams), so every image's choices depend on its own numbers only. Greedy
reads none.
"""
from dataclasses import dataclass

import numpy as np

from lantern.runtime import accept as acceptance, filtering


@dataclass(frozen=True)
class Greedy:
    """Argmax everywhere; acceptance without a logits processor (the public LANTERN code's greedy)."""

    temperature = 1.0
    top_k = 0
    top_p = 1.0

    def draw(self, logits, uniforms):
        """Next token per row of logits [N, V]."""
        return np.argmax(logits, axis=-1)

    def children(self, ids, probs, width, race):
        """The first `width` children of each parent: the drafter's top candidates, in rank order."""
        return ids[..., :width]

    def accept(self, tree, tokens, logits, draft_ids, draft_probs, rule, uniforms, neighbors):
        return acceptance.accept_greedy_batch(tree, tokens, logits, rule, neighbors)


@dataclass(frozen=True)
class Sampling:
    """Sampling from the filtered target distribution (lantern.runtime.filtering.filtered_probs)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        filtering.check_filters(self.temperature, self.top_k, self.top_p)

    def draw(self, logits, uniforms):
        """Next token per row of logits [N, V], by inverse CDF with one uniform per row."""
        p = filtering.filtered_probs(logits, self.temperature, self.top_k, self.top_p)
        return filtering.inverse_cdf_draw(p, uniforms)

    def children(self, ids, probs, width, race):
        """`width` children drawn from the drafter's distribution without replacement, in draw
        order, as acceptance assumes: an exponential race (candidate c arrives at -log(u_c) / q_c;
        the first `width` arrivals, in order; equivalent to Gumbel top-k). race: uniforms shaped
        like probs. Only the drawn ones are sorted."""
        with np.errstate(divide="ignore"):
            keys = -np.log(race) / probs.astype(np.float64)
        best = np.argpartition(keys, width - 1, axis=-1)[..., :width]
        best = np.take_along_axis(best, np.argsort(np.take_along_axis(keys, best, axis=-1), axis=-1, kind="stable"), -1)
        return np.take_along_axis(ids, best, axis=-1)

    def accept(self, tree, tokens, logits, draft_ids, draft_probs, rule, uniforms, neighbors):
        return acceptance.accept_sampling_batch(tree, tokens, logits, draft_ids, draft_probs, rule, uniforms, neighbors,
                                                temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


def sampler_for(greedy, temperature=1.0, top_k=0, top_p=1.0):
    return Greedy() if greedy else Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
