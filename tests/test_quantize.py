"""Quantized engines (lantern.export.quantize) on tiny real engines and the demo engine: the graphs
run on ONNX Runtime and stay within the stated tolerance of the fp32 graph on the inputs a real
generation feeds them; their records are typed manifest fields, checked against the graphs;
`lantern-export onnx --quantize` and `lantern-export quantize` write them; `check` applies each
scheme's tolerance against the fp32 PyTorch modules and catches a wrong tolerance or record; the
decoding loop generates with them.

Tolerances (relative RMS error of every float output against fp32, quantize.TOLERANCES): int8
0.05, int4 0.25. Measured here on generation inputs: int8 ~0.007, int4 ~0.09.
Exactness is relative to the engine that verifies: greedy exact == ar token for token at accuracy
level 0 (fp32 arithmetic). At level 4 (int8 activations, the fast default) it is not: measured on
the demo engine at cfg 3, 15 images, int8: 86.7% of the tokens (8 of 15 images identical), int4:
93.2% (see lantern.export.quantize, DECISIONS)."""
import dataclasses
import importlib.util
import json
import os
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from engines import build_engine
from lantern.export import cli, quant_graph, quantize, quantize_qdq
from lantern.export.check import check_engine
from lantern.export.quantize import QuantizeOptions, quantize_engine
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.manifest import quantization_scheme, read_manifest
from lantern.tools import run_cli

GRAPHS = ("target", "drafter")


@pytest.fixture(scope="module")
def c2i(tmp_path_factory):
    """The tiny c2i engine with init_random's near-uniform models (build_engine(peaked=False)):
    the session's peaked ones (random std-0.3 weights through two layers) carry int8/int4
    rounding past the schemes' tolerances, which are set for trained weights; positions are not
    what this file tests. Tiny dims: D = 32, FFN 96, drafter fc 64 -> every K is a multiple of
    32 (and of 16)."""
    return build_engine(tmp_path_factory.mktemp("c2i-near-uniform"), "c2i", peaked=False)


@pytest.fixture(scope="module")
def quantized(c2i, tmp_path_factory):
    """The tiny engine quantized per scheme (default options): {scheme: engine directory}."""
    root = tmp_path_factory.mktemp("quantized")
    made = {}
    for scheme in quantize.SCHEMES:
        quantize_engine(c2i, root / scheme, QuantizeOptions(scheme))
        made[scheme] = str(root / scheme)
    return made


class Recording:
    """A backend that keeps a copy of the target and drafter calls' inputs."""

    def __init__(self, backend):
        self.backend, self.calls = backend, {g: [] for g in GRAPHS}

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def run(self, call):
        if call.graph in self.calls:
            self.calls[call.graph].append({k: np.array(v, copy=True) for k, v in call.feeds.items()})
        return self.backend.run(call)


@pytest.fixture(scope="module")
def feeds(c2i):
    """Inputs of real target and drafter calls: a greedy `exact` generation with CFG, recorded
    at the backend (prefill, verification, every drafter depth: the host step runs each call)."""
    engine = Engine(c2i, threads=2, step="host")
    engine.backend = recorder = Recording(engine.backend)
    engine.generate(classes=[1, 2, 3], mode="exact", greedy=True, cfg_scale=3.0)
    return {g: calls[:: max(1, len(calls) // 6)] for g, calls in recorder.calls.items()}


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


def edit_manifest(directory, change):
    """Rewrite manifest.json with change(data) applied (its file hashes stay valid)."""
    path = os.path.join(directory, "manifest.json")
    with open(path) as f:
        data = json.load(f)
    change(data)
    with open(path, "w") as f:
        json.dump(data, f)


# ---------------------------------------------------------------------------------------------
# Graphs


@pytest.mark.parametrize("scheme", quantize.SCHEMES)
@pytest.mark.parametrize("graph", GRAPHS)
def test_quantized_graph_matches_fp32_within_tolerance(c2i, quantized, feeds, scheme, graph):
    src, dst = os.path.join(c2i, f"{graph}.onnx"), os.path.join(quantized[scheme], f"{graph}.onnx")
    record = read_manifest(quantized[scheme]).graphs[graph].quantization
    weights = quant_graph.weight_matmuls(onnx.load(src))
    assert record.quantized == len(weights) > 0  # every weight MatMul, the head at int8
    assert record.skipped == () and record.head == "int8" and len(record.head_nodes) == 1
    assert record.bits == {"int8": 8, "int4": 4}[scheme] and record.block == 32 and record.accuracy_level == 4
    quantize.verify_record(dst, record)

    reference, got = outputs(src, feeds[graph]), outputs(dst, feeds[graph])
    for r, q in zip(reference, got):
        quantize.check_outputs(r, q, scheme, where=graph)
    errors = worst_errors(reference, got)
    floats = [n for n in errors if np.issubdtype(reference[0][n].dtype, np.floating)]
    # Quantized for real: the outputs moved, by about what the bit width predicts (the drafter's
    # top-k probabilities of near-uniform tiny logits hardly move, so the largest error counts).
    low, high = {"int8": (1e-3, 0.03), "int4": (0.03, 0.25)}[scheme]
    assert low < max(errors[n] for n in floats) and all(errors[n] < high for n in floats), errors


def test_int4_is_coarser_than_int8(c2i, quantized, feeds):
    src = os.path.join(c2i, "target.onnx")
    errors = {s: worst_errors(outputs(src, feeds["target"]), outputs(os.path.join(d, "target.onnx"), feeds["target"]))
              for s, d in quantized.items()}
    assert errors["int4"]["logits"] > 4 * errors["int8"]["logits"]


def test_too_tight_tolerance_is_caught(c2i, quantized, feeds):
    src, dst = os.path.join(c2i, "target.onnx"), os.path.join(quantized["int8"], "target.onnx")
    reference, got = outputs(src, feeds["target"][-1:])[0], outputs(dst, feeds["target"][-1:])[0]
    measured = quantize.relative_errors(reference, got)["logits"]
    quantize.check_outputs(reference, got, 2 * measured)
    with pytest.raises(LanternError, match="over the tolerance"):
        quantize.check_outputs(reference, got, measured / 2)
    with pytest.raises(LanternError, match="output logits"):
        quantize.check_outputs(reference, got, 1e-6)  # fp32-level tolerance on an int8 graph


def test_wrong_record_is_caught(c2i, tmp_path):
    dst = str(tmp_path / "t.onnx")
    record = quantize.quantize_graph(os.path.join(c2i, "target.onnx"), dst, "int4", head="float")["record"]
    quantize.verify_record(dst, record)
    wrong = {
        "scheme says int8": dict(scheme="int8", bits=8),
        "bits disagree with scheme": dict(bits=8),
        "unknown scheme": dict(scheme="int3"),
        "block": dict(block=64),
        "accuracy level": dict(accuracy_level=0),
        "symmetry": dict(symmetric=False),
        "count": dict(quantized=record.quantized + 1),
        "head precision": dict(head="int8"),
        "head nodes": dict(head_nodes=("node_linear",)),
        "skipped": dict(skipped=()),
    }
    for what, change in wrong.items():
        with pytest.raises(LanternError):
            quantize.verify_record(dst, dataclasses.replace(record, **change))
            pytest.fail(f"a wrong record ({what}) passed")


def test_head_precision(c2i, tmp_path):
    src = os.path.join(c2i, "target.onnx")
    heads = quant_graph.output_heads(onnx.load(src))
    assert len(heads) == 1
    bits = {}
    for head in quantize.HEAD_PRECISIONS:
        dst = str(tmp_path / f"{head}.onnx")
        record = quantize.quantize_graph(src, dst, "int4", head=head)["record"]
        quantize.verify_record(dst, record)
        nodes = {quant_graph.source_name(n): n for n in onnx.load(dst).graph.node if n.op_type == "MatMulNBits"}
        bits[head] = {a.name: a.i for a in nodes[heads[0]].attribute}["bits"] if heads[0] in nodes else None
        assert list(record.skipped) == (heads if head == "float" else [])
    assert bits == {"float": None, "int8": 8, "int4": 4}


def test_block_larger_than_k_is_padded(c2i, feeds, tmp_path):
    """K = 32 and 96 with block 64: ONNX Runtime's quantizer pads K with zero weights to whole
    blocks, so these MatMuls are quantized too, and the graph still matches."""
    src, dst = os.path.join(c2i, "target.onnx"), str(tmp_path / "b64.onnx")
    record = quantize.quantize_graph(src, dst, "int8", block=64)["record"]
    assert record.skipped == () and record.quantized == len(quant_graph.weight_matmuls(onnx.load(src)))
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
    result = quantize.quantize_graph(src, dst, "int4")
    assert os.path.isfile(dst + ".data") and sorted(os.listdir(tmp_path / "out")) == ["target.onnx", "target.onnx.data"]
    assert result["bytes"]["quantized"] < result["bytes"]["source"]  # tiny: the weights are a small part
    quantize.verify_record(dst, result["record"])
    for r, q in zip(outputs(src, feeds["target"]), outputs(dst, feeds["target"])):
        quantize.check_outputs(r, q, "int4")


# ---------------------------------------------------------------------------------------------
# Engines: export, manifest, check, generation


def test_export_with_quantize_writes_records_and_passes_check(c2i, tmp_path, capsys):
    """`lantern-export onnx --quantize` from the tiny engine's own checkpoints: the graphs are
    quantized in the staging directory before the manifest is written, and the engine passes
    `check` at its scheme's tolerance against the fp32 PyTorch modules."""
    sources = read_manifest(c2i).sources
    out = tmp_path / "int4"
    argv = ["onnx", "--target", sources["target"]["path"], "--config", sources["target"]["options"]["config_file"],
            "--drafter", sources["drafter"]["path"], "--candidates", "16", "--out", str(out), "--no-progress",
            "--quantize", "int4", "--quant-block", "64", "--quant-accuracy-level", "0"]
    assert cli.main(argv) == 0
    assert "quantized weight-only: target int4 (block 64, accuracy level 0" in capsys.readouterr().out
    m = read_manifest(out)
    assert quantization_scheme(m) == "int4" and m.modes == ("ar", "exact")
    for graph in GRAPHS:
        q = m.graphs[graph].quantization
        assert (q.scheme, q.bits, q.block, q.accuracy_level, q.head) == ("int4", 4, 64, 0, "int8")
        quantize.verify_record(out / m.graphs[graph].file, q)
    assert m.graphs["condition"].quantization is None
    assert sorted(os.listdir(out)) == sorted(list(m.files) + ["manifest.json"])  # nothing left of the staging
    report = check_engine(out)
    assert report["ok"], report["failures"]
    assert report["quantization"] == {g: {"scheme": "int4", "tolerance": 0.25} for g in GRAPHS}
    rms = [r["rms_rel"] for r in report["results"] if "rms_rel" in r]
    assert len(rms) > 10 and 0.01 < max(rms) <= 0.25  # quantized for real, within the stated tolerance
    tokens = Engine(out, threads=2).generate(classes=[1, 2], mode="exact", greedy=True, cfg_scale=3.0).tokens
    assert tokens.shape == (2, m.image.tokens) and tokens.min() >= 0 and tokens.max() < m.vocabulary.codes
    # bad options are refused before anything is loaded or written
    for bad, message in ((["--quantize", "int8", "--dtype", "fp16"], "starts from fp32"),
                         (["--quantize", "int8", "--quant-block", "48"], "power of two"),
                         (["--quant-block", "64"], "needs --quantize")):
        assert cli.main(argv[:11] + ["--out", str(tmp_path / "bad"), "--no-progress"] + bad) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_quantized_engine_passes_check_and_generates(c2i, quantized, capsys):
    for scheme, directory in quantized.items():
        m = read_manifest(directory, verify=True)  # sizes and hashes of the new files are recorded
        assert quantization_scheme(m) == scheme and m.sources == read_manifest(c2i).sources
        # Copies, not hard links: onnx.load refuses external data with several links.
        assert all(os.stat(os.path.join(d, f)).st_nlink == 1 for d in (c2i, directory) for f in m.files)
        assert cli.main(["check", directory]) == 0
        printed = capsys.readouterr().out
        tolerance = quantize.TOLERANCES[scheme]
        assert f"except target ({scheme} weight-only): pass iff ||a - b|| / ||torch|| <= {tolerance:g}" in printed
        assert f"<= {tolerance:g})" in printed and "check passed" in printed
        engine = Engine(directory, threads=2)
        for mode in ("ar", "lantern++"):
            out = engine.generate(classes=[1, 2, 3], mode=mode, greedy=True, cfg_scale=3.0, k=8)
            assert out.tokens.shape == (3, m.image.tokens) and out.tokens.max() < m.vocabulary.codes
            again = engine.generate(classes=[1, 2, 3], mode=mode, greedy=True, cfg_scale=3.0, k=8)
            np.testing.assert_array_equal(again.tokens, out.tokens)
        assert engine.decode(out.tokens).shape[0] == 3


def test_wrong_tolerance_is_caught_by_check(quantized):
    """A tolerance below what quantization costs (here fp32's level, or half of what int8
    measures) fails the check: it can fail, so its pass means something."""
    from lantern.export.onnx_export import load_graph_modules

    modules = load_graph_modules(read_manifest(quantized["int8"]))  # the fp32 reference, loaded once
    report = check_engine(quantized["int8"], verify=False, modules=modules)
    worst = max(r["rms_rel"] for r in report["results"] if "rms_rel" in r)
    for tolerance in (1e-4, worst / 2):
        bad = check_engine(quantized["int8"], verify=False, quant_tolerance=tolerance, modules=modules)
        assert not bad["ok"] and all("relative RMS error" in f for f in bad["failures"] if "topk_ids" not in f)


def test_wrong_scheme_record_is_caught(quantized, tmp_path, capsys):
    """A manifest whose record does not match its graph (an int4 graph recorded as int8, a
    different block) is refused by check with a re-export line; an impossible record (unknown
    scheme, bits that contradict it, a quantized VQ decoder) already by the manifest reader."""
    def copy(name):
        directory = tmp_path / name
        shutil.copytree(quantized["int4"], directory)
        return directory

    def record(key, value, graph="target"):
        return lambda data: data["graphs"][graph]["quantization"].__setitem__(key, value)

    d = copy("as_int8")
    edit_manifest(d, lambda data: data["graphs"]["target"]["quantization"].update(scheme="int8", bits=8))
    read_manifest(d)  # a consistent record ...
    with pytest.raises(LanternError, match="re-export"):  # ... that the graph contradicts
        check_engine(d)
    assert cli.main(["check", str(d)]) == 2
    assert "bits 4, the record says 8" in capsys.readouterr().err

    d = copy("block")
    edit_manifest(d, record("block", 64))
    with pytest.raises(LanternError, match="block_size|block 32, the record says 64"):
        check_engine(d)

    for name, change, message in (
            ("unknown", record("scheme", "int3"), "scheme is 'int3', expected one of int8, int4"),
            ("bits", record("bits", 8), "bits is 8, expected 4"),
            ("level", record("accuracy_level", 7), "accuracy_level is 7"),
            ("vq", lambda data: data["graphs"]["vq_decoder"].__setitem__(
                "quantization", data["graphs"]["target"]["quantization"]), "only target and drafter"),
            ("extra", record("zero_points", True), "unknown field")):
        d = copy(name)
        edit_manifest(d, change)
        with pytest.raises(LanternError, match=message) as e:
            read_manifest(d)
        assert "re-export the engine" in str(e.value)


def test_torch_backend_refuses_a_quantized_engine(quantized, tmp_path, capsys):
    argv = ["generate", quantized["int8"], "--backend", "torch", "--classes", "1", "--out", str(tmp_path / "o")]
    assert run_cli.main(argv) == 2
    assert "int8-quantized graphs, which the torch backend cannot run" in capsys.readouterr().err


def test_onnxruntime_torch_runs_a_quantized_engine_on_both_step_paths(quantized):
    """What the torch backend refuses, onnxruntime-torch runs (ONNX Runtime runs the quantized
    graphs): the onnxruntime backend's tokens on the host step and the whole device step."""
    from lantern.export.torch_backend import open_onnxruntime_torch_backend

    directory = quantized["int8"]
    backend = open_onnxruntime_torch_backend(directory, threads=2)
    kw = dict(classes=[1, 2], mode="lantern++", greedy=True, cfg_scale=3.0, k=8)
    want = Engine(directory, threads=2).generate(**kw).tokens
    for step in ("host", "device"):
        out = Engine(directory, backend=backend, step=step).generate(**kw)
        assert out.stats["step"] == step
        np.testing.assert_array_equal(out.tokens, want, err_msg=step)


def test_tensorrt_plans_refused_for_a_quantized_engine(quantized, capsys):
    """TensorRT's parser takes MatMulNBits only with fp16 inputs (measured: TensorRT for RTX 1.7
    refuses an fp32 one), so `lantern-export trt` says so at once instead of failing mid-build."""
    assert cli.main(["trt", quantized["int8"], "--flavor", "tensorrt-rtx", "--compute-capability", "89"]) == 2
    assert "int8 weight-only graphs" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(quantized["int8"], "plans"))


def test_quantize_command_refuses_bad_requests(c2i, quantized, tmp_path, capsys):
    os.makedirs(tmp_path / "b")
    (tmp_path / "b" / "notes.txt").write_text("mine")
    for argv, message in ((["quantize", c2i, "--scheme", "int4", "--out", str(tmp_path / "b")], "already exists"),
                          (["quantize", c2i, "--scheme", "int4", "--out", str(tmp_path / "b"), "--force"],
                           "not an engine directory"),
                          (["quantize", quantized["int8"], "--scheme", "int4", "--out", str(tmp_path / "c")],
                           "already quantized"),
                          (["quantize", c2i, "--scheme", "int4", "--out", c2i, "--force"], "must not replace its source")):
        assert cli.main(argv) == 2
        assert message in capsys.readouterr().err
    assert os.listdir(tmp_path / "b") == ["notes.txt"]
    assert sorted(os.listdir(tmp_path)) == ["b"]


@pytest.mark.parametrize("scheme", quantize.SCHEMES)
def test_greedy_exact_equals_ar_at_accuracy_level_0(c2i, tmp_path, scheme):
    """Exactness is relative to the engine that verifies: with weight-only numerics (accuracy
    level 0: weights dequantized, fp32 arithmetic) a token's logits do not depend on how many
    tokens share the call, so greedy exact == greedy ar token for token."""
    out = tmp_path / scheme
    quantize_engine(c2i, out, QuantizeOptions(scheme, accuracy_level=0))
    engine = Engine(out, threads=2)
    for cfg in (1.0, 3.0):
        ar = engine.generate(classes=[1, 2, 3], mode="ar", greedy=True, cfg_scale=cfg).tokens
        exact = engine.generate(classes=[1, 2, 3], mode="exact", greedy=True, cfg_scale=cfg).tokens
        np.testing.assert_array_equal(exact, ar)


def test_greedy_exact_against_ar_on_the_demo_engine(demo_engine, tmp_path):
    """On the trained demo model (near-ties are common at cfg 3): int4 at level 0 keeps exact ==
    ar token for token; int8 at level 4 (the default) agrees on most tokens but not all, as the
    module docstring states (measured 86.7% of the tokens, 8 of 15 images identical): its int8
    activations round a 26-token verification call differently from a 1-token AR call."""
    classes = list(range(15))
    agreement = {}
    for scheme, level in (("int4", 0), ("int8", 4)):
        out = tmp_path / f"{scheme}-{level}"
        quantize_engine(demo_engine, out, QuantizeOptions(scheme, accuracy_level=level))
        engine = Engine(out, threads=2)
        ar = engine.generate(classes=classes, mode="ar", greedy=True, cfg_scale=3.0).tokens
        exact = engine.generate(classes=classes, mode="exact", greedy=True, cfg_scale=3.0).tokens
        agreement[scheme, level] = float((exact == ar).mean())
    assert agreement["int4", 0] == 1.0
    assert 0.75 < agreement["int8", 4] < 1.0, agreement


def test_teacher_forced_agreement(demo_engine, tmp_path):
    """quantize.greedy_agreement: the reference agrees with itself exactly, int8 with fp32 on
    most steps (measured 94.8%), int4 less (82.7%). Tuned trees stay with the fp32 engine."""
    engines = {"fp32": Engine(demo_engine, threads=2)}
    for scheme in quantize.SCHEMES:
        m = quantize_engine(demo_engine, tmp_path / scheme, QuantizeOptions(scheme))
        engines[scheme] = Engine(tmp_path / scheme, threads=2)
    # The demo tuned a tree on the fp32 engine's latency; the quantized copy does not inherit it.
    assert engines["fp32"].manifest.tuned_trees and m.tuned_trees == {} and m.tensorrt is None
    assert not os.path.exists(tmp_path / "int4" / "tuned") and not any(f.startswith("tuned/") for f in m.files)
    agreement, tokens = quantize.greedy_agreement(engines["fp32"], engines, list(range(15)), 3.0)
    assert tokens.shape == (15, 64)
    assert agreement["fp32"] == 1.0
    assert 0.9 < agreement["int8"] < 1.0 and 0.7 < agreement["int4"] < agreement["int8"], agreement


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
    for scheme in quantize_qdq.QDQ_SCHEMES:
        path = str(out / f"target-{scheme}.onnx")
        made[scheme] = (path, quantize_qdq.quantize_qdq(os.path.join(c2i, "target.onnx"), path, scheme, feeds["target"]))
    return made


@needs_modelopt
@pytest.mark.parametrize("scheme", quantize_qdq.QDQ_SCHEMES)
def test_qdq_form_matches_fp32(c2i, feeds, qdq, scheme):
    path, record = qdq[scheme]
    src = onnx.load(os.path.join(c2i, "target.onnx"))
    heads = quant_graph.output_heads(src)
    assert record["quantized"] == len(quant_graph.weight_matmuls(src)) - len(heads) > 0
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
            quantize_qdq.quantize_qdq(os.path.join(c2i, "target.onnx"), str(tmp_path / "x.onnx"), scheme)
    assert os.listdir(tmp_path) == []


@needs_modelopt
@needs_trt_rtx
@pytest.mark.parametrize("scheme", quantize_qdq.QDQ_SCHEMES)
def test_qdq_form_builds_with_tensorrt_rtx(c2i, qdq, scheme):
    """Parse + strongly typed build for SM89 and SM120 on this CPU; FP8 has no Ampere kernels,
    so the SM86 build must fail (the check can fail)."""
    import tensorrt_rtx as trt

    from lantern.tools.bench.quant_trt import build, profile_sizes

    path = qdq[scheme][0]
    sizes = profile_sizes(read_manifest(c2i), "target")
    for cc in ("SM89", "SM120"):
        result = build(trt, path, cc, sizes)
        assert result["ok"] and result["plan_bytes"] > 0, result
    if scheme == "fp8":
        assert not build(trt, path, "SM86", sizes)["ok"]
