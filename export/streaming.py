"""Exporting a model bigger than memory: deferred weights.

A 7B Chameleon target is 14 GB in fp16. Loaded, cast and exported the ordinary way it is held at
least twice (the torch parameters, then the exporter's optimizer folds every weight's Transpose
into a new numpy array), which does not fit a 24 GiB machine. Here a large checkpoint tensor
becomes a *placeholder*: a parameter of the real shape and export dtype whose storage is one
element (a stride-0 view), registered in a DeferredWeights with the function that reads the real
tensor (a safetensors slice, cast). The graph is traced over the placeholders (tracing only needs
shapes), exported without the optimizer, and then every initializer that is a placeholder (or a
placeholder's Transpose, folded here as the optimizer would) is replaced by an onnx_ir LazyTensor;
the optimizer runs after that, and saving writes the external data tensor by tensor, each read,
cast and transposed just before it is written and dropped after. Peak memory is the graph plus
the largest tensor.

    deferred = DeferredWeights()
    p = deferred.placeholder((65536, 4096), torch.float16, lambda: read("embed_tokens.weight"))
    ...  # modules hold placeholders; export_graph(module, ..., deferred=deferred)

Tensors below DEFER_ELEMENTS (norms, biases) stay real: they are small and some are reshaped by
the loaders. A placeholder must never be computed with; `materialize` gives the real tensor.
"""
import torch

DEFER_ELEMENTS = 1 << 20  # checkpoint tensors with at least this many elements are deferred


class DeferredWeights:
    """Placeholders and the functions that produce their real values (in the export dtype)."""

    def __init__(self):
        self._loads = {}  # placeholder storage address -> (placeholder, load)

    def placeholder(self, shape, dtype, load):
        """A tensor of `shape` and `dtype` holding one element; `load()` returns its real value."""
        t = torch.zeros((), dtype=dtype).expand(tuple(shape))
        self._loads[t.untyped_storage().data_ptr()] = (t, load)
        return t

    def __len__(self):
        return len(self._loads)

    def load_of(self, tensor):
        """The load function of a placeholder (or of a parameter wrapping one), else None."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            return None
        entry = self._loads.get(tensor.untyped_storage().data_ptr())
        if entry is None or tuple(entry[0].shape) != tuple(tensor.shape) or entry[0].dtype != tensor.dtype:
            return None
        return entry[1]

    def materialize(self, tensor):
        """The real value of a placeholder in its dtype (a plain tensor passes through)."""
        load = self.load_of(tensor)
        return tensor if load is None else _checked(load(), tensor)


def _checked(value, like):
    value = value.to(like.dtype).contiguous()
    if tuple(value.shape) != tuple(like.shape):
        raise RuntimeError(f"a deferred weight loaded with shape {tuple(value.shape)}, expected {tuple(like.shape)}")
    return value


def _ir_tensor(value):
    """A contiguous torch tensor as an onnx_ir tensor (bf16 through its uint16 bits)."""
    import onnx_ir as ir

    if value.dtype == torch.bfloat16:
        return ir.Tensor(value.view(torch.uint16).numpy(), dtype=ir.DataType.BFLOAT16)
    return ir.Tensor(value.numpy())


def defer_initializers(model, deferred):
    """Replace the exported model's placeholder initializers with LazyTensors (in place), folding
    `Transpose(placeholder)` into a lazily transposed initializer when the Transpose is its only
    use. Returns how many initializers are now lazy."""
    import onnx_ir as ir

    graph = model.graph
    lazy = 0
    for name, value in list(graph.initializers.items()):
        raw = getattr(value.const_value, "raw", None)
        load = deferred.load_of(raw)
        if load is None:
            continue
        like = raw
        uses = list(value.uses())
        node = uses[0].node if len(uses) == 1 else None
        if node is not None and node.op_type == "Transpose" and node.domain in ("", "ai.onnx") and \
                value not in graph.outputs:
            perm = node.attributes["perm"].as_ints() if "perm" in node.attributes else \
                tuple(reversed(range(len(like.shape))))
            shape = tuple(like.shape[i] for i in perm)
            out = node.outputs[0]
            tensor = ir.LazyTensor(lambda load=load, like=like, perm=tuple(perm): _ir_tensor(
                _checked(load(), like).permute(perm).contiguous()), dtype=value.dtype, shape=ir.Shape(shape),
                name=out.name)
            folded = ir.Value(name=out.name, shape=ir.Shape(shape), type=ir.TensorType(value.dtype),
                              const_value=tensor)
            ir.convenience.replace_all_uses_with(out, folded)
            if out in graph.outputs:
                graph.outputs[graph.outputs.index(out)] = folded
            graph.remove(node, safe=True)
            del graph.initializers[name]
            graph.register_initializer(folded)
        else:
            value.const_value = ir.LazyTensor(lambda load=load, like=like: _ir_tensor(_checked(load(), like)),
                                              dtype=value.dtype, shape=ir.Shape(tuple(like.shape)), name=name)
        lazy += 1
    return lazy
