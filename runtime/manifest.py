"""The engine directory format: what `lantern-export onnx` writes and the runtime reads.

engines/NAME/
  manifest.json     this format (FORMAT_VERSION), written last
  embed.onnx        token ids -> embeddings            (GRAPHS['embed'])
  condition.onnx    class ids / caption -> embeddings   (GRAPHS['condition_c2i' | 'condition_t2i'])
  target.onnx       the AR target: prefill, one-token steps and tree verification (GRAPHS['target'])
  drafter.onnx      the drafter with top-k and CFG in the graph (GRAPHS['drafter']; absent: `ar` only)
  vq_decoder.onnx   code grid -> RGB in [-1, 1]         (GRAPHS['vq_decoder']; optional)
  neighbors.npy     latent neighbours [V, k] of every code, nearest first (optional)
  *.onnx.data       external weights of a graph

Every file is listed in manifest['files'] with its size and sha256; the runtime checks sizes on
open and hashes when asked (`lantern-export check`, `open_engine(verify=True)`).
"""
import hashlib
import json
import os

from lantern.runtime.errors import LanternError

FORMAT_VERSION = 1

# Graph I/O contracts. Symbolic dims: B batch (2N with CFG), N images, T new tokens, P cache
# slots, L layers, H KV heads, D hidden size, V vocabulary, K drafter candidates.
# Scalars are shape-[1] tensors. attention_mask is True where a query may attend: the first P
# columns are the cache slots, the last T the new tokens.
GRAPHS = {
    "embed": {
        "inputs": {"input_ids": ("int64", ["B", "T"])},
        "outputs": {"inputs_embeds": ("float", ["B", "T", "D"])},
    },
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
            "inputs_embeds": ("float", ["B", "T", "D"]),
            "position_ids": ("int64", ["B", "T"]),
            "attention_mask": ("bool", ["B", 1, "T", "P+T"]),
            # One input per layer ({i} = 0..L-1): the runtime keeps one [L, B, H, P, hd] buffer and
            # passes its per-layer views, so no graph ever splits (copies) a stacked cache.
            "past_keys_{i}": ("float", ["B", "H", "P", "hd"]),
            "past_values_{i}": ("float", ["B", "H", "P", "hd"]),
        },
        "outputs": {
            "logits": ("float32", ["B", "T", "V"]),
            "hidden": ("float", ["B", "T", "D"]),
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
            "past_keys_{i}": ("float", ["B", "H", "P", "hd"]),  # one layer: past_keys_0
            "past_values_{i}": ("float", ["B", "H", "P", "hd"]),
            # CFG halves: conditional rows [0, N), unconditional rows [B - N, B); without CFG N = B
            # and both halves are the same rows, so the combination is exactly the logits.
            "cond_batch": ("int64", [1]),
            "cfg_scale": ("float32", [1]),
            "temperature": ("float32", [1]),
            "top_k": ("int64", [1]),  # 0 = no top-k filter (within the K candidates)
            "top_p": ("float32", [1]),  # 1 = no nucleus filter
        },
        "outputs": {
            "hidden_out": ("float", ["B", "T", "D"]),
            "new_keys": ("float", [1, "B", "H", "T", "hd"]),
            "new_values": ("float", [1, "B", "H", "T", "hd"]),
            # The K best tokens by CFG-combined logit, best first, and their probabilities under
            # the drafter's filtered distribution (temperature, top-k, top-p) renormalised over them.
            "topk_ids": ("int64", ["N", "T", "K"]),
            "topk_probs": ("float32", ["N", "T", "K"]),
        },
    },
    "vq_decoder": {
        "inputs": {"codes": ("int64", ["B", "h", "w"])},
        "outputs": {"image": ("float32", ["B", 3, "Hpx", "Wpx"])},
    },
}

def graph_io(contract, layers=1):
    """GRAPHS[contract] with the per-layer entries ('{i}' in the name) expanded for `layers`
    layers, in order: {"inputs": {name: (kind, shape)}, "outputs": {...}}."""
    def expand(entries):
        out = {}
        for name, value in entries.items():
            names = [name.format(i=i) for i in range(layers)] if "{i}" in name else [name]
            out.update({n: value for n in names})
        return out

    spec = GRAPHS[contract]
    return {"inputs": expand(spec["inputs"]), "outputs": expand(spec["outputs"])}


def cache_feeds(keys, values):
    """Per-layer cache inputs from stacked [L, ...] buffers (views, no copies)."""
    feeds = {f"past_keys_{i}": keys[i] for i in range(len(keys))}
    feeds.update({f"past_values_{i}": values[i] for i in range(len(values))})
    return feeds


GRAPH_FILES = {"embed": "embed.onnx", "condition": "condition.onnx", "target": "target.onnx",
               "drafter": "drafter.onnx", "vq_decoder": "vq_decoder.onnx"}


def sha256(path, chunk=1 << 20):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def describe_files(directory, names):
    """manifest['files'] entries for the given relative paths."""
    return {name: {"size": os.path.getsize(os.path.join(directory, name)),
                   "sha256": sha256(os.path.join(directory, name))} for name in sorted(names)}


def write_manifest(directory, manifest):
    path = os.path.join(directory, "manifest.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def read_manifest(directory, verify=False):
    """Load and validate an engine directory's manifest. Raises LanternError saying what to rebuild."""
    directory = os.fspath(directory)
    path = os.path.join(directory, "manifest.json")
    if not os.path.isdir(directory):
        raise LanternError(f"{directory}: no such engine directory (build one with `lantern-export onnx`)")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise LanternError(f"{directory}: no manifest.json; not an engine directory (rebuild with `lantern-export onnx`)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise LanternError(f"{path}: unreadable manifest ({e}); rebuild with `lantern-export onnx`") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise LanternError(f"{directory}: manifest format version {version!r} is not the supported {FORMAT_VERSION}; "
                           f"rebuild the engine with this version of `lantern-export onnx`")
    for key in ("files", "graphs", "model", "dtype"):
        if key not in manifest:
            raise LanternError(f"{path}: manifest lacks {key!r}; rebuild with `lantern-export onnx`")
    for name, entry in manifest["files"].items():
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            raise LanternError(f"{directory}: {name} is missing; rebuild the engine with `lantern-export onnx`")
        size = os.path.getsize(file)
        if size != entry["size"]:
            raise LanternError(f"{directory}: {name} has {size} bytes, the manifest says {entry['size']}; "
                               f"the file was changed or truncated; rebuild the engine")
        if verify and sha256(file) != entry["sha256"]:
            raise LanternError(f"{directory}: {name} does not match its sha256 in the manifest; rebuild the engine")
    for graph, entry in manifest["graphs"].items():
        if entry["file"] not in manifest["files"]:
            raise LanternError(f"{path}: graph {graph} names {entry['file']}, which the manifest does not list")
    return manifest
