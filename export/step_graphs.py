"""The decoding step as graphs: everything a step does between its engine calls, written once as
torch modules with static shapes (the tree and the token space constants; the batch and the
caches' capacities dynamic), exported to ONNX per draft tree and run by every runner around the
target's and the drafter's own calls (lantern.runtime.graph_step runs them in a fixed order over
buffers bound once). A step of a tree of depth D (AR: D = 0, no drafter calls):

    begin          state -> draft0's mask and the drafter's CFG pairs (AR: the verify call's feeds)
    draft0         (the drafter)
    level1         draft0's pairs into the drafter cache; the root's children: depth 1's node
                   tokens (sampling: the root's candidates and q too); draft1's feeds
    draft1 ... level{D}   likewise per depth; level{D} makes the verify call's feeds
    verify         (the target)
    accept         the rule (lantern.export.accept_graphs) over the verification; the accepted
                   path's K/V into the target cache, the next draft0's pairs, the next state, the
                   report [N, D + 3 + 2M]: accepted, emitted tokens [D + 1], invalid, decisions
                   [M], node tokens [M] (the runner reads the first D + 3 unless an observer asks)

Names are the runner's contract (lantern.runtime.graph_step binds by them): a state tensor goes
in as NAME and comes out as next_NAME (the runner keeps two buffers and alternates); a call's
feed comes out as REGIME.FEED (written into the call's bound input) and its outputs go in as
REGIME.OUTPUT; a cache goes in as target_keys (...) and comes out as target_keys_out, bound to the
same buffer: each is written by one ScatterND of the kept entries only, which ONNX Runtime runs
in place when input and output share their memory. Values made by one phase for a later one
(tokens{d}, cand_ids{d}, cand_probs{d}) have one buffer each.

Sampling draws every random number from the images' streams (lantern.runtime.streams): the
table of blocks [N, steps, block] is an input, read at the step counter draws_taken (every image
advances every step). The children of a node are drawn without replacement by the exponential
race (keys -log(u) / q in float64, the first `width` in a stable sort: ties to the lower
candidate), as lantern.runtime.sampling.Sampling.children draws them; the CFG combination is
made in float32 as the host's, and acceptance runs in `accept_dtype` (float64: numpy's decisions).
"""
import numpy as np
import torch
from torch import nn

from lantern.export.accept_graphs import GreedyAcceptance, SamplingAcceptance
from lantern.export.step_caches import append, cache_names, call_feeds, write_scratch
from lantern.runtime.contracts import SAMPLING_FILTERS

CFG_CONSTANTS = ("cond_rows", "uncond_rows", "cfg_scale", "cfg_interval")
RULE_CONSTANTS = ("neighbors", "k", "lam", "delta")  # read only where there are drafts
_NEVER = 1e300  # race keys of candidates with q = 0: past every real key (-log(u) / q < 1e48 for float32 q)


def _const(module, name, value, dtype=np.int64):
    module.register_buffer(name, torch.as_tensor(np.array(value, dtype=dtype)))


class Phase(nn.Module):
    """One phase: `inputs` and `outputs` are its names (the module's forward takes and returns
    them in that order); what every phase knows is the tree, the token space (columns: the
    vocabulary id of each column, the image codes first) and the model's position table."""

    inputs = outputs = ()

    def __init__(self, tree, columns, codes, vocab, max_position, sampling, inplace):
        super().__init__()
        self.depth, self.M, self.codes = tree.depth, tree.num_nodes, int(codes)
        self.max_position, self.sampling, self.inplace = int(max_position), sampling, inplace
        _const(self, "depths", tree.depths)
        _const(self, "tree_mask", tree.mask, bool)
        _const(self, "view_ids", columns)
        column_of_id = np.full(vocab, -1, dtype=np.int64)
        column_of_id[np.asarray(columns, dtype=np.int64)] = np.arange(len(columns))
        _const(self, "column_of_id", column_of_id)

    def forward(self, *args):
        out = self.run(dict(zip(self.inputs, args)))
        return tuple(out[name] for name in self.outputs)

    def ids(self, columns):
        return self.view_ids[columns.clamp(min=0)]

    def positions(self, slots, offset):
        return (slots - offset[:, None]).clamp(0, self.max_position)

    @staticmethod
    def forced_at(body, forced_columns):
        """The forced column at body indices, -1 where free or past the end."""
        L = forced_columns.shape[0]
        inside = (body >= 0) & (body < L)
        return torch.where(inside, forced_columns[body.clamp(0, L - 1)], torch.full_like(body, -1))

    @staticmethod
    def block_of_draws(x):
        """This step's block of every image's stream [N, block] (M acceptance uniforms, then the race's)."""
        table = x["table"]
        return table.index_select(1, x["draws_taken"] % table.shape[1])[:, 0]

    def race(self, x, first, count):
        """The race uniforms [N, count, K] of nodes first .. first + count - 1 this step."""
        block = self.block_of_draws(x)
        K = (block.shape[1] - self.M) // self.M
        return block[:, self.M:].reshape(block.shape[0], self.M, K)[:, first: first + count]


class Begin(Phase):
    """The step's first phase. A tree: draft0's mask (the drafter cache, then the pending pairs'
    causal block) and the drafter's CFG pairs (past cfg_interval a row is its own partner). AR:
    the verify call's feeds (the root alone)."""

    def __init__(self, *args):
        super().__init__(*args)
        if self.depth == 0:
            self.inputs = ("root", "image_of_row", "offset", "target_visible", "target_length")
            self.outputs = ("verify.input_ids", "verify.position_ids", "verify.attention_mask") + \
                (("verify.write_index",) if self.inplace else ())
        else:
            self.inputs = ("count", "pending", "image_of_row", "cfg_partners", "cfg_interval", "drafter_visible") + \
                (("drafter_length",) if self.inplace else ())
            self.outputs = ("draft0.attention_mask", "cfg_pair") + (("draft0.write_index",) if self.inplace else ())

    def run(self, x):
        iob = x["image_of_row"]
        B = iob.shape[0]
        if self.depth == 0:
            block = torch.ones((B, 1, 1), dtype=torch.bool, device=iob.device)
            length = x["target_length"]
            return {"verify.input_ids": x["root"][iob][:, None],
                    "verify.position_ids": self.positions(length[:, None], x["offset"]),
                    **call_feeds("verify", x["target_visible"], block, length, self.inplace)}
        index = torch.arange(self.depth + 1, device=iob.device)
        real = (index[None, :] < x["pending"][:, None])[iob]  # [B, W]
        causal = index[:, None] >= index[None, :]
        block = (causal[None] & real[:, None, :]) | (index[:, None] == index[None, :])[None]
        interval = x["cfg_interval"]
        late = (interval >= 0) & (x["count"][iob] >= interval)
        return {"cfg_pair": torch.where(late, torch.arange(B, device=iob.device), x["cfg_partners"]),
                **call_feeds("draft0", x["drafter_visible"], block, x.get("drafter_length"), self.inplace)}


class Level(Phase):
    """After drafter call draft{d-1}: the children of depth d-1's nodes are depth d's node
    tokens (greedy: the drafter's top candidates in rank order; sampling: drawn by the race, their
    candidates and q kept for acceptance); forced tokens where the grammar puts them. d = 1 first
    keeps draft0's pairs in the drafter cache; d > 1 writes draft{d-1}'s entries into their
    scratch slots (plain graphs). Then the next call's feeds: draft{d} (d < D) or verify (d = D).
    The drafter cache's scratch slots start after the body (slot L: one per image token)."""

    def __init__(self, tree, columns, codes, vocab, max_position, sampling, inplace, d):
        super().__init__(tree, columns, codes, vocab, max_position, sampling, inplace)
        self.d = d
        parents = np.flatnonzero(tree.depths == d - 1)  # depth d-1's nodes, consecutive
        level = tree.levels[d - 1]
        self.first_parent, self.parents_count, self.width = int(parents[0]), len(parents), level.width
        _const(self, "slots", level.slots)
        _const(self, "ranks", level.ranks)
        _const(self, "forcing_parents", np.isin(parents, level.parents), bool)  # parents with a child here
        _const(self, "parent_scratch", parents - 1)  # depth d-1's scratch slots, after the first scratch slot
        self.first_scratch = int(level.nodes[0]) - 1  # where draft{d} writes (in place), after the first one
        if d < tree.depth:  # draft{d} runs over this depth's nodes, which see their ancestors in the scratch slots
            _const(self, "ancestors", tree.mask[level.nodes][:, 1:] & (tree.depths[1:] < d)[None, :], bool)
            _const(self, "own_block", np.eye(len(level.nodes)), bool)  # each node sees itself among the call's
        call, last = f"draft{d - 1}", d == tree.depth
        cache_in, cache_out = cache_names("drafter", inplace)
        new = () if inplace else (f"{call}.new_keys", f"{call}.new_values")
        hidden = () if last else (f"{call}.hidden_out",)  # the next drafter call's parents' states
        visible = ("drafter_visible",) if d == 1 or not last else ()  # draft0's pairs kept, or the next call's mask
        self.inputs = (f"{call}.topk_ids", "count", "image_of_row", "offset", "forced_columns", "target_length") + \
            new + cache_in + (("pending", "drafter_length") if d == 1 else ()) + hidden + visible + \
            ((f"{call}.topk_probs", "table", "draws_taken") if sampling else ()) + \
            (("root", "target_visible") + tuple(f"tokens{e}" for e in range(1, d)) if last else ())
        outputs = (f"tokens{d}",) + ((f"cand_ids{d - 1}", f"cand_probs{d - 1}") if sampling else ())
        feeds = ("input_ids", "target_hidden", "position_ids", "attention_mask") if not last else \
            ("input_ids", "position_ids", "attention_mask")
        outputs += tuple(f"{'verify' if last else f'draft{d}'}.{n}" for n in feeds + (("write_index",) if inplace else ()))
        outputs += cache_out
        self.outputs = outputs + (("next_drafter_visible", "next_drafter_length") if d == 1 else ())

    def run(self, x):
        call = f"draft{self.d - 1}"
        count, pending, iob = x["count"], x.get("pending"), x["image_of_row"]
        N, B = count.shape[0], iob.shape[0]
        dev = count.device
        visible = x.get("drafter_visible")
        scratch0 = x["forced_columns"].shape[0]  # the drafter cache's first scratch slot: one slot per image token
        out = {}
        ids = x[f"{call}.topk_ids"][:N]
        probs = x[f"{call}.topk_probs"][:N] if self.sampling else None
        if self.d == 1:  # draft0's pairs (the last step's accepted (hidden, token) pairs), kept
            active = count < x["forced_columns"].shape[0]
            W = self.depth + 1
            src = torch.arange(W, device=dev)[None, :].expand(B, W)
            kept, visible, length = append(x, "drafter", "draft0", self.inplace, src,
                                           torch.where(active, pending, torch.zeros_like(pending))[iob], visible,
                                           x["drafter_length"])
            out.update(kept, next_drafter_visible=visible, next_drafter_length=length)
            last = (pending - 1)[:, None, None]  # the root's pair is the last pending one
            ids = ids.gather(1, last.expand(N, 1, ids.shape[2]))
            if self.sampling:
                probs = probs.gather(1, last.expand(N, 1, probs.shape[2]))
        else:  # draft{d-1} ran over depth d-1's nodes: their entries go to their scratch slots
            slots = (scratch0 + self.parent_scratch)[None, :].expand(B, self.parents_count)
            out.update(write_scratch(x, "drafter", call, self.inplace, slots))
        column = self.forced_at(count - 1 + self.d, x["forced_columns"])  # [N]: depth d's body index
        is_forced = column >= 0
        if self.sampling:
            cand_ids, cand_probs = self.column_of_id[ids], probs.float()  # [N, parents, K]
            q = cand_probs.to(torch.float64)
            # a candidate with q = 0 is never drawn before one with q > 0: it ranks after them, in candidate
            # order (unique keys, so any top-k gives the stable sort's order)
            last = _NEVER + torch.arange(q.shape[2], device=dev, dtype=torch.float64)
            race = torch.where(q > 0, -torch.log(self.race(x, self.first_parent, self.parents_count)) / q, last)
            children = ids.gather(2, torch.topk(race, self.width, dim=2, largest=False, sorted=True).indices)
            # a forced draft was drawn with probability 1: its parents' candidates say so
            here = (is_forced[:, None] & self.forcing_parents[None, :])[..., None]
            rank0 = (torch.arange(cand_ids.shape[2], device=dev) == 0).float()
            out[f"cand_ids{self.d - 1}"] = torch.where(here, column[:, None, None], cand_ids)
            out[f"cand_probs{self.d - 1}"] = torch.where(here, rank0, cand_probs)
        else:
            children = ids[..., : self.width]
        tokens = children[:, self.slots, self.ranks]  # [N, T]
        tokens = torch.where(is_forced[:, None], self.ids(column)[:, None], tokens)
        out[f"tokens{self.d}"] = tokens
        if self.d < self.depth:
            regime = f"draft{self.d}"
            hidden = x[f"{call}.hidden_out"]
            T = self.slots.shape[0]
            if self.d == 1:  # every depth-1 node's parent is the root, at draft0's column pending - 1
                last = (pending - 1)[iob]
                parent_hidden = hidden.gather(1, last[:, None, None].expand(B, T, hidden.shape[2]))
            else:
                parent_hidden = hidden.index_select(1, self.slots)
            capacity = visible.shape[1]
            extra = torch.cat([torch.zeros((T, scratch0), dtype=torch.bool, device=dev), self.ancestors,
                               torch.zeros((T, capacity - scratch0 - (self.M - 1)), dtype=torch.bool, device=dev)],
                              dim=1)
            block = self.own_block[None].expand(B, T, T)
            start = torch.full((B,), self.first_scratch, dtype=torch.int64, device=dev) + scratch0
            root_position = x["target_length"] - x["offset"]  # [B]: depth d's nodes sit at root + d
            out.update({f"{regime}.input_ids": tokens[iob], f"{regime}.target_hidden": parent_hidden,
                        f"{regime}.position_ids": (root_position + self.d).clamp(0, self.max_position)[:, None]
                        .expand(B, T), **call_feeds(regime, visible, block, start, self.inplace, extra)})
        else:  # the verify call: the root, then every depth's nodes
            nodes = torch.cat([x["root"][:, None]] + [x[f"tokens{e}"] for e in range(1, self.d)] + [tokens], dim=1)
            block = self.tree_mask[None].expand(B, self.M, self.M)
            length = x["target_length"]
            out.update({"verify.input_ids": nodes[iob],
                        "verify.position_ids": self.positions(length[:, None] + self.depths[None, :], x["offset"]),
                        **call_feeds("verify", x["target_visible"], block, length, self.inplace)})
        return out


class Accept(Phase):
    """The rule over the verification, then the commit: the accepted path's K/V into the target
    cache, the next root, counts and draws, the report, and what the proposer keeps (the drafter
    tree: the next draft0's pairs, the target's hidden states and tokens of the path). A
    proposer's accept overrides `block` (the node tokens and q it proposed) and `keep`."""

    draws = property(lambda self: self.sampling)  # whether the step reads the streams (a window's drafts do)

    def __init__(self, tree, columns, codes, vocab, max_position, sampling, inplace, accept_dtype=torch.float64,
                 filters=()):
        """filters: the sampling filters this accept has ("top_k", "top_p"; see accept_variant)."""
        super().__init__(tree, columns, codes, vocab, max_position, sampling, inplace)
        self.accept_dtype = accept_dtype
        self.rule = SamplingAcceptance(tree, columns, codes, "top_k" in filters, "top_p" in filters) if sampling \
            else GreedyAcceptance(tree, columns, codes)
        self.leaves = int((tree.depths == tree.depth).sum())  # the deepest nodes: no candidates
        D = tree.depth
        cache_in, cache_out = cache_names("target", inplace)
        self.inputs = ("verify.logits", "count", "root", "image_of_row", "forced_columns", "target_visible",
                       "target_length") + (() if inplace else ("verify.new_keys", "verify.new_values")) + cache_in + \
            CFG_CONSTANTS + (RULE_CONSTANTS if D else ()) + \
            (("table", "temperature") + filters if sampling else ()) + (("draws_taken",) if self.draws else ()) + \
            self.proposer_inputs()
        self.outputs = ("report", "next_target_visible", "next_target_length", "next_count", "next_root") + \
            cache_out + (("commit.write_index", "commit.src_slots") if inplace and D else ()) + \
            (("next_draws_taken",) if self.draws else ()) + self.proposer_outputs()

    # -- the drafter tree's (AR: no drafts) -----------------------------------------------------
    def proposer_inputs(self):
        D = self.depth
        return tuple(f"tokens{d}" for d in range(1, D + 1)) + (("verify.hidden", "offset") if D else ()) + \
            (tuple(f"cand_ids{d}" for d in range(D)) + tuple(f"cand_probs{d}" for d in range(D))
             if self.sampling else ())

    def proposer_outputs(self):
        return ("next_pending", "draft0.input_ids", "draft0.target_hidden", "draft0.position_ids") if self.depth else ()

    def block(self, x):
        """(node tokens [N, M] ids, q as candidate columns and probabilities [N, M, K] or None)."""
        D, N, dev = self.depth, x["count"].shape[0], x["count"].device
        node_tokens = torch.cat([x["root"][:, None]] + [x[f"tokens{d}"] for d in range(1, D + 1)], dim=1)
        if not self.sampling:
            return node_tokens, None, None
        if not D:  # AR: no drafts, one empty candidate
            return node_tokens, torch.zeros((N, 1, 1), dtype=torch.int64, device=dev), torch.zeros((N, 1, 1), device=dev)
        leaves = torch.zeros((N, self.leaves, x["cand_ids0"].shape[2]), device=dev)  # no drafter call over them
        return (node_tokens, torch.cat([x[f"cand_ids{d}"] for d in range(D)] + [leaves.long()], dim=1),
                torch.cat([x[f"cand_probs{d}"] for d in range(D)] + [leaves], dim=1))

    def keep(self, x, o):
        """The next draft0's pairs: the path's (hidden state, token), as many as each image emitted."""
        if not self.depth:
            return {}
        active, emit, emitted, cols = o["active"], o["emit"], o["emitted"], o["cols"]
        iob = x["image_of_row"]
        counts = torch.where(active, emit.clamp(min=1), torch.ones_like(emit))
        pairs = torch.where(active[:, None], emitted, torch.zeros_like(emitted))
        index = torch.arange(self.depth + 1, device=emit.device)
        real = index[None, :] < counts[:, None]
        hidden = x["verify.hidden"]
        kept = torch.where(active[iob][:, None], cols, torch.zeros_like(cols))
        first = o["target_length"] - x["offset"] - counts[iob] + 1  # the first pair's position
        return {"next_pending": counts, "draft0.input_ids": torch.where(real, pairs, torch.zeros_like(pairs))[iob],
                "draft0.target_hidden": hidden.gather(1, kept[..., None].expand(-1, -1, hidden.shape[2])),
                "draft0.position_ids": (first[:, None] + index[None, :]).clamp(0, self.max_position)}

    # -- the step's end, whatever proposed ------------------------------------------------------
    def run(self, x):
        count, root, iob = x["count"], x["root"], x["image_of_row"]
        D, M = self.depth, self.M
        length = x["forced_columns"].shape[0]
        active = count < length
        node_tokens, cand_ids, cand_probs = self.block(x)
        tokens = self.column_of_id[node_tokens]
        logits = x["verify.logits"]
        a = {name: x[name] for name in CFG_CONSTANTS}
        if D:
            a.update((name, x[name]) for name in RULE_CONSTANTS)
        else:  # AR: the rule reads no neighbors and no relaxation
            one = torch.ones(1, device=count.device)
            a.update(neighbors=torch.zeros((1, 1), dtype=torch.int64, device=count.device),
                     k=torch.zeros(1, dtype=torch.int64, device=count.device), lam=one, delta=one * 0)
        if self.sampling:  # the rule combines in float32 as the host loop does, accepts in temperature's dtype
            uniforms = self.block_of_draws(x)[:, :M]
            accepted, next_column, path, decisions, invalid = self.rule(
                logits.float(), a["cond_rows"], a["uncond_rows"], a["cfg_scale"], a["cfg_interval"], count,
                x["forced_columns"], tokens, cand_ids, cand_probs, uniforms, a["neighbors"], a["k"], a["lam"],
                a["delta"], x["temperature"].to(self.accept_dtype), x.get("top_k"), x.get("top_p"))
        else:
            accepted, next_column, path, decisions, invalid = self.rule(
                logits, a["cond_rows"], a["uncond_rows"], a["cfg_scale"], a["cfg_interval"], count,
                x["forced_columns"], tokens, a["neighbors"], a["k"], a["lam"], a["delta"])
        # what each image emits: its accepted drafts, then the rule's next token
        shifted = torch.cat([path[:, 1:], path[:, :1]], dim=1).clamp(min=0)
        emitted = node_tokens.gather(1, shifted)
        emitted = emitted.scatter(1, accepted[:, None], self.ids(next_column)[:, None])
        emit = torch.where(active, torch.minimum(accepted + 1, length - count), torch.zeros_like(count))
        cols = path.clamp(min=0)[iob]  # [B, D + 1]: the path's nodes, the verification's columns
        out, visible, target_length = append(x, "target", "verify", self.inplace, cols, emit[iob], x["target_visible"],
                                             x["target_length"])
        out.update({"next_target_visible": visible, "next_target_length": target_length, "next_count": count + emit,
                    "next_root": torch.where(active, emitted.gather(1, (emit - 1).clamp(min=0)[:, None])[:, 0], root)})
        if self.inplace and not D:  # AR: the root is where it belongs; the plan has no commit call
            out = {k: v for k, v in out.items() if not k.startswith("commit.")}
        out.update(self.keep(x, dict(active=active, emit=emit, emitted=emitted, cols=cols, accepted=accepted,
                                     target_length=target_length, logits=logits, a=a)))
        if self.draws:  # every image's stream advances every step
            out["next_draws_taken"] = x["draws_taken"] + 1
        zero = torch.zeros_like(accepted)
        out["report"] = torch.cat([torch.where(active, accepted, zero)[:, None], emitted,
                                   (invalid & active).long()[:, None], decisions, node_tokens], dim=1)
        return out


def phases(tree, columns, codes, vocab, max_position, sampling, inplace=False, accept_dtype=torch.float64):
    """{name: module} of a drafter tree's step (AR: the root-only tree), in the order a step runs
    them (the engine calls between: draft{d-1} before level{d}, verify before accept; in place,
    commit after accept). Sampling: an accept per filter combination (the runner picks one:
    lantern.runtime.graph_step.accept_variant). A drafter-free proposer has its own
    (lantern.export.step_jacobi.window_phases)."""
    common = (tree, columns, codes, vocab, max_position, sampling, inplace)
    out = {"begin": Begin(*common)}
    for d in range(1, tree.depth + 1):
        out[f"level{d}"] = Level(*common, d)
    for filters in SAMPLING_FILTERS if sampling else [()]:
        out["+".join(("accept",) + filters)] = Accept(*common, accept_dtype=accept_dtype, filters=filters)
    return {name: module.eval() for name, module in out.items()}
