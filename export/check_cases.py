"""`lantern-export check`'s cases: seeded random inputs for every graph of an engine, in the
shapes the decoding loop's step plans use (prefill, step, tree, draft0; two batch sizes for the
condition graph, two code grids for the VQ decoder, random moves for the commit graph), or in the
fixed shapes a backend serves (shaped per profile). lantern.export.check's docstring says what
each case holds and why."""
import numpy as np

from lantern.runtime.contracts import cache_feeds, GRAPHS
from lantern.runtime.tree import build_tree

GARBAGE = 100.0  # scale of the junk in unused cache slots (finite: masked slots get weight 0)
_NUMPY_FLOAT = {"fp32": np.float32, "fp16": np.float16, "bf16": np.float32}  # bf16 graphs run upcast


def _mask(batch, capacity, valid, block, in_place=False):
    """[B, 1, T, capacity + T]: the first `valid` cache slots visible, then block [T, T] (or
    [B, T, T]). in_place: [B, 1, T, capacity], the block at the slots the new tokens are written
    to (valid .. valid + T - 1)."""
    t = block.shape[-1]
    mask = np.zeros((batch, 1, t, capacity if in_place else capacity + t), dtype=bool)
    mask[:, 0, :, :valid] = True
    start = valid if in_place else capacity
    mask[:, 0, :, start:start + t] = block
    return mask


def _kv(rng, layers, batch, heads, capacity, valid, head_dim, dtype):
    kv = rng.standard_normal((layers, batch, heads, capacity, head_dim))
    kv[:, :, :, valid:] *= GARBAGE
    return kv.astype(dtype)


def _attention_cases(manifest):
    """(name, batch, T, capacity, valid slots, positions [T], block [T, T] or [B, T, T])."""
    C = manifest.condition.tokens or 5  # a prompt's length varies: five tokens stand for one
    max_pos = manifest.max_positions
    tree = build_tree(manifest.tree) if manifest.tree else build_tree("mc_sim_7b_63")
    prefill = min(C + 3, max_pos)
    past = max(0, min(C + 4, max_pos - tree.depth - 1))
    step = min(C + 2, max_pos - 1)
    width = tree.depth + 1
    real = np.arange(width) < np.array([[width], [1]])  # one row all real, one row one pair
    pad_block = np.tril(np.ones((width, width), dtype=bool))[None] & real[:, None, :] | np.eye(width, dtype=bool)
    return [
        ("prefill", 2, prefill, 0, 0, np.arange(prefill), np.tril(np.ones((prefill, prefill), dtype=bool))),
        ("step", 3, 1, step + 3, step, np.array([step]), np.ones((1, 1), dtype=bool)),
        ("tree", 2, tree.num_nodes, past + 2, past, past + np.asarray(tree.depths), np.asarray(tree.mask)),
        ("draft0", 2, width, past + 2, past, past + np.arange(width), pad_block),
    ]


def check_cases(graph, manifest, rng, shapes=None):
    """[(case name, {input name: numpy array})] for one graph; in the given shapes when `shapes`
    ([(case name, {input: shape})], the dynamic inputs' shapes) is given."""
    if shapes is not None:
        return [(name, _shaped_case(graph, manifest, rng, dims)) for name, dims in shapes]
    entry = manifest.graphs[graph]
    fdt = _NUMPY_FLOAT[entry.dtype]
    V = manifest.vocabulary.size
    if graph == "condition" and entry.contract == "condition_c2i":
        rows = manifest.condition.num_classes + (manifest.condition.null_class is not None)
        return [("B3", {"class_ids": np.array([0, rows - 1, rows // 2], dtype=np.int64)}),
                ("B1", {"class_ids": np.array([1 % rows], dtype=np.int64)})]
    if graph == "condition":
        c, e = entry.inputs["caption"].shape[1:]
        cases = []
        for b in (3, 1):
            caption = rng.standard_normal((b, c, e))
            caption[:, : c // 3] = 0  # left padding, as LlamaGen's sampler zeroes it
            cases.append((f"B{b}", {"caption": caption.astype(fdt), "unconditional": np.arange(b) % 2 == 1}))
        return cases
    if graph == "vq_decoder":
        codes, img = manifest.vocabulary.codes, manifest.image
        return [(f"1x{img.grid_height}x{img.grid_width}",
                 {"codes": rng.integers(0, codes, (1, img.grid_height, img.grid_width))}),
                ("2x2x3", {"codes": rng.integers(0, codes, (2, 2, 3))})]

    layers = entry.layers
    _, heads, slots, head_dim = entry.inputs["past_keys_0"].shape
    in_place = "aliases" in GRAPHS[entry.contract]
    if graph == "commit":
        return _commit_cases(manifest, layers, heads, slots, head_dim, fdt, rng)
    dim = manifest.target.dim
    cases = []
    for name, b, t, capacity, valid, pos, block in _attention_cases(manifest):
        if in_place:
            capacity = slots  # the static cache; the new tokens go to slots valid .. valid + t - 1
        if graph == "drafter" and name == "prefill":
            continue
        if graph == "target" and name == "draft0":
            continue
        feeds = {}
        if graph == "target":
            ids = rng.integers(0, V, (b, t))
            if name == "prefill" and "cond_embeds" in entry.inputs:  # the condition tokens first, as prefill feeds them
                C = entry.inputs["cond_embeds"].shape[1]
                ids[:, :C] = V + np.arange(C)
            feeds["input_ids"] = ids
            if "cond_embeds" in entry.inputs:
                feeds["cond_embeds"] = rng.standard_normal((b,) + tuple(entry.inputs["cond_embeds"].shape[1:])).astype(fdt)
        else:
            feeds["target_hidden"] = rng.standard_normal((b, t, dim)).astype(fdt)
            feeds["input_ids"] = rng.integers(0, V, (b, t))
        feeds["position_ids"] = np.ascontiguousarray(np.broadcast_to(pos, (b, t))).astype(np.int64)
        feeds["attention_mask"] = _mask(b, capacity, valid, block, in_place)
        feeds.update(cache_feeds(_kv(rng, layers, b, heads, capacity, valid, head_dim, fdt),
                                 _kv(rng, layers, b, heads, capacity, valid, head_dim, fdt)))
        if in_place:
            feeds["write_index"] = np.full(b, valid, dtype=np.int64)
        if graph == "drafter":
            k = manifest.candidates
            # step: no CFG, every filter; tree and draft0: [cond; uncond] CFG pairs, plain
            cfg = name != "step"
            pair = (np.arange(b) + b // 2) % b if cfg else np.arange(b)
            scale, temp, top_k, top_p = (2.0, 1.0, 0, 1.0) if cfg else (1.0, 0.8, min(5, k), 0.9)
            feeds.update(cfg_pair=pair.astype(np.int64), cfg_scale=np.array([scale], dtype=np.float32),
                         temperature=np.array([temp], dtype=np.float32), top_k=np.array([top_k], dtype=np.int64),
                         top_p=np.array([top_p], dtype=np.float32))
        cases.append((name, feeds))
    return cases


def _shaped_case(graph, manifest, rng, dims):
    """Inputs of one graph in given shapes: ids, a causal block over a cache filled up to the
    last T slots (garbage beyond, masked), positions past + 0..T-1 clamped to the RoPE table."""
    entry = manifest.graphs[graph]
    fdt = _NUMPY_FLOAT[entry.dtype]
    shape = {name: tuple(dims.get(name, spec.shape)) for name, spec in entry.inputs.items()}
    V = manifest.vocabulary.size
    if graph == "condition" and entry.contract == "condition_c2i":
        rows = manifest.condition.num_classes + (manifest.condition.null_class is not None)
        return {"class_ids": rng.integers(0, rows, shape["class_ids"])}
    if graph == "condition":
        b = shape["unconditional"][0]
        return {"caption": rng.standard_normal(shape["caption"]).astype(fdt), "unconditional": np.arange(b) % 2 == 1}
    if graph == "vq_decoder":
        return {"codes": rng.integers(0, manifest.vocabulary.codes, shape["codes"])}
    b, t = shape["input_ids"]
    capacity = shape["past_keys_0"][2]
    valid = max(0, min(capacity - t, manifest.max_positions - t))
    feeds = {"input_ids": rng.integers(0, V, (b, t))}
    if graph == "target":
        C = shape["cond_embeds"][1]
        feeds["input_ids"][:, : min(C, t)] = V + np.arange(min(C, t))  # condition tokens, as prefill feeds them
        feeds["cond_embeds"] = rng.standard_normal(shape["cond_embeds"]).astype(fdt)
    else:
        feeds["target_hidden"] = rng.standard_normal(shape["target_hidden"]).astype(fdt)
    positions = np.minimum(valid + np.arange(t), manifest.max_positions - 1)
    feeds["position_ids"] = np.ascontiguousarray(np.broadcast_to(positions, (b, t))).astype(np.int64)
    feeds["attention_mask"] = _mask(b, capacity, valid, np.tril(np.ones((t, t), dtype=bool)))
    _, _, _, head_dim = shape["past_keys_0"]
    heads = shape["past_keys_0"][1]
    feeds.update(cache_feeds(_kv(rng, entry.layers, b, heads, capacity, valid, head_dim, fdt),
                             _kv(rng, entry.layers, b, heads, capacity, valid, head_dim, fdt)))
    if graph == "drafter":
        cfg = b % 2 == 0
        pair = (np.arange(b) + b // 2) % b if cfg else np.arange(b)
        feeds.update(cfg_pair=pair.astype(np.int64), cfg_scale=np.array([2.0 if cfg else 1.0], dtype=np.float32),
                     temperature=np.array([1.0], dtype=np.float32), top_k=np.array([0], dtype=np.int64),
                     top_p=np.array([1.0], dtype=np.float32))
    return {name: feeds[name] for name in entry.inputs}


def _commit_cases(manifest, layers, heads, slots, head_dim, fdt, rng):
    """The commit graph: each row moves depth + 1 entries from random slots to random
    contiguous destinations (sources and destinations overlapping, as a tree's do)."""
    tree = build_tree(manifest.tree) if manifest.tree else build_tree("mc_sim_7b_63")
    width, b = tree.depth + 1, 3
    write_index = rng.integers(0, slots - width - tree.num_nodes, b)
    src = write_index[:, None] + rng.integers(0, tree.num_nodes, (b, width))
    feeds = {"src_slots": src.astype(np.int64), "write_index": write_index.astype(np.int64)}
    feeds.update(cache_feeds(_kv(rng, layers, b, heads, slots, slots, head_dim, fdt),
                             _kv(rng, layers, b, heads, slots, slots, head_dim, fdt)))
    return [("tree", feeds)]
