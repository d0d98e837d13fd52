"""`lantern-export onnx`: checkpoints -> an engine directory (ONNX graphs + manifest.json).

The graphs are the torch modules of lantern.export.graphs, each exported by
lantern.export.graph_export (torch's dynamo exporter), named and typed exactly as
lantern.runtime.contracts.GRAPHS says.

Weights: large safetensors tensors (the Chameleon family's checkpoints) are never loaded whole:
the graphs are traced over one-element placeholders and each weight is read, cast and transposed
while its external data is written (lantern.export.streaming), so a 7B export peaks near the
largest tensor plus the graph, not the model.

The directory is built in a temporary sibling of --out and renamed into place when complete,
so --out either holds a whole engine or nothing. manifest.json is written last.

Attention form (--attention, lantern.export.cache_forms): `plain` (default) exports the target and
drafter with caches in and the new tokens' K/V out, at any cache length; `inplace` exports the forms
TensorRT fuses (opset 24: TensorScatter writes the new K/V into static caches in place, Attention
attends over them with the tree mask) plus commit.onnx, with cache lengths fixed here
(Manifest.inplace_cache: the prefix budget, the grid's tokens and --max-tree-nodes).

Precision: --dtype casts the target and the drafter; LlamaGen's RMSNorm and RoPE still compute
in fp32 inside (the RoPE table stays fp32), logits and the drafter's top-k probabilities come
out fp32 as the contracts say. The VQ decoder always stays fp32 (it runs once per image, and
VQGAN decoders' GroupNorm/attention are prone to fp16 overflow); its manifest entry says so.
"""
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch

from lantern.export import placement
from lantern.export.families import DTYPES, FAMILIES, family_of
from lantern.export.cache_forms import ATTENTION_FORMS
from lantern.export.graph_export import DEFAULT_OPSET, export_graph, weight_bytes
from lantern.export.inspect_cmd import add_model_options, target_options
from lantern.export.neighbors import nearest_neighbors
from lantern.export.quantize import add_quantize_options, describe_quantization, quantize_graphs, quantize_options
from lantern.export.streaming import DeferredWeights
from lantern.runtime import manifest as engine_format
from lantern.runtime.contracts import resolved_io
from lantern.runtime.errors import LanternError
from lantern.runtime.integrity import sha256_file
from lantern.runtime.tree import build_tree

DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
INPLACE_OPSET = 24  # TensorScatter (in-place cache update) is opset 24; Attention opset 23
DEFAULT_TREE = "mc_sim_7b_63"  # EAGLE-1's default and the public LANTERN command line's
DEFAULT_NEIGHBORS_K = 1000  # the public code's default k


# ---------------------------------------------------------------------------------------------
# Loading and preparing the models (shared with `check` and the runtime's torch backend)


def load_graph_modules(manifest, verify=False):
    """The torch graph modules of an engine, rebuilt from the source checkpoints its manifest
    records (same family, loaders, options, dtype and candidates as the export):
    {graph: (contract, module)}."""
    sources = manifest.sources
    if not sources or "target" not in sources:
        raise LanternError("the engine's manifest records no source checkpoints, so its torch modules cannot be "
                           "rebuilt; re-export it with `lantern-export onnx`")
    if verify:
        verify_sources(manifest)
    if manifest.family not in FAMILIES:
        raise LanternError(f"the engine's family {manifest.family!r} is unknown to this lantern; valid: "
                           f"{', '.join(FAMILIES)}")
    family = FAMILIES[manifest.family]
    t = sources["target"]
    models = family.load(t["path"], t.get("format_option"), t.get("options"),
                         drafter=sources["drafter"]["path"] if "drafter" in sources else None,
                         vq=sources["vq"]["path"] if "vq" in sources else None)
    family.cast(models, manifest.dtype)
    return family.graphs(models, manifest.candidates, manifest.attention)


def _source_record(role, path, info, options=None):
    """Where a checkpoint came from and the sha256 of each of its files (a directory's top-level
    files), so `check` can tell whether it still compares against the same weights."""
    path = os.path.abspath(path)
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, name) for name in os.listdir(path) if os.path.isfile(os.path.join(path, name)))
    record = {"path": path, "format": info["format"],
              "sha256": {os.path.basename(f): sha256_file(f) for f in files}}
    if options is not None:
        record["options"] = options
    return record


def verify_sources(manifest):
    """LanternError unless every source checkpoint the manifest records is there, unchanged."""
    for role, record in manifest.sources.items():
        _verify_source(role, record)


def _verify_source(role, record):
    path = record["path"]
    for name, digest in record["sha256"].items():
        file = path if os.path.isfile(path) else os.path.join(path, name)
        if not os.path.isfile(file):
            raise LanternError(f"{role} checkpoint {file} is missing; the engine's source is gone (rebuild or restore it)")
        if sha256_file(file) != digest:
            raise LanternError(f"{role} checkpoint {file} changed since the export (sha256 differs); "
                               f"rebuild the engine or restore the checkpoint")


# ---------------------------------------------------------------------------------------------
# The engine directory


def _tool_versions():
    from importlib import metadata

    import onnx

    versions = {"python": platform.python_version(), "torch": torch.__version__, "onnx": onnx.__version__}
    for package in ("onnxscript", "onnxruntime", "lantern"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def export_engine(out, target, *, target_format=None, target_options=None, drafter=None, vq=None, tree=None,
                  dtype="fp32", candidates=None, opset=None, neighbors_k=None, attention="plain",
                  max_tree_nodes=None, max_prompt_tokens=None, force=False, progress=False, quantize=None,
                  graph_cache=None):
    """Build the engine directory `out` from checkpoints and return its manifest.
    quantize: a lantern.export.quantize.QuantizeOptions to quantize the target and drafter
    graphs (weight-only int8 / int4) before the manifest is written; None keeps them float.
    graph_cache: a directory of earlier exports' graphs (lantern.export.graph_cache) to copy
    unchanged graphs from instead of tracing them again; None traces every graph.

    attention: 'plain' or 'inplace' (module docstring); max_tree_nodes / max_prompt_tokens size a
    in-place engine's static caches (default: the export tree's nodes / 128 prompt tokens).
    Everything that can be checked is checked before anything is written; the directory appears
    at `out` only when complete."""
    import onnx

    # Options first, then the checkpoints; no file is created until all of it passed.
    out = os.path.abspath(os.fspath(out))
    if dtype not in DTYPES:
        raise LanternError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    if attention not in ATTENTION_FORMS:
        raise LanternError(f"unknown attention form {attention!r}; valid: {', '.join(ATTENTION_FORMS)}")
    lowest = INPLACE_OPSET if attention == "inplace" else DEFAULT_OPSET
    opset = lowest if opset is None else opset
    if isinstance(opset, bool) or not isinstance(opset, int) or not lowest <= opset <= onnx.defs.onnx_opset_version():
        why = f" (--attention inplace needs TensorScatter, opset {INPLACE_OPSET})" if attention == "inplace" else ""
        raise LanternError(f"opset {opset!r} is not supported: the dynamo exporter writes opset "
                           f"{lowest}..{onnx.defs.onnx_opset_version()}{why}")
    if attention == "plain" and (max_tree_nodes is not None or max_prompt_tokens is not None):
        raise LanternError("--max-tree-nodes and --max-prompt-tokens size static caches: they need --attention inplace")
    if candidates is not None and (isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1):
        raise LanternError(f"--candidates must be a positive integer, got {candidates!r}")
    if drafter is None and tree is not None:
        raise LanternError("--tree needs --drafter: an engine without a drafter serves mode 'ar' only")
    if drafter is None and candidates is not None:
        raise LanternError("--candidates needs --drafter (it is the drafter graph's top-k width)")
    if vq is None and neighbors_k is not None:
        raise LanternError("--neighbors-k needs --vq (the neighbors come from the VQ codebook)")
    if quantize is not None:
        quantize.check()
        if dtype != "fp32":
            raise LanternError(f"--quantize {quantize.scheme} starts from fp32 weights; drop --dtype {dtype}")
    placement.check_engine_destination(out, force)
    draft_tree = None
    if drafter is not None:

        draft_tree = build_tree(tree or DEFAULT_TREE)
    tree_nodes = None
    if attention == "inplace":
        tree_nodes = draft_tree.num_nodes if draft_tree is not None else 1
        if max_tree_nodes is not None:
            if isinstance(max_tree_nodes, bool) or not isinstance(max_tree_nodes, int) or max_tree_nodes < tree_nodes:
                raise LanternError(f"--max-tree-nodes must be an integer >= {tree_nodes} (the export tree's nodes, "
                                   f"root included), got {max_tree_nodes!r}")
            tree_nodes = max_tree_nodes

    family = family_of(target, target_format)
    stages = ["load"] + (["condition"] if family.condition_graph else []) + ["target"] + \
             (["drafter"] if drafter else []) + (["commit"] if drafter and attention == "inplace" else []) + \
             (["vq_decoder", "neighbors"] if vq else []) + ["manifest"]
    bar = _progress(stages, progress)
    job = _Export(family=family, target=target, target_format=target_format, target_options=target_options,
                  drafter=drafter, vq=vq, draft_tree=draft_tree, dtype=dtype, candidates=candidates, opset=opset,
                  neighbors_k=neighbors_k, attention=attention, tree_nodes=tree_nodes,
                  max_prompt_tokens=max_prompt_tokens, quantize=quantize,
                  graph_cache=None if graph_cache is None else os.path.abspath(os.fspath(graph_cache)))
    try:
        return _build(placement.engine_directory(out, force), bar, job)
    finally:
        bar.close()


@dataclass(frozen=True)
class _Export:
    """What export_engine checked and resolved, for _build."""

    family: object  # a families.Family
    target: str
    target_format: Optional[str]
    target_options: Optional[dict]
    drafter: Optional[str]
    vq: Optional[str]
    draft_tree: object  # a runtime Tree, or None without a drafter
    dtype: str
    candidates: Optional[int]
    opset: int
    neighbors_k: Optional[int]
    attention: str
    tree_nodes: Optional[int]  # static cache tree slots (in-place form)
    max_prompt_tokens: Optional[int]
    quantize: object = None  # a QuantizeOptions, or None
    graph_cache: Optional[str] = None  # a lantern.export.graph_cache directory, or None


def _inplace_cache(family, models, tree_nodes, max_prompt_tokens):
    """The in-place form's cache budget (Manifest.inplace_cache)."""
    prefix = family.prefix_tokens(models, max_prompt_tokens)
    image = family.image_tokens(models)
    return engine_format.CacheBudget(prefix=prefix, image_tokens=image, tree_nodes=tree_nodes,
                                     target=prefix + image + tree_nodes, drafter=image + tree_nodes)


def _build(staging, bar, job):
    family, drafter, vq, draft_tree, dtype, attention = (job.family, job.drafter, job.vq, job.draft_tree, job.dtype,
                                                         job.attention)
    candidates, neighbors_k = job.candidates, job.neighbors_k
    bar.set_description("load")
    # Large safetensors tensors stay on disk until each is written (lantern.export.streaming): a 7B
    # target is never held in memory.
    deferred = DeferredWeights()
    models = family.load(job.target, job.target_format, job.target_options, drafter, vq,
                         defer=(deferred, DTYPES[dtype]))
    sources = {"target": _source_record("target", job.target, models["target"].info,
                                        _options_record(job.target_options))}
    sources["target"]["format_option"] = job.target_format
    if drafter is not None:
        sources["drafter"] = _source_record("drafter", drafter, models["drafter"].info)
    if vq is not None:
        sources["vq"] = _source_record("vq", vq, models["vq"].info)
        n_codes = models["vq"].model.config.codebook_size
        neighbors_k = min(DEFAULT_NEIGHBORS_K, n_codes - 1) if neighbors_k is None else neighbors_k
        if isinstance(neighbors_k, bool) or not isinstance(neighbors_k, int) or not 1 <= neighbors_k <= n_codes - 1:
            raise LanternError(f"--neighbors-k must be in [1, {n_codes - 1}] for {n_codes} codes, got {neighbors_k!r}")
    inplace_cache = None if attention == "plain" else _inplace_cache(family, models, job.tree_nodes,
                                                                   job.max_prompt_tokens)
    family.cast(models, dtype)
    graphs = family.graphs(models, candidates, attention)
    extra_files = family.extra_files(models, vq)
    record = family.record(models, extra_files)
    if drafter is not None:
        candidates = graphs["drafter"][1].candidates
        codes = record["vocabulary"].codes
        if candidates > codes:
            raise LanternError(f"--candidates {candidates} exceeds the {codes} image tokens")
        if candidates < draft_tree.max_width:
            raise LanternError(f"--candidates {candidates} is narrower than tree {draft_tree.name!r}, whose widest "
                               f"node has {draft_tree.max_width} children")
    _check_disk(os.path.dirname(staging.path), graphs)
    bar.update()

    tmp = staging.open()  # locks `out`, re-checks it, cleans dead runs' leftovers
    try:
        files, graph_entries = [], {}
        for name, (contract, module) in graphs.items():
            bar.set_description(f"export {name}")
            graph_dtype = "fp32" if name == "vq_decoder" else dtype
            dims = family.dims(name, models, candidates)
            if inplace_cache is not None:  # S: the graph's static cache slots
                dims["S"] = inplace_cache.drafter if name == "drafter" else inplace_cache.target
            io_spec = resolved_io(contract, dims, DTYPE_NAMES[graph_dtype], layers=family.layers(name, models))
            path = os.path.join(tmp, engine_format.GRAPH_FILES[name])
            written = export_graph(module, io_spec, path, job.opset, deferred, job.graph_cache)
            files += written
            graph_entries[name] = engine_format.Graph(
                file=written[0], contract=contract, dtype=graph_dtype,
                inputs={k: engine_format.TensorSpec(v["dtype"], tuple(v["shape"])) for k, v in io_spec["inputs"].items()},
                outputs={k: engine_format.TensorSpec(v["dtype"], tuple(v["shape"])) for k, v in io_spec["outputs"].items()},
                external_data=written[1] if len(written) > 1 else None)
            bar.update()
        if job.quantize is not None:  # in place, file names unchanged; records go into the graphs' entries

            bar.set_description(f"quantize {job.quantize.scheme}")
            graph_entries = quantize_graphs(tmp, graph_entries, job.quantize)
        neighbors = None
        if vq is not None:
            bar.set_description("neighbors")
            neighbors = _write_neighbors(tmp, family.code_vectors(models), neighbors_k)
            files.append(neighbors.file)
            bar.update()
        for name, src in extra_files.items():
            shutil.copyfile(src, os.path.join(tmp, name))
            files.append(name)

        bar.set_description("manifest")
        manifest = engine_format.Manifest(
            **record, dtype=dtype, opset=job.opset, graphs=graph_entries,
            modes=("ar",) + (("exact",) if drafter else ()) + (("lantern", "lantern++") if drafter and vq else ()),
            tree=None if draft_tree is None else draft_tree.to_json(), candidates=candidates, neighbors=neighbors,
            sources=sources, tools=_tool_versions(),
            build={"kind": "onnx", "exporter": "torch.onnx.export(dynamo=True)", "attention": attention,
                   "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
            inplace_cache=inplace_cache, files=engine_format.describe_files(tmp, files))
        manifest.write(tmp)
        staging.place()  # re-checks `out` under the lock; never replaces what this run did not expect
        bar.update()
    except BaseException:
        staging.discard()
        raise
    return manifest


def _check_disk(parent, graphs):
    """LanternError before anything is written when the disk under `parent` cannot hold the graphs'
    weights (each graph writes its own copy of a shared weight) with 5% to spare."""
    while not os.path.isdir(parent) and os.path.dirname(parent) != parent:  # the nearest that exists
        parent = os.path.dirname(parent)
    needed = int(1.05 * sum(weight_bytes(module) for _, module in graphs.values()))
    free = shutil.disk_usage(parent).free
    if needed > free:
        raise LanternError(f"the engine's graphs need about {needed / 2**30:.1f} GiB of disk under {parent}; "
                           f"{free / 2**30:.1f} GiB is free")


def _write_neighbors(directory, vectors, k):
    """neighbors.npy: each code's k nearest codes by L2 distance of `vectors` (the family's)."""
    import numpy as np


    table = nearest_neighbors(vectors, k)
    np.save(os.path.join(directory, "neighbors.npy"), table, allow_pickle=False)
    return engine_format.Neighbors(file="neighbors.npy", k=int(table.shape[1]), dtype=str(table.dtype))


def _options_record(options):
    options = dict(options or {})
    if options.get("config_file"):
        options["config_file"] = os.path.abspath(options["config_file"])
    return options


class _NoBar:
    def set_description(self, _):
        pass

    def update(self, n=1):
        pass

    def close(self):
        pass


def _progress(stages, enabled):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=len(stages), unit="stage", file=sys.stderr, bar_format="{desc:<20} {bar} {n}/{total} [{elapsed}]")


# ---------------------------------------------------------------------------------------------
# CLI


def add_parser(sub):
    p = sub.add_parser("onnx", help="export checkpoints to an engine directory (ONNX graphs + manifest)",
                       description="Export a LlamaGen target (and a LANTERN drafter, a VQ decoder) to an engine "
                                   "directory, written atomically. Without --drafter the engine serves 'ar' only.")
    p.add_argument("--target", required=True, help="target checkpoint: LlamaGen .pt or LANTERN HF directory")
    add_model_options(p)
    p.add_argument("--drafter", help="LANTERN/EAGLE drafter directory (config.json + weights)")
    p.add_argument("--vq", help="LlamaGen VQ tokenizer checkpoint: adds vq_decoder.onnx and neighbors.npy")
    p.add_argument("--tree", help=f"static draft tree: preset name or JSON file (default {DEFAULT_TREE}; needs --drafter)")
    p.add_argument("--dtype", default="fp32", help="graph precision: fp32, fp16 or bf16 (default fp32)")
    p.add_argument("--candidates", type=int, help="top-k width K of the drafter graph (default min(2048, image codes))")
    p.add_argument("--opset", type=int, help=f"ONNX opset (default {DEFAULT_OPSET}; {INPLACE_OPSET} with --attention inplace)")
    p.add_argument("--attention", default="plain", choices=ATTENTION_FORMS,
                   help="graph form: plain (caches in, new K/V out; any cache length) or inplace (static caches "
                        "updated in place and fused attention, the forms TensorRT fuses, plus commit.onnx)")
    p.add_argument("--max-tree-nodes", type=int,
                   help="inplace: the largest draft tree (nodes, root included) the static caches hold "
                        "(default: the export tree's)")
    p.add_argument("--max-prompt-tokens", type=int,
                   help="inplace, prompt engines: the longest prompt row the static caches hold; shorter prompts are "
                        "left-padded (default 128)")
    p.add_argument("--neighbors-k", type=int, help=f"latent neighbors per code (default min({DEFAULT_NEIGHBORS_K}, codes - 1))")

    add_quantize_options(p)
    p.add_argument("--out", required=True, help="engine directory to create, e.g. engines/NAME")
    p.add_argument("--force", action="store_true", help="replace an existing engine directory")
    p.add_argument("--graph-cache", default=os.environ.get("LANTERN_GRAPH_CACHE") or None, metavar="DIR",
                   help="keep each exported graph in DIR under a key of everything it was exported from, and copy "
                        "it from there when an export would trace the same graph again (re-exports with another "
                        "tree, drafter or --neighbors-k skip the unchanged graphs; default: $LANTERN_GRAPH_CACHE, "
                        "else no cache)")
    p.add_argument("--no-graph-cache", dest="graph_cache", action="store_const", const=None,
                   help="trace every graph, even with $LANTERN_GRAPH_CACHE set (timing an export)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args):
    start = time.perf_counter()
    manifest = export_engine(args.out, args.target, target_format=args.format, target_options=target_options(args),
                             drafter=args.drafter, vq=args.vq, tree=args.tree, dtype=args.dtype,
                             candidates=args.candidates, opset=args.opset, neighbors_k=args.neighbors_k,
                             attention=args.attention, max_tree_nodes=args.max_tree_nodes,
                             max_prompt_tokens=args.max_prompt_tokens, force=args.force,
                             progress=not args.no_progress, quantize=quantize_options(args),
                             graph_cache=args.graph_cache)
    size = sum(f.size for f in manifest.files.values())
    print(f"engine {args.out}: {', '.join(manifest.graphs)} ({manifest.dtype}, opset {manifest.opset}, "
          f"{manifest.attention} attention, {size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f}s")
    if manifest.inplace_cache is not None:
        s = manifest.inplace_cache
        print(f"static caches: target {s.target} slots (prefix {s.prefix} + image {s.image_tokens} + tree "
              f"{s.tree_nodes}), drafter {s.drafter}")
    if describe_quantization(manifest):
        print(describe_quantization(manifest))
    if manifest.tree is not None:

        tree = build_tree(manifest.tree)
        print(f"modes: {', '.join(manifest.modes)}; tree {tree.name} ({tree.num_nodes} nodes, depth {tree.depth}), "
              f"drafter top-{manifest.candidates}")
    else:
        print("modes: ar only (no --drafter given)")
    if manifest.neighbors is None and manifest.tree is not None:
        print("no neighbor table (no --vq): modes lantern and lantern++ need one")
    return 0
