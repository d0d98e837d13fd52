"""The target distribution a sampler draws from, the one definition for every step (the host's
acceptance, the jacobi window's re-drafts, the samplers of lantern.runtime.sampling) and what the
step graphs' acceptance filters are tested against.

filtered_probs(logits, temperature, top_k, top_p): logits / T, keep the top-k (ties with the
k-th value kept, as LlamaGen does), keep the nucleus (the smallest set, by decreasing
probability, whose mass reaches top_p), renormalise; in float64. inverse_cdf_draw(p, u): one
token per row from a uniform, never a token of probability zero.
"""
import math

import numpy as np

from lantern.runtime.errors import LanternError


def filtered_probs(logits, temperature=1.0, top_k=0, top_p=1.0):
    """Probabilities [..., V] (float64) from logits [..., V]: logits / temperature, keep the
    top_k (0 = all; ties with the k-th value kept), keep the smallest set of highest
    probabilities whose mass reaches top_p (1 = all), renormalise."""
    check_filters(temperature, top_k, top_p)
    logits = np.asarray(logits)
    z = logits.astype(np.float64) / temperature
    vocab = z.shape[-1]
    if 0 < top_k < vocab:
        kth = np.partition(z, vocab - top_k, axis=-1)[..., vocab - top_k, None]
        z = np.where(z >= kth, z, -np.inf)
    m = z.max(axis=-1, keepdims=True)
    if not np.isfinite(m).all():
        raise LanternError("logits contain NaN or +inf, or are all -inf")
    p = np.exp(z - m)
    p /= p.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")  # stable: equal probabilities by id; zeros last
        ranked = np.take_along_axis(p, order, axis=-1)
        before = np.zeros_like(ranked)  # mass strictly above each entry
        np.cumsum(ranked[..., :-1], axis=-1, out=before[..., 1:])
        drop = np.zeros(p.shape, dtype=bool)
        np.put_along_axis(drop, order, before >= top_p, axis=-1)
        p[drop] = 0.0
        p /= p.sum(axis=-1, keepdims=True)
    return p


def check_filters(temperature, top_k, top_p):
    if not (isinstance(temperature, (int, float, np.floating)) and not isinstance(temperature, bool)
            and 0 < temperature < math.inf):
        raise LanternError(f"temperature must be > 0 and finite, got {temperature!r}")
    if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise LanternError(f"top_k must be an integer >= 0 (0 = no top-k), got {top_k!r}")
    if not (isinstance(top_p, (int, float, np.floating)) and not isinstance(top_p, bool) and 0 < top_p <= 1):
        raise LanternError(f"top_p must be in (0, 1] (1 = no nucleus filter), got {top_p!r}")


def inverse_cdf_draw(p, u):
    """Inverse-CDF draw per row; zero-probability tokens are never returned."""
    cdf = np.cumsum(p, axis=1)
    i = (cdf <= (u * cdf[:, -1])[:, None]).sum(axis=1)
    last = p.shape[1] - 1 - np.argmax(p[:, ::-1] > 0, axis=1)
    return np.minimum(i, last)
