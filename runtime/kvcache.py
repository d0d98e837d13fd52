"""A preallocated KV cache: the K/V buffers (owned by the backend, on its device), which slots each
batch row may attend to, and how many slots each row has filled. One class serves the target and
the drafter. Engine graphs read the cache in place through per-layer views (`feeds`) and return
only the new tokens' K/V; `append` and `write` copy the entries the loop keeps.
"""
import numpy as np

from lantern.runtime.manifest import cache_feeds


class KVCache:
    def __init__(self, backend, layers, rows, kv_heads, capacity, head_dim):
        shape = (layers, rows, kv_heads, capacity, head_dim)
        self.backend = backend
        self.keys = backend.zeros(shape)
        self.values = backend.zeros(shape)
        self.capacity = capacity
        self.visible = np.zeros((rows, capacity), dtype=bool)
        self.length = np.zeros(rows, dtype=np.int64)  # appended slots per row
        self.feeds = cache_feeds(self.keys, self.values)  # per-layer views, made once

    @property
    def nbytes(self):
        return 2 * int(np.prod(self.keys.shape)) * np.dtype(self.backend.float_dtype).itemsize

    def reset(self):
        """Empty it for a new generation (stale K/V stay, invisible)."""
        self.visible[:] = False
        self.length[:] = 0

    def append(self, new_keys, new_values, rows, src, counts, visible=None):
        """Row rows[i] keeps the call's new entries src[i, :counts[i]] in its next free slots.
        visible [len(rows), max count]: which of them later tokens may see (default: all)."""
        counts = np.asarray(counts, dtype=np.int64)
        keep = np.arange(src.shape[1])[None, :] < counts[:, None]
        r = np.repeat(rows, counts)
        dst = self.length[r] + np.nonzero(keep)[1]
        self.backend.commit(self.keys, new_keys, r, src[keep], dst)
        self.backend.commit(self.values, new_values, r, src[keep], dst)
        self.visible[r, dst] = True if visible is None else visible[keep]
        self.length[rows] += counts

    def write(self, new_keys, new_values, rows, src, slots):
        """Entries (rows[i], src[i]) to fixed slots[i], visibility unchanged (the drafter's
        scratch slots for the current tree, which only the tree mask exposes)."""
        self.backend.commit(self.keys, new_keys, rows, src, slots)
        self.backend.commit(self.values, new_values, rows, src, slots)

    def mask_into(self, mask, extra=None):
        """The cache columns of an attention mask [B, 1, T, capacity + T], in place: the rows'
        visible slots, or-ed with extra [T, capacity] (e.g. a node's ancestors in scratch slots)."""
        cache = mask[:, 0, :, : self.capacity]
        cache[:] = self.visible[:, None, :]
        if extra is not None:
            cache |= extra
