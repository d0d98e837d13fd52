"""The ONNX graph plumbing both quantizers share (lantern.export.quantize: ONNX Runtime
weight-only; lantern.export.quantize_qdq: TensorRT's Q/DQ forms): which MatMuls carry a constant
weight and which of them is the output head, loading a graph with its external data, and saving
one atomically in the source's layout (external weights stay external)."""
import contextlib
import logging
import os
import re
import shutil
import tempfile

from lantern.runtime.errors import LanternError


def weight_matmuls(model):
    """{node name: weight shape} of the MatMuls whose second input is a constant (an initializer)."""
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    return {n.name: shapes[n.input[1]] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in shapes}


def output_heads(model, quantized=False):
    """Names of the weight MatMuls that read a graph output: the output head, which maps the
    `hidden` (target) / `hidden_out` (drafter) output to the vocabulary in both graph contracts.
    quantized: also find MatMulNBits heads (by the name of the MatMul they replaced)."""
    outputs = {o.name for o in model.graph.output}
    weights = weight_matmuls(model)
    names = [n.name for n in model.graph.node if n.input and n.input[0] in outputs and n.name in weights]
    if quantized:
        names += [source_name(n) for n in model.graph.node if n.op_type == "MatMulNBits" and n.input[0] in outputs]
    return sorted(names)


def source_name(node):
    """The MatMul a MatMulNBits node replaced: the quantizer names it <name>_Q<bits>."""
    return re.sub(r"_Q\d+$", "", node.name)


def load_graph(path):
    """The graph at `path` with its external data; LanternError when it cannot be read."""
    import onnx

    if not os.path.isfile(path):
        raise LanternError(f"{path}: no such ONNX file")
    try:
        return onnx.load(path)  # external data is read from next to the file
    except Exception as e:  # onnx raises several types for unreadable files / missing data
        raise LanternError(f"{path}: cannot load the graph ({str(e).splitlines()[0]})") from None


def has_external_data(path):
    import onnx
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(path, load_external_data=False)
    return any(uses_external_data(t) for t in model.graph.initializer)


def save_graph(model, dst, external):
    """Write `dst` (and `dst`.data) through a temporary directory beside it, so a failed save
    leaves nothing half-written under the final names."""
    import onnx

    parent = os.path.dirname(os.path.abspath(dst)) or "."
    name = os.path.basename(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        onnx.save_model(model, os.path.join(tmp, name), save_as_external_data=external,
                        all_tensors_to_one_file=True, location=name + ".data", size_threshold=1024)
        if not external and os.path.exists(dst + ".data"):
            os.remove(dst + ".data")  # a stale data file of an earlier quantized graph
        for file in sorted(os.listdir(tmp), reverse=True):  # the .onnx.data first, the graph last
            os.chmod(os.path.join(tmp, file), 0o666 & ~_umask())  # onnx writes .data files private
            os.replace(os.path.join(tmp, file), os.path.join(parent, file))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def graph_bytes(path):
    return os.path.getsize(path) + (os.path.getsize(path + ".data") if os.path.exists(path + ".data") else 0)



@contextlib.contextmanager
def quiet(logger_name):
    """ONNX Runtime's quantizers log every node at INFO."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
