"""Acceptance as a graph: greedy static-tree acceptance (exact, LANTERN delta, LANTERN++ lam) with
the CFG combination and forced tokens in front, written as a torch module so every backend can
run it where the target left the verification logits (ONNX Runtime, TensorRT, the torch backend),
and only a few integers per image cross to the host. lantern.runtime.accept (numpy) is the
specification; tests/test_accept_graphs.py holds the graph to it.

One graph serves every rule and setting: the rule parameters are inputs and the bound on the
neighbor mass is delta * Z + (lam - 1) * w(x) (exact: delta 0, lam 1; LANTERN: lam 1; LANTERN++:
delta 0), k masks the neighbor table's columns. The tree is a constant of the graph.

How it stays loop-free and portable (ONNX opset 18, TensorRT without float64):
- argmax with ties to the lowest column: row max, where(l == max, column, S), ReduceMin
  (ONNX ArgMax lowers to TensorRT TopK, whose tie order is undocumented);
- the largest prefix sum S_j <= bound is max(where(cumsum <= bound, cumsum, 0)): the sums never
  decrease, and columns past k weigh 0, so they repeat S_k;
- "p~(x) beats the max" is decided on e = S_j - (1 - w(x)) against float64's rounding limits
  around 1 (e > 2^-53: 1 + e rounds above 1; -2^-54 <= e <= 2^-53: rounds to 1, a tie), so float32
  makes the decisions the float64 spec makes when a draft ties the max and its neighbors lend
  1e-16..1e-8 (there float32's 1 + s == 1);
- a node is accepted when no node on its root path failed: a MatMul of the failures with the
  tree's constant ancestor mask; the deepest accepted node is the max of a unique score.
"""
import numpy as np
import torch
from torch import nn
from lantern.export.onnx_export import _apply_contract, _quiet_exporter

# float64's rounding limits around 1: 1 + e rounds above 1 iff e > 2^-53 (2^-53 itself ties to
# 1.0, the even neighbor), and rounds to 1.0 iff -2^-54 <= e <= 2^-53.
_ABOVE_ONE = 2.0 ** -53
_BELOW_ONE = -(2.0 ** -54)

INPUTS = ("logits", "cond_rows", "uncond_rows", "cfg_scale", "cfg_interval", "count", "forced_columns", "tokens",
          "neighbors", "k", "lam", "delta")
OUTPUTS = ("accepted", "next_token", "path", "decisions", "invalid")


class GreedyAcceptance(nn.Module):
    """Inputs (R target rows, N images, M tree nodes, V vocabulary, S = columns of the token
    space acceptance works in: the image codes, then the forced ids; Kn neighbor table width;
    L body length):
        logits [R, M, V] float32      the verification logits as the target returns them
        cond_rows, uncond_rows [N]    each image's conditional / unconditional target row (equal
                                      without CFG: no combination)
        cfg_scale [1] float32, cfg_interval [1] int64 (-1: CFG for every token)
        count [N] int64               tokens each image has; node i predicts body index count + depth
        forced_columns [L] int64      per body index the forced token's column, -1 where free
        tokens [N, M] int64           node tokens as columns (node 0 the root)
        neighbors [S, Kn] int64      latent neighbors per column, nearest first
        k [1] int64, lam [1] float32, delta [1] float32
    Outputs, as lantern.runtime.accept.Outcome (columns for tokens):
        accepted [N], next_token [N], path [N, depth + 1] (-1 padded), decisions [N, M]
        (1 on the path, 0 evaluated and not on it, -1 never evaluated), all int64; invalid [N] bool:
        some node's logits have no finite maximum (NaN, +inf or all -inf): the outcome is void.
    """

    def __init__(self, tree, columns, codes):
        """columns [S]: the vocabulary id of each column; codes: how many of them are image codes."""
        super().__init__()
        self.codes = int(codes)
        self.depth = tree.depth
        parents = np.maximum(tree.parents, 0)  # the root is its own parent; its decision is fixed
        self.register_buffer("columns", torch.as_tensor(np.array(columns, dtype=np.int64)))
        self.register_buffer("parents", torch.as_tensor(parents.astype(np.int64)))
        self.register_buffer("depths", torch.as_tensor(np.array(tree.depths, dtype=np.int64)))
        self.register_buffer("is_root", torch.arange(tree.num_nodes) == 0)
        self.register_buffer("ancestors", torch.as_tensor(np.array(tree.mask, dtype=np.float32)))  # [i, j]: j on i's path
        self.register_buffer("on_path", torch.as_tensor(np.array(tree.mask, dtype=bool)))

    def forward(self, logits, cond_rows, uncond_rows, cfg_scale, cfg_interval, count, forced_columns, tokens,
                neighbors, k, lam, delta):
        M = self.depths.shape[0]
        S = self.columns.shape[0]
        column = torch.arange(S, device=logits.device)
        node = torch.arange(M, device=logits.device)

        # CFG combination and forced tokens, as the host loop's combined_logits
        view = logits.index_select(2, self.columns)
        cond, uncond = view[cond_rows], view[uncond_rows]
        body = count[:, None] + self.depths[None, :]  # [N, M]
        plain = (cond_rows == uncond_rows)[:, None] | ((cfg_interval >= 0) & (body >= cfg_interval))
        combined = torch.where(plain[..., None], cond, uncond + cfg_scale * (cond - uncond))
        length = forced_columns.shape[0]
        inside = (body >= 0) & (body < length)
        forced = torch.where(inside, forced_columns[body.clamp(0, length - 1)], torch.full_like(body, -1))
        is_forced = forced[..., None] >= 0  # (ONNX Runtime has no Where over bool values)
        keep = (is_forced & (column == forced[..., None])) | (~is_forced & (column < self.codes))
        l = torch.where(keep, combined, torch.full_like(combined, float("-inf")))

        # each node's target: the max and the argmax (ties to the lowest column)
        rowmax = l.amax(dim=2)  # [N, M]
        top = torch.where(l == rowmax[..., None], column, S).amin(dim=2)
        invalid = ~torch.isfinite(rowmax).all(dim=1)

        # node i's draft x against its parent's target, weights relative to the parent's max
        parent_l = l[:, self.parents]  # [N, M, S]
        parent_max = rowmax[:, self.parents]
        parent_top = top[:, self.parents]
        wx = torch.exp(parent_l.gather(2, tokens[..., None])[..., 0] - parent_max)
        near = neighbors[tokens]  # [N, M, Kn]
        rank = torch.arange(neighbors.shape[1], device=logits.device)
        lent = torch.exp(parent_l.gather(2, near) - parent_max[..., None])
        cum = torch.cumsum(torch.where(rank < k, lent, torch.zeros_like(lent)), dim=2)
        total = torch.exp(parent_l - parent_max[..., None]).sum(dim=2)
        bound = delta * total + (lam - 1.0) * wx
        moved = torch.where(cum <= bound[..., None], cum, torch.zeros_like(cum)).amax(dim=2)
        excess = moved - (1.0 - wx)  # p~(x) / w(top) - 1
        relaxed = (moved > 0) & ((excess > _ABOVE_ONE) | ((excess >= _BELOW_ONE) & (tokens < parent_top)))
        ok = (tokens == parent_top) | relaxed | self.is_root

        # accepted: nothing on the root path failed; the deepest accepted node, lowest index first
        failed_on_path = (~ok).float() @ self.ancestors.T  # [N, M]
        accepted = failed_on_path == 0
        score = torch.where(accepted, self.depths * (M + 1) + (M - node), torch.full_like(self.depths, -1))
        last = torch.where(score == score.amax(dim=1, keepdim=True), node, M).amin(dim=1)  # [N]
        path_nodes = self.on_path[last]  # [N, M]
        depth = torch.arange(self.depth + 1, device=logits.device)
        path = torch.where(path_nodes[:, None, :] & (self.depths[None, None, :] == depth[None, :, None]),
                           node, torch.full_like(node, -1)).amax(dim=2)
        evaluated = accepted[:, self.parents] | self.is_root
        decisions = torch.where(path_nodes, 1, torch.where(evaluated, 0, -1)).to(torch.int64)
        next_token = top.gather(1, last[:, None])[:, 0]
        return self.depths[last], next_token, path, decisions, invalid


def acceptance_contract(tree, size):
    """The graph's I/O (the engine directory's contract form): named dims are dynamic."""
    f32, i64 = "float32", "int64"
    M = tree.num_nodes
    inputs = {"logits": (f32, ["R", M, "V"]), "cond_rows": (i64, ["N"]), "uncond_rows": (i64, ["N"]),
              "cfg_scale": (f32, [1]), "cfg_interval": (i64, [1]), "count": (i64, ["N"]),
              "forced_columns": (i64, ["L"]), "tokens": (i64, ["N", M]), "neighbors": (i64, [size, "Kn"]),
              "k": (i64, [1]), "lam": (f32, [1]), "delta": (f32, [1])}
    outputs = {"accepted": (i64, ["N"]), "next_token": (i64, ["N"]), "path": (i64, ["N", tree.depth + 1]),
               "decisions": (i64, ["N", M]), "invalid": ("bool", ["N"])}
    return {kind: {name: {"dtype": d, "shape": s} for name, (d, s) in spec.items()}
            for kind, spec in (("inputs", inputs), ("outputs", outputs))}


_TRACE = {"R": 4, "N": 2, "V": None, "L": 7, "Kn": 3}


def export_acceptance(tree, columns, codes, vocab, path, opset=18):
    """Write the greedy acceptance graph for this tree and token space to `path` (ONNX)."""

    module = GreedyAcceptance(tree, columns, codes).eval()
    contract = acceptance_contract(tree, len(columns))
    sizes = dict(_TRACE, V=vocab)
    trace, dynamic = [], {}
    for name, entry in contract["inputs"].items():
        shape = [sizes[d] if isinstance(d, str) else d for d in entry["shape"]]
        value = torch.zeros(shape, dtype=getattr(torch, entry["dtype"]))
        if name in ("cfg_interval", "forced_columns"):
            value -= 1
        trace.append(value)
        dims = {i: torch.export.Dim.DYNAMIC for i, d in enumerate(entry["shape"]) if isinstance(d, str) and d != "V"}
        dynamic[name] = dims or None
    with _quiet_exporter(), torch.no_grad():
        program = torch.onnx.export(module, tuple(trace), None, input_names=list(contract["inputs"]),
                                    output_names=list(contract["outputs"]), dynamic_shapes=dynamic,
                                    opset_version=opset, dynamo=True, verbose=False)
    for entry in contract["inputs"].values():  # V is fixed by the engine's vocabulary
        entry["shape"] = [vocab if d == "V" else d for d in entry["shape"]]
    _apply_contract(program.model, contract, path)
    with _quiet_exporter():
        program.save(path)
    return contract
