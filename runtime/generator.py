"""The decoding loop: AR and static-tree speculative decoding (exact, LANTERN, LANTERN++) around
engine calls. Open an engine directory once, generate many times:

    engine = Engine("engines/demo")                      # onnxruntime on the CPU by default
    out = engine.generate(classes=[3, 7], mode="lantern++", lam=2.0, k=100, cfg_scale=4.0)
    out.tokens        # [images, block_size] VQ codes
    out.stats         # steps, mean accepted length, time per phase
    engine.decode(out.tokens)  # uint8 images [N, H, W, 3] when the engine has a VQ decoder

One speculative step (DESIGN.md "One decoding step"):
  draft   depth 0: one drafter call over the pairs the last step accepted, (h_t, x_{t+1}) with
          the target's own hidden states; it ends with the root, whose top-k fills depth 1. Then
          one call per depth over that depth's nodes (fed the drafter's own hidden states).
  verify  one target call over [root + all nodes], positions = past + depth, mask = cache + tree
  accept  the rule per image (lantern.runtime.accept) -> accepted path + next token
  commit  the accepted path's K/V into the target cache; its pairs go to the next depth-0 call

Caches are preallocated per call and owned by the backend: target [L, B, H, P, hd] with
P = cls_token_num + block_size; drafter [1, B, H, block_size + nodes, hd], whose last slots are
scratch space for the current tree. A boolean per slot says which cache entries a query may see
(padded caption tokens never become visible). With CFG the batch is [cond; uncond] and both
halves get the same tokens.
"""
import os
import time
from dataclasses import dataclass, field

import numpy as np

from lantern.runtime import accept as acceptance
from lantern.runtime.backends import open_backend
from lantern.runtime.errors import LanternError
from lantern.runtime.manifest import cache_feeds, read_manifest
from lantern.runtime.tree import build_tree

MODES = ("ar", "exact", "lantern", "lantern++")
DEFAULT_K = 100


@dataclass
class Generation:
    tokens: np.ndarray  # [N, block_size] int64
    stats: dict = field(default_factory=dict)


class Engine:
    """An engine directory opened on one backend. Holds no per-generation state."""

    def __init__(self, directory, backend="onnxruntime", threads=None, device="cpu", verify=False):
        self.directory = os.fspath(directory)
        self.manifest = read_manifest(self.directory, verify=verify)
        # A backend name, or an opened backend (e.g. a TorchBackend over in-memory modules).
        self.backend = backend if not isinstance(backend, str) else open_backend(
            backend, self.directory, self.manifest, threads=threads, device=device)
        m = self.manifest["model"]["config"]
        self.config = m
        self.model_type = m["model_type"]
        self.cls = m["cls_token_num"]
        self.block_size = m["block_size"]
        self.vocab = m["vocab_size"]
        self.n_layer = m["n_layer"]
        self.kv_heads = m.get("n_kv_head") or m["n_head"]
        self.head_dim = m["dim"] // m["n_head"]
        self.max_positions = self.cls + self.block_size
        self.has_drafter = "drafter" in self.manifest["graphs"]
        self.tree = build_tree(self.manifest["tree"]) if self.has_drafter else None
        if self.has_drafter:
            d = self.manifest["drafter"]["config"]
            self.drafter_kv_heads = d.get("n_kv_head") or d["n_head"]
            self.drafter_head_dim = d["dim"] // d["n_head"]
        neighbors = self.manifest.get("neighbors")
        self.neighbors = np.load(os.path.join(self.directory, neighbors["file"])) if neighbors else None

    # ------------------------------------------------------------------------------------------
    def generate(self, *, classes=None, caption=None, caption_mask=None, mode="lantern++", lam=2.0, delta=0.1,
                 k=None, greedy=False, temperature=1.0, top_k=0, top_p=1.0, cfg_scale=1.0, cfg_interval=-1,
                 seed=0, tree=None):
        """Generate one image per class (c2i) or per caption row (t2i). Returns a Generation.
        tree: another draft tree for this call (preset name, JSON file or paths); its widest node
        must fit the drafter graph's candidates. Default: the tree the engine was exported with."""
        if mode not in MODES:
            raise LanternError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
        rule = None
        if mode != "ar":
            if not self.has_drafter:
                raise LanternError(f"{self.directory} has no drafter, so it serves mode 'ar' only")
            if mode != "exact" and self.neighbors is None:
                raise LanternError(f"{self.directory} has no neighbour table (export with --vq); "
                                   f"mode {mode!r} needs one")
            width = self.neighbors.shape[1] if self.neighbors is not None else 0
            if k is None:  # default: up to DEFAULT_K neighbours, as many as the table holds
                k = min(DEFAULT_K, width)
            if mode != "exact" and k > width:
                raise LanternError(f"k = {k} exceeds the engine's neighbour table ({width} per token); "
                                   f"use k <= {width} or re-export with a larger --neighbors-k")
            rule = acceptance.Rule(mode=mode, k=k if mode != "exact" else 0,
                                   delta=delta if mode == "lantern" else 0.0, lam=lam if mode == "lantern++" else 1.0)
        tree = self._tree(tree) if mode != "ar" else None
        if tree is not None and not greedy and not tree.contiguous:
            raise LanternError(f"tree {tree.name!r} skips child ranks; sampling needs every node's children to "
                               f"be ranks 0..w-1 (drafts drawn without replacement in rank order)")
        if not greedy:
            acceptance.filtered_probs(np.zeros((1, 2)), temperature, top_k, top_p)  # validates the filters
        cond, key_mask = self._condition_inputs(classes, caption, caption_mask)
        run = _Run(self, tree, rule, greedy, temperature, top_k, top_p, cfg_scale, cfg_interval, seed, cond, key_mask)
        return run.generate()

    def _tree(self, spec):
        if spec is None:
            return self.tree
        tree = build_tree(spec)
        candidates = self.manifest.get("candidates") or 0
        if max(tree.widths) > candidates:
            raise LanternError(f"tree {tree.name!r} needs {max(tree.widths)} children per node but the exported "
                               f"drafter returns {candidates} candidates; re-export with --candidates "
                               f"{max(tree.widths)} or pick a narrower tree")
        return tree

    def _condition_inputs(self, classes, caption, caption_mask):
        if self.model_type == "c2i":
            if classes is None or caption is not None:
                raise LanternError("this is a class-conditional (c2i) engine: give class labels")
            ids = np.asarray(classes, dtype=np.int64).reshape(-1)
            n_classes = self.config["num_classes"]
            if ids.size == 0 or ids.min() < 0 or ids.max() >= n_classes:
                raise LanternError(f"class labels must be in [0, {n_classes - 1}]; got {ids.tolist()}")
            return ids, None
        if caption is None or classes is not None:
            raise LanternError("this is a text-conditional (t2i) engine: give caption features")
        caption = np.asarray(caption, dtype=np.float32)
        want = (self.cls, self.config["caption_dim"])
        if caption.ndim == 2:
            caption = caption[None]
        if caption.ndim != 3 or caption.shape[1:] != want:
            raise LanternError(f"caption features must be [N, {want[0]}, {want[1]}] (T5 features, left-padded); "
                               f"got {list(caption.shape)}")
        if not np.isfinite(caption).all():
            raise LanternError("caption features contain NaN or inf")
        if caption_mask is None:
            caption_mask = np.ones(caption.shape[:2], dtype=bool)
        caption_mask = np.asarray(caption_mask).astype(bool)
        if caption_mask.ndim == 1:
            caption_mask = caption_mask[None]
        if caption_mask.shape != caption.shape[:2]:
            raise LanternError(f"caption mask must be [N, {self.cls}] matching the features")
        # As LlamaGen's sampler: padded caption rows are zeroed and their keys hidden.
        return caption * caption_mask[..., None], caption_mask

    def decode(self, tokens):
        """VQ codes [N, block_size] -> uint8 images [N, H, W, 3]."""
        if "vq_decoder" not in self.manifest["graphs"]:
            raise LanternError(f"{self.directory} has no VQ decoder (export with --vq)")
        grid = int(round(self.block_size ** 0.5))
        codes = np.asarray(tokens, dtype=np.int64).reshape(-1, grid, grid)
        image = self.backend.numpy(self.backend.run("vq_decoder", {"codes": codes})["image"])
        return np.clip((image.transpose(0, 2, 3, 1) + 1) * 127.5 + 0.5, 0, 255).astype(np.uint8)


class _Run:
    """One generate() call: its caches, counters and timers."""

    def __init__(self, engine, tree, rule, greedy, temperature, top_k, top_p, cfg_scale, cfg_interval, seed, cond, key_mask):
        self.e, self.be, self.tree, self.rule = engine, engine.backend, tree, rule
        self.greedy, self.temperature, self.top_k, self.top_p = greedy, temperature, top_k, top_p
        self.cfg = cfg_scale > 1.0  # LlamaGen runs the unconditional half only when cfg_scale > 1
        self.cfg_scale, self.cfg_interval = cfg_scale, cfg_interval
        self.rng = np.random.default_rng(seed)
        self.cond, self.key_mask = cond, key_mask
        self.N = len(cond)
        self.B = 2 * self.N if self.cfg else self.N
        self.halves = np.tile(np.arange(self.N), 2 if self.cfg else 1)  # image of each batch row
        self.times = dict(prefill=0.0, draft=0.0, verify=0.0, accept=0.0, commit=0.0, engine=0.0)
        self.engine_calls = 0

    # -- plumbing ------------------------------------------------------------------------------
    def call(self, graph, feeds):
        t = time.perf_counter()
        out = self.be.run(graph, feeds)
        self.be.synchronize()
        self.times["engine"] += time.perf_counter() - t
        self.engine_calls += 1
        return out

    def rows(self, per_image):
        """Per-image values -> per-batch-row values (both CFG halves)."""
        return np.asarray(per_image)[self.halves]

    def positions(self, pos):
        # Nodes past the last image token only happen in the final step and are never emitted;
        # clamp them onto the RoPE table.
        return np.minimum(pos, self.e.max_positions - 1).astype(np.int64)

    def mask(self, cache_visible, new_block):
        """[B, 1, T, P + T] from cache visibility [B, T or 1, P] and the new block [B?, T, T]."""
        B, T = self.B, new_block.shape[-1]
        cache = np.broadcast_to(cache_visible[:, None, :] if cache_visible.ndim == 2 else cache_visible,
                                (B, T, cache_visible.shape[-1]))
        return np.concatenate([cache, np.broadcast_to(new_block, (B, T, T))], axis=-1)[:, None]

    def combined_logits(self, logits, token_index):
        """CFG-combined logits per image, [N, T, V] float32. token_index [N, T]: which image token
        each row predicts (after cfg_interval tokens only the conditional logits count)."""
        logits = self.be.numpy(logits).astype(np.float32, copy=False)
        if not self.cfg:
            return logits
        cond, uncond = logits[: self.N], logits[self.N:]
        out = uncond + self.cfg_scale * (cond - uncond)
        if self.cfg_interval >= 0:
            late = token_index >= self.cfg_interval
            out[late] = cond[late]
        return out

    def draw(self, logits_row):
        """The next token from one row of combined logits."""
        if self.greedy:
            return int(np.argmax(logits_row))
        probs = acceptance.filtered_probs(logits_row[None], self.temperature, self.top_k, self.top_p)[0]
        cdf = np.cumsum(probs)
        return int(min(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"), len(cdf) - 1))

    # -- prefill -------------------------------------------------------------------------------
    def prefill(self):
        t0 = time.perf_counter()
        e, be, N, B, cls = self.e, self.be, self.N, self.B, self.e.cls
        if e.model_type == "c2i":
            ids = np.concatenate([self.cond, np.full(N, e.config["num_classes"])]) if self.cfg else self.cond
            cond = self.call("condition", {"class_ids": ids.astype(np.int64)})["cond_embeds"]
            key_ok = np.ones((B, cls), dtype=bool)
        else:
            caption = np.concatenate([self.cond, np.zeros_like(self.cond)]) if self.cfg else self.cond
            flags = np.arange(B) >= N
            cond = self.call("condition", {"caption": caption.astype(e.backend.float_dtype), "unconditional": flags})["cond_embeds"]
            key_ok = self.rows(self.key_mask)  # LlamaGen masks the same caption keys in both halves
        self.P = cls + e.block_size
        self.k_cache = be.zeros((e.n_layer, B, e.kv_heads, self.P, e.head_dim), e.backend.float_dtype)
        self.v_cache = be.zeros((e.n_layer, B, e.kv_heads, self.P, e.head_dim), e.backend.float_dtype)
        self.target_caches = cache_feeds(self.k_cache, self.v_cache)
        self.visible = np.zeros((B, self.P), dtype=bool)
        block = np.tril(np.ones((cls, cls), dtype=bool)) & key_ok[:, None, :] | np.eye(cls, dtype=bool)
        out = self.call("target", {
            "inputs_embeds": cond, "position_ids": np.broadcast_to(np.arange(cls, dtype=np.int64), (B, cls)).copy(),
            "attention_mask": self.mask(np.zeros((B, self.P), dtype=bool), block),
            **self.target_caches})
        self.commit_target(out, np.arange(B).repeat(cls), np.tile(np.arange(cls), B), np.tile(np.arange(cls), B))
        self.visible[:, :cls] = key_ok
        self.length = np.full(N, cls)  # target cache slots used per image
        logits = self.combined_logits(out["logits"][:, -1:], np.zeros((N, 1), dtype=np.int64))[:, 0]
        self.tokens = np.zeros((N, e.block_size), dtype=np.int64)
        self.count = np.zeros(N, dtype=np.int64)
        for n in range(N):
            self.tokens[n, 0] = self.draw(logits[n])
        self.count[:] = 1
        self.times["prefill"] += time.perf_counter() - t0
        return out

    def commit_target(self, out, rows, src, dst):
        self.be.commit(self.k_cache, out["new_keys"], rows, src, dst)
        self.be.commit(self.v_cache, out["new_values"], rows, src, dst)

    # -- AR ------------------------------------------------------------------------------------
    def ar_step(self, active):
        t0 = time.perf_counter()
        N, B = self.N, self.B
        last = self.tokens[np.arange(N), self.count - 1]
        embeds = self.call("embed", {"input_ids": self.rows(last)[:, None]})["inputs_embeds"]
        out = self.call("target", {
            "inputs_embeds": embeds, "position_ids": self.positions(self.rows(self.length))[:, None],
            "attention_mask": self.mask(self.visible, np.ones((1, 1), dtype=bool)),
            **self.target_caches})
        t1 = time.perf_counter()
        logits = self.combined_logits(out["logits"], self.count[:, None])[:, 0]
        for n in np.flatnonzero(active):
            self.tokens[n, self.count[n]] = self.draw(logits[n])
        t2 = time.perf_counter()
        rows = np.flatnonzero(active[self.halves])
        dst = self.length[self.halves][rows]
        self.commit_target(out, rows, np.zeros_like(rows), dst)
        self.visible[rows, dst] = True
        self.length[active] += 1
        self.count[active] += 1
        t3 = time.perf_counter()
        self.times["verify"] += t1 - t0
        self.times["accept"] += t2 - t1
        self.times["commit"] += t3 - t2

    # -- speculative ---------------------------------------------------------------------------
    def start_drafting(self, prefill_out):
        e, B = self.e, self.B
        self.D = e.block_size + self.tree.num_nodes - 1  # drafter slots: stable pairs, then the tree
        self.scratch = e.block_size
        shape = (1, B, e.drafter_kv_heads, self.D, e.drafter_head_dim)
        self.dk, self.dv = self.be.zeros(shape, e.backend.float_dtype), self.be.zeros(shape, e.backend.float_dtype)
        self.drafter_caches = cache_feeds(self.dk, self.dv)
        self.d_visible = np.zeros((B, self.D), dtype=bool)
        self.d_length = np.zeros(self.N, dtype=np.int64)
        # The first pair: the last condition token's hidden state with the first image token.
        self.pending_hidden = self.be.take(prefill_out["hidden"], np.arange(B)[:, None],
                                           np.full((B, 1), e.cls - 1))
        self.pending_tokens = self.tokens[:, :1].copy()
        self.pending_len = np.ones(self.N, dtype=np.int64)
        self.pending_pos = np.full(self.N, e.cls)  # position of the first pending token
        self.sampler_params = dict(
            cond_batch=np.array([self.N], dtype=np.int64),
            cfg_scale=np.array([self.cfg_scale if self.cfg else 1.0], dtype=np.float32),
            temperature=np.array([1.0 if self.greedy else self.temperature], dtype=np.float32),
            top_k=np.array([0 if self.greedy else self.top_k], dtype=np.int64),
            top_p=np.array([1.0 if self.greedy else self.top_p], dtype=np.float32))

    def drafter_call(self, hidden, ids, pos, cache_visible, block):
        feeds = {"target_hidden": hidden, "input_ids": self.rows(ids), "position_ids": self.positions(self.rows(pos)),
                 "attention_mask": self.mask(cache_visible, block), **self.drafter_caches}
        feeds.update(self.sampler_params)
        if self.cfg and self.cfg_interval >= 0 and self.count.min() >= self.cfg_interval:
            feeds["cfg_scale"] = np.array([1.0], dtype=np.float32)
        return self.call("drafter", feeds)

    def children(self, ids, probs, width):
        """The first `width` children of a set of parents, in rank order: the drafter's top
        choices (greedy) or a draw without replacement from its distribution (Gumbel top-k), as
        acceptance assumes. Only the drawn ones are sorted, not all K candidates."""
        if self.greedy:
            return ids[..., :width]
        with np.errstate(divide="ignore"):
            keys = -(np.log(probs) + self.rng.gumbel(size=probs.shape))
        best = np.argpartition(keys, width - 1, axis=-1)[..., :width]
        best = np.take_along_axis(best, np.argsort(np.take_along_axis(keys, best, axis=-1), axis=-1, kind="stable"), -1)
        return np.take_along_axis(ids, best, axis=-1)

    def draft(self, active):
        e, tree, N, B = self.e, self.tree, self.N, self.B
        M = self.pending_hidden.shape[1]
        # depth 0: the pairs accepted last step, ending with the root pair
        j = np.arange(M)
        real = j[None, :] < self.pending_len[:, None]  # [N, M]
        block = (np.tril(np.ones((M, M), dtype=bool))[None] & self.rows(real)[:, None, :]) | np.eye(M, dtype=bool)
        out = self.drafter_call(self.pending_hidden, self.pending_tokens, self.pending_pos[:, None] + j,
                                self.d_visible, block)
        img = np.flatnonzero(active)
        rows = np.flatnonzero(active[self.halves])
        n_of_row = self.halves[rows]
        src = np.concatenate([np.arange(self.pending_len[n]) for n in n_of_row]).astype(np.int64)
        dst = np.concatenate([self.d_length[n] + np.arange(self.pending_len[n]) for n in n_of_row]).astype(np.int64)
        rr = np.repeat(rows, self.pending_len[n_of_row])
        self.be.commit(self.dk, out["new_keys"], rr, src, dst)
        self.be.commit(self.dv, out["new_values"], rr, src, dst)
        self.d_visible[rr, dst] = True
        self.d_length[img] += self.pending_len[img]

        last = self.pending_len - 1
        node_tokens = np.zeros((N, tree.num_nodes), dtype=np.int64)
        node_tokens[:, 0] = self.pending_tokens[np.arange(N), last]
        topk_ids, topk_probs = self.be.numpy(out["topk_ids"]), self.be.numpy(out["topk_probs"])
        q_ids = {0: topk_ids[np.arange(N), last]}
        q_probs = {0: topk_probs[np.arange(N), last]}
        parent_hidden = self.be.take(out["hidden_out"], np.arange(B)[:, None], self.rows(last)[:, None])
        parent_ids = self.children(q_ids[0][:, None], q_probs[0][:, None], tree.levels[0].width)  # [N, 1, w]
        root_pos = self.pending_pos + last

        for d, level in enumerate(tree.levels, start=1):
            node_tokens[:, level.nodes] = parent_ids[:, level.slots, level.ranks]
            if d == tree.depth:
                break
            T = len(level.nodes)
            hidden = self.be.take(parent_hidden, np.arange(B)[:, None], np.broadcast_to(level.slots, (B, T)))
            ancestors = tree.mask[level.nodes][:, 1:] & (tree.depths[1:] < d)[None, :]  # [T, nodes-1]
            cache_visible = np.concatenate([np.broadcast_to(self.d_visible[:, None, :self.scratch], (B, T, self.scratch)),
                                            np.broadcast_to(ancestors, (B, T, tree.num_nodes - 1))], axis=-1)
            out = self.drafter_call(hidden, node_tokens[:, level.nodes], np.broadcast_to(root_pos[:, None] + d, (N, T)),
                                    cache_visible, np.eye(T, dtype=bool))
            slots = np.tile(self.scratch + level.nodes - 1, B)
            cols = np.tile(np.arange(T), B)
            self.be.commit(self.dk, out["new_keys"], np.repeat(np.arange(B), T), cols, slots)
            self.be.commit(self.dv, out["new_values"], np.repeat(np.arange(B), T), cols, slots)
            ids, probs = self.be.numpy(out["topk_ids"]), self.be.numpy(out["topk_probs"])
            for i, node in enumerate(level.nodes):
                q_ids[int(node)], q_probs[int(node)] = ids[:, i], probs[:, i]
            parent_hidden = out["hidden_out"]
            parent_ids = self.children(ids, probs, tree.levels[d].width)
        return node_tokens, q_ids, q_probs

    def verify(self, node_tokens):
        tree = self.tree
        embeds = self.call("embed", {"input_ids": self.rows(node_tokens)})["inputs_embeds"]
        pos = self.rows(self.length)[:, None] + tree.depths[None, :]
        return self.call("target", {
            "inputs_embeds": embeds, "position_ids": self.positions(pos),
            "attention_mask": self.mask(self.visible, tree.mask), **self.target_caches})

    def accept(self, active, node_tokens, out, q_ids, q_probs):
        tree, V = self.tree, self.e.vocab
        logits = self.combined_logits(out["logits"], self.count[:, None] + tree.depths[None, :])
        results = {}
        for n in np.flatnonzero(active):
            if self.greedy:
                results[n] = acceptance.accept_greedy(tree, node_tokens[n], logits[n], self.rule, self.e.neighbors)
            else:
                q = np.zeros((tree.num_nodes, V))
                for node in q_ids:
                    q[node, q_ids[node][n]] = q_probs[node][n]
                results[n] = acceptance.accept_sampling(
                    tree, node_tokens[n], logits[n], q, self.rule, self.rng, self.e.neighbors,
                    temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        return results

    def commit_step(self, results, out):
        e, N = self.e, self.N
        new_len = np.zeros(N, dtype=np.int64)
        path_nodes = {}
        for n, r in results.items():
            emitted = list(r.tokens) + [r.next_token]
            emit = min(len(emitted), e.block_size - self.count[n])
            self.tokens[n, self.count[n]: self.count[n] + emit] = emitted[:emit]
            path_nodes[n] = np.asarray(r.nodes[:emit], dtype=np.int64)  # root + accepted drafts fed
            new_len[n] = emit
            self.stats_accepted.append(len(r.tokens))
        rows = [row for row in range(self.B) if self.halves[row] in results]
        src = np.concatenate([path_nodes[self.halves[r]] for r in rows]).astype(np.int64)
        dst = np.concatenate([self.length[self.halves[r]] + np.arange(new_len[self.halves[r]]) for r in rows])
        rr = np.repeat(rows, [new_len[self.halves[r]] for r in rows])
        self.commit_target(out, rr, src, dst)
        self.visible[rr, dst] = True
        # Next step's depth-0 pairs: (h(path node j), emitted token j), positions after the root.
        M = int(new_len.max())
        cols = np.zeros((self.B, M), dtype=np.int64)
        tokens = np.zeros((N, M), dtype=np.int64)
        for n in results:
            cols[self.halves == n, : new_len[n]] = path_nodes[n]
            tokens[n, : new_len[n]] = self.tokens[n, self.count[n]: self.count[n] + new_len[n]]
        self.pending_hidden = self.be.take(out["hidden"], np.arange(self.B)[:, None], cols)
        self.pending_tokens = tokens
        self.pending_pos = self.length + 1
        self.pending_len = np.maximum(new_len, 1)  # finished images keep a dummy pair, never committed
        self.length += new_len
        self.count += new_len

    def spec_step(self, active):
        t0 = time.perf_counter()
        node_tokens, q_ids, q_probs = self.draft(active)
        t1 = time.perf_counter()
        out = self.verify(node_tokens)
        t2 = time.perf_counter()
        results = self.accept(active, node_tokens, out, q_ids, q_probs)
        t3 = time.perf_counter()
        self.commit_step(results, out)
        t4 = time.perf_counter()
        for key, dt in zip(("draft", "verify", "accept", "commit"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            self.times[key] += dt

    # -- the loop ------------------------------------------------------------------------------
    def generate(self):
        start = time.perf_counter()
        prefill_out = self.prefill()
        speculative = self.rule is not None
        if speculative:
            self.start_drafting(prefill_out)
        self.stats_accepted = []
        steps = np.zeros(self.N, dtype=np.int64)
        while (active := self.count < self.e.block_size).any():
            steps[active] += 1
            (self.spec_step if speculative else self.ar_step)(active)
        total = time.perf_counter() - start
        phases = {k: v for k, v in self.times.items() if k != "engine"}
        stats = {
            "mode": self.rule.mode if speculative else "ar",
            "images": self.N,
            "tokens_per_image": self.e.block_size,
            "steps_per_image": float(steps.mean()),
            # tokens per target step after prefill, the bonus token included (LANTERN's tau)
            "mean_accepted_length": float((self.e.block_size - 1) / steps.mean()) if steps.mean() else 0.0,
            "mean_accepted_drafts": float(np.mean(self.stats_accepted)) if self.stats_accepted else 0.0,
            # steps (per image) that accepted 0, 1, ..., depth draft tokens
            "accepted_histogram": np.bincount(self.stats_accepted, minlength=self.tree.depth + 1).tolist()
            if speculative else [],
            "seconds": total,
            "tokens_per_second": self.N * self.e.block_size / total,
            "phase_seconds": phases,
            "engine_seconds": self.times["engine"],
            "engine_calls": self.engine_calls,
            "host_overhead_seconds": total - self.times["engine"],
            "backend": self.be.name,
        }
        return Generation(tokens=self.tokens, stats=stats)
