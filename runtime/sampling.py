"""How tokens are chosen: greedy, or sampling with temperature / top-k / top-p. One object per
generation, chosen once; the decoding loop asks it to draw a token, to pick a node's children
from the drafter's candidates, and to run acceptance, and never checks which one it holds.

Random numbers come only from the generation's numpy Generator, in this order per step: the
Gumbel keys of each drafter depth (sampling only), then one uniform per tree node for acceptance
(sampling only; see lantern.runtime.accept). Greedy draws none.
"""
from dataclasses import dataclass

import numpy as np

from lantern.runtime import accept as acceptance


@dataclass(frozen=True)
class Greedy:
    """Argmax everywhere; acceptance without a logits processor (the public LANTERN code's greedy)."""

    temperature = 1.0
    top_k = 0
    top_p = 1.0

    def draw(self, logits, rng):
        """Next token per row of logits [N, V]."""
        return np.argmax(logits, axis=-1)

    def children(self, ids, probs, width, rng):
        """The first `width` children of each parent: the drafter's top candidates, in rank order."""
        return ids[..., :width]

    def accept(self, tree, tokens, logits, draft_ids, draft_probs, rule, rng, neighbors):
        return acceptance.accept_greedy_batch(tree, tokens, logits, rule, neighbors)


@dataclass(frozen=True)
class Sampling:
    """Sampling from the filtered target distribution (lantern.runtime.accept.filtered_probs)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        acceptance.check_filters(self.temperature, self.top_k, self.top_p)

    def draw(self, logits, rng):
        p = acceptance.filtered_probs(logits, self.temperature, self.top_k, self.top_p)
        return acceptance.inverse_cdf_draw(p, rng.random(len(p)))

    def children(self, ids, probs, width, rng):
        """`width` children drawn from the drafter's distribution without replacement, in draw
        order (Gumbel top-k), as acceptance assumes. Only the drawn ones are sorted."""
        with np.errstate(divide="ignore"):
            keys = -(np.log(probs) + rng.gumbel(size=probs.shape))
        best = np.argpartition(keys, width - 1, axis=-1)[..., :width]
        best = np.take_along_axis(best, np.argsort(np.take_along_axis(keys, best, axis=-1), axis=-1, kind="stable"), -1)
        return np.take_along_axis(ids, best, axis=-1)

    def accept(self, tree, tokens, logits, draft_ids, draft_probs, rule, rng, neighbors):
        uniforms = rng.random(tokens.shape)
        return acceptance.accept_sampling_batch(tree, tokens, logits, draft_ids, draft_probs, rule, uniforms, neighbors,
                                                temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


def sampler_for(greedy, temperature=1.0, top_k=0, top_p=1.0):
    return Greedy() if greedy else Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
