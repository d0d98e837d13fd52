"""`lantern-export check ENGINE`: every graph on ONNX Runtime against the PyTorch graph modules
rebuilt from the source checkpoints the manifest records.

Cases per graph (seeded random inputs):
  prefill  a causal block from an empty cache (condition tokens + a few image tokens)
  step     one token over a partly filled cache; the unused slots hold large garbage, masked out
  tree     the manifest's draft tree (or mc_sim_7b_63 for an `ar` engine) over a filled cache:
           mask = valid cache slots + tree mask, positions = past + depth
plus two batch sizes for embed/condition and two code grids for the VQ decoder. Batch, token
count and cache length differ between cases, so the dynamic axes are exercised too.

Comparison per output: max |ort - torch| must be <= atol + rtol * max |torch| (the output's
scale). Defaults, stated in TOLERANCES:
  fp32  atol 1e-5, rtol 1e-4
  fp16  atol 1e-3, rtol 1e-2   (ONNX Runtime and torch round fp16 differently per op)
  bf16  atol 1e-4, rtol 2e-3   ONNX Runtime's CPU EP has no bf16 kernels, so the bf16 graph is
        run with its bf16 tensors upcast exactly to fp32 and compared against the torch modules
        holding the same bf16 weights, run in fp32: this checks the graph and its weights, not
        bf16 rounding (check on a GPU for that).
The drafter's top-k ids are compared only at ranks whose CFG-combined logit is clear of its
neighbours' (near-ties may legitimately swap): the gap must exceed 4x the logit error that ORT's
hidden-state error implies plus one rounding unit of the dtype at the logits' scale.
Probabilities are compared numerically by rank.
"""
import os
import tempfile

import numpy as np
import torch

from lantern.runtime.errors import LanternError
from lantern.export.graphs import graph_layers
from lantern.runtime.manifest import cache_feeds, graph_io, read_manifest

TOLERANCES = {"fp32": (1e-5, 1e-4), "fp16": (1e-3, 1e-2), "bf16": (1e-4, 2e-3)}
GARBAGE = 100.0  # scale of the junk in unused cache slots (finite: masked slots get weight 0)
THREADS = 2
_EPS = {"fp32": 2.0**-23, "fp16": 2.0**-10, "bf16": 2.0**-23}  # bf16 graphs run upcast to fp32
_NUMPY_FLOAT = {"fp32": np.float32, "fp16": np.float16, "bf16": np.float32}


# ---------------------------------------------------------------------------------------------
# Inputs


def _tree(manifest):
    from lantern.runtime.tree import build_tree

    return build_tree(manifest["tree"] if manifest.get("tree") else "mc_sim_7b_63")


def _mask(batch, capacity, valid, new_mask):
    """Mask [B, 1, T, capacity + T]: the first `valid` cache slots visible, then new_mask [T, T]."""
    t = new_mask.shape[0]
    cache = np.zeros((t, capacity), dtype=bool)
    cache[:, :valid] = True
    mask = np.concatenate([cache, new_mask], axis=1)
    return np.ascontiguousarray(np.broadcast_to(mask, (batch, 1, t, capacity + t)))


def _kv(rng, layers, batch, heads, capacity, valid, head_dim, dtype):
    kv = rng.standard_normal((layers, batch, heads, capacity, head_dim))
    kv[:, :, :, valid:] *= GARBAGE
    return kv.astype(dtype)


def _attention_cases(manifest):
    """(name, batch, T, capacity, valid cache slots, positions [T], new-token mask [T, T])."""
    cfg = manifest["model"]["config"]
    cls, max_pos = cfg["cls_token_num"], cfg["cls_token_num"] + cfg["block_size"]
    prefill = min(cls + 3, max_pos)
    tree = _tree(manifest)
    past = max(0, min(cls + 4, max_pos - tree.depth - 1))
    step_valid = min(cls + 2, max_pos - 1)
    return [
        ("prefill", 2, prefill, 0, 0, np.arange(prefill), np.tril(np.ones((prefill, prefill), dtype=bool))),
        ("step", 3, 1, step_valid + 3, step_valid, np.array([step_valid]), np.ones((1, 1), dtype=bool)),
        ("tree", 2, tree.num_nodes, past + 2, past, past + np.asarray(tree.depths), np.asarray(tree.mask)),
    ]


def _inputs(graph, manifest, rng):
    """[(case name, {input name: numpy array})] for one graph."""
    entry = manifest["graphs"][graph]
    io = entry["io"]
    fdt = _NUMPY_FLOAT[entry["dtype"]]  # bf16 graphs run upcast to fp32 (see _upcast_bf16)
    cfg = manifest["model"]["config"]
    vocab = cfg["vocab_size"]
    if graph == "embed":
        return [(f"B{b}xT{t}", {"input_ids": rng.integers(0, vocab, (b, t))}) for b, t in ((2, 5), (3, 1))]
    if graph == "condition" and entry["contract"] == "condition_c2i":
        null = manifest["condition"]["null_class"]
        rows = cfg["num_classes"] + (1 if null is not None else 0)
        return [("B3", {"class_ids": np.array([0, rows - 1, rows // 2], dtype=np.int64)}),
                ("B1", {"class_ids": np.array([1 % rows], dtype=np.int64)})]
    if graph == "condition":
        c, e = io["caption"]["shape"][1:]
        cases = []
        for b in (3, 1):
            caption = rng.standard_normal((b, c, e))
            caption[:, : c // 3] = 0  # left padding, as LlamaGen's sampler zeroes it
            uncond = np.array([i % 2 == 1 for i in range(b)])
            cases.append((f"B{b}", {"caption": caption.astype(fdt), "unconditional": uncond}))
        return cases
    if graph == "vq_decoder":
        codes = manifest["vq"]["config"]["codebook_size"]
        grid = manifest["grid_size"]
        return [(f"1x{grid}x{grid}", {"codes": rng.integers(0, codes, (1, grid, grid))}),
                ("2x2x3", {"codes": rng.integers(0, codes, (2, 2, 3))})]

    layers = sum(name.startswith("past_keys_") for name in io)
    _, heads, _, head_dim = io["past_keys_0"]["shape"]
    dim = io["inputs_embeds" if graph == "target" else "target_hidden"]["shape"][2]
    cases = []
    for name, b, t, capacity, valid, pos, new_mask in _attention_cases(manifest):
        feeds = {}
        if graph == "target":
            feeds["inputs_embeds"] = rng.standard_normal((b, t, dim)).astype(fdt)
        else:
            feeds["target_hidden"] = rng.standard_normal((b, t, dim)).astype(fdt)
            feeds["input_ids"] = rng.integers(0, vocab, (b, t))
        feeds["position_ids"] = np.ascontiguousarray(np.broadcast_to(pos, (b, t))).astype(np.int64)
        feeds["attention_mask"] = _mask(b, capacity, valid, new_mask)
        feeds.update(cache_feeds(_kv(rng, layers, b, heads, capacity, valid, head_dim, fdt),
                                 _kv(rng, layers, b, heads, capacity, valid, head_dim, fdt)))
        if graph == "drafter":
            k = manifest["candidates"]
            # prefill: no CFG, no filter; step: CFG halves with every filter; tree: CFG, plain.
            n, scale, temp, top_k, top_p = {"prefill": (b, 1.0, 1.0, 0, 1.0),
                                            "step": (1, 4.0, 0.8, min(5, k), 0.9),
                                            "tree": (b // 2, 2.0, 1.0, 0, 1.0)}[name]
            feeds.update(cond_batch=np.array([n], dtype=np.int64), cfg_scale=np.array([scale], dtype=np.float32),
                         temperature=np.array([temp], dtype=np.float32), top_k=np.array([top_k], dtype=np.int64),
                         top_p=np.array([top_p], dtype=np.float32))
        cases.append((name, feeds))
    return cases


# ---------------------------------------------------------------------------------------------
# Running both sides


def _session(path, bf16):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.inter_op_num_threads = 1
    if not bf16:
        return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    with tempfile.TemporaryDirectory() as tmp:  # the session has read everything once it exists
        upcast = os.path.join(tmp, "upcast.onnx")
        _upcast_bf16(path, upcast)
        return ort.InferenceSession(upcast, options, providers=["CPUExecutionProvider"])


def _upcast_bf16(src, dst):
    """Copy an ONNX model with every bf16 tensor, cast and I/O type made fp32 (exact for values)."""
    import onnx
    from onnx import numpy_helper

    bf16, fp32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
    model = onnx.load(src)

    def fix_tensor(t):
        if t.data_type == bf16:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))

    def fix_graph(graph):
        for t in graph.initializer:
            fix_tensor(t)
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    fix_tensor(attr.t)
                elif attr.name in ("to", "dtype") and attr.i == bf16:
                    attr.i = fp32
                for sub in list(attr.graphs) + ([attr.g] if attr.HasField("g") else []):
                    fix_graph(sub)
        del graph.value_info[:]
        for v in list(graph.input) + list(graph.output):
            if v.type.tensor_type.elem_type == bf16:
                v.type.tensor_type.elem_type = fp32

    fix_graph(model.graph)
    onnx.save_model(model, dst, save_as_external_data=True, location=os.path.basename(dst) + ".data")


def _torch_run(module, contract, feeds, float_dtype):
    kinds = graph_io(contract, graph_layers(contract, module))["inputs"]
    args = []
    for name, value in feeds.items():
        t = torch.from_numpy(np.ascontiguousarray(value))
        args.append(t.to(float_dtype) if kinds[name][0] == "float" else t)
    with torch.inference_mode():
        out = module(*args)
    return out if isinstance(out, tuple) else (out,)


def _combined_logits(module, hidden, feeds):
    """The drafter graph's CFG-combined logits for given hidden states, in fp32."""
    weight = module.head.weight.detach().float()
    with torch.inference_mode():
        logits = torch.nn.functional.linear(torch.from_numpy(hidden).float(), weight)
    n, scale = int(feeds["cond_batch"][0]), float(feeds["cfg_scale"][0])
    uncond = logits[logits.shape[0] - n:]
    return uncond + scale * (logits[:n] - uncond)


def _clear_ranks(module, got, want, feeds, eps):
    """Which (row, token, rank) entries of the top-k are clear of a near-tie: the reference's
    logit gap to the neighbouring ranks exceeds 4x the logit error that ORT's hidden-state error
    implies plus one rounding unit of the graph's dtype at the logits' scale."""
    ref = _combined_logits(module, want["hidden_out"], feeds)
    est = float((_combined_logits(module, got["hidden_out"], feeds) - ref).abs().max())
    k = module.candidates
    values = torch.topk(ref, min(k + 1, ref.shape[-1]), dim=-1).values.numpy()
    diffs = values[..., :-1] - values[..., 1:]  # diffs[r]: rank r minus rank r + 1
    above = np.full(values.shape[:-1] + (k,), np.inf)
    above[..., 1:] = diffs[..., : k - 1]
    below = np.full(values.shape[:-1] + (k,), np.inf)
    below[..., : diffs.shape[-1]] = diffs[..., :k]
    return np.minimum(above, below) > 4 * (est + eps * float(np.abs(values).max()))


def _compare_float(got, want, atol, rtol):
    got, want = got.astype(np.float64), want.astype(np.float64)
    if got.shape != want.shape:
        return {"ok": False, "max_abs": float("inf"), "max_rel": float("inf"), "scale": None,
                "note": f"shape {list(got.shape)} != {list(want.shape)}"}
    scale = float(np.abs(want).max()) if want.size else 0.0
    if not np.isfinite(got).all() and np.isfinite(want).all():
        return {"ok": False, "max_abs": float("inf"), "max_rel": float("inf"), "scale": scale, "note": "non-finite"}
    max_abs = float(np.abs(got - want).max()) if want.size else 0.0
    return {"ok": max_abs <= atol + rtol * scale, "max_abs": max_abs, "max_rel": max_abs / scale if scale else 0.0,
            "scale": scale, "bound": atol + rtol * scale}


def _compare_ids(got, want, is_clear):
    if got.shape != want.shape:
        return {"ok": False, "note": f"shape {list(got.shape)} != {list(want.shape)}"}
    bad = int(((got != want) & is_clear).sum())
    return {"ok": bad == 0, "mismatched": bad, "clear": int(is_clear.sum()), "near_ties": int((~is_clear).sum()),
            "note": f"{bad} of {int(is_clear.sum())} clear ranks differ, {int((~is_clear).sum())} near-ties skipped"}


def check_engine(directory, *, verify=True, atol=None, rtol=None, seed=0, modules=None):
    """Compare every graph of an engine on ONNX Runtime (CPU, 2 threads) with the PyTorch modules.

    verify: check the engine files' and the source checkpoints' sha256 (sizes always).
    modules: {graph: (contract, module)} to compare against instead of reloading the sources.
    Returns {"engine", "dtype", "atol", "rtol", "ok", "results": [per graph/case/output dicts],
    "failures": [one line each]}. Raises LanternError for a directory that does not match its
    manifest or sources that changed."""
    from lantern.export.onnx_export import DTYPES, load_graph_modules

    directory = os.fspath(directory)
    manifest = read_manifest(directory, verify=verify)
    dtype = manifest["dtype"]
    default_atol, default_rtol = TOLERANCES[dtype]
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    if modules is None:
        modules = load_graph_modules(manifest, verify_sources=verify)
    bf16 = dtype == "bf16"
    rng = np.random.default_rng(seed)
    results = []
    for graph, entry in manifest["graphs"].items():
        module = modules[graph][1]
        graph_dtype = entry.get("dtype", dtype)
        float_dtype = torch.float32 if graph_dtype in ("fp32", "bf16") else DTYPES[graph_dtype]
        if graph_dtype == "bf16":
            module = module.float()  # the same bf16 weights, run in fp32 like the upcast graph
        try:
            session = _session(os.path.join(directory, entry["file"]), bf16 and graph_dtype == "bf16")
        except Exception as e:  # ORT's own exception types
            raise LanternError(f"{directory}/{entry['file']}: ONNX Runtime cannot load it "
                               f"({str(e).splitlines()[0]}); rebuild the engine") from None
        for case, feeds in _inputs(graph, manifest, rng):
            got = dict(zip(entry["outputs"], session.run(entry["outputs"], feeds)))
            want = _torch_run(module, entry["contract"], feeds, float_dtype)
            want = {name: t.float().numpy() if t.is_floating_point() else t.numpy()
                    for name, t in zip(entry["outputs"], want)}
            for name in entry["outputs"]:
                if name == "topk_ids":
                    clear = _clear_ranks(module, got, want, feeds, _EPS[graph_dtype])
                    result = _compare_ids(got[name], want[name], clear)
                else:
                    result = _compare_float(got[name], want[name], atol, rtol)
                results.append({"graph": graph, "case": case, "output": name, **result})
    failures = [f"{r['graph']}/{r['case']}/{r['output']}: " +
                (r.get("note") or f"max abs error {r['max_abs']:.3g} > bound {r['bound']:.3g}")
                for r in results if not r["ok"]]
    return {"engine": directory, "dtype": dtype, "atol": atol, "rtol": rtol, "ok": not failures,
            "results": results, "failures": failures}


def format_report(report):
    lines = [f"engine {report['engine']} ({report['dtype']}): pass iff max|ort - torch| <= "
             f"{report['atol']:g} + {report['rtol']:g} * max|torch| per output",
             f"{'graph':<11}{'case':<9}{'output':<15}{'max abs':>10}{'max rel':>10}  result"]
    for r in report["results"]:
        if "max_abs" in r:
            row = f"{r['max_abs']:>10.2e}{r['max_rel']:>10.2e}"
        else:
            row = f"{'':>10}{'':>10}"
        note = r.get("note", "") if r["output"] == "topk_ids" or not r["ok"] else ""
        lines.append(f"{r['graph']:<11}{r['case']:<9}{r['output']:<15}{row}  {'ok' if r['ok'] else 'FAIL'}"
                     + (f" ({note})" if note else ""))
    return "\n".join(lines)


def add_parser(sub):
    p = sub.add_parser("check", help="compare an engine's ONNX graphs (ONNX Runtime) with the PyTorch modules",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("engine", help="engine directory (engines/NAME)")
    p.add_argument("--verify-hashes", dest="verify", action="store_true", default=True,
                   help="check the sha256 of the engine files and the source checkpoints (default)")
    p.add_argument("--no-verify-hashes", dest="verify", action="store_false", help="check file sizes only")
    p.add_argument("--atol", type=float, help="absolute tolerance (default per dtype: " +
                   ", ".join(f"{k} {v[0]:g}" for k, v in TOLERANCES.items()) + ")")
    p.add_argument("--rtol", type=float, help="tolerance relative to each output's max |value| (default per dtype: " +
                   ", ".join(f"{k} {v[1]:g}" for k, v in TOLERANCES.items()) + ")")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.set_defaults(func=run)


def run(args):
    report = check_engine(args.engine, verify=args.verify, atol=args.atol, rtol=args.rtol, seed=args.seed)
    print(format_report(report))
    if not report["ok"]:
        print(f"check FAILED: {len(report['failures'])} output(s) over tolerance: " + "; ".join(report["failures"][:5]))
        return 1
    print(f"check passed: {len(report['results'])} outputs within tolerance")
    return 0
