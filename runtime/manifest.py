"""The engine directory format: the typed manifest that `lantern-export` writes and the runtime reads.

engines/NAME/
  manifest.json     this format (SCHEMA_VERSION), written last
  condition.onnx    class ids / caption -> condition embeddings (LlamaGen)
  target.onnx       the AR target: prefill, one-token steps and tree verification in one graph
  drafter.onnx      the drafter with CFG, filters and top-K in the graph (absent: `ar` only)
  commit.onnx       in-place engines: moves the accepted path's K/V inside the target's cache
  vq_decoder.onnx   code grid -> RGB in [-1, 1] (optional)
  neighbors.npy     latent neighbors [codes, k] of every code, nearest first (optional)
  *.onnx.data       external weights of a graph
  accept/*.onnx     acceptance graphs per draft tree (`Manifest.acceptance`; optional: a tree
                    without them runs acceptance on the host)
  plans/KEY/*.plan  TensorRT plans built from the graphs by `lantern-export trt` (optional;
                    KEY = flavor and compute capabilities, e.g. tensorrt-rtx-SM89)

`Manifest` is the only way into a manifest: export builds one and writes it with `write`, the
runtime reads it with `read_manifest`, which validates every field (types, ranges, the graphs'
files, the modes the engine can serve) and refuses unknown fields and other schema versions with
a line that says to re-export. Nothing else in the code base reads manifest keys.

Every file is listed in `files` with its size and sha256: sizes are checked on every open,
hashes when asked (`read_manifest(..., verify=True)`, `lantern-export check`).

`tuned_trees` (optional) records the draft trees `lantern-run tune` chose on this engine:
{settings key: TunedSettings}. The key (`GenerationSettings.key`) names the generation settings that
change acceptance: the mode and its relaxation (lam or delta, k), greedy or sampling with its
temperature/top-k/top-p, and the CFG scale and interval (CFG on or off also changes the rows
every call carries). Each entry holds one TunedTree per batch size tuned for (latency depends
on the batch, acceptance does not) and names the backend the latency was measured on:
`Engine.generate` uses an entry only on that backend, with the tree of the tuned batch nearest
the request's image count, unless a tree is given. A TunedTree with no file means "no drafting"
(AR was predicted fastest for those settings on that machine).
"""
import dataclasses
import json
import math
import os
import re
import sys
import typing
from dataclasses import dataclass, field
from typing import Optional

from lantern.runtime.contracts import ACCEPT_CONTRACTS, GRAPHS, IN_PLACE_CONTRACTS, graph_io
from lantern.runtime.enginedir import inside, load_json, onnx_external_files, open_file, write_file
from lantern.runtime.errors import LanternError
from lantern.runtime.integrity import REBUILD, sha256_file, verify_files
from lantern.runtime.settings import MODES, GenerationSettings
from lantern.runtime.tree import build_tree

SCHEMA_VERSION = 2
PROMPT_STYLES = ("anole", "lumina_mgpt")
DTYPES = ("fp32", "fp16", "bf16")
TENSOR_DTYPES = ("float32", "float16", "bfloat16", "int64", "bool")

GRAPH_FILES = {"condition": "condition.onnx", "target": "target.onnx", "drafter": "drafter.onnx",
               "vq_decoder": "vq_decoder.onnx", "commit": "commit.onnx"}

REEXPORT = "re-export the engine with `lantern-export onnx`"
RETUNE = "run `lantern-run tune` again (or delete the entry)"
REBUILD_PLANS = "rebuild the plans with `lantern-export trt ENGINE --force`"
READD_ACCEPTANCE = "add them again with `lantern-export accept ENGINE --force`"


# ---------------------------------------------------------------------------------------------
# How a record field is read and written
#
# A field's annotation says its JSON form: int, float, str, bool, dict, tuple (a JSON list), a
# record (a nested object), Optional[...] (may be missing or null). `rule(...)` adds what the
# annotation cannot say, in the field's metadata; the reader and writer below take everything
# from the dataclasses, so a new field is one line in its record.


@dataclass(frozen=True)
class _Rule:
    check: Optional[typing.Callable] = None  # check(json value) -> bool, on the value as the file has it
    why: str = ""  # what check wants, for the error line
    of: object = None  # a record type (or read(value, reader)) for each value of a dict / item of a tuple
    file: bool = False  # names a file of the directory: `files` must list it
    optional: bool = False  # may be missing or null although the type is not Optional (the default then)
    fix: Optional[str] = None  # what errors below this field tell the user to do
    read: Optional[typing.Callable] = None  # read(reader, name) -> value, for a field with its own JSON form
    write: Optional[typing.Callable] = None  # write(value) -> JSON, its inverse
    was: Optional[str] = None  # the field's key in files written before it was renamed (read, never written)


_PLAIN = _Rule()


def rule(check=None, why="", *, default=dataclasses.MISSING, default_factory=dataclasses.MISSING, **how):
    """A record field with its rule in the metadata (see _Rule), e.g. `rule(POSITIVE)`."""
    if isinstance(check, tuple):  # (check, why), as the shared rules below are
        check, why = check
    return field(default=default, default_factory=default_factory,
                 metadata={"lantern": _Rule(check=check, why=why, **how)})


def one_of(values, why=None):
    values = tuple(values)
    return lambda v: v in values, why or f"one of {', '.join(values)}"


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


POSITIVE = (lambda v: v > 0, "a positive integer")
AT_LEAST_0 = (lambda v: v >= 0, "an integer >= 0")
AN_ID = (lambda v: v >= 0, "an id >= 0")
NAMES = (lambda v: all(isinstance(x, str) for x in v), "a list of node names")


# ---------------------------------------------------------------------------------------------
# The typed records


@dataclass(frozen=True)
class TensorSpec:
    dtype: str = rule(one_of(TENSOR_DTYPES, "a tensor dtype"))  # numpy-style name
    shape: tuple = rule(lambda v: all(isinstance(d, str) or (_is_int(d) and d >= 0) for d in v),
                        "a list of dims")  # ints, or names of dims that stay dynamic


QUANT_SCHEMES = {"int8": 8, "int4": 4}  # scheme -> bits
QUANT_HEADS = ("float", "int8", "int4")
QUANTIZABLE = ("target", "drafter")  # the graphs with weight MatMuls worth quantizing


@dataclass(frozen=True)
class Quantization:
    """Weight-only quantization of a graph (`lantern-export onnx --quantize`, lantern.export.quantize):
    its MatMuls with constant weights became ONNX Runtime's MatMulNBits (com.microsoft), weights
    in blocks of `block` along K with one scale per block, the output head at its own precision.
    `check` verifies the graph against this record and applies the scheme's tolerance."""

    scheme: str = rule(one_of(QUANT_SCHEMES))  # int8 / int4: the bits of the body's weights
    bits: int  # QUANT_SCHEMES[scheme]
    block: int = rule(lambda v: v >= 16 and not v & (v - 1), "a power of two >= 16")
    symmetric: bool  # no zero points
    accuracy_level: int = rule(lambda v: 0 <= v <= 4, "0..4")  # MatMulNBits' compute type: 4 = int8 activations per block, 0 = fp32
    head: str = rule(one_of(QUANT_HEADS))  # float / int8 / int4: the output head's weights
    head_nodes: tuple = rule(NAMES)  # names of the head's MatMuls in the float graph
    quantized: int = rule(POSITIVE)  # MatMulNBits nodes in the graph
    skipped: tuple = rule(NAMES)  # weight MatMuls left in float (names)
    tool: dict = field(default_factory=dict)  # quantizer and ONNX Runtime versions


@dataclass(frozen=True)
class Graph:
    file: str = rule(file=True)
    contract: str = rule(one_of(GRAPHS))  # a key of GRAPHS
    dtype: str = rule(one_of(DTYPES))  # fp32 / fp16 / bf16: the precision of its float tensors
    inputs: dict = rule(of=TensorSpec)  # name -> TensorSpec, in the contract's order
    outputs: dict = rule(of=TensorSpec)
    external_data: Optional[str] = rule(file=True, default=None)  # weights file beside it, if any
    quantization: Optional[Quantization] = None  # weight-only quantized graphs only

    @property
    def layers(self):
        """Per-layer cache inputs (0 for graphs without a cache)."""
        return sum(name.startswith("past_keys_") for name in self.inputs)


@dataclass(frozen=True)
class Shape:
    """What the runtime must know of a transformer to size its buffers and estimate a step."""

    layers: int = rule(POSITIVE)
    dim: int = rule(POSITIVE)
    query_heads: int = rule(POSITIVE)
    kv_heads: int = rule(POSITIVE)
    head_dim: int = rule(POSITIVE)
    ffn_hidden: int = rule(POSITIVE)


@dataclass(frozen=True)
class Condition:
    """How a generation is conditioned. kind 'class': one token, a class label per image
    (null_class is the unconditional row's label, None when the model has no CFG row);
    kind 'caption': `tokens` caption features of width caption_dim per image;
    kind 'prompt': a text prompt as token ids, in the rows of `style` (anole, lumina_mgpt: see
    lantern.runtime.chameleon_prompts), with the engine's copy of the text tokenizer, if any."""

    kind: str = rule(one_of(("class", "caption", "prompt"), "'class', 'caption' or 'prompt'"))
    tokens: Optional[int] = rule(POSITIVE, default=None)  # condition tokens per row (class, caption); a prompt's vary
    num_classes: Optional[int] = rule(POSITIVE, default=None)
    null_class: Optional[int] = rule(AN_ID, default=None)
    caption_dim: Optional[int] = rule(POSITIVE, default=None)
    style: Optional[str] = rule(one_of(PROMPT_STYLES, " or ".join(PROMPT_STYLES)), default=None)
    tokenizer: Optional[str] = rule(file=True, default=None)


@dataclass(frozen=True)
class Vocabulary:
    """The target's logits cover `size` ids; image tokens are ids [image_start, image_end) and a
    VQ code is its id minus image_start."""

    size: int = rule(POSITIVE)
    image_start: int = rule(AN_ID)
    image_end: int = rule(POSITIVE)

    @property
    def codes(self):
        return self.image_end - self.image_start


@dataclass(frozen=True)
class Image:
    grid_height: int = rule(POSITIVE)  # latent rows and columns: a generation makes grid_height * grid_width tokens
    grid_width: int = rule(POSITIVE)
    pixels: Optional[int] = rule(POSITIVE, default=None)  # image side in pixels when the engine has a VQ decoder

    @property
    def tokens(self):
        return self.grid_height * self.grid_width


@dataclass(frozen=True)
class Neighbors:
    file: str = rule(file=True)
    k: int = rule(POSITIVE)  # neighbors per code
    dtype: str


@dataclass(frozen=True)
class CacheBudget:
    """The cache budget of an in-place engine, fixed at export (its caches have a static length,
    which TensorRT's fused cache update needs). A generation fits when its prefix (condition
    tokens, or prompt rows left-padded to `prefix`), its image tokens and its tree fit.
    Target cache slots: prefix, then the image's tokens, then room for one tree's nodes beyond
    the last committed token. Drafter cache slots: one per committed (hidden, token) pair, then
    the current tree's nodes (scratch)."""

    prefix: int = rule(POSITIVE)  # prefix slots: LlamaGen's condition tokens; Chameleon: the longest prompt row
    image_tokens: int = rule(POSITIVE)  # the most tokens a generation emits per image
    tree_nodes: int = rule(POSITIVE)  # the largest draft tree (root included); 1 for an `ar` engine
    target: int = rule(POSITIVE)  # = prefix + image_tokens + tree_nodes: the S of the target and commit graphs
    drafter: int = rule(POSITIVE)  # = image_tokens + tree_nodes: the S of the drafter graph


@dataclass(frozen=True)
class FileRecord:
    size: int = rule(lambda v: v >= 0, "a size")
    sha256: str = rule(lambda v: len(v) == 64, "a sha256")


def _dim_range(value, r):
    """A profile's {"min", "opt", "max"} dims of one input (ranks are checked against the graph)."""
    dims = lambda v: all(_is_int(d) and d >= 0 for d in v)  # noqa: E731
    r = _Reader(value, r.where, r.path, r.fix)
    out = {k: r.get(k, list, check=dims, why="a list of dims") for k in ("min", "opt", "max")}
    r.done(out)
    return out


@dataclass(frozen=True)
class PlanProfile:
    """One optimization profile of a TensorRT plan: every dynamic input's shape range (min, opt,
    max; all three equal in the exact profiles `lantern-export trt` builds) and the step plan's
    calls it was built for, as labels such as "verify n1 cfg mc_sim_7b_63"."""

    serves: tuple = rule(lambda v: all(isinstance(s, str) for s in v), "a list of labels")
    shapes: dict = rule(of=_dim_range)  # input name -> {"min": [...], "opt": [...], "max": [...]}

    def covers(self, shapes):
        """Whether a call with these input shapes {name: shape} runs in this profile."""
        for name, rng in self.shapes.items():
            shape = shapes.get(name)
            if shape is None or len(shape) != len(rng["min"]) or not all(
                    lo <= d <= hi for lo, d, hi in zip(rng["min"], shape, rng["max"])):
                return False
        return True


@dataclass(frozen=True)
class PlanFile:
    file: str = rule(file=True)  # relative path, listed in `files`
    profiles: tuple = rule(lambda v: len(v) > 0, "a non-empty list", of=PlanProfile)  # in the plan's profile order


PLAN_FLAVORS = ("tensorrt", "tensorrt-rtx")
_SM = re.compile(r"^SM\d{2,3}$")


@dataclass(frozen=True)
class TensorRTPlans:
    """One `lantern-export trt` build: a plan per graph for one flavor and set of GPUs. A plan
    runs only on the TensorRT version that built it and on the compute capabilities it targets."""

    flavor: str = rule(one_of(PLAN_FLAVORS))  # "tensorrt" (full TensorRT) or "tensorrt-rtx" (TensorRT for RTX)
    version: str = rule(lambda v: len(v) > 0, "a version string")  # the TensorRT (or -RTX) version that built the plans
    compute_capabilities: tuple = rule(lambda v: v and all(isinstance(c, str) and _SM.match(c) for c in v),
                                       "a non-empty list like ['SM89']")  # "SM89", ...
    plans: dict = rule(lambda v: len(v) > 0, "a non-empty object", of=PlanFile)  # graph name -> PlanFile
    batches: tuple = rule(lambda v: v and all(_is_int(b) and b > 0 for b in v),
                          "a non-empty list of positive integers")  # images per call the profiles were made for
    cfg: tuple = rule(lambda v: v and all(isinstance(c, bool) for c in v) and len(set(v)) == len(v),
                      "[false], [true] or [false, true]")  # with / without classifier-free guidance
    trees: tuple = rule(lambda v: all(isinstance(t, str) for t in v), "a list of tree names")  # the draft trees profiled
    builder: dict = field(default_factory=dict)  # builder settings, for people and for rebuilding


@dataclass(frozen=True)
class TunedTree:
    """The tree `lantern-run tune` chose for one batch size (images per generate call)."""

    images: int  # the batch size: the key of the entry in the file
    file: Optional[str] = rule(file=True)  # choices JSON, or None: AR, no drafting
    name: str
    nodes: int = rule(POSITIVE)  # root included (the verification's T)
    depth: int = rule(AT_LEAST_0)
    predicted: dict  # model predictions: tokens_per_step, step_ms, tokens_per_s (of a call), speedup_vs_ar


def _read_tuned_settings(r, name):
    """The GenerationSettings of a tuned-tree entry, in the canonical form tune writes (each value
    of the type its GenerationSettings field has), or one LanternError line."""
    r = r.obj(name)
    r.get("mode", str, check=lambda v: v in MODES[1:], why=f"one of {', '.join(MODES[1:])}")  # ar needs no tree
    r.get("sampling", str, check=lambda v: v in ("greedy", "sample"), why="'greedy' or 'sample'")
    for f in dataclasses.fields(GenerationSettings):
        if f.name in r.data:
            r.get(f.name, _kind(f.type)[0])
    try:
        settings = GenerationSettings.from_canonical(r.data)
    except LanternError as e:
        r.fail("", str(e))
    if settings.canonical() != r.data:
        r.fail("", f"is {r.data!r}, not in the canonical form lantern-run tune writes ({settings.canonical()!r})")
    return settings


def _read_trees_by_batch(r, name):
    """{batch size: tree} in the file -> TunedTree per batch, ascending."""
    entries = r.get(name, dict, check=bool, why="a non-empty {batch: tree} object")
    trees = []
    for images, entry in entries.items():
        t = _Reader(entry, r.where, f"{r.path}{name}.{images}.", r.fix)
        if not images.isdigit() or int(images) < 1:
            t.fail("", "is keyed by a batch size, which must be a positive integer")
        trees.append(_read_record(TunedTree, t, images=int(images)))
    return tuple(sorted(trees, key=lambda t: t.images))


def _write_trees_by_batch(trees):
    return {str(t.images): {k: v for k, v in _to_json(t).items() if k != "images"} for t in trees}


@dataclass(frozen=True)
class TunedSettings:
    """Trees tuned for one set of generation settings (resolved; the file holds their canonical form)."""

    settings: GenerationSettings = rule(read=_read_tuned_settings, write=GenerationSettings.canonical)
    backend: str  # the backend whose latency was measured; the trees are used on it only
    trees: tuple = rule(read=_read_trees_by_batch, write=_write_trees_by_batch)  # TunedTree per batch, ascending
    report: Optional[str] = rule(file=True, default=None)  # the tuner's report.json
    measured: dict = field(default_factory=dict)  # where and how: threads, device, machine, date

    def tree_for(self, images):
        """The TunedTree of the tuned batch nearest `images` on a log scale (ties: the smaller)."""
        return min(self.trees, key=lambda t: (abs(math.log(t.images / images)), t.images))


@dataclass(frozen=True)
class AcceptanceGraphs:
    """The acceptance graphs of one draft tree (lantern.export.accept_graphs; contracts
    accept_greedy / accept_sampling). They work in the token space of the image codes followed
    by `forced_ids` (the ids the prompt style forces, ascending; none for LlamaGen and Anole),
    which must equal the generation's VocabularyView.extra for the graphs to serve it."""

    tree: dict  # {"name", "paths"}, as Manifest.tree
    forced_ids: tuple = rule(lambda v: all(_is_int(i) and i >= 0 for i in v) and list(v) == sorted(set(v)),
                             "ascending distinct vocabulary ids")  # vocabulary ids after the codes in the token space
    greedy: Graph
    sampling: Optional[Graph] = None


@dataclass(frozen=True)
class Manifest:
    family: str
    model: dict  # the family's own config and parameter count, for people and for re-export
    target: Shape
    condition: Condition
    vocabulary: Vocabulary
    image: Image
    max_positions: int = rule(POSITIVE)  # rows of the RoPE table: positions are clamped below it
    dtype: str = rule(one_of(DTYPES))
    opset: int = rule(POSITIVE)
    graphs: dict = rule(of=Graph)  # name -> Graph
    modes: tuple = rule(lambda v: v and all(x in MODES for x in v) and len(set(v)) == len(v),
                        f"a list of distinct modes from {', '.join(MODES)}")
    files: dict = rule(of=FileRecord)  # relative path -> FileRecord
    drafter: Optional[Shape] = None
    drafter_config: Optional[dict] = None
    tree: Optional[dict] = None  # {"name", "paths"}: the default draft tree
    candidates: Optional[int] = rule(POSITIVE, default=None)  # K: the drafter graph's top-k width
    neighbors: Optional[Neighbors] = None
    vq: Optional[dict] = None
    sources: dict = field(default_factory=dict)  # checkpoints the graphs came from (export reads it)
    tools: dict = field(default_factory=dict)
    build: dict = field(default_factory=dict)
    tensorrt: Optional[dict] = rule(of=TensorRTPlans, fix=REBUILD_PLANS, default=None)  # plans key -> TensorRTPlans
    tuned_trees: dict = rule(of=TunedSettings, fix=RETUNE, optional=True,
                             default_factory=dict)  # settings key -> TunedSettings (lantern-run tune)
    inplace_cache: Optional[CacheBudget] = rule(was="static_cache", default=None)  # in-place engines only
    acceptance: dict = rule(of=AcceptanceGraphs, fix=READD_ACCEPTANCE, optional=True,
                            default_factory=dict)  # tree name -> AcceptanceGraphs (`lantern-export accept`)
    schema: int = SCHEMA_VERSION

    def acceptance_for(self, tree):
        """The AcceptanceGraphs of a runtime Tree (matched by its paths, whatever its name), or None."""
        for entry in self.acceptance.values():
            if [list(p) for p in tree.paths[1:]] == entry.tree["paths"]:
                return entry
        return None

    def all_graphs(self):
        """{label: Graph} of the engine graphs and the acceptance graphs ("accept_greedy@TREE")."""
        out = dict(self.graphs)
        for name, entry in self.acceptance.items():
            for kind in ("greedy", "sampling"):
                if getattr(entry, kind) is not None:
                    out[f"accept_{kind}@{name}"] = getattr(entry, kind)
        return out

    @property
    def attention(self):
        """The graphs' cache form: 'inplace' (static caches updated in the graphs) or 'plain'."""
        return "inplace" if self.inplace_cache is not None else "plain"

    def to_json(self):
        return _to_json(self)

    def write(self, directory):
        """manifest.json in `directory`, atomically through a unique temporary name (written last
        by export; commands that change an existing engine call it under its lock,
        lantern.runtime.enginedir.locked, after re-reading the manifest)."""
        write_file(directory, "manifest.json", (json.dumps(self.to_json(), indent=2) + "\n").encode())

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


def _rule(f):
    return f.metadata.get("lantern", _PLAIN)


def _to_json(value):
    if dataclasses.is_dataclass(value):
        return {f.name: (_rule(f).write or _to_json)(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    return value


def describe_files(directory, names):
    """`files` records for the given relative paths."""
    return {name: FileRecord(size=os.path.getsize(os.path.join(directory, name)),
                             sha256=sha256_file(os.path.join(directory, name))) for name in sorted(names)}


# ---------------------------------------------------------------------------------------------
# Reading: one reader for every record, driven by the fields


class _Reader:
    """Typed access to one JSON object at `path` (e.g. "graphs.target.") of the file `where`;
    every failure is one LanternError naming the field and saying what to do (`fix`)."""

    def __init__(self, data, where, path="", fix=REEXPORT, key=None):
        self.where, self.path, self.fix = where, path, fix
        self.key = key  # the object's key in its parent (a graph's name, a tuned entry's settings key)
        if not isinstance(data, dict):
            self.fail("", f"must be an object, got {type(data).__name__}")
        self.data = data

    def fail(self, key, why):
        name = (self.path + key).rstrip(".")
        raise LanternError(f"{self.where}: {name + ' ' if name else ''}{why}; {self.fix}")

    def get(self, key, kind, optional=False, check=None, why=""):
        if key not in self.data:
            if optional:
                return None
            self.fail(key, "is missing")
        value = self.data[key]
        if value is None and optional:
            return None
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or (check is not None and not check(value)):
            self.fail(key, f"is {value!r}, expected {why or kind.__name__}")
        return value

    def obj(self, key, optional=False, fix=None):
        value = self.get(key, dict, optional)
        return None if value is None else _Reader(value, self.where, f"{self.path}{key}.", fix or self.fix)

    def done(self, known):
        unknown = sorted(set(self.data) - set(known))
        if unknown:
            self.fail("", f"has unknown field(s) {', '.join(unknown)} (written by a newer lantern?)")


def _kind(annotation):
    """(the type of a field's value, whether it may be missing or null) from its annotation."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Union and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return annotation, False


def _read_record(cls, r, **given):
    """A `cls` from the object `r` reads: each field by its annotation and rule, unknown fields
    refused, then the record's own cross-field check (_RECORD_CHECKS). `given`: fields the file
    holds elsewhere (a tuned tree's batch size is its key)."""
    values = dict(given)
    for f in dataclasses.fields(cls):
        if f.name not in given:
            values[f.name] = _read_field(r, f)
    r.done([f.name for f in dataclasses.fields(cls) if f.name not in given] +
           [_rule(f).was for f in dataclasses.fields(cls) if _rule(f).was])
    record = cls(**values)
    check = _RECORD_CHECKS.get(cls)
    return (check(record, r) or record) if check else record


def _read_field(r, f):
    how = _rule(f)
    if how.read:
        return how.read(r, f.name)
    name = f.name
    if how.was is not None and how.was in r.data:  # an engine written before the rename
        if name in r.data:
            r.fail(how.was, f"and {name} are one field under its old and new name")
        name = how.was
    kind, optional = _kind(f.type)
    record = dataclasses.is_dataclass(kind)
    value = r.get(name, dict if record else list if kind is tuple else kind, optional or how.optional,
                  how.check, how.why)
    if value is None:
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else None
    fix = how.fix or r.fix  # what to do about what is wrong inside the value
    if record:
        return _read_record(kind, _Reader(value, r.where, f"{r.path}{name}.", fix))
    if how.of is None:
        return tuple(value) if kind is tuple else value
    place = [(f"{k}", v) for k, v in value.items()] if kind is dict else [(f"[{i}]", v) for i, v in enumerate(value)]
    items = {}
    for label, v in place:
        at = f"{r.path}{name}{'.' if kind is dict else ''}{label}."
        if dataclasses.is_dataclass(how.of):
            items[label] = _read_record(how.of, _Reader(v, r.where, at, fix, key=label))
        else:
            items[label] = how.of(v, _Reader({}, r.where, at, fix))
    return items if kind is dict else tuple(items.values())


def _file_references(value, path="", fix=REEXPORT):
    """(path, file name, fix) of every field marked file=True in a record and those below it."""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            how, v = _rule(f), getattr(value, f.name)
            if how.file and v is not None:
                yield f"{path}{f.name}", v, fix
            elif not how.file:
                yield from _file_references(v, f"{path}{f.name}.", how.fix or fix)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _file_references(v, f"{path}{k}.", fix)
    elif isinstance(value, tuple):
        for i, v in enumerate(value):
            yield from _file_references(v, f"{path.rstrip('.')}[{i}].", fix)


# ---------------------------------------------------------------------------------------------
# What a record's fields must agree on (a field's own range is its rule)


def _check_shape(s, r):
    if s.query_heads % s.kv_heads:
        r.fail("query_heads", f"({s.query_heads}) is not a multiple of kv_heads ({s.kv_heads})")


def _check_condition(c, r):
    if c.kind != "prompt" and c.tokens is None:
        r.fail("tokens", "is missing")
    if c.kind == "class" and c.num_classes is None:
        r.fail("num_classes", "is missing (class-conditional engine)")
    if c.kind == "caption" and c.caption_dim is None:
        r.fail("caption_dim", "is missing (caption-conditional engine)")
    if c.kind == "prompt" and c.style is None:
        r.fail("style", "is missing (prompt-conditional engine)")


def _check_vocabulary(v, r):
    if not v.image_start < v.image_end <= v.size:
        r.fail("image_end", f"range [{v.image_start}, {v.image_end}) does not fit {v.size} ids")


def _check_graph(g, r):
    """A quantization only where it applies; inputs and outputs as the contract has them (ranks included: buffers are sized from these
    shapes), put in the contract's order whatever order the file kept."""
    q, name = g.quantization, r.key
    if q is not None:
        if name not in QUANTIZABLE:
            r.fail("quantization", f"quantizes the {name} graph; only {' and '.join(QUANTIZABLE)} are quantized")
        if g.dtype != "fp32":
            r.fail("quantization", f"is on a {g.dtype} graph; weight-only quantization starts from fp32")
    expected = graph_io(g.contract, max(g.layers, 1))
    if set(g.inputs) != set(expected["inputs"]) or set(g.outputs) != set(expected["outputs"]):
        r.fail("inputs", f"do not follow the {g.contract!r} contract of this lantern version")
    for side in ("inputs", "outputs"):
        for k, spec in getattr(g, side).items():
            want = expected[side][k][1]
            if len(spec.shape) != len(want):
                r.fail(f"{side}.{k}.shape", f"is {list(spec.shape)}, of rank {len(spec.shape)}; the {g.contract!r} "
                                            f"contract has {list(want)}")
    return dataclasses.replace(g, inputs={k: g.inputs[k] for k in expected["inputs"]},
                               outputs={k: g.outputs[k] for k in expected["outputs"]})


def _check_quantization(q, r):
    if q.bits != QUANT_SCHEMES[q.scheme]:
        r.fail("bits", f"is {q.bits!r}, expected {QUANT_SCHEMES[q.scheme]} (scheme {q.scheme})")
    if q.head == "float" and not set(q.head_nodes) <= set(q.skipped):
        r.fail("skipped", f"lacks the float head {', '.join(q.head_nodes)}")


def _check_tuned_tree(t, r):
    if (t.file is None) != (t.nodes == 1):
        r.fail("file", "must be given for a tree with drafts and null for AR (nodes 1)")


def _check_tuned_settings(t, r):
    if t.settings.key != r.key:
        r.fail("", f"is keyed {r.key!r} but its settings make the key {t.settings.key!r}")


def _check_cache_budget(s, r):
    if s.target != s.prefix + s.image_tokens + s.tree_nodes or s.drafter != s.image_tokens + s.tree_nodes:
        r.fail("", f"{s} does not add up (target = prefix + image_tokens + tree_nodes, "
                   f"drafter = image_tokens + tree_nodes)")


def _check_acceptance(a, r):
    """A draft tree keyed by its name, and graphs of the acceptance contracts without weights."""
    try:
        tree = build_tree(a.tree)
    except LanternError as err:
        r.fail("tree", f"is not a draft tree ({err})")
    if tree.name != r.key or tree.depth == 0:
        r.fail("tree", f"is named {tree.name!r} with depth {tree.depth}; the entry is keyed {r.key!r} and needs drafts")
    for kind in ("greedy", "sampling"):
        g = getattr(a, kind)
        if g is not None and (g.contract != f"accept_{kind}" or g.dtype != "fp32" or g.external_data is not None):
            r.fail(f"{kind}.contract", f"is {g.contract!r} ({g.dtype}); expected 'accept_{kind}', fp32, no weights file")


def _check_acceptance_dims(m, r):
    """The acceptance graphs' fixed dims fit their tree, the vocabulary and the token space
    (the codes, then the forced ids, which are no image tokens)."""
    for name, a in m.acceptance.items():
        v = m.vocabulary
        if any(v.image_start <= i < v.image_end or i >= v.size for i in a.forced_ids):
            r.fail(f"{name}.forced_ids", "holds an image token id or one past the vocabulary")
        tree = build_tree(a.tree)
        for kind in ("greedy", "sampling"):
            g = getattr(a, kind)
            if g is None:
                continue
            want = {"M": tree.num_nodes, "V": m.vocabulary.size, "W": m.vocabulary.codes + len(a.forced_ids),
                    "depth+1": tree.depth + 1}
            dims = {"M": g.inputs["tokens"].shape[1], "V": g.inputs["logits"].shape[2],
                    "W": g.inputs["neighbors"].shape[0], "depth+1": g.outputs["path"].shape[1]}
            if kind == "sampling":
                want["K"], dims["K"] = m.candidates, g.inputs["draft_ids"].shape[2]
            if dims != want:
                r.fail(f"{name}.{kind}.inputs", f"have dims {dims}; tree {name!r} and the engine make {want}")


_RECORD_CHECKS = {Shape: _check_shape, Condition: _check_condition, Vocabulary: _check_vocabulary,
                  Graph: _check_graph, Quantization: _check_quantization, TunedTree: _check_tuned_tree,
                  TunedSettings: _check_tuned_settings, CacheBudget: _check_cache_budget,
                  AcceptanceGraphs: _check_acceptance}


def quantization_scheme(manifest):
    """'none' when no graph is quantized, else the scheme(s) of the quantized graphs ('int8',
    or e.g. 'int4+int8' when they differ)."""
    schemes = sorted({g.quantization.scheme for g in manifest.graphs.values() if g.quantization is not None})
    return "+".join(schemes) or "none"


def _parse(data, where):
    schema = data.get("schema", data.get("format_version")) if isinstance(data, dict) else None
    if schema != SCHEMA_VERSION:
        raise LanternError(f"{where}: engine schema {schema!r} is not the supported {SCHEMA_VERSION}; "
                           f"re-export the engine with this version of `lantern-export onnx`")
    r = _Reader(data, where)
    m = _read_record(Manifest, r)
    _check_consistency(m, r)
    return m


# ---------------------------------------------------------------------------------------------
# What the records must agree on across the manifest


def _check_consistency(m, r):
    """What the modes promise must be there: a drafter, a tree and candidates for speculative
    modes, a neighbor table for relaxed ones; every file a record names listed in `files`."""
    if "target" not in m.graphs:
        r.fail("graphs", "has no target graph")
    _check_inplace_cache(m, r)
    wants = "target_ids" if m.condition.kind == "prompt" else "target"
    if m.inplace_cache is not None:
        wants = IN_PLACE_CONTRACTS[wants]
    if m.graphs["target"].contract != wants:
        r.fail("graphs.target.contract", f"is {m.graphs['target'].contract!r}; a {m.condition.kind} engine "
                                         f"{'with' if m.inplace_cache else 'without'} a static cache has {wants!r}")
    if m.vocabulary.size != m.graphs["target"].outputs["logits"].shape[-1]:
        r.fail("vocabulary.size", f"({m.vocabulary.size}) differs from the target's logits width")
    if m.graphs["target"].layers != m.target.layers:
        r.fail("target.layers", f"({m.target.layers}) differs from the target graph's cache inputs")
    for path, name, fix in _file_references(m):
        if name not in m.files:
            _Reader({}, r.where, fix=fix).fail(path, f"names {name}, which `files` does not list")
    for name, g in m.graphs.items():
        if g.contract in ACCEPT_CONTRACTS:
            r.fail(f"graphs.{name}.contract", f"is {g.contract!r}; acceptance graphs are recorded per tree in `acceptance`")
    _check_acceptance_dims(m, _Reader({}, r.where, "acceptance.", READD_ACCEPTANCE))
    if "ar" not in m.modes:
        r.fail("modes", "lacks 'ar' (every engine serves it)")
    speculative = [mode for mode in m.modes if mode != "ar"]
    if speculative:
        if "drafter" not in m.graphs or m.drafter is None:
            r.fail("modes", f"lists {', '.join(speculative)} but the engine has no drafter graph")
        if m.tree is None:
            r.fail("tree", f"is missing; modes {', '.join(speculative)} need the default draft tree")
        if m.candidates is None:
            r.fail("candidates", f"is missing; modes {', '.join(speculative)} need the drafter's top-k width")
        if m.candidates != m.graphs["drafter"].outputs["topk_ids"].shape[-1]:
            r.fail("candidates", f"({m.candidates}) differs from the drafter graph's top-k width")
        tree = build_tree(m.tree)
        if max(tree.widths) > m.candidates:
            r.fail("tree", f"{tree.name!r} needs {max(tree.widths)} children per node; the drafter returns {m.candidates}")
    if {"lantern", "lantern++"} & set(m.modes) and m.neighbors is None:
        r.fail("neighbors", "is missing; modes lantern and lantern++ need a neighbor table")
    if m.condition.kind == "class" and "condition" not in m.graphs:
        r.fail("graphs", "has no condition graph for a class-conditional engine")
    tuned = _Reader({}, r.where, "tuned_trees.", RETUNE)
    for key, entry in m.tuned_trees.items():
        if entry.settings.mode not in m.modes:
            tuned.fail(key, f"is for mode {entry.settings.mode!r}, which the engine does not serve")
    for key, plans in (m.tensorrt or {}).items():
        _check_plans(m, plans, _Reader({}, r.where, f"tensorrt.{key}.", REBUILD_PLANS))


def _check_plans(m, t, r):
    """Plans of graphs the engine has, with profiles that range over the graph's inputs at
    their ranks."""
    graphs = m.all_graphs()  # the acceptance graphs' plans are keyed accept_<kind>@TREE
    for graph, plan in t.plans.items():
        if graph not in graphs:
            r.fail(f"plans.{graph}", "is a plan for a graph the engine does not have")
        inputs = graphs[graph].inputs
        for i, profile in enumerate(plan.profiles):
            for name, rng in profile.shapes.items():
                at = f"plans.{graph}.profiles[{i}].shapes.{name}"
                if name not in inputs:
                    r.fail(at, f"is not an input of the {graphs[graph].contract} graph")
                dims = [rng[k] for k in ("min", "opt", "max")]
                if not (len(dims[0]) == len(dims[1]) == len(dims[2]) == len(inputs[name].shape)) or not all(
                        a <= b <= c for a, b, c in zip(*dims)):
                    r.fail(at, f"needs min <= opt <= max of the input's rank, got {dims}")


def _check_inplace_cache(m, r):
    """An in-place engine: every graph in its in-place form, with caches of the budget's length,
    and a commit graph when it drafts; a plain engine has none of these."""
    s = m.inplace_cache
    in_place = {name: g for name, g in m.graphs.items() if "aliases" in GRAPHS[g.contract]}
    if s is None:
        if in_place:
            r.fail("inplace_cache", f"is missing; graphs {', '.join(sorted(in_place))} update static caches in place")
        return
    if s.image_tokens < m.image.tokens:
        r.fail("inplace_cache.image_tokens", f"({s.image_tokens}) is less than the engine's grid makes ({m.image.tokens})")
    slots = {"target": s.target, "commit": s.target, "drafter": s.drafter}
    for name, want in slots.items():
        if name in m.graphs:
            g = m.graphs[name]
            if "aliases" not in GRAPHS[g.contract]:
                r.fail(f"graphs.{name}.contract", f"is {g.contract!r}, not an in-place contract, in an engine with a "
                                                  f"static cache")
            if g.inputs["past_keys_0"].shape[2] != want:
                r.fail(f"graphs.{name}.inputs.past_keys_0", f"has {g.inputs['past_keys_0'].shape[2]} slots; the static "
                                                            f"cache gives it {want}")
    if "drafter" in m.graphs and "commit" not in m.graphs:
        r.fail("graphs", "has no commit graph (an in-place engine with a drafter commits accepted paths with it)")
    if "commit" in m.graphs and m.graphs["commit"].layers != m.target.layers:
        r.fail("graphs.commit", f"moves {m.graphs['commit'].layers} layers' caches; the target has {m.target.layers}")
    if m.tree is not None and build_tree(m.tree).num_nodes > s.tree_nodes:
        r.fail("inplace_cache.tree_nodes", f"({s.tree_nodes}) is less than the default tree's nodes")


def read_manifest(directory, verify=True):
    """Load and validate an engine directory's manifest: a Manifest, or LanternError saying what
    to rebuild. Every file's size is checked, and its sha256 unless verify is false (hashes are
    remembered per file version, so later opens cost a stat per file: runtime/integrity.py)."""
    directory = os.fspath(directory)
    path = os.path.join(directory, "manifest.json")
    if not os.path.isdir(directory):
        raise LanternError(f"{directory}: no such engine directory (build one with `lantern-export onnx`)")
    try:
        with open_file(directory, "manifest.json", "r") as f:
            data = load_json(f, path)
    except FileNotFoundError:
        raise LanternError(f"{directory}: no manifest.json; not an engine directory (build one with "
                           f"`lantern-export onnx`)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LanternError(f"{path}: unreadable manifest ({e}); re-export the engine") from None
    manifest = _parse(data, path)
    manifest = check_files(directory, manifest, verify)
    _check_external_data(directory, manifest)
    return manifest


def _check_external_data(directory, manifest):
    """Every external-data file a graph names must be one the manifest lists (so it was
    confined and hashed): ONNX Runtime and TensorRT open whatever path a graph gives."""
    for name, g in manifest.all_graphs().items():
        base = os.path.dirname(g.file)
        for location in sorted(onnx_external_files(directory, g.file)):
            listed = os.path.normpath(os.path.join(base, location)).replace(os.sep, "/")
            if os.path.isabs(location) or listed not in manifest.files:
                raise LanternError(f"{directory}: {g.file} reads external data from {location!r}, which the "
                                   f"manifest does not list; re-export the engine with `lantern-export onnx`")


def check_files(directory, manifest, verify=True):
    """Sizes (and, with verify, sha256) of every file the manifest lists. Returns the manifest,
    less what a damaged file that generation does not need belongs to (a tuned entry: its tree
    or its report; one warning line each); every refusal names the cheapest repair."""
    retune = "run `lantern-run tune` again with these settings"
    tuned = {}  # file -> the tuned entries it belongs to
    for key, entry in manifest.tuned_trees.items():
        folder = os.path.dirname(entry.report) + "/" if entry.report else None
        for name in manifest.files:
            if name in {t.file for t in entry.trees} or (folder and name.startswith(folder)):
                tuned.setdefault(name, []).append(key)
    plans = {p.file for entry in (manifest.tensorrt or {}).values() for p in entry.plans.values()}
    groups = [(sorted(set(manifest.files) - set(tuned) - plans), None), (sorted(plans), REBUILD_PLANS)]
    groups += [(sorted(n for n, keys in tuned.items() if key in keys), retune) for key in manifest.tuned_trees]
    dropped = set()
    for names, fix in groups:
        if not names:
            continue
        try:
            _check_group(directory, {n: manifest.files[n] for n in names}, verify, fix)
        except LanternError as e:
            if fix != retune:
                raise
            keys = sorted({k for n in names for k in tuned[n]} - dropped)
            if not keys:
                continue
            print(f"lantern: warning: {e}; the tuned tree(s) {', '.join(keys)} are ignored until "
                  f"`lantern-run tune` runs again with their settings", file=sys.stderr)
            dropped |= set(keys)
    if not dropped:
        return manifest
    gone = {name for name, keys in tuned.items() if set(keys) & dropped}
    return manifest.replace(tuned_trees={k: v for k, v in manifest.tuned_trees.items() if k not in dropped},
                            files={k: v for k, v in manifest.files.items() if k not in gone})


def _check_group(directory, records, verify, fix):
    fix = fix or REBUILD
    files = {name: {"size": f.size, "sha256": f.sha256} for name, f in records.items()}
    if verify:
        verify_files(directory, files, fix=fix)
        return
    for name, entry in files.items():
        file = inside(directory, name)  # refuses names outside and links
        if not os.path.isfile(file):
            raise LanternError(f"{directory}: {name} is missing; {fix}")
        if os.path.getsize(file) != entry["size"]:
            raise LanternError(f"{directory}: {name} has {os.path.getsize(file)} bytes, the manifest says "
                               f"{entry['size']}; the file was changed or truncated; {fix}")
