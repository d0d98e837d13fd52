"""The manifest's typed records: one frozen dataclass per JSON object of manifest.json, each
field's JSON form and range declared once (schema.py reads and writes them from these
declarations; checks.py holds what fields must agree on).
"""
import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Optional

from lantern.runtime.contracts import ACCEPT_PHASES, GRAPHS
from lantern.runtime.enginedir import write_file
from lantern.runtime.errors import LanternError
from lantern.runtime.jacobi import INITS, MAX_WINDOW, MIN_WINDOW
from lantern.runtime.manifest.schema import (AN_ID, AT_LEAST_0, NAMES, POSITIVE, Reader, is_int, json_type, one_of,
                                             read_record, rule, to_json)
from lantern.runtime.settings import MODES, GenerationSettings

SCHEMA_VERSION = 2
PROMPT_STYLES = ("anole", "lumina_mgpt")
DTYPES = ("fp32", "fp16", "bf16")
TENSOR_DTYPES = ("float32", "float16", "bfloat16", "int64", "bool")

GRAPH_FILES = {"condition": "condition.onnx", "target": "target.onnx", "drafter": "drafter.onnx",
               "vq_decoder": "vq_decoder.onnx", "commit": "commit.onnx"}

RETUNE = "run `lantern-run tune` again (or delete the entry)"
REBUILD_PLANS = "rebuild the plans with `lantern-export trt ENGINE --force`"
# a legacy acceptance entry (AcceptanceGraphs) that no longer checks: nothing writes them any more
READD_ACCEPTANCE = "re-export the engine with `lantern-export onnx` (acceptance-only graphs are no longer written)"
READD_STEP = "export them again with `lantern-export accept ENGINE --force`"
READD_WINDOW = "export them again with `lantern-export accept ENGINE --window W --init INIT --force`"


@dataclass(frozen=True)
class TensorSpec:
    dtype: str = rule(one_of(TENSOR_DTYPES, "a tensor dtype"))  # numpy-style name
    shape: tuple = rule(lambda v: all(isinstance(d, str) or (is_int(d) and d >= 0) for d in v),
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
    dims = lambda v: all(is_int(d) and d >= 0 for d in v)  # noqa: E731
    r = Reader(value, r.where, r.path, r.fix)
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
    batches: tuple = rule(lambda v: v and all(is_int(b) and b > 0 for b in v),
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
    # the jacobi proposer's window tune chose (file None, name jacobi-W), or None
    window: Optional[int] = rule(lambda v: v is None or (is_int(v) and 2 <= v <= 17), "a window of 2..17 slots or null",
                                 default=None)


def _read_tuned_settings(r, name):
    """The GenerationSettings of a tuned-tree entry, in the canonical form tune writes (each value
    of the type its GenerationSettings field has), or one LanternError line."""
    r = r.obj(name)
    r.get("mode", str, check=lambda v: v in MODES[1:], why=f"one of {', '.join(MODES[1:])}")  # ar needs no tree
    r.get("sampling", str, check=lambda v: v in ("greedy", "sample"), why="'greedy' or 'sample'")
    for f in dataclasses.fields(GenerationSettings):
        if f.name in r.data:
            r.get(f.name, json_type(f.type)[0])
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
        t = Reader(entry, r.where, f"{r.path}{name}.{images}.", r.fix)
        if not images.isdigit() or int(images) < 1:
            t.fail("", "is keyed by a batch size, which must be a positive integer")
        trees.append(read_record(TunedTree, t, images=int(images)))
    return tuple(sorted(trees, key=lambda t: t.images))


def _write_trees_by_batch(trees):
    return {str(t.images): {k: v for k, v in to_json(t).items() if k != "images" and not (k == "window" and v is None)}
            for t in trees}


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
    """Legacy, read only: the acceptance-only graphs of one draft tree (accept/TREE-HASH.KIND.onnx;
    contracts accept_greedy / accept_sampling) that `lantern-export accept` wrote before the step
    graphs held acceptance. Nothing writes or runs them any more; the record stays so an older
    engine's manifest still reads and verifies (its files stay listed and hashed, and TensorRT
    plans built of them stay keyed by all_graphs' labels) and still runs on its step graphs.
    They worked in the token space of the image codes followed by `forced_ids`."""

    tree: dict  # {"name", "paths"}, as Manifest.tree
    forced_ids: tuple = rule(lambda v: all(is_int(i) and i >= 0 for i in v) and list(v) == sorted(set(v)),
                             "ascending distinct vocabulary ids")  # vocabulary ids after the codes in the token space
    greedy: Graph
    sampling: Optional[Graph] = None


def _phase_files(value, r):
    """A step graph entry's {phase: file}: phase names of the step (begin, level1.., accept), each
    a plain relative path (no '..', not absolute: the engine directory is untrusted; `files` must
    list it, checks.py)."""
    if not value:
        r.fail("", "is empty; expected {phase: file}")
    for phase, name in value.items():
        if not (phase in ("begin",) + ACCEPT_PHASES or (phase.startswith("level") and phase[5:].isdigit())):
            r.fail("", f"names phase {phase!r}; the step's phases are begin, level1.., {', '.join(ACCEPT_PHASES)}")
        parts = name.replace("\\", "/").split("/") if isinstance(name, str) else None
        if not parts or name.startswith(("/", "\\")) or any(p in ("", ".", "..") for p in parts):
            r.fail(phase, f"is {name!r}, not a relative path inside the engine directory")
    return dict(value)


@dataclass(frozen=True)
class _PhaseFiles:
    """What a tree's and a window's step graphs record alike: the token space's forced ids, the
    STEP_VERSION that wrote them, and one file per phase for greedy and for sampling generations."""

    forced_ids: tuple = rule(lambda v: all(is_int(i) and i >= 0 for i in v) and list(v) == sorted(set(v)),
                             "ascending distinct vocabulary ids")
    version: int = rule(AT_LEAST_0)
    greedy: dict = rule(read=lambda r, name: _phase_files(r.get(name, dict), r.obj(name)))  # phase -> file
    sampling: dict = rule(read=lambda r, name: _phase_files(r.get(name, dict), r.obj(name)))

    def files(self):
        return set(self.greedy.values()) | set(self.sampling.values())


@dataclass(frozen=True)
class StepGraphs(_PhaseFiles):
    """The step graphs of one draft tree (lantern.export.step_graphs, written by `lantern-export
    accept`): the phases a step runs between the engine calls (begin, level1..level{depth},
    accept), one file each, for greedy and for sampling generations. AR is the root-only tree
    (name 'ar', no paths). They work in the token space of the image codes followed by
    `forced_ids` (the ids the prompt style forces, ascending; none for LlamaGen and Anole), which
    must equal the generation's VocabularyView.extra for the graphs to serve it. `version` is the
    STEP_VERSION (lantern.runtime.contracts) of the lantern that wrote them; a runner refuses other
    versions."""

    tree: dict  # {"name", "paths"}, as Manifest.tree


def window_name(window, init):
    """A Jacobi window's key in Manifest.window_graphs (and its folder under step/)."""
    return f"jacobi{int(window)}-{init}"


@dataclass(frozen=True)
class WindowGraphs(_PhaseFiles):
    """The step graphs of one Jacobi window (lantern.export.step_jacobi, written by `lantern-export
    accept --window W --init INIT`), keyed window_name(window, init): the phases begin and
    accept, for greedy and for sampling generations. The window fixes the graphs' block (a chain
    of `window` slots) and init their fresh drafts (spatial reads the body, uniform's q is not
    one-hot); the grid's stride is an input, so one entry serves every grid. forced_ids and
    version as StepGraphs'."""

    window: int = rule(lambda v: MIN_WINDOW <= v <= MAX_WINDOW, f"an integer in [{MIN_WINDOW}, {MAX_WINDOW}]")
    init: str = rule(one_of(INITS))


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
    # legacy, read only (see AcceptanceGraphs): tree name -> AcceptanceGraphs of an older engine
    acceptance: dict = rule(of=AcceptanceGraphs, fix=READD_ACCEPTANCE, optional=True, default_factory=dict)
    step_graphs: dict = rule(of=StepGraphs, fix=READD_STEP, optional=True,
                             default_factory=dict)  # tree name -> StepGraphs (`lantern-export accept`)
    window_graphs: dict = rule(of=WindowGraphs, fix=READD_WINDOW, optional=True,
                               default_factory=dict)  # window_name -> WindowGraphs (`accept --window`)
    schema: int = SCHEMA_VERSION

    def step_graphs_for(self, tree):
        """The StepGraphs of a runtime Tree (matched by its paths; AR: the root-only tree), or None."""
        for entry in self.step_graphs.values():
            if [list(p) for p in tree.paths[1:]] == entry.tree["paths"]:
                return entry
        return None

    def window_graphs_for(self, window, init):
        """The WindowGraphs of a Jacobi window of `window` slots and fresh drafts `init`, or None."""
        return self.window_graphs.get(window_name(window, init))

    def step_files(self, windows=False):
        """The files of the trees' step graphs (each its TensorRT plan's label), and of the Jacobi
        windows' with windows."""
        entries = list(self.step_graphs.values()) + (list(self.window_graphs.values()) if windows else [])
        return {f for entry in entries for f in entry.files()}

    def all_graphs(self):
        """{label: Graph} of the engine graphs and an older engine's acceptance-only graphs
        ("accept_greedy@TREE": kept so their files' external data and their plans still check)."""
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
        out = to_json(self)
        if not self.window_graphs:  # written only where there are some: a lantern from before reads the rest
            del out["window_graphs"]
        return out

    def write(self, directory):
        """manifest.json in `directory`, atomically through a unique temporary name (written last
        by export; commands that change an existing engine call it under its lock,
        lantern.runtime.enginedir.locked, after re-reading the manifest)."""
        write_file(directory, "manifest.json", (json.dumps(self.to_json(), indent=2) + "\n").encode())

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


def quantization_scheme(manifest):
    """'none' when no graph is quantized, else the scheme(s) of the quantized graphs ('int8',
    or e.g. 'int4+int8' when they differ)."""
    schemes = sorted({g.quantization.scheme for g in manifest.graphs.values() if g.quantization is not None})
    return "+".join(schemes) or "none"

