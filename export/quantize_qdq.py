"""TensorRT's quantized graphs: Q/DQ forms `fp8`, `int8` (weights and activations, calibrated)
and `int4` (weight-only, blocked DequantizeLinear), made by NVIDIA ModelOpt's ONNX PTQ
(quantize_qdq), calibrated on ONNX Runtime's CPU provider. TensorRT for RTX 1.7 builds all three
on this CPU for SM89 and SM120 (tools/bench/quant_trt.py; GPT-B target plans: fp32 407 MB, fp8 and
int8 155 MB, int4 113 MB, the head in float); fp8 does not build for SM75-SM86, int8 and int4 not
for SM75. The CPU's weight-only schemes are lantern.export.quantize's.
"""
import contextlib
import io
import os
import re
import tempfile
import time

import numpy as np

from lantern.export.quant_graph import graph_bytes, has_external_data, load_graph, output_heads, quiet, save_graph, \
    weight_matmuls
from lantern.runtime.errors import LanternError


QDQ_SCHEMES = ("fp8", "int8", "int4")
QDQ_INT4_BLOCK = 128  # ModelOpt's default INT4 block; TensorRT's weight-only INT4 takes blocks along K


def quantize_qdq(src, dst, scheme, calibration=None, *, block=QDQ_INT4_BLOCK, head="float",
                 method=None, high_precision=None):
    """Write `dst`, the graph `src` in the Q/DQ form TensorRT builds from, made by NVIDIA ModelOpt's
    ONNX post-training quantization (`modelopt.onnx.quantization.quantize`), calibrated with ONNX
    Runtime on the CPU:
      fp8   FP8 E4M3 weights and activations of the MatMuls (per-tensor activation scales), the
            attention MatMuls included (TensorRT for RTX builds it for SM89 and later)
      int8  INT8 weights (per channel) and activations, likewise (SM80 and later)
      int4  weight-only INT4 in blocks of `block` along K (blocked DequantizeLinear, opset 21;
            SM80 and later)
    calibration: a list of feed dicts for the graph (the inputs a real generation gives it);
    required for fp8 and int8, optional for int4 (AWQ-clip with it, round-to-nearest without).
    method: ModelOpt's calibration method (default: 'max' for fp8/int8, 'awq_clip' / 'rtn_dq'
    for int4). high_precision: what stays unquantized, 'fp32' or 'fp16' (default: the graph's own
    float type). head: 'float' (default) or 'quantized' (the same scheme as the body). Returns
    the record."""
    import onnx
    import onnxruntime
    from importlib import metadata

    if scheme not in QDQ_SCHEMES:
        raise LanternError(f"unknown Q/DQ scheme {scheme!r}; valid: {', '.join(QDQ_SCHEMES)}")
    if scheme != "int4" and not calibration:
        raise LanternError(f"{scheme} quantizes activations too: give calibration feeds (a list of input dicts)")
    if scheme == "int4" and (isinstance(block, bool) or not isinstance(block, int) or block < 16 or block & (block - 1)):
        raise LanternError(f"INT4 block must be a power of two >= 16, got {block!r}")
    try:
        from modelopt.onnx.quantization import quantize as modelopt_quantize
    except ImportError as e:
        raise LanternError(f"NVIDIA ModelOpt's ONNX quantization is not importable ({e}); "
                           f"pip install 'lantern[trt-quant]'") from None
    src, dst = os.fspath(src), os.fspath(dst)
    model = load_graph(src)
    external = has_external_data(src)
    if high_precision is None:
        high_precision = "fp16" if _float_type(model) == onnx.TensorProto.FLOAT16 else "fp32"
    if method is None:
        method = "max" if scheme != "int4" else ("awq_clip" if calibration else "rtn_dq")
    heads = output_heads(model)
    if head not in ("float", "quantized"):
        raise LanternError(f"head must be 'float' or 'quantized' for Q/DQ graphs, got {head!r}")
    exclude = [] if head == "quantized" else ["^" + re.escape(name) + "$" for name in heads]
    weights = weight_matmuls(model)
    del model

    # Weights stored quantized (DequantizeLinear of an int8 / fp8 constant; dq_only) rather than as
    # fp32 behind a Q/DQ pair: a quarter of the bytes, and TensorRT builds either.
    options = {"block_size": block} if scheme == "int4" else {"dq_only": True}
    if calibration and method.startswith("awq"):
        # AWQ concatenates each MatMul's activations over the calibration calls, so they must
        # share one shape: keep the most common call shape (a run's verification calls).
        calibration = _largest_shape_group(calibration)
    start = time.perf_counter()
    printed = io.StringIO()  # ModelOpt logs to stdout (and tools print JSON there)
    with tempfile.TemporaryDirectory(prefix="lantern-modelopt-") as work, contextlib.redirect_stdout(printed), \
            quiet("modelopt"), quiet("onnxruntime"), quiet("onnxslim"):
        out = os.path.join(work, "quantized.onnx")
        modelopt_quantize(src, quantize_mode=scheme, calibration_method=method,
                          calibration_data_reader=_feed_reader(calibration) if calibration else None,
                          calibration_eps=["cpu"], nodes_to_exclude=exclude, high_precision_dtype=high_precision,
                          use_external_data_format=external, output_path=out, log_level="CRITICAL", **options)
        quantized = onnx.load(out)
    seconds = time.perf_counter() - start
    dequantized = _dequantized_weights(quantized)
    left = weight_matmuls(quantized)
    skipped = [{"node": name, "reason": "output head (kept in float)" if name in heads else "not quantized by ModelOpt"}
               for name in sorted(left)]
    save_graph(quantized, dst, external)
    return {
        "scheme": scheme,
        "format": "qdq",
        "weights": {"fp8": "float8e4m3fn", "int8": "int8", "int4": "int4"}[scheme],
        "activations": {"fp8": "float8e4m3fn", "int8": "int8", "int4": "float"}[scheme],
        "block": block if scheme == "int4" else None,
        "symmetric": True,
        "calibration": {"method": method, "samples": len(calibration or []), "provider": "CPUExecutionProvider"},
        "high_precision": high_precision,
        "head": {"nodes": heads, "precision": scheme if head == "quantized" else "float"},
        "weight_matmuls": len(weights),
        "quantized": len(dequantized),
        "skipped": skipped,
        "bytes": {"source": graph_bytes(src), "quantized": graph_bytes(dst)},
        "seconds": round(seconds, 3),
        "tool": {"modelopt": metadata.version("nvidia-modelopt"), "onnxruntime": onnxruntime.__version__},
    }


def _feed_reader(feeds):
    """ONNX Runtime's CalibrationDataReader over a list of feed dicts, with the get_first() and
    rewind() ModelOpt's calibration also calls."""
    from onnxruntime.quantization import CalibrationDataReader

    class FeedReader(CalibrationDataReader):
        def __init__(self):
            self.feeds, self.position = list(feeds), 0

        def get_next(self):
            self.position += 1
            return self.feeds[self.position - 1] if self.position <= len(self.feeds) else None

        def get_first(self):
            return self.feeds[0]

        def rewind(self):
            self.position = 0

        def __len__(self):
            return len(self.feeds)

    return FeedReader()


def _largest_shape_group(feeds):
    groups = {}
    for f in feeds:
        groups.setdefault(tuple((k, np.shape(v)) for k, v in sorted(f.items())), []).append(f)
    return max(groups.values(), key=len)


def _dequantized_weights(model):
    """Names of the MatMuls whose second input is a DequantizeLinear of a constant (directly, or
    through a QuantizeLinear of a constant)."""
    constants = {t.name for t in model.graph.initializer}
    producer = {out: n for n in model.graph.node for out in n.output}

    def constant(name):
        node = producer.get(name)
        return name in constants or (node is not None and node.op_type == "QuantizeLinear" and node.input[0] in constants)

    names = []
    for n in model.graph.node:
        dq = producer.get(n.input[1]) if n.op_type == "MatMul" else None
        if dq is not None and dq.op_type == "DequantizeLinear" and constant(dq.input[0]):
            names.append(n.name)
    return names


def _float_type(model):
    for value in model.graph.input:
        kind = value.type.tensor_type.elem_type
        if kind in (1, 10, 16):  # float, float16, bfloat16
            return kind
    return 1

