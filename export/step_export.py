"""The step's phases (lantern.export.step_graphs) exported to ONNX for one engine and tree:
example inputs at distinct sizes for every dynamic dimension (images, rows, the caches'
capacities, the body length, the streams' table), traced by torch's TorchScript exporter (no
weights, no attention: seconds instead of dynamo's minutes), written beside the
engine's graphs."""
import io
import os
import warnings

import numpy as np
import torch

from lantern.export.graph_cache import fetch_graph, graph_key, store_graph
from lantern.export.step_graphs import phases
from lantern.export.step_jacobi import window_phases

KINDS = ("greedy", "sampling")
_FLOATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# tracing sizes of the dynamic dims, distinct from each other and from every constant dim
_N, _ROWS, _BODY, _STEPS, _KN = 3, 6, 13, 5, 7
_TARGET_EXTRA, _DRAFTER_EXTRA = 21, 17  # target capacity - M, drafter capacity - (M - 1): > _BODY


class Facts:
    """What the phases' shapes depend on in an engine: its manifest's model shapes and the token space."""

    def __init__(self, manifest, tree, columns, accept_dtype=torch.float64, proposer="tree", init=None):
        """proposer "jacobi": tree is the window's chain, init its fresh drafts' (lantern.runtime.jacobi)."""
        self.tree, self.columns, self.accept_dtype = tree, np.asarray(columns, dtype=np.int64), accept_dtype
        self.proposer, self.init = proposer, init
        self.vocab, self.codes = manifest.vocabulary.size, manifest.vocabulary.codes
        self.max_position = manifest.max_positions - 1
        self.K = manifest.candidates if tree.depth and proposer == "tree" else 2 if proposer == "jacobi" else 1
        self.float = _FLOATS[manifest.dtype]
        self.target, self.drafter = manifest.target, manifest.drafter
        self.inplace = manifest.inplace_cache is not None

    def modules(self, kind):
        """{phase: module} of the proposer's step (the drafter tree's, or the Jacobi window's)."""
        common = (self.tree, self.columns, self.codes, self.vocab, self.max_position, kind == "sampling", self.inplace)
        if self.proposer == "jacobi":
            return window_phases(*common, self.init, self.accept_dtype)
        return phases(*common, self.accept_dtype)


def _example(name, facts, kind):
    """(tensor, {axis: dim name}) of an input for tracing."""
    tree, M, D = facts.tree, facts.tree.num_nodes, facts.tree.depth
    St, Sd = M + _TARGET_EXTRA, M - 1 + _DRAFTER_EXTRA
    t, dr = facts.target, facts.drafter
    real = facts.accept_dtype if kind == "sampling" else torch.float32
    i64, f32, fl = torch.int64, torch.float32, facts.float
    n_at = [int((tree.depths == d).sum()) for d in range(D + 1)]
    call_tokens = {"verify": M, **{f"draft{d}": (D + 1 if d == 0 else n_at[d]) for d in range(D)}}

    def kv(shape, regime, T):
        return (shape.layers, _ROWS, shape.kv_heads, T, shape.head_dim)

    if "." in name:
        regime, what = name.split(".")
        T = call_tokens[regime]
        model = t if regime == "verify" else dr
        shapes = {"topk_ids": ((_ROWS, T, facts.K), i64), "topk_probs": ((_ROWS, T, facts.K), f32),
                  "hidden_out": ((_ROWS, T, dr.dim if dr else 0), fl), "hidden": ((_ROWS, T, t.dim), fl),
                  "logits": ((_ROWS, T, facts.vocab), f32),
                  "new_keys": (kv(model, regime, T), fl), "new_values": (kv(model, regime, T), fl)}
        shape, dtype = shapes[what]
        dims = {0: "B"} if what not in ("new_keys", "new_values") else {1: "B"}
        value = torch.rand(shape).to(dtype) if dtype != i64 else torch.randint(0, facts.K, shape)
        return value, dims
    code = int(facts.columns[0])  # node tokens are vocabulary ids: an image code's (a prompt engine's ids start past 0)
    per_image = {"count": 2, "root": code, "pending": 1, "cond_rows": 0, "uncond_rows": 0}
    if name in per_image:
        return torch.full((_N,), per_image[name], dtype=i64), {0: "N"}
    if name in ("image_of_row", "offset", "cfg_partners", "target_length", "drafter_length"):
        return torch.zeros(_ROWS, dtype=i64), {0: "B"}
    if name.endswith(".write_index"):
        return torch.zeros(_ROWS, dtype=i64), {0: "B"}
    scalars = {"cfg_interval": (-1, i64), "k": (1, i64), "top_k": (0, i64), "draws_taken": (0, i64),
               "cfg_scale": (1.0, f32), "lam": (1.0, real), "delta": (0.0, real), "temperature": (1.0, real),
               "top_p": (1.0, real)}
    if name in scalars:
        value, dtype = scalars[name]
        return torch.full((1,), value, dtype=dtype), {}
    if name == "target_visible":
        return torch.zeros((_ROWS, St), dtype=torch.bool), {0: "B", 1: "St"}
    if name == "drafter_visible":
        return torch.zeros((_ROWS, Sd), dtype=torch.bool), {0: "B", 1: "Sd"}
    if name in ("target_keys", "target_values"):
        return torch.zeros((t.layers, _ROWS, t.kv_heads, St, t.head_dim), dtype=fl), {1: "B", 3: "St"}
    if name in ("drafter_keys", "drafter_values"):
        return torch.zeros((dr.layers, _ROWS, dr.kv_heads, Sd, dr.head_dim), dtype=fl), {1: "B", 3: "Sd"}
    if name == "forced_columns":
        return torch.full((_BODY,), -1, dtype=i64), {0: "L"}
    if name == "neighbors":
        return torch.zeros((len(facts.columns), _KN), dtype=i64), {1: "Kn"}
    if name == "table":
        return torch.rand((_N, _STEPS, M + M * facts.K), dtype=torch.float64), {0: "N", 1: "steps", 2: "block"}
    S = len(facts.columns)
    window = {"window_drafts": ((_N, D), i64), "window_kept": ((_N,), i64), "window_q": ((_N, D, S), real),
              "window_block_q": ((_N, M, S), real), "body": ((_N, _BODY), i64), "window_stride": ((1,), i64)}
    if name in window:
        shape, dtype = window[name]
        value = torch.zeros(shape, dtype=dtype) if name != "window_stride" else torch.full(shape, 3, dtype=dtype)
        return value, {0: "N", 1: "L"} if name == "body" else {0: "N"} if name != "window_stride" else {}
    if name == "tokens1" and facts.proposer == "jacobi":  # the window's slots 1..W-1
        return torch.full((_N, D), code, dtype=i64), {0: "N"}
    if name.startswith("tokens"):
        return torch.full((_N, n_at[int(name[6:])]), code, dtype=i64), {0: "N"}
    if name.startswith("cand_ids"):
        return torch.zeros((_N, n_at[int(name[8:])], facts.K), dtype=i64), {0: "N"}
    if name.startswith("cand_probs"):
        return torch.rand((_N, n_at[int(name[10:])], facts.K), dtype=f32), {0: "N"}
    raise KeyError(name)


def phase_io(module, facts, kind):
    """([(input, numpy dtype)], [(output, numpy dtype)]) of a phase: its inputs' as the graphs
    take them, its outputs' from one run on the tracing examples."""
    examples = [_example(name, facts, kind)[0] for name in module.inputs]
    with torch.no_grad():
        outputs = module(*examples)
    numpy = lambda t: torch.empty(0, dtype=t.dtype).numpy().dtype  # noqa: E731
    return ([(n, numpy(t)) for n, t in zip(module.inputs, examples)],
            [(n, numpy(t)) for n, t in zip(module.outputs, outputs)])


def step_phase_factory(manifest):
    """The torch backend's step modules for an engine: (tree, columns, kind, proposer, init,
    accept dtype) -> {phase: (module, inputs, outputs)} as phase_io gives them; the same modules
    the graphs are exported from."""
    def make(tree, columns, kind, proposer="tree", init=None, accept_dtype="float64"):
        facts = Facts(manifest, tree, columns, getattr(torch, accept_dtype), proposer, init)
        return {name: (module,) + phase_io(module, facts, kind) for name, module in facts.modules(kind).items()}

    return make


def export_phase(module, facts, kind, path, opset=18):
    """Write one phase as ONNX at `path`; its inputs and outputs carry the phase's names."""
    examples = [_example(name, facts, kind) for name in module.inputs]
    dynamic = {name: dims for name, (_, dims) in zip(module.inputs, examples) if dims}
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, tuple(x for x, _ in examples), buffer, input_names=list(module.inputs),
                          output_names=list(module.outputs), dynamic_axes=dynamic, opset_version=opset,
                          dynamo=False)
    import onnx

    model = onnx.load_from_string(buffer.getvalue())
    got = [v.name for v in model.graph.input]
    if got != list(module.inputs):
        raise RuntimeError(f"{path}: exported inputs {got} differ from the phase's {list(module.inputs)}")
    onnx.save(model, path)


def write_step_graphs(directory, folder, manifest, tree, columns, kinds=KINDS, opset=18, progress=None,
                      proposer="tree", init=None, cache=None):
    """Export every phase of `tree`'s step for each kind into directory/folder:
    {kind: {phase: file relative to directory}}. cache: a graph cache directory
    (lantern.export.graph_cache): a phase exported before for the same shapes is copied from it
    (the phases hold no weights: engines of one shape share them)."""
    facts = Facts(manifest, tree, columns, proposer=proposer, init=init)
    os.makedirs(os.path.join(directory, folder), exist_ok=True)
    files = {}
    for kind in kinds:
        files[kind] = {}
        for name, module in facts.modules(kind).items():
            rel = f"{folder}/{kind}.{name}.onnx"
            path = os.path.join(directory, rel)
            key = graph_key(module, _cache_io(module, facts, kind), os.path.basename(rel), opset, False) \
                if cache else None
            if key is None or not fetch_graph(cache, key, path):
                export_phase(module, facts, kind, path, opset)
                if key is not None:
                    store_graph(cache, key, path, [os.path.basename(rel)])
            files[kind][name] = rel
            if progress is not None:
                progress()
    return files


def _cache_io(module, facts, kind):
    """What a phase's graph depends on besides the module itself: its names and the shapes and
    dtypes of its tracing examples (the model's dims, the drafter's width)."""
    examples = {name: _example(name, facts, kind) for name in module.inputs}
    return {"inputs": {n: [str(x.dtype), list(x.shape), sorted(d.items())] for n, (x, d) in examples.items()},
            "outputs": list(module.outputs), "kind": kind}
