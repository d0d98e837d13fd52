"""One graph module -> one ONNX file: lantern-export onnx's exporter (export_graph).

The graphs are the torch modules of lantern.export.graphs, exported one by one with torch's
dynamo exporter (`torch.onnx.export(..., dynamo=True)`), named and typed exactly as
lantern.runtime.contracts.GRAPHS says. Both exporters trace these graphs and the results run on
ONNX Runtime at any batch / token count / cache length; dynamo is the one used because it keeps
the modules' dtypes whatever ops they use (the TorchScript exporter lowered SDPA with a boolean
mask to fp32, so fp16 graphs came out fp32 after the first attention), streams the weights to
one `<graph>.onnx.data` file (a GPT-XL export peaks near the loader's own footprint), and is the
supported one (the TorchScript exporter is deprecated). Its cost is time: ~2-3 s per tiny graph,
where the TorchScript exporter takes a fraction of a second.
"""
import contextlib
import inspect
import io
import logging
import os
import warnings

import torch

from lantern.export.graph_cache import fetch_graph, graph_key, store_graph
from lantern.export.streaming import defer_initializers

DEFAULT_OPSET = 18  # the dynamo exporter's own opset; lower ones are not offered
EXTERNAL_DATA_BYTES = 100 * 2**20  # graphs with more weights than this keep them in <file>.data

# Tracing sizes of the contracts' dynamic dims: distinct and > 1 (torch.export specialises 0 and 1).
_TRACE_SIZES = {"B": 4, "N": 2, "T": 3, "P": 5, "P+T": 8, "h": 2, "w": 3, "A": 6}

_ONNX_TYPES = {"float32": 1, "int64": 7, "bool": 9, "float16": 10, "bfloat16": 16}  # TensorProto codes


def _trace_inputs(io_spec):
    """Example inputs of the right dtypes and shapes; values only matter for cond_batch (N rows)."""
    tensors = []
    for name, entry in io_spec["inputs"].items():
        shape = [_TRACE_SIZES[d] if isinstance(d, str) else d for d in entry["shape"]]
        dtype = getattr(torch, entry["dtype"])
        if name in ("temperature", "top_p", "cfg_scale", "attention_mask"):
            tensors.append(torch.ones(shape, dtype=dtype))
        else:
            tensors.append(torch.zeros(shape, dtype=dtype))
    return tuple(tensors)


@contextlib.contextmanager
def _quiet_exporter():
    """The exporter prints progress lines and warns about deprecations and torchvision; the
    export command shows its own progress."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def weight_bytes(module):
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def export_graph(module, io_spec, path, opset=DEFAULT_OPSET, deferred=None, cache=None):
    """Export one graph module to `path` (plus `path`.data when its weights are large).
    deferred: the DeferredWeights (lantern.export.streaming) whose placeholders the module holds;
    their real values are read one by one while the file is written. cache: a graph cache
    directory (lantern.export.graph_cache) to copy an identical earlier export from and to keep
    this one in. Returns the file names written."""
    inputs, outputs = list(io_spec["inputs"]), list(io_spec["outputs"])
    streamed = deferred is not None and any(deferred.load_of(p) is not None for p in module.parameters())
    external = streamed or weight_bytes(module) > EXTERNAL_DATA_BYTES
    key = None
    if cache is not None and not streamed:
        key = graph_key(module, io_spec, os.path.basename(path), opset, external)
        cached = key and fetch_graph(cache, key, path)
        if cached:
            return cached
    with _quiet_exporter(), torch.no_grad():
        # streamed: the optimizer runs after the placeholders became lazy tensors (it would fold each
        # weight's Transpose into an in-memory copy otherwise)
        program = torch.onnx.export(module, _trace_inputs(io_spec), None, input_names=inputs,
                                    output_names=outputs, dynamic_shapes=_dynamic_shapes(module, io_spec),
                                    opset_version=opset, dynamo=True, external_data=external, verbose=False,
                                    optimize=not streamed)
        if streamed:
            defer_initializers(program.model, deferred)
            program.optimize()
    _apply_contract(program.model, io_spec, os.path.basename(path))
    with _quiet_exporter():
        program.save(path, external_data=external)
    names = [os.path.basename(path)]
    if os.path.exists(path + ".data"):
        names.append(os.path.basename(path) + ".data")
    if key:
        store_graph(cache, key, path, names)
    return names


def _dynamic_shapes(module, io_spec):
    """torch.export's dynamic_shapes for the contract: every named dim dynamic, keyed by the
    forward's parameters (a *caches parameter takes the per-layer inputs as a tuple). Derived
    dims such as P+T are left for the exporter to infer; _apply_contract names them."""
    specs = [{i: torch.export.Dim.DYNAMIC for i, d in enumerate(entry["shape"]) if isinstance(d, str)} or None
             for entry in io_spec["inputs"].values()]
    shapes = {}
    for param in inspect.signature(module.forward).parameters.values():
        if param.kind == param.VAR_POSITIONAL:
            shapes[param.name], specs = tuple(specs), []
        elif specs:  # parameters past the contract's inputs keep their defaults (write_index=None)
            shapes[param.name] = specs.pop(0)
    return shapes


def _apply_contract(model, io_spec, where):
    """Check the exported graph's I/O names and dtypes against the contract and name its dims
    as the contract does (the exporter invents names for derived dims)."""
    import onnx_ir as ir

    for kind, values in (("inputs", model.graph.inputs), ("outputs", model.graph.outputs)):
        expected = io_spec[kind]
        names = [v.name for v in values]
        if names != list(expected):
            raise RuntimeError(f"{where}: exported {kind} {names} differ from the contract's {list(expected)}")
        for value in values:
            entry = expected[value.name]
            if value.dtype is None or value.dtype.value != _ONNX_TYPES[entry["dtype"]]:
                raise RuntimeError(f"{where}: {kind[:-1]} {value.name} has type {value.dtype}, "
                                   f"the contract says {entry['dtype']}")
            value.shape = ir.Shape(entry["shape"])
