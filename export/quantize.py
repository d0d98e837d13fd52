"""Quantized engine graphs, made from exported ONNX graphs with the vendors' own tools.

ONNX Runtime: weight-only `int8` / `int4` (quantize_graph; for engines `lantern-export onnx
  --quantize int8|int4 [--quant-block N] [--quant-accuracy-level 0|4]`, which quantizes the
  target and drafter graphs in the export's staging directory, or `lantern-export quantize ENGINE
  --scheme S --out NEW` from an fp32 engine in a second or two: quantize_graphs, quantize_engine).
  The manifest records each quantized graph's Quantization (lantern.runtime.manifest: scheme,
  bits, block, symmetry, accuracy level, head precision and nodes, quantized and skipped
  MatMuls, tool versions); `lantern-export check` verifies the graph against it (verify_record)
  and compares with the fp32 PyTorch modules at the scheme's TOLERANCES. Every MatMul with a constant 2-D weight becomes ONNX Runtime's MatMulNBits (com.microsoft):
  weights in blocks of `block` (32) along K, one float scale per block, symmetric (no zero
  points), written by ONNX Runtime's `MatMulNBitsQuantizer` (round to nearest). The output head
  gets its own precision (HEAD: int8 in both schemes). With accuracy_level 4 the CPU kernel
  rounds the activations to int8 per block of each row and runs an int8 dot product, which is
  what makes the step faster. MatMuls whose second input is not a constant (attention scores and
  values) stay as they are. K not a multiple of the block is padded with zero weights to whole
  blocks by the quantizer (exact), so every 2-D constant weight is taken; a weight MatMul the
  quantizer leaves alone (an N-D weight with batch dims) is listed in the record's `skipped`.
  The block must be a power of two >= 16 (MatMulNBits' rule).

TensorRT: Q/DQ forms fp8, int8 and int4, made by NVIDIA ModelOpt: lantern.export.quantize_qdq.

DECISIONS. Measured with `python -m lantern.tools.bench.quant --decisions` (ONNX Runtime 1.32 CPU,
2 intra-op threads, no spinning; a 2-core machine shared with other jobs, so times are medians
of interleaved runs: trust their ratios, not their absolute values). Speed: GPT-B target, random
weights, batch 2 (CFG), 256 cached tokens. Fidelity: teacher-forced greedy agreement (how often
the quantized graph's CFG-combined argmax equals fp32's, on the inputs of an fp32 sampled
generation) and the logits' relative RMS error; deterministic.

  one-token step (ms)     fp32 30.3 | int8 15.9 (1.9x) | int4 13.3 (2.3x)
    head float            int8 17.7 | int4 15.8     (the head is 12.6M of GPT-B's 97M weights)
    head int4             int4 13.7
    accuracy level 0      int8 318  | int4 99       (weights dequantized to fp32 on every call)
    quantize_dynamic int8 15.3
  L(T) (ms), T=1/8/26/58  fp32 31/56/140/391 | int8 16/40/101/365 | int4 13/40/110/265
                          quantize_dynamic int8 13/24/57/127
  greedy agreement / logits error, demo model (trained; 1920 positions, cfg 3):
                          int8 95.5% / 0.0067 | int4 82.9% / 0.052
    head float            int8 95.6% / 0.0064 | int4 83.1% / 0.052
    head int4                                 | int4 79.4% / 0.056
    accuracy level 0      int8 98.6% / 0.0034 | int4 83.5% / 0.052
    quantize_dynamic int8 88.4% / 0.0185
  same on GPT-B random weights (512 positions, cfg 4): int8 96.3% / 0.016 | int4 67.0% / 0.149
  quantization time: 1-2 s per GPT-B target graph; bytes 392 MB -> int8 111 MB, int4 69 MB.

  * accuracy level 4: the only level faster than fp32 (level 0 is 3-10x slower). Its price: the
    int8 rounding of activations makes the outputs step-wise in the inputs, so the float noise
    between a 1-token call and a 27-token call of the same position becomes whole rounding steps.
    Greedy `exact` then matches greedy `ar` only where the model has no near-ties: on the tiny
    test engines it does; on the demo model in 86% (int8) / 88% (int4) of the tokens at cfg 3,
    97% / 94% at cfg 1 (15 images; phase 2 measured 86.7% / 93.2% at cfg 3 on one greedy image
    per class, 8 of 15 int8 images identical). At level 0 exact == ar
    token for token (tests/test_quantize.py, on the tiny engines and int4 on the demo), as for fp32. Exactness holds relative to the
    verifying call's numerics, not to a different call shape.
  * int8 is MatMulNBits bits=8, not quantize_dynamic: equal one-token step, better fidelity, and
    row-local: quantize_dynamic scales activations per tensor, so a row's output depends on the
    other rows of the call (measured: one large row moved another row's output by 14%), i.e. on
    the other image, the CFG half and the tree's other tokens. Its large-T speed (3x fp32 at
    T=58, where MatMulNBits is 1.1-1.5x) is the measured cost of that choice.
  * output head at int8 in both schemes: a float head costs ~2 ms of the step; an int8 head is as
    fast as an int4 one and as faithful as a float one (int4: 82.9% vs 83.1% float, 79.4% int4).
  * Quantized verification is relatively dearer: L(58)/L(1) is 12.6 (fp32), 23 (int8), 20 (int4),
    so on a CPU quantized engines favour smaller trees (pick the tree per engine, as always).
"""
import dataclasses
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from lantern.export import placement
from lantern.export.quant_graph import graph_bytes, has_external_data, load_graph, output_heads, quiet, save_graph, \
    source_name, weight_matmuls
from lantern.runtime.errors import LanternError
from lantern.runtime.manifest import describe_files, QUANTIZABLE, Quantization, quantization_scheme, read_manifest
from lantern.runtime.plan import Call

SCHEMES = ("int8", "int4")  # ONNX Runtime weight-only
BITS = {"int8": 8, "int4": 4}
DEFAULT_BLOCK = 32
DEFAULT_ACCURACY_LEVEL = 4  # int8 activations inside MatMulNBits: the fast CPU path
HEAD_PRECISIONS = ("float", "int8", "int4")
HEAD = {"int8": "int8", "int4": "int8"}  # the output head's precision per scheme; see DECISIONS

# Tolerances of a quantized graph against its fp32 graph on the same inputs: the relative RMS
# error ||q - f|| / ||f|| of each float output. Round to nearest with a symmetric scale per block
# of 32 has a step of max|w| / (2^(bits-1) - 1): an RMS weight error of ~0.5% (int8) and ~9%
# (int4) of the weights' RMS. Measured on real generations' inputs (logits; see DECISIONS): demo
# 0.007 / 0.052, GPT-B random weights 0.016 / 0.149, tiny test engines up to 0.009 / 0.15 (K/V).
# `lantern-export check` applies them against the fp32 PyTorch modules on its random cases, where
# the drafter's top-k probabilities move most (CFG scale 2 doubles the logits' error before the
# softmax): demo engine, worst output over seeds 0-9 0.034 (int8), over seeds 0-5 0.185 (int4).
TOLERANCES = {"int8": 0.05, "int4": 0.25}


@dataclass(frozen=True)
class QuantizeOptions:
    """What `lantern-export onnx --quantize` / `lantern-export quantize` do to the target and
    drafter graphs (see quantize_graph)."""

    scheme: str
    block: int = DEFAULT_BLOCK
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL
    head: Optional[str] = None  # default HEAD[scheme]

    def check(self):
        """LanternError for an option quantize_graph would refuse, before anything is exported."""
        if self.scheme not in SCHEMES:
            raise LanternError(f"unknown quantization scheme {self.scheme!r}; valid: none, {', '.join(SCHEMES)}")
        if self.head is not None and self.head not in HEAD_PRECISIONS:
            raise LanternError(f"unknown head precision {self.head!r}; valid: {', '.join(HEAD_PRECISIONS)}")
        block = self.block
        if isinstance(block, bool) or not isinstance(block, int) or block < 16 or block & (block - 1):
            raise LanternError(f"quantization block must be a power of two >= 16, got {block!r}")
        if self.accuracy_level not in (0, 1, 2, 3, 4) or isinstance(self.accuracy_level, bool):
            raise LanternError(f"accuracy level must be 0..4 (MatMulNBits), got {self.accuracy_level!r}")
        return self

    def graph_options(self):
        return dict(scheme=self.scheme, block=self.block, accuracy_level=self.accuracy_level, head=self.head)


# ---------------------------------------------------------------------------------------------
# ONNX Runtime weight-only


def quantize_graph(src, dst, scheme, *, block=DEFAULT_BLOCK, head=None, accuracy_level=DEFAULT_ACCURACY_LEVEL,
                   symmetric=True):
    """Write `dst`, the graph `src` with its constant-weight MatMuls quantized (weight-only) to
    `scheme` ('int8' | 'int4'). The output head (output_heads()) gets `head`: 'float', 'int8' or
    'int4' (default HEAD[scheme]). Graphs with external data (`src`.data) work; `dst` keeps the
    source's layout (its weights go to `dst`.data when the source's did). Returns
    {"record": the manifest's Quantization record, "bytes": {"source", "quantized"}, "seconds"}."""
    import onnxruntime

    QuantizeOptions(scheme, block, accuracy_level, head).check()
    head = HEAD[scheme] if head is None else head
    src, dst = os.fspath(src), os.fspath(dst)
    if os.path.abspath(src) == os.path.abspath(dst):
        raise LanternError(f"{dst}: the quantized graph must not overwrite its source")
    model = load_graph(src)
    if any(n.op_type == "MatMulNBits" for n in model.graph.node):
        raise LanternError(f"{src}: the graph is already quantized (it has MatMulNBits nodes); start from the float graph")
    external = has_external_data(src)
    weights = weight_matmuls(model)
    heads = output_heads(model)

    start = time.perf_counter()
    # The body first (the head excluded unless it gets the same bits), then the head alone.
    model = _matmul_nbits(model, BITS[scheme], block, symmetric, accuracy_level,
                          exclude=[] if head == scheme else heads)
    if head != "float" and head != scheme:
        model = _matmul_nbits(model, BITS[head], block, symmetric, accuracy_level,
                              exclude=[n for n in weight_matmuls(model) if n not in heads])
    seconds = time.perf_counter() - start

    quantized = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    left = weight_matmuls(model)
    if len(quantized) + len(left) != len(weights):
        raise RuntimeError(f"{src}: {len(weights)} weight MatMuls became {len(quantized)} quantized + "
                           f"{len(left)} float; the quantizer changed something else")
    save_graph(model, dst, external)
    record = Quantization(scheme=scheme, bits=BITS[scheme], block=block, symmetric=symmetric,
                          accuracy_level=accuracy_level, head=head, head_nodes=tuple(heads), quantized=len(quantized),
                          skipped=tuple(sorted(left)),
                          tool={"onnxruntime": onnxruntime.__version__,
                                "quantizer": "onnxruntime MatMulNBitsQuantizer (round to nearest)"})
    return {"record": record, "bytes": {"source": graph_bytes(src), "quantized": graph_bytes(dst)},
            "seconds": round(seconds, 3)}


def _matmul_nbits(model, bits, block, symmetric, accuracy_level, exclude):
    """One pass of ONNX Runtime's MatMulNBitsQuantizer over every MatMul not in `exclude`
    (those without a constant weight are left alone by the quantizer)."""
    quantizer_class = _nbits_quantizer()
    with quiet("onnxruntime.quantization"):
        quantizer = quantizer_class(model, bits=bits, block_size=block, is_symmetric=symmetric,
                                    accuracy_level=accuracy_level, nodes_to_exclude=sorted(exclude))
        quantizer.process()
    return quantizer.model.model


def quantize_graphs(directory, graphs, options):
    """Quantize, in the engine directory being built at `directory`, each graph of `graphs`
    ({name: manifest Graph}) that QUANTIZABLE names; its files are replaced under the same names
    (external weights stay external). Returns the graphs with their quantization records."""
    options.check()
    out = dict(graphs)
    for name in QUANTIZABLE:
        if name not in graphs:
            continue
        g = graphs[name]
        if g.dtype != "fp32":
            raise LanternError(f"quantization starts from fp32 graphs; the {name} graph is {g.dtype}")
        with tempfile.TemporaryDirectory(prefix=".quantize-", dir=directory) as work:
            result = quantize_graph(os.path.join(directory, g.file), os.path.join(work, g.file),
                                    **options.graph_options())
            written = sorted(os.listdir(work), reverse=True)  # the .onnx.data first, the graph last
            if written != sorted(f for f in (g.file, g.external_data) if f)[::-1]:
                raise RuntimeError(f"{name}: quantized files {written} differ from the graph's {g.file}, {g.external_data}")
            for file in written:
                os.replace(os.path.join(work, file), os.path.join(directory, file))
        out[name] = dataclasses.replace(g, quantization=result["record"])
    return out


def quantize_engine(src, dst, options, *, force=False):
    """A new engine directory `dst`: the engine `src` with its target and drafter graphs
    quantized (QuantizeOptions), the other files copied (not hard-linked: onnx refuses external
    data files with several links, as a hardlink attack), the manifest updated; TensorRT plans
    and tuned trees, measured on the float graphs, are left behind. The sources stay the fp32
    checkpoints, so `check` compares against the fp32 PyTorch modules. Placed atomically
    (lantern.export.placement). Returns the new Manifest."""

    options.check()
    src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    manifest = read_manifest(src)
    if src == dst:
        raise LanternError(f"{dst}: the quantized engine must not replace its source; give another --out")
    quantized = [name for name, g in manifest.graphs.items() if g.quantization is not None]
    if quantized:
        raise LanternError(f"{src} is already quantized ({', '.join(quantized)}: "
                           f"{quantization_scheme(manifest)}); quantize the fp32 engine")
    if not any(name in manifest.graphs for name in QUANTIZABLE):
        raise LanternError(f"{src} has no {' or '.join(QUANTIZABLE)} graph to quantize")
    placement.check_engine_destination(dst, force)
    # TensorRT plans were built from the float graphs and tuned trees were timed on them: neither
    # describes the quantized engine, so neither is copied (rebuild / re-tune on the new one).
    measured = {p.file for entry in (manifest.tensorrt or {}).values() for p in entry.plans.values()}
    for entry in manifest.tuned_trees.values():
        folder = os.path.dirname(entry.report) + "/" if entry.report else None
        measured |= {t.file for t in entry.trees if t.file}
        measured |= {name for name in manifest.files if folder and name.startswith(folder)}
    files = sorted(set(manifest.files) - measured)  # the same names; quantized graphs get new sizes and hashes
    staging = placement.engine_directory(dst, force)
    tmp = staging.open()
    try:
        for name in files:
            os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
            shutil.copy2(os.path.join(src, name), os.path.join(tmp, name))
        graphs = quantize_graphs(tmp, manifest.graphs, options)
        build = dict(manifest.build, quantized_from=src,
                     quantized=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        manifest = manifest.replace(graphs=graphs, files=describe_files(tmp, files), build=build, tensorrt=None,
                                    tuned_trees={})
        manifest.write(tmp)
        staging.place()
    except BaseException:
        staging.discard()
        raise
    return manifest


def verify_record(path, record):
    """Check that the graph at `path` is what its Quantization `record` says: scheme and bits,
    block, symmetry and accuracy level of every MatMulNBits node (the head's at the head's
    precision), how many there are, which weight MatMuls stayed float. Raises LanternError
    naming the first mismatch."""
    import onnx

    where = os.fspath(path)
    if record.scheme not in BITS:
        raise LanternError(f"{where}: the record's scheme {record.scheme!r} is not one of {', '.join(SCHEMES)}")
    if record.bits != BITS[record.scheme]:
        raise LanternError(f"{where}: the record says scheme {record.scheme} with {record.bits} bits "
                           f"({record.scheme} is {BITS[record.scheme]} bits)")
    if record.head not in HEAD_PRECISIONS:
        raise LanternError(f"{where}: the record's head precision {record.head!r} is not one of "
                           f"{', '.join(HEAD_PRECISIONS)}")
    model = onnx.load(where, load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    if len(nodes) != record.quantized:
        raise LanternError(f"{where}: {len(nodes)} MatMulNBits nodes, the record says {record.quantized}")
    head_nodes = sorted(record.head_nodes)
    found_heads = output_heads(model, quantized=True)
    if head_nodes != found_heads:
        raise LanternError(f"{where}: output head {found_heads}, the record says {head_nodes}")
    weights = weight_matmuls(model)
    float_heads = [name for name in head_nodes if name in weights]
    if (record.head == "float") != (float_heads == head_nodes):
        raise LanternError(f"{where}: the record says the head is {record.head}, the graph's head "
                           f"{head_nodes} is {'float' if float_heads else 'quantized'}")
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        is_head = source_name(node) in head_nodes
        expected = {"bits": BITS[record.head] if is_head else record.bits, "block": record.block,
                    "accuracy_level": record.accuracy_level, "symmetric": record.symmetric}
        found = {"bits": attrs.get("bits", 4), "block": attrs.get("block_size"),
                 "accuracy_level": attrs.get("accuracy_level", 0),
                 "symmetric": len(node.input) < 4 or not node.input[3]}
        for key, value in found.items():
            if value != expected[key]:
                raise LanternError(f"{where}: node {node.name} has {key} {value}, the record says {expected[key]}")
    if sorted(weights) != sorted(record.skipped):
        raise LanternError(f"{where}: float weight MatMuls {sorted(weights)}, the record lists "
                           f"{sorted(record.skipped)} as skipped")




def relative_errors(reference, quantized):
    """{output: ||q - f|| / ||f||} over the float outputs of two runs of one graph ({name: array});
    integer outputs (top-k ids) give the fraction of positions whose first id differs."""
    errors = {}
    for name, f in reference.items():
        q = quantized[name]
        if np.issubdtype(f.dtype, np.floating):
            f64, q64 = f.astype(np.float64), q.astype(np.float64)
            errors[name] = float(np.linalg.norm(q64 - f64) / max(np.linalg.norm(f64), 1e-30))
        else:
            errors[name] = float(np.mean(f[..., 0] != q[..., 0]))
    return errors


def check_outputs(reference, quantized, tolerance, where="graph"):
    """relative_errors(), raising LanternError when a float output's error exceeds `tolerance`
    (a number, or a scheme name from TOLERANCES). Returns the errors."""
    limit = TOLERANCES[tolerance] if isinstance(tolerance, str) else float(tolerance)
    errors = relative_errors(reference, quantized)
    for name, error in errors.items():
        if np.issubdtype(reference[name].dtype, np.floating) and not error <= limit:
            raise LanternError(f"{where}: output {name} differs from the float graph by {error:.4g} "
                               f"(relative RMS), over the tolerance {limit:g}")
    return errors


# ---------------------------------------------------------------------------------------------
# Fidelity through the runtime


class RecordingBackend:
    """A backend that keeps a copy of every target call's inputs (for teacher forcing)."""

    def __init__(self, backend):
        self.backend, self.target_calls = backend, []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def run(self, call):
        if call.graph == "target":
            self.target_calls.append((call.regime, {k: np.array(v, copy=True) for k, v in call.feeds.items()}))
        return self.backend.run(call)


def greedy_agreement(reference, engines, classes, cfg_scale):
    """Teacher-forced greedy agreement with a reference engine (runtime Engines, class-conditional):
    the reference generates greedy `ar` images for `classes` with its target calls recorded, then
    every engine's target runs on exactly those inputs. Returns ({name: the fraction of (call,
    image) pairs whose CFG-combined greedy image token at the call's last position equals the
    reference's}, the reference's greedy tokens). Free of the divergence that makes free-running
    agreement fall after a first different token: it measures each step's fidelity."""

    recorder = RecordingBackend(reference.backend)
    # the host step: every target call goes through run(), where the recorder sees it (a device
    # step runs its calls on the runner itself)
    reference.backend, step, reference.step = recorder, reference.step, "host"
    try:
        tokens = reference.generate(classes=list(classes), mode="ar", greedy=True, cfg_scale=cfg_scale).tokens
    finally:
        reference.backend, reference.step = recorder.backend, step
    m, images = reference.manifest, len(classes)
    columns = slice(m.vocabulary.image_start, m.vocabulary.image_end)

    def greedy(engine, regime, feeds):
        logits = engine.backend.numpy(engine.backend.run(Call("target", regime, feeds))["logits"])
        last = logits[:, -1, columns].astype(np.float64)
        if cfg_scale > 1.0:  # rows [cond; uncond], combined as the decoding loop does
            last = last[images:] + cfg_scale * (last[:images] - last[images:])
        return last.argmax(-1)

    want = [greedy(reference, regime, feeds) for regime, feeds in recorder.target_calls]
    agreement = {name: float(np.mean([(greedy(e, regime, feeds) == w).mean()
                                      for (regime, feeds), w in zip(recorder.target_calls, want)]))
                 for name, e in engines.items()}
    return agreement, tokens


# ---------------------------------------------------------------------------------------------
# Command line: `lantern-export onnx --quantize ...` and `lantern-export quantize ENGINE --out NEW`


def add_quantize_options(p, required=False):
    if required:
        p.add_argument("--scheme", required=True, choices=SCHEMES, help="int8 or int4 weights (weight-only)")
    else:
        p.add_argument("--quantize", default="none", choices=("none",) + SCHEMES,
                       help="weight-only quantization of the target and drafter graphs (ONNX Runtime MatMulNBits; "
                            "default none). int8: ~2x faster one-token step on CPU, close to fp32; int4: a little "
                            "faster and smaller, coarser (see lantern.export.quantize)")
    p.add_argument("--quant-block", type=int, default=None,
                   help=f"weights per scale along K, a power of two >= 16 (default {DEFAULT_BLOCK})")
    p.add_argument("--quant-accuracy-level", type=int, choices=(0, 4), default=None,
                   help="MatMulNBits compute: 4 = int8 activations, the fast CPU path (default); 0 = fp32 "
                        "arithmetic on dequantized weights (3-10x slower; greedy exact == ar token for token)")


def quantize_options(args):
    """QuantizeOptions from the command line, or None for --quantize none."""
    scheme = getattr(args, "scheme", None) or args.quantize
    if scheme == "none":
        given = [flag for flag, value in (("--quant-block", args.quant_block),
                                          ("--quant-accuracy-level", args.quant_accuracy_level)) if value is not None]
        if given:
            raise LanternError(f"{', '.join(given)} needs --quantize int8 or int4")
        return None
    return QuantizeOptions(scheme, DEFAULT_BLOCK if args.quant_block is None else args.quant_block,
                           DEFAULT_ACCURACY_LEVEL if args.quant_accuracy_level is None else args.quant_accuracy_level
                           ).check()


def describe_quantization(manifest):
    """One line on an engine's quantized graphs ('' when none)."""
    parts = [f"{name} {q.scheme} (block {q.block}, accuracy level {q.accuracy_level}, head {q.head}, "
             f"{q.quantized} MatMuls{f', {len(q.skipped)} left float' if q.skipped else ''})"
             for name, g in manifest.graphs.items() if (q := g.quantization) is not None]
    return "quantized weight-only: " + "; ".join(parts) if parts else ""


def add_parser(sub):
    p = sub.add_parser("quantize", help="quantize an engine's target and drafter graphs into a new engine directory",
                       description="Copy an fp32 engine directory to --out with its target and drafter graphs "
                                   "quantized weight-only (int8 / int4, ONNX Runtime MatMulNBits), written atomically; "
                                   "the same as `lantern-export onnx --quantize` without exporting again.")
    p.add_argument("engine", help="the fp32 engine directory")
    add_quantize_options(p, required=True)
    p.add_argument("--out", required=True, help="the quantized engine directory to create")
    p.add_argument("--force", action="store_true", help="replace an existing engine directory at --out")
    p.set_defaults(func=run)


def run(args):
    start = time.perf_counter()
    manifest = quantize_engine(args.engine, args.out, quantize_options(args), force=args.force)
    size = sum(f.size for f in manifest.files.values())
    print(f"engine {args.out}: {describe_quantization(manifest)}; {size / 2**20:.1f} MiB in "
          f"{time.perf_counter() - start:.1f}s. Check it with `lantern-export check {args.out}`")
    return 0


def _nbits_quantizer():
    """ONNX Runtime's MatMulNBitsQuantizer. Its module calls logging.basicConfig(level=INFO) on
    import, which would make every logger of this process print INFO lines; undo that."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    root.handlers[:] = handlers
    root.setLevel(level)
    return MatMulNBitsQuantizer

