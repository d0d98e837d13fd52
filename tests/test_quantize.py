"""Quantized graphs (lantern.export.quantize) on tiny real engines: they run on ONNX Runtime, stay
within the stated tolerance of the fp32 graph on the inputs a real generation feeds them, their
records are checked against the graphs, and the decoding loop generates with them.

Tolerances (relative RMS error of every float output against the fp32 graph, TOLERANCES):
int8 0.03, int4 0.25. Measured here: int8 ~0.007, int4 ~0.09."""
import importlib.util
import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from engines import build_engine
from lantern.export import quantize
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.manifest import read_manifest

GRAPHS = ("target", "drafter")


@pytest.fixture(scope="module")
def c2i(tmp_path_factory):
    # Tiny dims: D = 32, FFN 96, drafter fc 64 -> every K is a multiple of 32 (and of 16).
    return build_engine(tmp_path_factory.mktemp("c2i"), "c2i", with_vq=False)


@pytest.fixture(scope="module")
def feeds(c2i):
    """Inputs of real target and drafter calls: a greedy `exact` generation with CFG, recorded
    at the backend (prefill, verification, every drafter depth)."""
    engine = Engine(c2i, threads=2)
    recorded = {g: [] for g in GRAPHS}
    run = engine.backend.run

    def recording(graph, f):
        if graph in recorded:
            recorded[graph].append({k: np.array(v, copy=True) for k, v in f.items()})
        return run(graph, f)

    engine.backend.run = recording
    engine.generate(classes=[1, 2, 3], mode="exact", greedy=True, cfg_scale=3.0)
    return {g: calls[:: max(1, len(calls) // 6)] for g, calls in recorded.items()}


def session(path):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def outputs(path, calls):
    s = session(path)
    names = [o.name for o in s.get_outputs()]
    return [dict(zip(names, s.run(None, f))) for f in calls]


def worst_errors(reference, quantized):
    """Per output, the largest relative error over the calls."""
    errors = [quantize.relative_errors(r, q) for r, q in zip(reference, quantized)]
    return {name: max(e[name] for e in errors) for name in errors[0]}


@pytest.mark.parametrize("scheme", quantize.SCHEMES)
@pytest.mark.parametrize("graph", GRAPHS)
def test_quantized_graph_matches_fp32_within_tolerance(c2i, feeds, tmp_path, scheme, graph):
    src, dst = os.path.join(c2i, f"{graph}.onnx"), str(tmp_path / f"{graph}.onnx")
    record = quantize.quantize_graph(src, dst, scheme)
    weights = quantize.weight_matmuls(onnx.load(src))
    assert record["quantized"] == len(weights) > 0  # every weight MatMul, the head at int8
    assert record["skipped"] == [] and record["head"]["precision"] == "int8"
    assert record["bits"] == {"int8": 8, "int4": 4}[scheme] and record["block"] == 32
    quantize.verify_record(dst, record)

    reference, quantized = outputs(src, feeds[graph]), outputs(dst, feeds[graph])
    for r, q in zip(reference, quantized):
        quantize.check_outputs(r, q, scheme, where=graph)
    errors = worst_errors(reference, quantized)
    floats = [n for n in errors if np.issubdtype(reference[0][n].dtype, np.floating)]
    # Quantized for real: the outputs moved, by about what the bit width predicts (the drafter's
    # top-k probabilities of near-uniform tiny logits hardly move, so the largest error counts).
    low, high = {"int8": (1e-3, 0.03), "int4": (0.03, 0.25)}[scheme]
    assert low < max(errors[n] for n in floats) and all(errors[n] < high for n in floats), errors


def test_int4_is_coarser_than_int8(c2i, feeds, tmp_path):
    src = os.path.join(c2i, "target.onnx")
    errors = {}
    for scheme in quantize.SCHEMES:
        quantize.quantize_graph(src, str(tmp_path / f"{scheme}.onnx"), scheme)
        errors[scheme] = worst_errors(outputs(src, feeds["target"]), outputs(str(tmp_path / f"{scheme}.onnx"), feeds["target"]))
    assert errors["int4"]["logits"] > 4 * errors["int8"]["logits"]


def test_too_tight_tolerance_is_caught(c2i, feeds, tmp_path):
    src, dst = os.path.join(c2i, "target.onnx"), str(tmp_path / "t.onnx")
    quantize.quantize_graph(src, dst, "int8")
    reference, quantized = outputs(src, feeds["target"][-1:])[0], outputs(dst, feeds["target"][-1:])[0]
    measured = quantize.relative_errors(reference, quantized)["logits"]
    quantize.check_outputs(reference, quantized, 2 * measured)
    with pytest.raises(LanternError, match="over the tolerance"):
        quantize.check_outputs(reference, quantized, measured / 2)
    with pytest.raises(LanternError, match="output logits"):
        quantize.check_outputs(reference, quantized, 1e-6)  # fp32-level tolerance on an int8 graph


def test_wrong_record_is_caught(c2i, tmp_path):
    dst = str(tmp_path / "t.onnx")
    record = quantize.quantize_graph(os.path.join(c2i, "target.onnx"), dst, "int4", head="float")
    quantize.verify_record(dst, record)
    wrong = {
        "scheme says int8": dict(record, scheme="int8", bits=8),
        "bits disagree with scheme": dict(record, bits=8),
        "unknown scheme": dict(record, scheme="int3"),
        "block": dict(record, block=64),
        "accuracy level": dict(record, accuracy_level=0),
        "symmetry": dict(record, symmetric=False),
        "count": dict(record, quantized=record["quantized"] + 1),
        "head precision": dict(record, head=dict(record["head"], precision="int8")),
        "head nodes": dict(record, head=dict(record["head"], nodes=["node_linear"])),
        "skipped": dict(record, skipped=[]),
    }
    for what, bad in wrong.items():
        with pytest.raises(LanternError):
            quantize.verify_record(dst, bad)
            pytest.fail(f"a wrong record ({what}) passed")


def test_head_precision(c2i, tmp_path):
    src = os.path.join(c2i, "target.onnx")
    heads = quantize.output_heads(onnx.load(src))
    assert len(heads) == 1
    bits = {}
    for head in quantize.HEAD_PRECISIONS:
        dst = str(tmp_path / f"{head}.onnx")
        record = quantize.quantize_graph(src, dst, "int4", head=head)
        quantize.verify_record(dst, record)
        nodes = {quantize._source_name(n): n for n in onnx.load(dst).graph.node if n.op_type == "MatMulNBits"}
        bits[head] = {a.name: a.i for a in nodes[heads[0]].attribute}["bits"] if heads[0] in nodes else None
        assert [s["node"] for s in record["skipped"]] == (heads if head == "float" else [])
    assert bits == {"float": None, "int8": 8, "int4": 4}


def test_block_larger_than_k_is_padded(c2i, feeds, tmp_path):
    """K = 32 and 96 with block 64: ONNX Runtime's quantizer pads K with zero weights to whole
    blocks, so these MatMuls are quantized too, and the graph still matches."""
    src, dst = os.path.join(c2i, "target.onnx"), str(tmp_path / "b64.onnx")
    record = quantize.quantize_graph(src, dst, "int8", block=64)
    assert record["skipped"] == [] and record["quantized"] == len(quantize.weight_matmuls(onnx.load(src)))
    quantize.verify_record(dst, record)
    for r, q in zip(outputs(src, feeds["target"]), outputs(dst, feeds["target"])):
        quantize.check_outputs(r, q, "int8")


def test_bad_options_write_nothing(c2i, tmp_path):
    src = os.path.join(c2i, "target.onnx")
    for options in (dict(scheme="int3"), dict(scheme="int4", block=48), dict(scheme="int4", block=8),
                    dict(scheme="int4", head="fp16"), dict(scheme="int4", accuracy_level=5)):
        with pytest.raises(LanternError):
            quantize.quantize_graph(src, str(tmp_path / "x.onnx"), **options)
    with pytest.raises(LanternError, match="overwrite its source"):
        quantize.quantize_graph(src, src, "int4")
    with pytest.raises(LanternError, match="no such ONNX file"):
        quantize.quantize_graph(str(tmp_path / "missing.onnx"), str(tmp_path / "x.onnx"), "int4")
    assert os.listdir(tmp_path) == []
    quantize.quantize_graph(src, str(tmp_path / "q.onnx"), "int4")
    with pytest.raises(LanternError, match="already quantized"):
        quantize.quantize_graph(str(tmp_path / "q.onnx"), str(tmp_path / "qq.onnx"), "int8")
    assert sorted(os.listdir(tmp_path)) == ["q.onnx"]


def test_external_data(c2i, feeds, tmp_path):
    """A graph whose weights live in <file>.data (as big exports do) quantizes into the same layout."""
    src = str(tmp_path / "ext" / "target.onnx")
    os.makedirs(os.path.dirname(src))
    onnx.save(onnx.load(os.path.join(c2i, "target.onnx")), src, save_as_external_data=True,
              all_tensors_to_one_file=True, location="target.onnx.data", size_threshold=1024)
    dst = str(tmp_path / "out" / "target.onnx")
    record = quantize.quantize_graph(src, dst, "int4")
    assert os.path.isfile(dst + ".data") and sorted(os.listdir(tmp_path / "out")) == ["target.onnx", "target.onnx.data"]
    assert record["bytes"]["quantized"] < record["bytes"]["source"]  # tiny: the weights are a small part
    quantize.verify_record(dst, record)
    for r, q in zip(outputs(src, feeds["target"]), outputs(dst, feeds["target"])):
        quantize.check_outputs(r, q, "int4")


@pytest.mark.parametrize("scheme", quantize.SCHEMES)
def test_greedy_ar_on_quantized_engine(c2i, tmp_path, scheme):
    out = str(tmp_path / scheme)
    manifest = quantize.quantize_engine(c2i, out, scheme)
    assert manifest["quantization"] == {"target": scheme, "drafter": scheme}
    read_manifest(out, verify=True)  # sizes and hashes of the new files are recorded
    # Copies, not hard links: onnx.load refuses external data with several links.
    assert all(os.stat(os.path.join(d, f)).st_nlink == 1 for d in (c2i, out) for f in os.listdir(d))
    for graph in GRAPHS:
        entry = manifest["graphs"][graph]
        quantize.verify_record(os.path.join(out, entry["file"]), entry["quantization"])
    with open(os.path.join(c2i, "manifest.json")) as f:
        vocab = json.load(f)["model"]["config"]["vocab_size"]
    engine = Engine(out, threads=2)
    tokens = engine.generate(classes=[1, 2, 3], mode="ar", greedy=True, cfg_scale=3.0).tokens
    assert tokens.shape == (3, engine.block_size) and tokens.dtype == np.int64
    assert tokens.min() >= 0 and tokens.max() < vocab
    np.testing.assert_array_equal(engine.generate(classes=[1, 2, 3], mode="ar", greedy=True, cfg_scale=3.0).tokens, tokens)


@pytest.mark.parametrize("scheme", quantize.SCHEMES)
def test_greedy_exact_equals_ar_at_accuracy_level_0(c2i, tmp_path, scheme):
    """Exactness is relative to the engine that verifies: with weight-only numerics (accuracy
    level 0: weights dequantized, fp32 arithmetic) a token's logits do not depend on how many
    tokens share the call, so greedy exact == greedy ar token for token. At level 4 the
    activations are rounded to int8 inside MatMulNBits, which turns the float noise between a
    1-token and a 27-token call into whole rounding steps; see lantern.export.quantize."""
    out = str(tmp_path / scheme)
    quantize.quantize_engine(c2i, out, scheme, accuracy_level=0)
    engine = Engine(out, threads=2)
    for cfg in (1.0, 3.0):
        ar = engine.generate(classes=[1, 2, 3], mode="ar", greedy=True, cfg_scale=cfg).tokens
        exact = engine.generate(classes=[1, 2, 3], mode="exact", greedy=True, cfg_scale=cfg).tokens
        np.testing.assert_array_equal(exact, ar)


def test_quantize_engine_refuses_bad_requests(c2i, tmp_path):
    with pytest.raises(LanternError, match="no vq_decoder graph"):
        quantize.quantize_engine(c2i, str(tmp_path / "a"), "int4", graphs=("vq_decoder",))
    os.makedirs(tmp_path / "b")
    (tmp_path / "b" / "notes.txt").write_text("mine")
    with pytest.raises(LanternError, match="already exists"):
        quantize.quantize_engine(c2i, str(tmp_path / "b"), "int4")
    with pytest.raises(LanternError, match="not an engine directory"):
        quantize.quantize_engine(c2i, str(tmp_path / "b"), "int4", force=True)
    assert os.listdir(tmp_path / "b") == ["notes.txt"]
    assert sorted(os.listdir(tmp_path)) == ["b"]


# ---------------------------------------------------------------------------------------------
# Q/DQ forms for TensorRT (NVIDIA ModelOpt), built with TensorRT for RTX on the CPU

needs_modelopt = pytest.mark.skipif(importlib.util.find_spec("modelopt") is None,
                                    reason="NVIDIA ModelOpt is not installed (pip install 'lantern[trt-quant]')")
needs_trt_rtx = pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None,
                                   reason="TensorRT for RTX is not installed (pip install tensorrt-rtx-cu12)")

# Element types of the quantized weights: ONNX TensorProto INT8, FLOAT8E4M3FN, INT4.
QDQ_WEIGHT_TYPES = {"int8": 3, "fp8": 17, "int4": 22}
# Relative RMS error against fp32 on ONNX Runtime CPU. int8 / fp8 quantize the activations too
# (per tensor, calibrated); measured on the tiny target: int8 ~0.016, fp8 ~0.055, int4 ~0.075.
QDQ_TOLERANCES = {"int8": 0.05, "fp8": 0.15, "int4": 0.25}


@pytest.fixture(scope="module")
def qdq(c2i, feeds, tmp_path_factory):
    """The tiny target in each Q/DQ form: {scheme: (path, record)}."""
    out = tmp_path_factory.mktemp("qdq")
    made = {}
    for scheme in quantize.QDQ_SCHEMES:
        path = str(out / f"target-{scheme}.onnx")
        made[scheme] = (path, quantize.quantize_qdq(os.path.join(c2i, "target.onnx"), path, scheme, feeds["target"]))
    return made


@needs_modelopt
@pytest.mark.parametrize("scheme", quantize.QDQ_SCHEMES)
def test_qdq_form_matches_fp32(c2i, feeds, qdq, scheme):
    path, record = qdq[scheme]
    src = onnx.load(os.path.join(c2i, "target.onnx"))
    heads = quantize.output_heads(src)
    assert record["quantized"] == len(quantize.weight_matmuls(src)) - len(heads) > 0
    assert [s["node"] for s in record["skipped"]] == heads and record["head"]["precision"] == "float"
    model = onnx.load(path)
    constants = {t.name: t.data_type for t in model.graph.initializer}
    weight_types = {constants[n.input[0]] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in constants}
    assert QDQ_WEIGHT_TYPES[scheme] in weight_types

    quantized = outputs(path, feeds["target"])  # ONNX Runtime CPU runs all three forms
    for r, q in zip(outputs(os.path.join(c2i, "target.onnx"), feeds["target"]), quantized):
        errors = quantize.check_outputs(r, q, QDQ_TOLERANCES[scheme], where=scheme)
        assert max(errors.values()) > 1e-3  # quantized for real


@needs_modelopt
def test_qdq_refuses_missing_calibration(c2i, tmp_path):
    for scheme in ("int8", "fp8"):
        with pytest.raises(LanternError, match="calibration"):
            quantize.quantize_qdq(os.path.join(c2i, "target.onnx"), str(tmp_path / "x.onnx"), scheme)
    assert os.listdir(tmp_path) == []


@needs_modelopt
@needs_trt_rtx
@pytest.mark.parametrize("scheme", quantize.QDQ_SCHEMES)
def test_qdq_form_builds_with_tensorrt_rtx(c2i, qdq, scheme):
    """Parse + strongly typed build for SM89 and SM120 on this CPU; FP8 has no Ampere kernels,
    so the SM86 build must fail (the check can fail)."""
    import tensorrt_rtx as trt

    from lantern.tools.bench_quant_trt import build, profile_sizes

    path = qdq[scheme][0]
    sizes = profile_sizes(json.load(open(os.path.join(c2i, "manifest.json"))), "target")
    for cc in ("SM89", "SM120"):
        result = build(trt, path, cc, sizes)
        assert result["ok"] and result["plan_bytes"] > 0, result
    if scheme == "fp8":
        assert not build(trt, path, "SM86", sizes)["ok"]
