"""Preallocated KV caches: the K/V buffers (owned by the backend, on its device), which slots each
batch row may attend to, and how many slots each row has filled. One object per model (target,
drafter); which class is the engine's choice, made once from its graph contracts (`cache_layout`):

  KVCache         plain graphs: a call reads the cache through per-layer views and returns only
                  its new tokens' K/V; `append` and `write` copy the entries the loop keeps.
  InPlaceKVCache  in-place graphs (Manifest.inplace_cache): a call writes its new tokens' K/V into
                  the cache itself, at slots write_index[b] .. + T - 1 of row b, and attends over
                  the whole static cache; `append` and `write` only move what is not already
                  where it belongs: the accepted path of a tree, with the engine's commit graph,
                  on the backend's device (nothing crosses to the host).

The loop uses both the same way: before a call `mask_into(call, extra)` writes the call's
attention mask (visible slots, `extra`, and the call's own block `call.block` [B, T, T] among
its new tokens) and, in place, its write_index; after it `append`/`write` keep entries.
"""
import numpy as np

from lantern.runtime.errors import LanternError
from lantern.runtime.contracts import cache_feeds


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

    def mask_columns(self, tokens):
        """Columns of a call's attention mask: the cache slots, then its new tokens."""
        return self.capacity + tokens

    def block_of(self, mask):
        """Where a call's block (its new tokens among themselves, [B, T, T]) lives: here the
        mask's last T columns, so writing the block writes the mask."""
        return mask[:, 0, :, self.capacity:]

    def mask_into(self, call, extra=None):
        """The cache columns of the call's mask [B, 1, T, capacity + T], in place: the rows'
        visible slots, or-ed with extra [T, capacity] (e.g. a node's ancestors in scratch slots).
        Its block columns are call.block itself."""
        cache = call.feeds["attention_mask"][:, 0, :, : self.capacity]
        cache[:] = self.visible[:, None, :]
        if extra is not None:
            cache |= extra

    def append(self, call, out, rows, src, counts, visible=None):
        """Row rows[i] keeps the call's new entries src[i, :counts[i]] in its next free slots.
        visible [len(rows), max count]: which of them later tokens may see (default: all).
        Returns the engine calls it made (the in-place form's commit graph; none here)."""
        counts = np.asarray(counts, dtype=np.int64)
        keep = np.arange(src.shape[1])[None, :] < counts[:, None]
        r = np.repeat(rows, counts)
        dst = self.length[r] + np.nonzero(keep)[1]
        self.backend.commit(self.keys, out["new_keys"], r, src[keep], dst)
        self.backend.commit(self.values, out["new_values"], r, src[keep], dst)
        self.visible[r, dst] = True if visible is None else visible[keep]
        self.length[rows] += counts
        return 0

    def write(self, call, out, rows, src, slots):
        """Entries (rows[i], src[i]) to fixed slots[i], visibility unchanged (the drafter's
        scratch slots for the current tree, which only the tree mask exposes)."""
        self.backend.commit(self.keys, out["new_keys"], rows, src, slots)
        self.backend.commit(self.values, out["new_values"], rows, src, slots)


class InPlaceKVCache(KVCache):
    """A static cache the graphs update in place (see the module docstring). A call's new entry j
    of row b sits at slot write_index[b] + j once the call ran: appended after the row's
    committed entries (write_index = length), or at the call's fixed `first_slot` (the drafter's
    scratch slots). `commit` is the plan's commit Call (target cache of a plan that drafts): it
    moves entries to contiguous slots from each row's length, in place on the device."""

    commit = None

    def mask_columns(self, tokens):
        return self.capacity

    def block_of(self, mask):
        """The block is placed per call, at the slots its tokens are written to: a buffer of its own."""
        return np.zeros(mask.shape[:1] + mask.shape[2:3] * 2, dtype=bool)

    def mask_into(self, call, extra=None):
        """The call's whole mask [B, 1, T, capacity]: visible slots (| extra), then call.block at
        the slots the call writes; and its write_index."""
        B, T = call.block.shape[:2]
        start = self.length if call.first_slot is None else np.full(B, call.first_slot, dtype=np.int64)
        if start.max() + T > self.capacity:
            raise LanternError(f"a call of {T} tokens at slot {start.max()} overruns the static cache of "
                               f"{self.capacity} slots; the engine's budget (manifest inplace_cache) is too small")
        call.feeds["write_index"][:] = start
        mask = call.feeds["attention_mask"][:, 0]
        mask[:] = self.visible[:, None, :]
        if extra is not None:
            mask |= extra
        slots = start[:, None] + np.arange(T)
        mask[np.arange(B)[:, None, None], np.arange(T)[None, :, None], slots[:, None, :]] = call.block

    def append(self, call, out, rows, src, counts, visible=None):
        counts = np.asarray(counts, dtype=np.int64)
        keep = np.arange(src.shape[1])[None, :] < counts[:, None]
        r = np.repeat(rows, counts)
        j = np.nonzero(keep)[1]
        written = call.feeds["write_index"][r] + src[keep]
        dst = self.length[r] + j
        moved = not np.array_equal(written, dst)
        if moved:
            self._move(r, j, written)
        self.visible[r, dst] = True if visible is None else visible[keep]
        self.length[rows] += counts
        return int(moved)

    def write(self, call, out, rows, src, slots):
        if not np.array_equal(call.feeds["write_index"][rows] + src, slots):
            raise RuntimeError("in-place cache: a write to slots other than those the call wrote")

    def _move(self, rows, index, src_slots):
        """Entry `index` of row `rows[i]` from slot src_slots[i] to slot length + index[i], every
        row at once, with the commit graph: rows and entries not named stay (they copy onto
        themselves)."""
        if self.commit is None:
            raise RuntimeError("in-place cache: accepted entries to move, but the plan has no commit call")
        feeds = self.commit.feeds
        width = feeds["src_slots"].shape[1]
        feeds["write_index"][:] = self.length
        feeds["src_slots"][:] = self.length[:, None] + np.arange(width)
        feeds["src_slots"][rows, index] = src_slots
        self.backend.run(self.commit)


def cache_layout(manifest, prefix, tree, drafter=True):
    """How a generation's caches are laid out on this engine: (cache class, the prefix as the
    caches hold it, target slots, drafter slots (0 when the tree's drafts come without drafter
    calls)).

    Plain graphs: caches sized per generation, the prefix as it is: target C + image tokens;
    drafter image tokens + the tree's M - 1 nodes (scratch). In-place graphs: the static sizes
    the engine was exported with; the prefix is left-padded to the budget's prefix slots (so every
    prefix sits in the same slots and the prefill has one shape), and the generation must fit."""
    s = manifest.inplace_cache
    if s is None:
        return KVCache, prefix, prefix.tokens + prefix.length, (prefix.length + tree.num_nodes - 1) * drafter
    fix = "re-export it with `lantern-export onnx --attention inplace` and a larger"
    if prefix.tokens > s.prefix:
        raise LanternError(f"the prompt takes {prefix.tokens} tokens; this engine's static cache holds prompts of at "
                           f"most {s.prefix} ({fix} --max-prompt-tokens, or use a plain engine)")
    if prefix.length > s.image_tokens:
        raise LanternError(f"a {prefix.grid[0]}x{prefix.grid[1]} grid takes {prefix.length} tokens; this engine's "
                           f"static cache holds {s.image_tokens} (generate a smaller grid, or use a plain engine)")
    if tree.num_nodes > s.tree_nodes and not drafter:  # a drafter-free window: its slots are its tokens
        raise LanternError(f"a jacobi window of {tree.num_nodes} slots does not fit this engine's static cache, which "
                           f"verifies at most {s.tree_nodes} tokens per step (use --window {s.tree_nodes} or less, or "
                           f"{fix[0].lower() + fix[1:]} --max-tree-nodes)")
    if tree.num_nodes > s.tree_nodes:
        raise LanternError(f"tree {tree.name!r} has {tree.num_nodes} nodes; this engine's static cache holds trees of "
                           f"at most {s.tree_nodes} ({fix} --max-tree-nodes, or use a smaller tree)")
    return InPlaceKVCache, prefix.left_padded(s.prefix), s.target, s.drafter if drafter else 0
