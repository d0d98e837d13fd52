"""Step plans: every engine call a generation makes, derived once from (engine, tree, prefix).

For a tree with M nodes (root included) and depth D, N images and B batch rows (2N with CFG):

  regime    graph       tokens per row (T)
  condition condition   -                   the prefix's condition inputs -> cond_embeds
  prefill   target      C                   the prefix (condition tokens or prompt)
  verify    target      M                   root + all drafts; AR is the root-only tree (M = 1)
  draft0    drafter     D + 1               last step's accepted pairs, padded to a fixed width
  draft{d}  drafter     nodes at depth d    d = 1 .. D - 1

Every call's shapes are fixed for the whole generation, and so are its feed buffers: the loop
writes ids, positions and masks into them in place and gathers hidden states into them on the
backend's device, so a backend may bind them once (ONNX Runtime IOBinding, TensorRT tensor
addresses, CUDA graphs). Anything that depends on a step's outcome (how many pairs the last step
accepted) is padded and masked instead of changing a shape. `shapes()` lists the regimes for
TensorRT optimization profiles; `step_bytes()` estimates what a step needs so a request the
machine cannot hold is refused up front.

Caches (lantern.runtime.kvcache.cache_layout): plain graphs, target capacity C + image tokens;
drafter capacity image tokens (one slot per committed pair) + M - 1 scratch slots where the
current tree's nodes live while it is drafted. In-place graphs: the static sizes the engine was
exported with, the prefix left-padded to its budget (so prefill has one shape for every prompt),
and one more regime:
  commit    commit      -                   the accepted path's K/V moved inside the target's
                                            cache (src_slots [B, depth + 1]); only when it drafts
"""
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from lantern.runtime.errors import LanternError
from lantern.runtime.kvcache import cache_layout


@dataclass
class Call:
    graph: str
    regime: str
    feeds: dict  # input name -> buffer of the call's fixed shape
    output_shapes: dict = field(default_factory=dict)  # output name -> shape
    outputs: Optional[dict] = None  # preallocated outputs when the backend binds the call
    tokens: int = 0  # T
    block: Optional[np.ndarray] = None  # [B, T, T]: the mask among the call's new tokens (the cache places it)
    first_slot: Optional[int] = None  # where the call's new K/V go: a fixed slot on (drafter scratch), or
    # None: after each row's committed entries


class StepPlan:
    def __init__(self, manifest, backend, tree, prefix, settings, drafter=True):
        """settings: the drafter's sampling inputs {cfg_scale, temperature, top_k, top_p};
        drafter: whether the tree's drafts come from drafter calls (False: a drafter-free
        proposer fills the block, and the plan's step is the verification alone)."""
        m = manifest
        self.manifest, self.tree = m, tree
        self.drafts = drafter and tree.depth > 0
        cache_type, prefix, target_slots, drafter_slots = cache_layout(m, prefix, tree, self.drafts)
        self.images, self.rows, self.tokens = prefix.images, prefix.rows, prefix.tokens
        B, C = prefix.rows, prefix.tokens
        self.image_of_row = np.arange(B) % self.images  # [B]: the image batch row b belongs to (CFG: [cond; uncond])
        self.image_tokens = prefix.length  # tokens generated per image
        t = m.target
        self.target_cache = cache_type(backend, t.layers, B, t.kv_heads, target_slots, t.head_dim)
        self.drafter_cache = None
        self.calls = {}
        target_inputs = m.graphs["target"].inputs
        shared = {}
        if "cond_embeds" in target_inputs:
            shared["cond_embeds"] = backend.zeros((B,) + tuple(target_inputs["cond_embeds"].shape[1:]))
        if prefix.condition_feeds is not None:
            feeds = {k: np.zeros_like(v) for k, v in prefix.condition_feeds.items()}
            self.calls["condition"] = Call("condition", "condition", feeds, self._output_shapes("condition", B, 0))
        self._target_call("prefill", C, shared)
        verify = self._target_call("verify", tree.num_nodes, shared)
        verify.block[:] = tree.mask

        if self.drafts:
            d = m.drafter
            self.scratch = self.image_tokens  # first scratch slot
            self.drafter_cache = cache_type(backend, d.layers, B, d.kv_heads, drafter_slots, d.head_dim)
            pair = np.arange(B)
            if prefix.cfg:
                pair = (pair + self.images) % B  # [cond; uncond] partners
            self.cfg_partners = pair.astype(np.int64)  # the loop makes rows their own partners past cfg_interval
            self.settings = {"cfg_pair": self.cfg_partners.copy(), "cfg_scale": np.zeros(1, dtype=np.float32),
                             "temperature": np.zeros(1, dtype=np.float32), "top_k": np.zeros(1, dtype=np.int64),
                             "top_p": np.zeros(1, dtype=np.float32)}
            self._drafter_call("draft0", tree.depth + 1, backend)
            for level in tree.levels[:-1]:
                call = self._drafter_call(f"draft{level.depth}", len(level.nodes), backend)
                call.block[:] = np.eye(call.tokens, dtype=bool)
                call.first_slot = self.scratch + int(level.nodes[0]) - 1  # a depth's nodes are consecutive
            # Depth d's nodes see their ancestors at depths 1 .. d-1 in the scratch slots.
            self.scratch_ancestors = {}
            for level in tree.levels[:-1]:
                extra = np.zeros((len(level.nodes), self.drafter_cache.capacity), dtype=bool)
                anc = tree.mask[level.nodes][:, 1:] & (tree.depths[1:] < level.depth)[None, :]
                extra[:, self.scratch: self.scratch + tree.num_nodes - 1] = anc
                self.scratch_ancestors[level.depth] = extra
        if tree.depth and "commit" in m.graphs:
            self.target_cache.commit = self._commit_call(tree.depth + 1)
        self.reset(prefix, settings)

    def fits(self, prefix):
        """Whether this plan's shapes serve a prefix (same rows and prefix length, as the caches
        hold it)."""
        prefix = cache_layout(self.manifest, prefix, self.tree, self.drafts)[1]
        return (prefix.rows, prefix.tokens, prefix.images, prefix.length) == \
            (self.rows, self.tokens, self.images, self.image_tokens)

    def reset(self, prefix, settings):
        """Start a generation: empty caches, write the prefix's feeds and the sampling settings
        into the bound buffers (shapes stay)."""
        prefix = cache_layout(self.manifest, prefix, self.tree, self.drafts)[1]
        C = prefix.tokens
        self.prefix = prefix
        self.target_cache.reset()
        if self.drafter_cache is not None:
            self.drafter_cache.reset()
            for name in ("cfg_scale", "temperature", "top_k", "top_p"):
                self.settings[name][:] = settings[name]
            self.settings["cfg_pair"][:] = self.cfg_partners
        if "condition" in self.calls:
            for name, value in prefix.condition_feeds.items():
                self.calls["condition"].feeds[name][:] = value
        call = self.calls["prefill"]
        call.feeds["input_ids"][:] = prefix.ids
        call.feeds["position_ids"][:] = prefix.positions
        causal = np.tril(np.ones((C, C), dtype=bool))
        call.block[:] = causal[None] & prefix.key_visible[:, None, :] | np.eye(C, dtype=bool)
        self.target_cache.mask_into(call)

    # -- construction ------------------------------------------------------------------------------
    def _output_shapes(self, graph, rows, tokens):
        spec = self.manifest.graphs[graph].outputs
        dims = {"B": rows, "T": tokens}
        return {name: tuple(dims.get(d, d) for d in s.shape) for name, s in spec.items()}

    def _feeds(self, graph, rows, tokens, cache):
        feeds = {}
        for name, spec in self.manifest.graphs[graph].inputs.items():
            shape = {"input_ids": (rows, tokens), "position_ids": (rows, tokens), "write_index": (rows,),
                     "attention_mask": (rows, 1, tokens, cache.mask_columns(tokens))}.get(name)
            if shape is not None:
                feeds[name] = np.zeros(shape, dtype=spec.dtype)
        return feeds

    def _target_call(self, regime, tokens, shared):
        cache = self.target_cache
        feeds = self._feeds("target", self.rows, tokens, cache)
        feeds.update(shared)
        feeds.update(cache.feeds)
        call = Call("target", regime, feeds, self._output_shapes("target", self.rows, tokens), tokens=tokens,
                    block=cache.block_of(feeds["attention_mask"]))
        self.calls[regime] = call
        return call

    def _drafter_call(self, regime, tokens, backend):
        cache = self.drafter_cache
        feeds = self._feeds("drafter", self.rows, tokens, cache)
        feeds["target_hidden"] = backend.zeros((self.rows, tokens, self.manifest.target.dim))
        feeds.update(cache.feeds)
        feeds.update(self.settings)
        call = Call("drafter", regime, feeds, self._output_shapes("drafter", self.rows, tokens), tokens=tokens,
                    block=cache.block_of(feeds["attention_mask"]))
        self.calls[regime] = call
        return call

    def _commit_call(self, width):
        """The in-place target cache's commit: entries to `width` contiguous slots per row."""
        feeds = {"src_slots": np.zeros((self.rows, width), dtype=np.int64),
                 "write_index": np.zeros(self.rows, dtype=np.int64), **self.target_cache.feeds}
        call = Call("commit", "commit", feeds, self._output_shapes("commit", self.rows, 0), tokens=width)
        self.calls["commit"] = call
        return call

    # -- what the plan is --------------------------------------------------------------------------
    def shapes(self):
        """{regime: (graph, {input: shape})}: the exact shapes of every call (TensorRT profiles)."""
        return {regime: (call.graph, {name: tuple(np.shape(buf)) for name, buf in call.feeds.items()})
                for regime, call in self.calls.items()}


# ONNX Runtime's CPU arena keeps a call's intermediates in regions that grow by powers of two and
# are kept: measured 2.4-2.6x the live working memory below (tiny engine, 200 and 800 images with
# CFG; tests/test_reliability.py checks the estimate against a measured peak).
ARENA = 3


def estimate_bytes(manifest, tree, prefix, itemsize, drafter=True):
    """Bytes a generation holds at its peak, from shapes alone (before anything is allocated):
    caches and feed buffers, the largest call's outputs and working memory (attention scores and
    softmax, the MLP; ARENA times what is live), and the host's acceptance work on a step's
    logits. Weights not included."""
    _, prefix, target_slots, drafter_slots = cache_layout(manifest, prefix, tree, drafter)
    m, B, C, N = manifest, prefix.rows, prefix.tokens, prefix.images
    M = tree.num_nodes
    calls = [("target", m.target, C, target_slots), ("target", m.target, M, target_slots)]
    held = 2 * m.target.layers * B * m.target.kv_heads * target_slots * m.target.head_dim * itemsize
    if drafter and tree.depth:
        d, capacity = m.drafter, drafter_slots
        held += 2 * d.layers * B * d.kv_heads * capacity * d.head_dim * itemsize
        calls += [("drafter", d, tree.depth + 1, capacity)] + [("drafter", d, len(lv.nodes), capacity)
                                                               for lv in tree.levels[:-1]]
    peak = 0
    for graph, shape, T, capacity in calls:
        width = m.vocabulary.size if graph == "target" else 2 * (m.candidates or 1)
        outputs = B * T * (4 * width + itemsize * (shape.dim + 2 * shape.layers * shape.kv_heads * shape.head_dim))
        feeds = B * T * (capacity + T + 16)
        scores = 3 * 4 * B * shape.query_heads * T * (capacity + T)
        mlp = 3 * itemsize * B * T * shape.ffn_hidden
        mlp += 8 * 4 * B * T * shape.dim  # a layer's other activations (norms, q/k/v, RoPE, residuals)
        held += outputs + feeds  # bound outputs and feed buffers stay allocated per call
        peak = max(peak, scores + mlp)
    acceptance = 4 * N * M * m.vocabulary.codes + 8 * 6 * N * m.vocabulary.codes
    # the device step's accept graph holds every node's CFG-combined logits and their softmax terms at
    # once (about 8 [N, M, S] float32 tensors live, ARENA times in ONNX Runtime's arena)
    acceptance += ARENA * 8 * 4 * N * M * m.vocabulary.codes
    if tree.depth and not drafter:  # a drafter-free window's dense q and processed p, float64
        acceptance += 8 * 4 * N * M * m.vocabulary.codes
    return held + ARENA * peak + acceptance


def check_memory(manifest, tree, prefix, itemsize, limit, copies=1, drafter=True):
    """Refuse, in one line and before anything is allocated, `copies` step plans for `tree` and
    `prefix` (each replica of a server holds one) that `limit` bytes cannot hold, with 20% kept
    for everything else; limit None: no check."""
    need = copies * estimate_bytes(manifest, tree, prefix, itemsize, drafter)
    if limit is not None and need > 0.8 * limit:
        held = f"{copies} replicas' plans of " if copies > 1 else ""
        raise LanternError(
            f"{held}tree {tree.name!r} ({tree.num_nodes} nodes) for {prefix.images} image(s)"
            f"{' with CFG' if prefix.cfg else ''} need{'s' if copies == 1 else ''} about {need / 2**30:.2f} GiB, more "
            f"than this machine can give ({limit / 2**30:.2f} GiB available); use a smaller tree or fewer images per "
            f"call")


def decode_bytes(manifest, images, chunk, grid=None):
    """Bytes Engine.decode adds for `images` decoded `chunk` at a time: the uint8 images it
    returns and one chunk's float output and working memory (a few activations of the VQ
    decoder's full-resolution stage, ARENA times)."""
    h, w = grid or (manifest.image.grid_height, manifest.image.grid_width)
    image = manifest.image
    down = image.pixels // image.grid_width if image.pixels else 16
    pixels = h * w * down * down
    config = (manifest.vq or {}).get("config") or {}
    channels = int(config.get("ch", 128)) * int((config.get("decoder_ch_mult") or [1])[0])
    n = min(images, chunk)
    return images * pixels * 3 + n * pixels * 3 * 4 + ARENA * 4 * 4 * n * pixels * channels
