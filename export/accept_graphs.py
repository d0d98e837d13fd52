"""Acceptance as graphs: static-tree acceptance (exact, LANTERN delta, LANTERN++ lam), greedy
(GreedyAcceptance) and sampling with temperature / top-k / top-p (SamplingAcceptance), with the
CFG combination and forced tokens in front, written as torch modules so every backend can run
them where the target left the verification logits (ONNX Runtime, TensorRT, the torch backend),
and only a few integers per image cross to the host. They are the accept phase of the step graphs
(lantern.export.step_graphs, which `lantern-export accept` writes and every runner runs); their
I/O follows the contracts accept_greedy / accept_sampling (lantern.runtime.contracts).
lantern.runtime.accept (numpy) is the specification; tests/test_accept_graphs.py holds the
modules to it, in torch and exported to ONNX on ONNX Runtime.

Greedy. One graph serves every rule and setting: the rule parameters are inputs and the bound on the
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

from lantern.runtime.contracts import ACCEPT_TOP_K_LIMIT, GRAPHS
from lantern.runtime.errors import LanternError

# float64's rounding limits around 1: 1 + e rounds above 1 iff e > 2^-53 (2^-53 itself ties to
# 1.0, the even neighbor), and rounds to 1.0 iff -2^-54 <= e <= 2^-53.
_ABOVE_ONE = 2.0 ** -53
_BELOW_ONE = -(2.0 ** -54)


def _register_tree(module, tree, columns, codes):
    """The tree and the token space as buffers: constants of the exported graph."""
    module.codes = int(codes)
    module.depth = tree.depth
    columns = np.array(columns, dtype=np.int64)
    # a token space that is one run of ids (a c2i model's codes) is a slice of the logits, cheaper than a gather
    run = len(columns) > 0 and bool((columns == columns[0] + np.arange(len(columns))).all())
    module.first_column = int(columns[0]) if run else None
    parents = np.maximum(tree.parents, 0)  # the root is its own parent; its decision is fixed
    module.register_buffer("columns", torch.as_tensor(np.array(columns, dtype=np.int64)))
    module.register_buffer("parents", torch.as_tensor(parents.astype(np.int64)))
    module.register_buffer("depths", torch.as_tensor(np.array(tree.depths, dtype=np.int64)))
    module.register_buffer("is_root", torch.arange(tree.num_nodes) == 0)
    module.register_buffer("ancestors", torch.as_tensor(np.array(tree.mask, dtype=np.float32)))  # [i, j]: j on i's path
    module.register_buffer("on_path", torch.as_tensor(np.array(tree.mask, dtype=bool)))


def cfg_combined(module, logits, cond_rows, uncond_rows, cfg_scale, cfg_interval, count, forced_columns):
    """The CFG combination and forced tokens, as the host loop's combined_logits: [N, M, S] in
    the logits' dtype, -inf outside what may be emitted at each node's body index."""
    S = module.columns.shape[0]
    column = torch.arange(S, device=logits.device)
    c0 = module.first_column
    view = logits[:, :, c0:c0 + S] if c0 is not None else logits.index_select(2, module.columns)
    cond, uncond = view[cond_rows], view[uncond_rows]
    body = count[:, None] + module.depths[None, :]  # [N, M]
    plain = (cond_rows == uncond_rows)[:, None] | ((cfg_interval >= 0) & (body >= cfg_interval))
    combined = torch.where(plain[..., None], cond, uncond + cfg_scale.to(logits.dtype) * (cond - uncond))
    length = forced_columns.shape[0]
    inside = (body >= 0) & (body < length)
    forced = torch.where(inside, forced_columns[body.clamp(0, length - 1)], torch.full_like(body, -1))
    is_forced = forced[..., None] >= 0  # (ONNX Runtime has no Where over bool values)
    keep = (is_forced & (column == forced[..., None])) | (~is_forced & (column < module.codes))
    return torch.where(keep, combined, torch.full_like(combined, float("-inf")))


def _outcome(module, last, next_token, decisions, invalid):
    """The outcome tensors from each image's last accepted node and the evaluated decisions."""
    M = module.depths.shape[0]
    node = torch.arange(M, device=last.device)
    path_nodes = module.on_path[last]  # [N, M]
    depth = torch.arange(module.depth + 1, device=last.device)
    path = torch.where(path_nodes[:, None, :] & (module.depths[None, None, :] == depth[None, :, None]),
                       node, torch.full_like(node, -1)).amax(dim=2)
    decisions = torch.where(path_nodes, torch.ones_like(decisions), decisions)
    return module.depths[last], next_token, path, decisions, invalid


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
        _register_tree(self, tree, columns, codes)

    def forward(self, logits, cond_rows, uncond_rows, cfg_scale, cfg_interval, count, forced_columns, tokens,
                neighbors, k, lam, delta):
        M = self.depths.shape[0]
        S = self.columns.shape[0]
        column = torch.arange(S, device=logits.device)
        node = torch.arange(M, device=logits.device)
        l = cfg_combined(self, logits, cond_rows, uncond_rows, cfg_scale, cfg_interval, count, forced_columns)

        # each node's target: the max and the argmax (ties to the lowest column)
        rowmax = l.amax(dim=2)  # [N, M]
        top = torch.where(l == rowmax[..., None], column, S).amin(dim=2)
        invalid = ~torch.isfinite(rowmax).all(dim=1)
        if self.depth == 0:  # AR (the tree is a constant of the module): the root's target is all there is
            return _outcome(self, torch.zeros_like(count), top[:, 0], torch.zeros_like(tokens), invalid)

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
        evaluated = accepted[:, self.parents] | self.is_root
        decisions = torch.where(evaluated, 0, -1).to(torch.int64)
        next_token = top.gather(1, last[:, None])[:, 0]
        return _outcome(self, last, next_token, decisions, invalid)


# The top-p threshold is found by bisection on the probability value: each halving keeps the
# interval [lo, hi) that holds the smallest kept probability; 40 halvings of [0, 2) isolate
# float32 values down to ~1e-12 of the row max (smaller probabilities weigh nothing).
_TOP_P_HALVINGS = 40


class SamplingAcceptance(nn.Module):
    """Sampling acceptance over the static tree (lantern.runtime.accept.accept_sampling_batch:
    multi-draft recursive rejection sampling with the relaxed p~ of LANTERN / LANTERN++), with the
    CFG combination and forced tokens in front, as a graph. Inputs as GreedyAcceptance's plus
        draft_ids [N, M, K] int64, draft_probs [N, M, K]   node i's drafter candidates (columns)
                                      and probabilities (renormalised here; q(x) = 0: skipped)
        uniforms [N, M]               the step's acceptance uniforms (uniforms[:, i] decides node
                                      i, uniforms[:, 0] draws the final token)
        temperature [1], top_k [1] int64 (0 = off), top_p [1] (1 = off)
    and the same outputs. The CFG combination is made in the dtype of `logits` (float32: the
    numbers the host loop combines), the acceptance in the dtype of `temperature` (float64 gives
    the specification's decisions; float32, what TensorRT runs, the same up to rounding).

    How (no loops, TensorRT-portable):
    - the filtered target of the node each image stands on, once per depth [N, S] (not every
      node's up front): temperature, top-k as z >= the k-th value
      of one TopK of min(3840, S) values (TensorRT's limit; ties with it kept), top-p as the
      smallest kept probability found by bisection, ties at it kept in column order while the
      mass above them stays below top_p (the spec's stable sort);
    - the walk down the tree unrolled over the static tree's children: for each depth, for each
      rank up to that depth's width, every image tries its current node's child of that rank
      (one step per (depth, rank): 15 for mc_sim_7b_63);
    - the residual after a rejection written with ScatterElements whose indices are unique per
      row: the lent neighbors (the table's rows hold distinct ids), x itself, and the candidates
      with q > 0 (the drafter's top-K ids are distinct); every other slot writes to a column of
      its own past the token space, dropped after.
    """

    def __init__(self, tree, columns, codes, top_k=True, top_p=True):
        """top_k, top_p: whether the graph has those filters (without, its top_k / top_p inputs
        must be off: 0 and 1); the step graphs export each combination, since on a CPU the top-p
        bisection costs more than the rest of the step."""
        super().__init__()
        if not tree.contiguous:
            raise LanternError(f"tree {tree.name!r} has a node whose children skip a rank; sampling needs ranks 0..w-1")
        _register_tree(self, tree, columns, codes)
        self.top_k, self.top_p = top_k, top_p
        self.widths = tuple(tree.widths)
        self.register_buffer("child_at", torch.as_tensor(np.array(tree.child_at, dtype=np.int64)))

    def forward(self, logits, cond_rows, uncond_rows, cfg_scale, cfg_interval, count, forced_columns, tokens,
                draft_ids, draft_probs, uniforms, neighbors, k, lam, delta, temperature, top_k, top_p):
        M = self.depths.shape[0]
        S = self.columns.shape[0]
        dt = temperature.dtype  # the acceptance's; the CFG combination stays in the logits' (the host's float32)
        l = cfg_combined(self, logits, cond_rows, uncond_rows, cfg_scale, cfg_interval, count, forced_columns)
        invalid = ~torch.isfinite(l.amax(dim=2)).all(dim=1)
        N = l.shape[0]
        temperature = temperature.to(dt)

        def target_at(node):
            """The filtered target [N, S] of each image's node: only the depth + 1 nodes the walk
            reaches, not all M (a CPU spent as long on top-p over every node as on the verification)."""
            return self.filtered(l.gather(1, node[:, None, None].expand(N, 1, S)).to(dt), temperature, top_k,
                                 top_p)[:, 0]

        K = draft_ids.shape[2]
        Kn = neighbors.shape[1]
        q_all = draft_probs.to(dt)
        q_total = q_all.sum(dim=2, keepdim=True)
        q_all = torch.where(q_total > 0, q_all / torch.where(q_total > 0, q_total, torch.ones_like(q_total)), q_all)
        # a uniform that rounded up to 1 (float64 -> float32) is the largest value below 1
        below_one = 1.0 - torch.finfo(dt).eps / 2
        u_all = torch.clamp(uniforms.to(dt), max=below_one)
        lam, delta = lam.to(dt), delta.to(dt)

        node_index = torch.arange(M, device=logits.device)
        cand = torch.arange(K, device=logits.device)
        rank = torch.arange(Kn, device=logits.device)
        in_k = rank < k  # [Kn]
        trash_near = S + rank  # unique scatter targets past the token space
        trash_cand = S + Kn + cand
        node = torch.zeros(N, dtype=torch.int64, device=logits.device)
        p = target_at(node)
        q = q_all[:, 0]
        ids = draft_ids[:, 0]
        going = torch.ones(N, dtype=torch.bool, device=logits.device)
        decisions = torch.full((N, M), -1, dtype=torch.int64, device=logits.device)
        for width in self.widths:
            chosen = torch.full_like(node, -1)
            for r in range(width):
                child = self.child_at[:, r][node]  # [N], -1: no child of this rank
                active = going & (chosen < 0) & (child >= 0)
                c = child.clamp(min=0)
                x = tokens.gather(1, c[:, None])[:, 0]
                u = u_all.gather(1, c[:, None])[:, 0]
                hit = ids == x[:, None]
                col = torch.where(hit, cand, K).amin(dim=1)  # the first candidate that is x
                qx = torch.where(col < K, q.gather(1, col.clamp(max=K - 1)[:, None])[:, 0], torch.zeros_like(u))
                decisions = torch.where(active[:, None] & (node_index == c[:, None]), torch.zeros_like(decisions),
                                        decisions)
                live = active & (qx > 0)  # a draft outside q's support was not drawn from it: skipped
                # p~(x): the largest prefix of x's first k neighbors whose mass fits the bound
                px = p.gather(1, x[:, None])[:, 0]
                near = neighbors[x]  # [N, Kn]
                cum = torch.cumsum(torch.where(in_k, p.gather(1, near), torch.zeros_like(u)[:, None]), dim=1)
                bound = delta + (lam - 1.0) * px
                fits = in_k & (cum <= bound[:, None])
                lent_mass = torch.where(fits, cum, torch.zeros_like(cum)).amax(dim=1)
                pt = px + lent_mass
                ok = live & (u * qx < pt)
                chosen = torch.where(ok, child, chosen)
                rejected = live & ~ok
                # residual: normalise(max(p~_x - q, 0)), p~_x when that has no mass
                lent = fits & (lent_mass > 0)[:, None]
                wide = torch.cat([p, torch.zeros((N, Kn + K), dtype=dt, device=p.device)], dim=1)
                wide = wide.scatter(1, torch.where(lent, near, trash_near), torch.zeros_like(cum))
                wide = wide.scatter(1, x[:, None], pt[:, None])  # pt == px when nothing was lent
                relaxed = wide
                less = (wide.gather(1, ids) - q).clamp(min=0.0)
                wide = wide.scatter(1, torch.where(q > 0, ids, trash_cand), less)
                rest = wide[:, :S]
                mass = rest.sum(dim=1, keepdim=True)
                residual = torch.where(mass > 0, rest / torch.where(mass > 0, mass, torch.ones_like(mass)),
                                       relaxed[:, :S])
                p = torch.where(rejected[:, None], residual, p)
                q_less = torch.where(cand == col[:, None], torch.zeros_like(q), q)
                q_mass = q_less.sum(dim=1, keepdim=True)
                q_less = torch.where(q_mass > 0, q_less / torch.where(q_mass > 0, q_mass, torch.ones_like(q_mass)),
                                     q_less)
                q = torch.where(rejected[:, None], q_less, q)
            moved = going & (chosen >= 0)
            going = moved
            node = torch.where(moved, chosen, node)
            p = torch.where(moved[:, None], target_at(node), p)
            q = torch.where(moved[:, None], q_all.gather(1, node[:, None, None].expand(N, 1, K))[:, 0], q)
            ids = torch.where(moved[:, None], draft_ids.gather(1, node[:, None, None].expand(N, 1, K))[:, 0], ids)

        # the next token: inverse CDF of the current (residual) p with uniforms[:, 0]
        column = torch.arange(S, device=logits.device)
        cdf = torch.cumsum(p, dim=1)
        drawn = (cdf <= u_all[:, :1] * cdf[:, -1:]).sum(dim=1)
        last_positive = torch.where(p > 0, column, torch.full_like(column, -1)).amax(dim=1)
        next_token = torch.minimum(drawn, last_positive)
        return _outcome(self, node, next_token, decisions, invalid)

    def filtered(self, l, temperature, top_k, top_p):
        """lantern.runtime.filtering.filtered_probs of every node's combined logits [N, M, S]."""
        S = l.shape[2]
        z = l / temperature
        if self.top_k:
            cap = min(ACCEPT_TOP_K_LIMIT, S)
            best = torch.topk(z, cap, dim=2).values  # sorted, largest first
            kth = best.index_select(2, top_k.clamp(1, cap) - 1)  # [N, M, 1]
            use_k = (top_k > 0) & (top_k < S)
            z = torch.where(use_k & (z < kth), torch.full_like(z, float("-inf")), z)
        p = torch.exp(z - z.amax(dim=2, keepdim=True))  # max 1; -inf -> 0
        if not self.top_p:
            return p / p.sum(dim=2, keepdim=True)
        top_p = top_p.to(p.dtype)
        goal = top_p * p.sum(dim=2, keepdim=True)  # the nucleus' mass, unnormalised
        lo = torch.zeros_like(goal)
        hi = torch.full_like(goal, 2.0)  # invariant: mass(p >= lo) >= goal > mass(p >= hi)
        for _ in range(_TOP_P_HALVINGS):
            mid = (lo + hi) * 0.5
            enough = torch.where(p >= mid, p, torch.zeros_like(p)).sum(dim=2, keepdim=True) >= goal
            lo = torch.where(enough, mid, lo)
            hi = torch.where(enough, hi, mid)
        smallest = torch.where(p < hi, p, torch.zeros_like(p)).amax(dim=2, keepdim=True)  # the smallest kept value
        above = torch.where(p > smallest, p, torch.zeros_like(p)).sum(dim=2, keepdim=True)
        tie = p == smallest
        before = above + (torch.cumsum(tie.to(p.dtype), dim=2) - 1.0) * smallest  # mass ahead in the stable order
        keep = (p > smallest) | (tie & (before < goal)) | (top_p >= 1.0)
        p = torch.where(keep, p, torch.zeros_like(p))
        return p / p.sum(dim=2, keepdim=True)


def contract_inputs(kind):
    """The input names, in order, of the module of `kind` (greedy, sampling): contract accept_<kind>."""
    return tuple(GRAPHS[f"accept_{kind}"]["inputs"])


INPUTS = contract_inputs("greedy")
OUTPUTS = tuple(GRAPHS["accept_greedy"]["outputs"])
