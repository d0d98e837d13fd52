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
from dataclasses import dataclass, field
from typing import Optional

from lantern.runtime.contracts import ACCEPT_CONTRACTS, GRAPHS, IN_PLACE_CONTRACTS, graph_io
from lantern.runtime.errors import LanternError
from lantern.runtime.integrity import sha256_file
from lantern.runtime.settings import MODES, RELAXED, GenerationSettings

SCHEMA_VERSION = 2
PROMPT_STYLES = ("anole", "lumina_mgpt")
DTYPES = ("fp32", "fp16", "bf16")

GRAPH_FILES = {"condition": "condition.onnx", "target": "target.onnx", "drafter": "drafter.onnx",
               "vq_decoder": "vq_decoder.onnx", "commit": "commit.onnx"}


# ---------------------------------------------------------------------------------------------
# The typed records


@dataclass(frozen=True)
class TensorSpec:
    dtype: str  # numpy-style name: float32, float16, bfloat16, int64, bool
    shape: tuple  # ints, or names of dims that stay dynamic


@dataclass(frozen=True)
class Quantization:
    """Weight-only quantization of a graph (`lantern-export onnx --quantize`, lantern.export.quantize):
    its MatMuls with constant weights became ONNX Runtime's MatMulNBits (com.microsoft), weights
    in blocks of `block` along K with one scale per block, the output head at its own precision.
    `check` verifies the graph against this record and applies the scheme's tolerance."""

    scheme: str  # int8 / int4: the bits of the body's weights
    bits: int
    block: int
    symmetric: bool  # no zero points
    accuracy_level: int  # MatMulNBits' compute type: 4 = int8 activations per block, 0 = fp32
    head: str  # float / int8 / int4: the output head's weights
    head_nodes: tuple  # names of the head's MatMuls in the float graph
    quantized: int  # MatMulNBits nodes in the graph
    skipped: tuple  # weight MatMuls left in float (names)
    tool: dict = field(default_factory=dict)  # quantizer and ONNX Runtime versions


QUANT_SCHEMES = {"int8": 8, "int4": 4}  # scheme -> bits
QUANT_HEADS = ("float", "int8", "int4")
QUANTIZABLE = ("target", "drafter")  # the graphs with weight MatMuls worth quantizing


@dataclass(frozen=True)
class Graph:
    file: str
    contract: str  # a key of GRAPHS
    dtype: str  # fp32 / fp16 / bf16: the precision of its float tensors
    inputs: dict  # name -> TensorSpec, in the graph's order
    outputs: dict
    external_data: Optional[str] = None  # weights file beside it, if any
    quantization: Optional[Quantization] = None  # weight-only quantized graphs only

    @property
    def layers(self):
        """Per-layer cache inputs (0 for graphs without a cache)."""
        return sum(name.startswith("past_keys_") for name in self.inputs)


@dataclass(frozen=True)
class Shape:
    """What the runtime must know of a transformer to size its buffers and estimate a step."""

    layers: int
    dim: int
    query_heads: int
    kv_heads: int
    head_dim: int
    ffn_hidden: int


@dataclass(frozen=True)
class Condition:
    """How a generation is conditioned. kind 'class': one token, a class label per image
    (null_class is the unconditional row's label, None when the model has no CFG row);
    kind 'caption': `tokens` caption features of width caption_dim per image;
    kind 'prompt': a text prompt as token ids, in the rows of `style` (anole, lumina_mgpt: see
    lantern.runtime.chameleon_prompts), with the engine's copy of the text tokenizer, if any."""

    kind: str
    tokens: Optional[int] = None  # condition tokens per row (class, caption); a prompt's vary
    num_classes: Optional[int] = None
    null_class: Optional[int] = None
    caption_dim: Optional[int] = None
    style: Optional[str] = None
    tokenizer: Optional[str] = None


@dataclass(frozen=True)
class Vocabulary:
    """The target's logits cover `size` ids; image tokens are ids [image_start, image_end) and a
    VQ code is its id minus image_start."""

    size: int
    image_start: int
    image_end: int

    @property
    def codes(self):
        return self.image_end - self.image_start


@dataclass(frozen=True)
class Image:
    grid_height: int  # latent rows and columns: the generation produces grid_height * grid_width tokens
    grid_width: int
    pixels: Optional[int] = None  # image side in pixels when the engine has a VQ decoder

    @property
    def tokens(self):
        return self.grid_height * self.grid_width


@dataclass(frozen=True)
class Neighbors:
    file: str
    k: int  # neighbors per code
    dtype: str


@dataclass(frozen=True)
class StaticCache:
    """The cache budget of an in-place engine, fixed at export (its caches have a static length,
    which TensorRT's fused cache update needs). A generation fits when its prefix (condition
    tokens, or prompt rows left-padded to `prefix`), its image tokens and its tree fit.
    Target cache slots: prefix, then the image's tokens, then room for one tree's nodes beyond
    the last committed token. Drafter cache slots: one per committed (hidden, token) pair, then
    the current tree's nodes (scratch)."""

    prefix: int  # prefix slots: LlamaGen's condition tokens; Chameleon: the longest prompt row
    image_tokens: int  # the most tokens a generation emits per image
    tree_nodes: int  # the largest draft tree (root included); 1 for an `ar` engine
    target: int  # = prefix + image_tokens + tree_nodes: the S of the target and commit graphs
    drafter: int  # = image_tokens + tree_nodes: the S of the drafter graph


@dataclass(frozen=True)
class FileRecord:
    size: int
    sha256: str


@dataclass(frozen=True)
class PlanProfile:
    """One optimization profile of a TensorRT plan: every dynamic input's shape range (min, opt,
    max; all three equal in the exact profiles `lantern-export trt` builds) and the step plan's
    calls it was built for, as labels such as "verify n1 cfg mc_sim_7b_63"."""

    serves: tuple
    shapes: dict  # input name -> {"min": [...], "opt": [...], "max": [...]}

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
    file: str  # relative path, listed in `files`
    profiles: tuple  # PlanProfile, in the plan's profile order


@dataclass(frozen=True)
class TensorRTPlans:
    """One `lantern-export trt` build: a plan per graph for one flavor and set of GPUs. A plan
    runs only on the TensorRT version that built it and on the compute capabilities it targets."""

    flavor: str  # "tensorrt" (full TensorRT) or "tensorrt-rtx" (TensorRT for RTX)
    version: str  # the TensorRT (or TensorRT-RTX) version that built the plans
    compute_capabilities: tuple  # "SM89", ...
    plans: dict  # graph name -> PlanFile
    batches: tuple  # images per call the profiles were made for
    cfg: tuple  # (False,), (True,) or (False, True): with / without classifier-free guidance
    trees: tuple  # names of the draft trees the profiles were made for
    builder: dict = field(default_factory=dict)  # builder settings, for people and for rebuilding


PLAN_FLAVORS = ("tensorrt", "tensorrt-rtx")


@dataclass(frozen=True)
class TunedTree:
    """The tree `lantern-run tune` chose for one batch size (images per generate call)."""

    images: int
    file: Optional[str]  # choices JSON (listed in `files`), or None: AR, no drafting
    name: str
    nodes: int  # root included (the verification's T)
    depth: int
    predicted: dict  # model predictions: tokens_per_step, step_ms, tokens_per_s (of a call), speedup_vs_ar


@dataclass(frozen=True)
class TunedSettings:
    """Trees tuned for one set of generation settings (resolved; the file holds their canonical form)."""

    settings: GenerationSettings
    backend: str  # the backend whose latency was measured; the trees are used on it only
    trees: tuple  # TunedTree per tuned batch size, ascending
    report: Optional[str] = None  # the tuner's report.json (listed in `files`)
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
    forced_ids: tuple  # vocabulary ids after the codes in the graphs' token space
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
    max_positions: int  # rows of the RoPE table: positions are clamped below it
    dtype: str
    opset: int
    graphs: dict  # name -> Graph
    modes: tuple
    files: dict  # relative path -> FileRecord
    drafter: Optional[Shape] = None
    drafter_config: Optional[dict] = None
    tree: Optional[dict] = None  # {"name", "paths"}: the default draft tree
    candidates: Optional[int] = None  # K: the drafter graph's top-k width
    neighbors: Optional[Neighbors] = None
    vq: Optional[dict] = None
    sources: dict = field(default_factory=dict)  # checkpoints the graphs came from (export reads it)
    tools: dict = field(default_factory=dict)
    build: dict = field(default_factory=dict)
    tensorrt: Optional[dict] = None  # plans directory key ("tensorrt-rtx-SM89") -> TensorRTPlans
    tuned_trees: dict = field(default_factory=dict)  # settings key -> TunedSettings (lantern-run tune)
    static_cache: Optional[StaticCache] = None  # in-place engines only (target contract *_inplace)
    acceptance: dict = field(default_factory=dict)  # tree name -> AcceptanceGraphs (`lantern-export accept`)
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
        """The graphs' cache form: 'fused' (in place, static caches) or 'plain'."""
        return "fused" if self.static_cache is not None else "plain"

    def to_json(self):
        return _to_json(self)

    def write(self, directory):
        """manifest.json in `directory`, atomically through a unique temporary name (written last
        by export; commands that change an existing engine call it under its lock,
        lantern.runtime.enginedir.locked, after re-reading the manifest)."""
        from lantern.runtime.enginedir import write_file

        write_file(directory, "manifest.json", (json.dumps(self.to_json(), indent=2) + "\n").encode())

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


def _to_json(value):
    if isinstance(value, GenerationSettings):
        return value.canonical()
    if isinstance(value, TunedSettings):  # its trees are keyed by batch size in the file
        data = {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
        data["trees"] = {str(t.images): {k: v for k, v in _to_json(t).items() if k != "images"} for t in value.trees}
        return data
    if dataclasses.is_dataclass(value):
        return {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------
# Reading and validating


def describe_files(directory, names):
    """`files` records for the given relative paths."""
    return {name: FileRecord(size=os.path.getsize(os.path.join(directory, name)),
                             sha256=sha256_file(os.path.join(directory, name))) for name in sorted(names)}


class _Reader:
    """Typed access to a JSON object; every failure is one LanternError naming the field."""

    def __init__(self, data, where, fix="re-export the engine with `lantern-export onnx`"):
        self.where, self.fix = where, fix  # fix: what the message tells the user to do
        if not isinstance(data, dict):
            self.fail("", f"must be an object, got {type(data).__name__}")
        self.data = data

    def fail(self, key, why):
        raise LanternError(f"{self.where}{'.' + key if key else ''} {why}; {self.fix}")

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

    def positive(self, key, optional=False):
        return self.get(key, int, optional, lambda v: v > 0, "a positive integer")

    def obj(self, key, optional=False):
        value = self.get(key, dict, optional)
        return None if value is None else _Reader(value, f"{self.where}.{key}", self.fix)

    def done(self, known):
        unknown = sorted(set(self.data) - set(known))
        if unknown:
            self.fail("", f"has unknown field(s) {', '.join(unknown)} (written by a newer lantern?)")


def _fields(cls):
    return [f.name for f in dataclasses.fields(cls)]


def _shape(r):
    s = Shape(**{k: r.positive(k) for k in _fields(Shape)})
    r.done(_fields(Shape))
    if s.query_heads % s.kv_heads:
        r.fail("query_heads", f"({s.query_heads}) is not a multiple of kv_heads ({s.kv_heads})")
    return s


def _tensor(r, name):
    dtype = r.get("dtype", str, check=lambda v: v in ("float32", "float16", "bfloat16", "int64", "bool"),
                  why="a tensor dtype")
    shape = r.get("shape", list, check=lambda v: all(isinstance(d, str) or (isinstance(d, int) and not isinstance(d, bool)
                                                                            and d >= 0) for d in v),
                  why="a list of dims")
    r.done(["dtype", "shape"])
    return TensorSpec(dtype=dtype, shape=tuple(shape))


def _graph(r, name):
    contract = r.get("contract", str, check=lambda v: v in GRAPHS, why=f"one of {', '.join(GRAPHS)}")
    g = Graph(file=r.get("file", str), contract=contract,
              dtype=r.get("dtype", str, check=lambda v: v in DTYPES, why=f"one of {', '.join(DTYPES)}"),
              inputs={k: _tensor(_Reader(v, f"{r.where}.inputs.{k}"), k) for k, v in r.get("inputs", dict).items()},
              outputs={k: _tensor(_Reader(v, f"{r.where}.outputs.{k}"), k) for k, v in r.get("outputs", dict).items()},
              external_data=r.get("external_data", str, optional=True))
    q = r.obj("quantization", optional=True)
    if q is not None:
        g = dataclasses.replace(g, quantization=_quantization(q, name, g))
    r.done(_fields(Graph))
    expected = graph_io(contract, max(g.layers, 1))
    if set(g.inputs) != set(expected["inputs"]) or set(g.outputs) != set(expected["outputs"]):
        r.fail("inputs", f"do not follow the {contract!r} contract of this lantern version")
    for side in ("inputs", "outputs"):  # buffers are sized from these shapes: a wrong rank fails in the backend
        for k, spec in getattr(g, side).items():
            want = expected[side][k][1]
            if len(spec.shape) != len(want):
                r.fail(f"{side}.{k}.shape", f"is {list(spec.shape)}, of rank {len(spec.shape)}; the {contract!r} "
                                            f"contract has {list(want)}")
    # in the contract's order, whatever order the file kept
    return dataclasses.replace(g, inputs={k: g.inputs[k] for k in expected["inputs"]},
                               outputs={k: g.outputs[k] for k in expected["outputs"]})


def _quantization(r, name, graph):
    scheme = r.get("scheme", str, check=lambda v: v in QUANT_SCHEMES, why=f"one of {', '.join(QUANT_SCHEMES)}")
    names = lambda v: all(isinstance(x, str) for x in v)  # noqa: E731
    q = Quantization(
        scheme=scheme, bits=r.get("bits", int, check=lambda v: v == QUANT_SCHEMES[scheme], why=f"{QUANT_SCHEMES[scheme]} "
                                                                                              f"(scheme {scheme})"),
        block=r.get("block", int, check=lambda v: v >= 16 and not v & (v - 1), why="a power of two >= 16"),
        symmetric=r.get("symmetric", bool), accuracy_level=r.get("accuracy_level", int, check=lambda v: 0 <= v <= 4,
                                                                 why="0..4"),
        head=r.get("head", str, check=lambda v: v in QUANT_HEADS, why=f"one of {', '.join(QUANT_HEADS)}"),
        head_nodes=tuple(r.get("head_nodes", list, check=names, why="a list of node names")),
        quantized=r.positive("quantized"), skipped=tuple(r.get("skipped", list, check=names, why="a list of node names")),
        tool=r.get("tool", dict))
    r.done(_fields(Quantization))
    if name not in QUANTIZABLE:
        r.fail("", f"quantizes the {name} graph; only {' and '.join(QUANTIZABLE)} are quantized")
    if graph.dtype != "fp32":
        r.fail("", f"is on a {graph.dtype} graph; weight-only quantization starts from fp32")
    if q.head == "float" and not set(q.head_nodes) <= set(q.skipped):
        r.fail("skipped", f"lacks the float head {', '.join(q.head_nodes)}")
    return q


def quantization_scheme(manifest):
    """'none' when no graph is quantized, else the scheme(s) of the quantized graphs ('int8',
    or e.g. 'int4+int8' when they differ)."""
    schemes = sorted({g.quantization.scheme for g in manifest.graphs.values() if g.quantization is not None})
    return "+".join(schemes) or "none"


def _parse(data, where):
    r = _Reader(data, where)
    schema = data.get("schema", data.get("format_version")) if isinstance(data, dict) else None
    if schema != SCHEMA_VERSION:
        raise LanternError(f"{where}: engine schema {schema!r} is not the supported {SCHEMA_VERSION}; "
                           f"re-export the engine with this version of `lantern-export onnx`")
    cond = r.obj("condition")
    kind = cond.get("kind", str, check=lambda v: v in ("class", "caption", "prompt"),
                    why="'class', 'caption' or 'prompt'")
    condition = Condition(kind=kind, tokens=cond.positive("tokens", optional=kind == "prompt"),
                          num_classes=cond.positive("num_classes", True),
                          null_class=cond.get("null_class", int, True, lambda v: v >= 0, "an id >= 0"),
                          caption_dim=cond.positive("caption_dim", True),
                          style=cond.get("style", str, True, lambda v: v in PROMPT_STYLES, " or ".join(PROMPT_STYLES)),
                          tokenizer=cond.get("tokenizer", str, True))
    cond.done(_fields(Condition))
    if kind == "class" and condition.num_classes is None:
        cond.fail("num_classes", "is missing (class-conditional engine)")
    if kind == "caption" and condition.caption_dim is None:
        cond.fail("caption_dim", "is missing (caption-conditional engine)")
    if kind == "prompt" and condition.style is None:
        cond.fail("style", "is missing (prompt-conditional engine)")
    voc = r.obj("vocabulary")
    vocabulary = Vocabulary(size=voc.positive("size"), image_start=voc.get("image_start", int, check=lambda v: v >= 0,
                                                                            why="an id >= 0"),
                            image_end=voc.positive("image_end"))
    voc.done(_fields(Vocabulary))
    if not vocabulary.image_start < vocabulary.image_end <= vocabulary.size:
        voc.fail("image_end", f"range [{vocabulary.image_start}, {vocabulary.image_end}) does not fit {vocabulary.size} ids")
    img = r.obj("image")
    image = Image(grid_height=img.positive("grid_height"), grid_width=img.positive("grid_width"),
                  pixels=img.positive("pixels", True))
    img.done(_fields(Image))
    graphs = {name: _graph(_Reader(g, f"{where}: graphs.{name}"), name) for name, g in r.get("graphs", dict).items()}
    files = {}
    for name, entry in r.get("files", dict).items():
        fr = _Reader(entry, f"{where}: files.{name}")
        files[name] = FileRecord(size=fr.get("size", int, check=lambda v: v >= 0, why="a size"),
                                 sha256=fr.get("sha256", str, check=lambda v: len(v) == 64, why="a sha256"))
        fr.done(_fields(FileRecord))
    nb = r.obj("neighbors", optional=True)
    neighbors = None
    if nb is not None:
        neighbors = Neighbors(file=nb.get("file", str), k=nb.positive("k"), dtype=nb.get("dtype", str))
        nb.done(_fields(Neighbors))
    drafter = r.obj("drafter", optional=True)
    sc = r.obj("static_cache", optional=True)
    static_cache = None
    if sc is not None:
        static_cache = StaticCache(**{k: sc.positive(k) for k in _fields(StaticCache)})
        sc.done(_fields(StaticCache))
    m = Manifest(
        family=r.get("family", str), model=r.get("model", dict), target=_shape(r.obj("target")), condition=condition,
        vocabulary=vocabulary, image=image, max_positions=r.positive("max_positions"),
        dtype=r.get("dtype", str, check=lambda v: v in DTYPES, why=f"one of {', '.join(DTYPES)}"),
        opset=r.positive("opset"), graphs=graphs,
        modes=tuple(r.get("modes", list, check=lambda v: v and all(x in MODES for x in v) and len(set(v)) == len(v),
                          why=f"a list of distinct modes from {', '.join(MODES)}")),
        files=files, drafter=None if drafter is None else _shape(drafter),
        drafter_config=r.get("drafter_config", dict, optional=True),
        tree=r.get("tree", dict, optional=True), candidates=r.positive("candidates", optional=True), neighbors=neighbors,
        vq=r.get("vq", dict, optional=True), sources=r.get("sources", dict), tools=r.get("tools", dict),
        build=r.get("build", dict), tuned_trees=_tuned_trees(r.get("tuned_trees", dict, optional=True), where),
        static_cache=static_cache, schema=SCHEMA_VERSION)
    m = m.replace(acceptance=_acceptance(r.get("acceptance", dict, optional=True), where, m))
    r.done(_fields(Manifest))
    _check_consistency(m, r)
    plans = r.get("tensorrt", dict, optional=True)
    if plans is not None:
        m = m.replace(tensorrt={key: _plans(_Reader(v, f"{where}: tensorrt.{key}", _REBUILD_PLANS), key, m)
                                for key, v in plans.items()})
    return m


_REBUILD_PLANS = "rebuild the plans with `lantern-export trt ENGINE --force`"
_SM = re.compile(r"^SM\d{2,3}$")


def _plans(r, key, m):
    """One TensorRTPlans entry: plans of graphs the engine has, listed in `files`, with profiles
    whose ranges are well formed and name the graph's inputs."""
    flavor = r.get("flavor", str, check=lambda v: v in PLAN_FLAVORS, why=f"one of {', '.join(PLAN_FLAVORS)}")
    ccs = r.get("compute_capabilities", list, check=lambda v: v and all(isinstance(c, str) and _SM.match(c) for c in v),
                why="a non-empty list like ['SM89']")
    plans = {}
    graphs = m.all_graphs()  # the acceptance graphs' plans are keyed accept_<kind>@TREE
    for graph, entry in r.get("plans", dict, check=lambda v: len(v) > 0, why="a non-empty object").items():
        pr = _Reader(entry, f"{r.where}.plans.{graph}", r.fix)
        if graph not in graphs:
            pr.fail("", "is a plan for a graph the engine does not have")
        file = pr.get("file", str, check=lambda v: v in m.files, why="a file that `files` lists")
        profiles = []
        for i, p in enumerate(pr.get("profiles", list, check=lambda v: len(v) > 0, why="a non-empty list")):
            profiles.append(_profile(_Reader(p, f"{pr.where}.profiles[{i}]", r.fix), graphs[graph]))
        pr.done(_fields(PlanFile))
        plans[graph] = PlanFile(file=file, profiles=tuple(profiles))
    t = TensorRTPlans(
        flavor=flavor, version=r.get("version", str, check=lambda v: len(v) > 0, why="a version string"),
        compute_capabilities=tuple(ccs), plans=plans,
        batches=tuple(r.get("batches", list, check=lambda v: v and all(isinstance(b, int) and not isinstance(b, bool)
                                                                        and b > 0 for b in v),
                            why="a non-empty list of positive integers")),
        cfg=tuple(r.get("cfg", list, check=lambda v: v and all(isinstance(c, bool) for c in v) and len(set(v)) == len(v),
                        why="[false], [true] or [false, true]")),
        trees=tuple(r.get("trees", list, check=lambda v: all(isinstance(t, str) for t in v), why="a list of tree names")),
        builder=r.get("builder", dict))
    r.done(_fields(TensorRTPlans))
    return t


def _profile(r, graph):
    serves = r.get("serves", list, check=lambda v: all(isinstance(s, str) for s in v), why="a list of labels")
    shapes = {}
    for name, rng in r.get("shapes", dict).items():
        sr = _Reader(rng, f"{r.where}.shapes.{name}", r.fix)
        if name not in graph.inputs:
            sr.fail("", f"is not an input of the {graph.contract} graph")
        dims = [sr.get(k, list, check=lambda v: all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v),
                       why="a list of dims") for k in ("min", "opt", "max")]
        sr.done(["min", "opt", "max"])
        if not (len(dims[0]) == len(dims[1]) == len(dims[2]) == len(graph.inputs[name].shape)) or not all(
                a <= b <= c for a, b, c in zip(*dims)):
            sr.fail("", f"needs min <= opt <= max of the input's rank, got {dims}")
        shapes[name] = dict(zip(("min", "opt", "max"), dims))
    r.done(_fields(PlanProfile))
    return PlanProfile(serves=tuple(serves), shapes=shapes)


def _tuned_settings(r):
    """The GenerationSettings of a tuned-tree entry, in the canonical form tune writes, or one
    LanternError line."""
    mode = r.get("mode", str, check=lambda v: v in MODES[1:], why=f"one of {', '.join(MODES[1:])}")
    sampling = r.get("sampling", str, check=lambda v: v in ("greedy", "sample"), why="'greedy' or 'sample'")
    sample = sampling == "sample"
    relaxed = mode in RELAXED
    values = dict(
        k=r.get("k", int, not relaxed, lambda v: v >= 0, "an integer >= 0"),
        lam=r.get("lam", float, mode != "lantern++"), delta=r.get("delta", float, mode != "lantern"),
        temperature=r.get("temperature", float, not sample),
        top_k=r.get("top_k", int, not sample, lambda v: v >= 0, "an integer >= 0"),
        top_p=r.get("top_p", float, not sample), cfg_scale=r.get("cfg_scale", float, check=lambda v: v >= 0),
        cfg_interval=r.get("cfg_interval", int, check=lambda v: v >= -1, why="an integer >= -1"))
    try:
        settings = GenerationSettings(mode=mode, greedy=not sample,
                                      **{name: v for name, v in values.items() if v is not None})
    except LanternError as e:
        r.fail("", str(e))
    if settings.canonical() != r.data:
        r.fail("", f"is {r.data!r}, not in the canonical form lantern-run tune writes ({settings.canonical()!r})")
    return settings


def _tuned_trees(data, where):
    if data is None:
        return {}
    r = _Reader(data, f"{where}: tuned_trees", "run `lantern-run tune` again (or delete the entry)")
    out = {}
    for key in r.data:
        e = r.obj(key)
        settings = _tuned_settings(e.obj("settings"))
        expected = settings.key
        if expected != key:
            e.fail("", f"is keyed {key!r} but its settings make the key {expected!r}")
        trees = []
        for images, entry in e.get("trees", dict, check=bool, why="a non-empty {batch: tree} object").items():
            t = _Reader(entry, f"{e.where}.trees.{images}", e.fix)
            if not images.isdigit() or int(images) < 1:
                t.fail("", "is keyed by a batch size, which must be a positive integer")
            trees.append(TunedTree(images=int(images), file=t.get("file", str, optional=True), name=t.get("name", str),
                                   nodes=t.positive("nodes"), depth=t.get("depth", int, check=lambda v: v >= 0,
                                                                           why="an integer >= 0"),
                                   predicted=t.get("predicted", dict)))
            t.done([f for f in _fields(TunedTree) if f != "images"])
            if (trees[-1].file is None) != (trees[-1].nodes == 1):
                t.fail("file", "must be given for a tree with drafts and null for AR (nodes 1)")
        out[key] = TunedSettings(settings=settings, backend=e.get("backend", str),
                                 trees=tuple(sorted(trees, key=lambda t: t.images)),
                                 report=e.get("report", str, optional=True), measured=e.get("measured", dict))
        e.done(_fields(TunedSettings))
    return out


def _acceptance(data, where, m):
    """Manifest.acceptance: per tree, graphs of the acceptance contracts whose fixed dims fit the
    tree, the vocabulary and the token space, listed in `files`."""
    if not data:
        return {}
    from lantern.runtime.tree import build_tree

    fix = "add them again with `lantern-export accept ENGINE --force`"
    r = _Reader(data, f"{where}: acceptance", fix)
    codes = m.vocabulary.codes
    out = {}
    for name in r.data:
        e = r.obj(name)
        tree_data = e.get("tree", dict)
        try:
            tree = build_tree(tree_data)
        except LanternError as err:
            e.fail("tree", f"is not a draft tree ({err})")
        if tree.name != name or tree.depth == 0:
            e.fail("tree", f"is named {tree.name!r} with depth {tree.depth}; the entry is keyed {name!r} and needs drafts")
        forced = e.get("forced_ids", list, check=lambda v: all(isinstance(i, int) and not isinstance(i, bool) and
                                                               0 <= i < m.vocabulary.size for i in v)
                       and v == sorted(set(v)), why="ascending distinct vocabulary ids")
        if any(m.vocabulary.image_start <= i < m.vocabulary.image_end for i in forced):
            e.fail("forced_ids", "holds an image token id")
        kinds = {}
        for kind in ("greedy", "sampling"):
            g = e.obj(kind, optional=kind == "sampling")
            if g is None:
                kinds[kind] = None
                continue
            graph = _graph(g, f"accept_{kind}")
            if graph.contract != f"accept_{kind}" or graph.dtype != "fp32" or graph.external_data is not None:
                g.fail("contract", f"is {graph.contract!r} ({graph.dtype}); expected 'accept_{kind}', fp32, no weights file")
            want = {"M": tree.num_nodes, "V": m.vocabulary.size, "W": codes + len(forced), "depth+1": tree.depth + 1}
            if kind == "sampling":
                want["K"] = m.candidates
            dims = {"M": graph.inputs["tokens"].shape[1], "V": graph.inputs["logits"].shape[2],
                    "W": graph.inputs["neighbors"].shape[0], "depth+1": graph.outputs["path"].shape[1]}
            if kind == "sampling":
                dims["K"] = graph.inputs["draft_ids"].shape[2]
            if dims != want:
                g.fail("inputs", f"have dims {dims}; tree {name!r} and the engine make {want}")
            if graph.file not in m.files:
                g.fail("file", f"names {graph.file}, which `files` does not list")
            kinds[kind] = graph
        e.done(_fields(AcceptanceGraphs))
        out[name] = AcceptanceGraphs(tree=tree_data, forced_ids=tuple(forced), **kinds)
    return out


def _check_consistency(m, r):
    """What the modes promise must be there: a drafter, a tree and candidates for speculative
    modes, a neighbor table for relaxed ones; every graph's file listed."""
    if "target" not in m.graphs:
        r.fail("graphs", "has no target graph")
    _check_static_cache(m, r)
    wants = "target_ids" if m.condition.kind == "prompt" else "target"
    if m.static_cache is not None:
        wants = IN_PLACE_CONTRACTS[wants]
    if m.graphs["target"].contract != wants:
        r.fail("graphs.target.contract", f"is {m.graphs['target'].contract!r}; a {m.condition.kind} engine "
                                         f"{'with' if m.static_cache else 'without'} a static cache has {wants!r}")
    if m.condition.tokenizer is not None and m.condition.tokenizer not in m.files:
        r.fail("condition.tokenizer", f"names {m.condition.tokenizer}, which `files` does not list")
    if m.vocabulary.size != m.graphs["target"].outputs["logits"].shape[-1]:
        r.fail("vocabulary.size", f"({m.vocabulary.size}) differs from the target's logits width")
    if m.graphs["target"].layers != m.target.layers:
        r.fail("target.layers", f"({m.target.layers}) differs from the target graph's cache inputs")
    for name, g in m.graphs.items():
        if g.contract in ACCEPT_CONTRACTS:
            r.fail(f"graphs.{name}.contract", f"is {g.contract!r}; acceptance graphs are recorded per tree in `acceptance`")
        if g.file not in m.files:
            r.fail(f"graphs.{name}.file", f"names {g.file}, which `files` does not list")
        if g.external_data is not None and g.external_data not in m.files:
            r.fail(f"graphs.{name}.external_data", f"names {g.external_data}, which `files` does not list")
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
        from lantern.runtime.tree import build_tree

        tree = build_tree(m.tree)
        if max(tree.widths) > m.candidates:
            r.fail("tree", f"{tree.name!r} needs {max(tree.widths)} children per node; the drafter returns {m.candidates}")
    if {"lantern", "lantern++"} & set(m.modes):
        if m.neighbors is None:
            r.fail("neighbors", "is missing; modes lantern and lantern++ need a neighbor table")
        if m.neighbors.file not in m.files:
            r.fail("neighbors.file", f"names {m.neighbors.file}, which `files` does not list")
    if m.condition.kind == "class" and "condition" not in m.graphs:
        r.fail("graphs", "has no condition graph for a class-conditional engine")
    tuned = _Reader({}, f"{r.where}: tuned_trees", "run `lantern-run tune` again (or delete the entry)")
    for key, entry in m.tuned_trees.items():
        if entry.settings.mode not in m.modes:
            tuned.fail(key, f"is for mode {entry.settings.mode!r}, which the engine does not serve")
        files = [t.file for t in entry.trees if t.file is not None] + ([entry.report] if entry.report else [])
        for name in files:
            if name not in m.files:
                tuned.fail(key, f"names {name}, which `files` does not list")


def _check_static_cache(m, r):
    """An in-place engine: every graph in its in-place form, with caches of the budget's length,
    and a commit graph when it drafts; a plain engine has none of these."""
    s = m.static_cache
    in_place = {name: g for name, g in m.graphs.items() if "aliases" in GRAPHS[g.contract]}
    if s is None:
        if in_place:
            r.fail("static_cache", f"is missing; graphs {', '.join(sorted(in_place))} update static caches in place")
        return
    if s.target != s.prefix + s.image_tokens + s.tree_nodes or s.drafter != s.image_tokens + s.tree_nodes:
        r.fail("static_cache", f"{s} does not add up (target = prefix + image_tokens + tree_nodes, "
                               f"drafter = image_tokens + tree_nodes)")
    if s.image_tokens < m.image.tokens:
        r.fail("static_cache.image_tokens", f"({s.image_tokens}) is less than the engine's grid makes ({m.image.tokens})")
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
    if m.tree is not None:
        from lantern.runtime.tree import build_tree

        if build_tree(m.tree).num_nodes > s.tree_nodes:
            r.fail("static_cache.tree_nodes", f"({s.tree_nodes}) is less than the default tree's nodes")


def read_manifest(directory, verify=True):
    """Load and validate an engine directory's manifest: a Manifest, or LanternError saying what
    to rebuild. Every file's size is checked, and its sha256 unless verify is false (hashes are
    remembered per file version, so later opens cost a stat per file: runtime/integrity.py)."""
    directory = os.fspath(directory)
    path = os.path.join(directory, "manifest.json")
    if not os.path.isdir(directory):
        raise LanternError(f"{directory}: no such engine directory (build one with `lantern-export onnx`)")
    from lantern.runtime.enginedir import load_json, open_file

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
    from lantern.runtime.enginedir import onnx_external_files

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
    import sys

    retune = "run `lantern-run tune` again with these settings"
    tuned = {}  # file -> the tuned entries it belongs to
    for key, entry in manifest.tuned_trees.items():
        folder = os.path.dirname(entry.report) + "/" if entry.report else None
        for name in manifest.files:
            if name in {t.file for t in entry.trees} or (folder and name.startswith(folder)):
                tuned.setdefault(name, []).append(key)
    plans = {p.file for entry in (manifest.tensorrt or {}).values() for p in entry.plans.values()}
    groups = [(sorted(set(manifest.files) - set(tuned) - plans), None), (sorted(plans), _REBUILD_PLANS)]
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
    from lantern.runtime.enginedir import inside
    from lantern.runtime.integrity import REBUILD, verify_files

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
