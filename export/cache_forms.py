"""The two forms a graph's attention and KV cache can take, and the ops of the in-place one.

Every attention layer of an engine graph is written once, against a *cache form* it is handed
when the graph module is built (lantern.export.llamagen, lantern.export.chameleon): the form
decides how a layer meets its cache and what the graph returns. No layer branches on the form.

  PlainCache    the engines' first form ("plain"; contracts target / target_ids / drafter):
                attention over [past cache, new tokens] scored per part (layers.attend,
                shared by the families), the new tokens' K/V returned stacked [L, B, H, T, hd]; the runtime
                copies the entries it keeps into its cache.
  InPlaceCache  the form TensorRT fuses ("inplace"; contracts target_inplace / target_ids_inplace
                / drafter_inplace): each layer writes its T new K/V entries into a static cache
                [B, H, S, hd] at per-row slots write_index[b] .. + T - 1 (ONNX TensorScatter,
                opset 24 -> TensorRT IKVCacheUpdateLayer; the output aliases the input, in
                ONNX Runtime when IOBinding binds one buffer to both), then attends over the
                whole cache with a boolean mask [B, 1, T, S] (ONNX Attention, opset 23 ->
                TensorRT IAttention). Returns the updated caches, one output per layer.
  CommitGraph   the in-place form's commit: the accepted tree nodes' K/V moved inside the
                device-resident cache (GatherElements + TensorScatter), so a step moves no cache
                across PCIe.

tests/test_cache_forms.py checks each op against eager torch, a numpy reference and ONNX Runtime;
tests/test_inplace_engines.py checks whole engines of both forms against each other.
"""
import contextlib
import io
import warnings

import torch
import torch.nn as nn

from lantern.export.layers import attend

OPSET = 24  # TensorScatter is opset 24; Attention is opset 23


def cache_update(cache, update, write_index):
    """cache [B, H, P, hd] with update [B, H, T, hd] written at slots write_index[b] + 0..T-1
    of row b (ONNX TensorScatter, linear mode). Returns the updated cache (eagerly a new tensor)."""
    if torch.onnx.is_in_onnx_export():
        # TensorScatter has no torch counterpart the exporter knows, so emit it by name.
        return torch.onnx.ops.symbolic("TensorScatter", [cache, update, write_index], {"axis": 2},
                                       dtype=cache.dtype, shape=cache.shape, version=OPSET)
    B, H, T, hd = update.shape
    slots = write_index[:, None] + torch.arange(T, device=update.device)  # [B, T]
    return cache.scatter(2, slots[:, None, :, None].expand(B, H, T, hd), update)


def attention(q, k, v, mask):
    """Softmax(q k^T / sqrt(hd), masked) v; q [B, H, T, hd], k/v [B, Hkv, S, hd] (H a multiple
    of Hkv: grouped-query attention), mask bool [B, 1, T, S] (True = attend). A fully masked
    query row comes out 0 in eager torch and ONNX Runtime 1.32 (the plain masked_fill + softmax
    form gives NaN there); TensorRT's behaviour for it is unverified, so padded rows should
    attend to something (their own slot)."""
    return torch.onnx.ops.attention(q, k, v, mask)[0]


class PlainCache:
    """Attention over [past, new] scored per part (lantern.export.layers.attend); the layer
    returns the new tokens' K/V, the graph returns them stacked [L, B, H, T, hd]."""

    name = "plain"

    def split(self, cache_inputs):
        """A graph's trailing inputs -> (write_index, keys, values): here the per-layer caches."""
        layers = len(cache_inputs) // 2
        return None, cache_inputs[:layers], cache_inputs[layers:]

    def layer(self, q, k, v, past_k, past_v, mask, write_index):
        return attend(q, past_k, past_v, k, v, mask), k, v

    def outputs(self, keys, values):
        return torch.stack(keys), torch.stack(values)


class InPlaceCache:
    """Write the new K/V into the static caches at write_index, attend over the whole cache;
    the layer returns the updated caches, the graph returns them one output per layer."""

    name = "inplace"

    def split(self, cache_inputs):
        """(the caches of every layer, then write_index) -> (write_index, keys, values)."""
        caches, write_index = cache_inputs[:-1], cache_inputs[-1]
        layers = len(caches) // 2
        return write_index, caches[:layers], caches[layers:]

    def layer(self, q, k, v, cache_k, cache_v, mask, write_index):
        cache_k = cache_update(cache_k, k, write_index)
        cache_v = cache_update(cache_v, v, write_index)
        return attention(q, cache_k, cache_v, mask), cache_k, cache_v

    def outputs(self, keys, values):
        return (*keys, *values)


PLAIN = PlainCache()  # the default of every layer and model
IN_PLACE = InPlaceCache()
ATTENTION_FORMS = ("plain", "inplace")


class AttentionStep(nn.Module):
    """Write this step's K/V into the static caches, then attend over the whole cache.
    Inputs q [B, H, T, hd]; k, v [B, Hkv, T, hd]; cache_k, cache_v [B, Hkv, P, hd];
    write_index int64 [B]; mask bool [B, 1, T, P] (its columns are cache slots, including the
    slots this step writes). Outputs: out [B, H, T, hd], the updated cache_k, cache_v."""

    def forward(self, q, k, v, cache_k, cache_v, write_index, mask):
        return IN_PLACE.layer(q, k, v, cache_k, cache_v, mask, write_index)


class PlainAttentionStep(nn.Module):
    """The engines' current form, for comparison: attention over [past, new] scored per part
    (no Concat of the caches; lantern.export.layers.attend), new K/V returned for the host to store.
    Inputs q, k, v as AttentionStep; past_k, past_v [B, Hkv, P0, hd]; mask bool [B, 1, T, P0 + T]."""

    def forward(self, q, k, v, past_k, past_v, mask):
        return attend(q, past_k, past_v, k, v, mask), k, v


class CommitGraph(nn.Module):
    """Move the accepted nodes' K/V inside the caches, on the device.

    Verification wrote node i of the tree at slot write_index + i; the accepted path's node at
    depth d must end at slot write_index + d. Inputs: src_slots int64 [B, A] (the slots to read,
    A = tree depth, padded rows copy any slot: they land past the new committed length, where
    the next step writes anyway); write_index int64 [B] (first destination slot: the row's
    committed length + 1, after the root); caches [B, Hkv, P, hd] (keys of every layer, then
    values). Outputs: the caches, updated in place where the runtime aliases them. The
    destinations are contiguous, which is what makes this an in-place TensorScatter; arbitrary
    destinations would need ScatterElements, which TensorRT computes out of place (a copy of
    the whole cache per call)."""

    def forward(self, src_slots, write_index, *caches):
        out = []
        for cache in caches:
            B, H, _, hd = cache.shape
            moved = cache.gather(2, src_slots[:, None, :, None].expand(B, H, src_slots.shape[1], hd))
            out.append(cache_update(cache, moved, write_index))
        return tuple(out)


def export(module, args, path, input_names, output_names, dynamic_dims):
    """Export `module` at opset 24 with torch's dynamo exporter. dynamic_dims: per input,
    {axis: dim name} or None; those axes stay dynamic and carry the names in the ONNX file.
    Trace with sizes > 1 on dynamic axes (torch.export specialises 0 and 1)."""
    import inspect

    import onnx_ir as ir

    specs = [None if spec is None else {axis: torch.export.Dim.DYNAMIC for axis in spec} for spec in dynamic_dims]
    shapes = {}  # keyed by the forward's parameters; a *caches parameter takes the rest as a tuple
    for param in inspect.signature(module.forward).parameters.values():
        if param.kind == param.VAR_POSITIONAL:
            shapes[param.name], specs = tuple(specs), []
        else:
            shapes[param.name] = specs.pop(0)
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")  # the exporter's progress lines and deprecation notes
        program = torch.onnx.export(module.eval(), tuple(args), None, input_names=input_names,
                                    output_names=output_names, dynamic_shapes=shapes, opset_version=OPSET,
                                    dynamo=True, verbose=False)
    for value, spec in zip(program.model.graph.inputs, dynamic_dims):
        if spec:
            value.shape = ir.Shape([spec.get(axis, d) for axis, d in enumerate(value.shape)])
    program.save(path)
    return path
