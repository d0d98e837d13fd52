"""The graph I/O contracts: the names, dtypes and symbolic shapes of every engine graph's inputs
and outputs. Export traces graphs to them, the manifest records which contract each graph
follows, and the KV caches, step plans and backends feed and read graphs by them.
"""

# Graph I/O contracts. Symbolic dims: B batch rows (2N with CFG: [cond; uncond]), N images,
# T new tokens, P cache slots, L layers, H KV heads, hd head dim, D hidden size, V vocabulary,
# K drafter candidates, C condition tokens. Scalars are shape-[1] tensors. attention_mask is
# True where a query may attend: the first P columns are the cache slots, the last T the new
# tokens. Entries whose name holds "{i}" repeat once per layer.
#
# Two forms of the target and drafter graphs, chosen at export (`lantern-export onnx --attention`):
#   plain  (target, target_ids, drafter): caches in, the new tokens' K/V out; the runtime copies
#          the entries it keeps into its cache (any cache length P).
#   inplace (target_inplace, target_ids_inplace, drafter_inplace, + commit): the forms TensorRT
#          fuses. S cache slots, fixed at export (Manifest.inplace_cache); the caches are in/out,
#          one buffer: each layer writes the T new tokens' K/V at slots write_index[b] ..
#          write_index[b] + T - 1 of row b (ONNX TensorScatter), and attention_mask [B, 1, T, S]
#          covers the whole cache, the new tokens included at the slots they are written to.
#          `aliases` names each output that is its input updated in place: a backend binds both
#          to one buffer (or copies the output back). The commit graph moves the accepted path's
#          entries (written at write_index + node index during verification) to the contiguous
#          slots write_index .. write_index + A - 1, in place; A = tree depth + 1.
GRAPHS = {
    "condition_c2i": {
        "inputs": {"class_ids": ("int64", ["B"])},
        "outputs": {"cond_embeds": ("float", ["B", "C", "D"])},
    },
    "condition_t2i": {
        # caption: T5 features, padded rows already zero; unconditional: use the null caption.
        "inputs": {"caption": ("float", ["B", "C", "E"]), "unconditional": ("bool", ["B"])},
        "outputs": {"cond_embeds": ("float", ["B", "C", "D"])},
    },
    "target": {
        "inputs": {
            # Token ids; an id V + j stands for row j of cond_embeds (the condition tokens), so
            # prefill, one-token steps and tree verification all feed ids.
            "input_ids": ("int64", ["B", "T"]),
            "cond_embeds": ("float", ["B", "C", "D"]),
            "position_ids": ("int64", ["B", "T"]),
            "attention_mask": ("bool", ["B", 1, "T", "P+T"]),
            # One input per layer: the runtime keeps one [L, B, H, P, hd] buffer and passes its
            # per-layer views, so no graph ever splits (copies) a stacked cache.
            "past_keys_{i}": ("float", ["B", "H", "P", "hd"]),
            "past_values_{i}": ("float", ["B", "H", "P", "hd"]),
        },
        "outputs": {
            "logits": ("float32", ["B", "T", "V"]),
            "hidden": ("float", ["B", "T", "D"]),  # after the final norm: the drafter's input
            "new_keys": ("float", ["L", "B", "H", "T", "hd"]),
            "new_values": ("float", ["L", "B", "H", "T", "hd"]),
        },
    },
    "drafter": {
        "inputs": {
            "target_hidden": ("float", ["B", "T", "D"]),
            "input_ids": ("int64", ["B", "T"]),
            "position_ids": ("int64", ["B", "T"]),
            "attention_mask": ("bool", ["B", 1, "T", "P+T"]),
            "past_keys_{i}": ("float", ["B", "H", "P", "hd"]),
            "past_values_{i}": ("float", ["B", "H", "P", "hd"]),
            # CFG as data, not shapes: row b's unconditional partner is row cfg_pair[b] (itself
            # without CFG) and its logits are l[pair] + cfg_scale * (l - l[pair]).
            "cfg_pair": ("int64", ["B"]),
            "cfg_scale": ("float32", [1]),
            "temperature": ("float32", [1]),
            "top_k": ("int64", [1]),  # 0 = no top-k filter (within the K candidates)
            "top_p": ("float32", [1]),  # 1 = no nucleus filter
        },
        "outputs": {
            "hidden_out": ("float", ["B", "T", "D"]),
            "new_keys": ("float", ["L", "B", "H", "T", "hd"]),
            "new_values": ("float", ["L", "B", "H", "T", "hd"]),
            # The K best tokens by CFG-combined logit, best first, and their probabilities under
            # the filtered distribution renormalised over them; rows of the conditional half count.
            "topk_ids": ("int64", ["B", "T", "K"]),
            "topk_probs": ("float32", ["B", "T", "K"]),
        },
    },
    "vq_decoder": {
        "inputs": {"codes": ("int64", ["B", "h", "w"])},
        "outputs": {"image": ("float32", ["B", 3, "Hpx", "Wpx"])},
    },
}


# The same target for prompts of token ids only (the Chameleon family): no condition rows.
GRAPHS["target_ids"] = {"inputs": {k: v for k, v in GRAPHS["target"]["inputs"].items() if k != "cond_embeds"},
                        "outputs": dict(GRAPHS["target"]["outputs"])}


def _in_place(plain, first_outputs, last_outputs=()):
    """The in-place contract of a plain one: mask over the S static slots, caches in/out as
    past_*/present_* (aliased), write_index last."""
    inputs = {name: (kind, ["B", 1, "T", "S"] if name == "attention_mask" else
                     ["B", "H", "S", "hd"] if name.startswith("past_") else shape)
              for name, (kind, shape) in plain["inputs"].items()}
    inputs["write_index"] = ("int64", ["B"])
    outputs = {name: plain["outputs"][name] for name in first_outputs}
    outputs.update({"present_keys_{i}": ("float", ["B", "H", "S", "hd"]),
                    "present_values_{i}": ("float", ["B", "H", "S", "hd"])})
    outputs.update({name: plain["outputs"][name] for name in last_outputs})
    return {"inputs": inputs, "outputs": outputs, "aliases": _CACHE_ALIASES}


_CACHE_ALIASES = {"present_keys_{i}": "past_keys_{i}", "present_values_{i}": "past_values_{i}"}
GRAPHS["target_inplace"] = _in_place(GRAPHS["target"], ("logits", "hidden"))
GRAPHS["target_ids_inplace"] = _in_place(GRAPHS["target_ids"], ("logits", "hidden"))
GRAPHS["drafter_inplace"] = _in_place(GRAPHS["drafter"], ("hidden_out",), ("topk_ids", "topk_probs"))
GRAPHS["commit"] = {
    "inputs": {
        "src_slots": ("int64", ["B", "A"]),  # row b's entry j comes from slot src_slots[b, j]
        "write_index": ("int64", ["B"]),  # ... and goes to slot write_index[b] + j
        "past_keys_{i}": ("float", ["B", "H", "S", "hd"]),
        "past_values_{i}": ("float", ["B", "H", "S", "hd"]),
    },
    "outputs": {"present_keys_{i}": ("float", ["B", "H", "S", "hd"]),
                "present_values_{i}": ("float", ["B", "H", "S", "hd"])},
    "aliases": _CACHE_ALIASES,
}

# Acceptance as modules (lantern.export.accept_graphs, the step graphs' accept rule;
# lantern.runtime.accept is their specification): the verification logits in, the step's outcome
# out. The tree is a constant of each, in the engine's token space of W columns: the image codes,
# then the ids the prompt style forces (StepGraphs.forced_ids records them; an older engine's
# acceptance-only graphs, Manifest.acceptance, follow these contracts too). Dims:
# B target rows as the target returned them, N images, M tree nodes, V vocabulary, F body length
# (forced_columns), Kn neighbor table width, K drafter candidates, depth+1 path length. Tokens,
# draft ids, neighbors and next_token are columns of the token space, not vocabulary ids. Rule
# parameters are inputs: exact is lam 1, delta 0; k <= Kn masks the table's columns.
_ACCEPT_FRONT = {
    "logits": ("float32", ["B", "M", "V"]),
    "cond_rows": ("int64", ["N"]),  # each image's conditional / unconditional row (equal: no CFG)
    "uncond_rows": ("int64", ["N"]),
    "cfg_scale": ("float32", [1]),
    "cfg_interval": ("int64", [1]),  # -1: CFG for every token; else only for body indices below it
    "count": ("int64", ["N"]),  # tokens each image has: node i predicts body index count + depth_i
    "forced_columns": ("int64", ["F"]),  # per body index the forced token's column, -1 where free
    "tokens": ("int64", ["N", "M"]),  # node tokens (node 0 the root)
}
_ACCEPT_RULE = {"neighbors": ("int64", ["W", "Kn"]), "k": ("int64", [1]), "lam": ("float32", [1]),
                "delta": ("float32", [1])}
_ACCEPT_OUTCOME = {
    "accepted": ("int64", ["N"]),  # draft tokens accepted (the depth of the last accepted node)
    "next_token": ("int64", ["N"]),  # the token after the accepted path (a column)
    "path": ("int64", ["N", "depth+1"]),  # node indices from the root, -1 padded
    "decisions": ("int64", ["N", "M"]),  # 1 on the path, 0 evaluated and not on it, -1 never evaluated
    "invalid": ("bool", ["N"]),  # some node's logits have no finite maximum: the outcome is void
}
GRAPHS["accept_greedy"] = {"inputs": {**_ACCEPT_FRONT, **_ACCEPT_RULE}, "outputs": dict(_ACCEPT_OUTCOME)}
GRAPHS["accept_sampling"] = {
    "inputs": {**_ACCEPT_FRONT,
               "draft_ids": ("int64", ["N", "M", "K"]),  # node i's drafter candidates (columns), best first
               "draft_probs": ("float32", ["N", "M", "K"]),  # ... and their probabilities (renormalised inside)
               "uniforms": ("float32", ["N", "M"]),  # the step's acceptance uniforms (lantern.runtime.streams)
               **_ACCEPT_RULE,
               "temperature": ("float32", [1]),
               "top_k": ("int64", [1]),  # 0 = off; values in (ACCEPT_TOP_K_LIMIT, W) are not served
               "top_p": ("float32", [1])},  # 1 = off
    "outputs": dict(_ACCEPT_OUTCOME),
}
ACCEPT_CONTRACTS = ("accept_greedy", "accept_sampling")
# TensorRT's TopK takes K <= 3840: the sampling graph finds the top-k threshold with one TopK of
# min(ACCEPT_TOP_K_LIMIT, W) values, so it serves top_k = 0, 1 .. that, or >= W (no filter).
ACCEPT_TOP_K_LIMIT = 3840
# the step graphs' names and meaning (lantern.export.step_graphs): an engine whose step graphs carry another
# version is refused by the runners that run them, with the command that re-exports them
STEP_VERSION = 2  # 2: a sampling step's accept per filter combination
# a sampling step's accept phase per filter combination (the runner picks the one its settings need:
# an absent filter costs nothing, an inactive one does): lantern.runtime.graph_step.accept_variant
SAMPLING_FILTERS = ((), ("top_k",), ("top_p",), ("top_k", "top_p"))
ACCEPT_PHASES = tuple("+".join(("accept",) + f) for f in SAMPLING_FILTERS)  # a sampling step's; greedy: "accept"

IN_PLACE_CONTRACTS = {"target": "target_inplace", "target_ids": "target_ids_inplace", "drafter": "drafter_inplace"}


def graph_io(contract, layers=1):
    """GRAPHS[contract] with the per-layer entries expanded for `layers` layers, in order:
    {"inputs": {name: (kind, shape)}, "outputs": {...}, "aliases": {output: input}} (aliases:
    the outputs that are their input updated in place; empty for most graphs)."""
    def expand(entries):
        out = {}
        for name, value in entries.items():
            names = [name.format(i=i) for i in range(layers)] if "{i}" in name else [name]
            out.update({n: value for n in names})
        return out

    spec = GRAPHS[contract]
    aliases = {}
    for output, source in spec.get("aliases", {}).items():
        aliases.update({output.format(i=i): source.format(i=i) for i in range(layers)})
    return {"inputs": expand(spec["inputs"]), "outputs": expand(spec["outputs"]), "aliases": aliases}


def cache_feeds(keys, values):
    """Per-layer cache inputs from stacked [L, ...] buffers (views, no copies)."""
    feeds = {f"past_keys_{i}": keys[i] for i in range(len(keys))}
    feeds.update({f"past_values_{i}": values[i] for i in range(len(values))})
    return feeds


# Dims that stay dynamic in the exported graphs; every other dim is fixed by the model config.
DYNAMIC_DIMS = ("B", "T", "P", "P+T", "N", "h", "w", "Hpx", "Wpx", "A", "F", "Kn")


def resolved_io(contract, dims, float_dtype, layers=1):
    """graph_io(contract, layers) with the fixed dims filled in from `dims` and 'float' resolved:
    {"inputs": {name: {"dtype", "shape"}}, "outputs": {...}} (dynamic dims stay names)."""
    spec = graph_io(contract, layers)

    def one(entries):
        return {name: {"dtype": float_dtype if kind == "float" else kind,
                       "shape": [d if not isinstance(d, str) or d in DYNAMIC_DIMS else dims[d] for d in shape]}
                for name, (kind, shape) in entries.items()}

    return {"inputs": one(spec["inputs"]), "outputs": one(spec["outputs"])}
