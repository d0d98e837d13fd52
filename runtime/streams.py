"""Per-image random streams: every random number a generation uses comes from its image's own
seed, so an image's tokens do not depend on the images that share its batch, and a path that
runs the step elsewhere (a device) can read exactly the numbers the host path reads.

Seeds: `generate(seed=s)` with an int gives image i the seed s + i (one image with seed s keeps
the tokens it had when the whole batch shared one generator); a sequence gives one seed per
image, so an image generated alone with seed s equals the same image at any place in any batch
given seed s there.

Image n's stream is numpy's default_rng(seed_n) (PCG64) read as float64 uniforms in [0, 1), in
this fixed order:
    1 uniform                the first token's draw after prefill
    then one block per step, M + M * K uniforms (M tree nodes, K drafter candidates):
      accept [M]             acceptance uniforms (accept[i] decides node i; accept[0] draws the
                             step's next token; see lantern.runtime.accept)
      race [M, K]            node i's candidates' arrival times when its children are drawn
                             without replacement (exponential race: E = -log u, E / q smallest
                             first; the Gumbel top-k trick in another form)
PCG64 spends one 64-bit output per double, so S blocks drawn at once are the numbers S
step-by-step draws give: `table` hands a whole generation's blocks to a device path, indexed by
each image's own step counter (an image is active from step 0 until it is done, so its step
counter is the loop's). Greedy decoding reads none of them.
"""
from dataclasses import dataclass

import numpy as np

from lantern.runtime.errors import LanternError


def image_seeds(seed, images):
    """One seed per image: an int s means s, s + 1, ...; a sequence must hold one int >= 0 per image."""
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, (bool, np.bool_)):
        if seed < 0:
            raise LanternError(f"seed must be an integer >= 0, got {seed!r}")
        return [int(seed) + i for i in range(images)]
    if isinstance(seed, (str, bytes)) or not hasattr(seed, "__len__"):
        raise LanternError(f"seed must be an integer >= 0 or one such integer per image, got {seed!r}")
    seeds = list(seed)
    if len(seeds) != images:
        raise LanternError(f"{len(seeds)} seeds given for {images} image(s); give one seed per image or one int")
    for s in seeds:
        if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)) or s < 0:
            raise LanternError(f"every seed must be an integer >= 0, got {s!r}")
    return [int(s) for s in seeds]


@dataclass(frozen=True)
class StepDraws:
    """One step's random numbers for every image of a batch."""

    accept: np.ndarray  # [N, M] float64
    race: np.ndarray  # [N, M, K] float64


class RandomStreams:
    """The generation's streams, one numpy Generator per image, read in the order above."""

    def __init__(self, seeds, nodes, candidates):
        self.generators = [np.random.default_rng(s) for s in seeds]
        self.nodes, self.candidates = nodes, candidates

    @property
    def block(self):
        """Uniforms per image per step."""
        return self.nodes * (1 + self.candidates)

    def first(self):
        """The first token's uniform per image [N]."""
        return np.array([g.random() for g in self.generators])

    def step(self):
        """The next step's draws for every image (finished images' streams advance unread)."""
        return self.split(np.stack([g.random(self.block) for g in self.generators]))

    def table(self, steps):
        """The next `steps` blocks per image at once [N, steps, block], the numbers `steps`
        calls of step() would give."""
        return np.stack([g.random((steps, self.block)) for g in self.generators])

    def split(self, blocks):
        """Blocks [..., block] -> StepDraws with the same leading dimensions."""
        M, K = self.nodes, self.candidates
        lead = blocks.shape[:-1]
        return StepDraws(accept=blocks[..., :M], race=blocks[..., M:].reshape(lead + (M, K)))
