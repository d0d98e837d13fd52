"""The drafter-free Jacobi window (lantern.runtime.jacobi.JacobiWindow, the specification) as
step graphs: a chain of W slots verified in one target call, no drafter calls. Its phases are
`begin` (the window's drafts and their q, then the verify call's feeds) and `accept` (the step's
end as lantern.export.step_graphs.Accept's, then the next window's re-drafts).

State it adds (in and out as NAME / next_NAME, like the step's): window_drafts [N, W-1] (the
re-drafts, columns), window_kept [N] (how many slots they fill), window_q [N, W-1, S] (their q,
sampling only), body [N, L] (the ids generated so far: the spatial init reads the row above).
Random numbers: the race block's two uniforms per slot ([.., 0] a fresh draft, [.., 1] a
re-draft's draw), greedy too. q is dense over the token space's S columns."""
import numpy as np
import torch

from lantern.export.accept_graphs import cfg_combined
from lantern.export.step_caches import call_feeds
from lantern.export.step_graphs import Accept, Phase
from lantern.runtime.contracts import SAMPLING_FILTERS


class WindowBegin(Phase):
    """JacobiWindow.propose: slots 1..W-1 are the re-drafts where slot <= kept, fresh drafts
    after, forced tokens where the grammar puts them; node i holds q of slot i + 1."""

    def __init__(self, tree, columns, codes, vocab, max_position, sampling, inplace, init, accept_dtype):
        super().__init__(tree, columns, codes, vocab, max_position, sampling, inplace)
        self.init, self.accept_dtype = init, accept_dtype
        S = len(columns)
        self.register_buffer("uniform_q", torch.as_tensor(np.where(np.arange(S) < codes, 1.0 / codes, 0.0)))
        self.inputs = ("count", "root", "window_drafts", "window_kept", "table", "draws_taken", "forced_columns",
                       "image_of_row", "offset", "target_visible", "target_length") + \
            (("window_q",) if sampling else ()) + (("body", "window_stride") if init == "spatial" else ())
        self.outputs = ("tokens1",) + (("window_block_q",) if sampling else ()) + \
            ("verify.input_ids", "verify.position_ids", "verify.attention_mask") + \
            (("verify.write_index",) if inplace else ())

    def run(self, x):
        count, iob = x["count"], x["image_of_row"]
        dev = count.device
        W, codes = self.depth + 1, self.codes
        slots = torch.arange(1, W, device=dev)[None, :]
        redraft = slots <= x["window_kept"][:, None]  # [N, W - 1]
        fresh = (self.race(x, 0, self.M)[:, 1:, 0] * codes).long().clamp(max=codes - 1)
        if self.init == "spatial":
            fresh = self.spatial(x, redraft, fresh)
        cols = torch.where(redraft, x["window_drafts"], fresh)
        columns = torch.arange(self.view_ids.shape[0], device=dev)
        column = self.forced_at(count[:, None] - 1 + slots, x["forced_columns"])
        is_forced = column >= 0
        out = {}
        if self.sampling:
            if self.init == "uniform":
                fresh_q = self.uniform_q.to(self.accept_dtype)[None, None, :]
            else:
                fresh_q = (columns == cols[..., None]).to(self.accept_dtype)
            q = torch.where(redraft[..., None], x["window_q"].to(self.accept_dtype), fresh_q)
            q = torch.where(is_forced[..., None], (columns == column[..., None]).to(q.dtype), q)
            out["window_block_q"] = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # node W - 1 has no child
        cols = torch.where(is_forced, column, cols)
        tokens = self.ids(cols)
        out["tokens1"] = tokens
        B = iob.shape[0]
        nodes = torch.cat([x["root"][:, None], tokens], dim=1)
        length = x["target_length"]
        out.update({"verify.input_ids": nodes[iob],
                    "verify.position_ids": self.positions(length[:, None] + self.depths[None, :], x["offset"]),
                    **call_feeds("verify", x["target_visible"], self.tree_mask[None].expand(B, self.M, self.M),
                                 length, self.inplace)})
        return out

    def spatial(self, x, redraft, fresh):
        """JacobiWindow._spatial: the code one grid row above each slot (left on the first row),
        from the body or from the window's earlier slots; the fresh code where that is not one."""
        count, body, drafts = x["count"], x["body"], x["window_drafts"]
        W, L = self.depth + 1, body.shape[1]
        stride = x["window_stride"]
        index = count[:, None] - 1 + torch.arange(1, W, device=count.device)[None, :]
        source = torch.where(index >= stride, index - stride, index - 1)
        cols = fresh
        for i in range(W - 1):
            s = source[:, i]
            emitted = s < count
            from_window = (s - count).clamp(0, W - 2)[:, None]
            generated = self.column_of_id[body.gather(1, s.clamp(0, L - 1)[:, None])[:, 0]]
            window = torch.where(redraft.gather(1, from_window), drafts.gather(1, from_window),
                                 cols.gather(1, from_window))[:, 0]
            seen = torch.where(emitted, generated, window)
            ok = (s >= 0) & (seen >= 0) & (seen < self.codes)
            cols = torch.cat([cols[:, :i], torch.where(ok, seen, fresh[:, i])[:, None], cols[:, i + 1:]], dim=1)
        return cols


class WindowAccept(Accept):
    """Accept's end of the step with the window's block (dense q over every column) and its keep:
    JacobiWindow.commit, the rows 1..W-1 of this verification (CFG-combined, forced tokens
    applied) drawn from their processed p (greedy: argmax) become the next window's re-drafts,
    shifted by what was accepted; the spatial init's body gets this step's tokens."""

    draws = True  # the window's fresh drafts read the streams, greedy too

    def __init__(self, tree, columns, codes, vocab, max_position, sampling, inplace, init, accept_dtype, filters=()):
        self.init = init
        super().__init__(tree, columns, codes, vocab, max_position, sampling, inplace, accept_dtype, filters)

    def proposer_inputs(self):
        return ("tokens1", "window_drafts", "window_kept") + \
            (("window_block_q", "window_q") if self.sampling else ()) + \
            (("body",) if self.init == "spatial" else ())

    def proposer_outputs(self):
        return ("next_window_drafts", "next_window_kept") + (("next_window_q",) if self.sampling else ()) + \
            (("next_body",) if self.init == "spatial" else ())

    def block(self, x):
        node_tokens = torch.cat([x["root"][:, None], x["tokens1"]], dim=1)
        if not self.sampling:
            return node_tokens, None, None
        q = x["window_block_q"]
        N, M, S = q.shape
        return node_tokens, torch.arange(S, device=q.device)[None, None, :].expand(N, M, S), q

    def keep(self, x, o):
        count, active, accepted, emit = x["count"], o["active"], o["accepted"], o["emit"]
        dev = count.device
        W = self.depth + 1
        slots = torch.arange(1, W, device=dev)[None, :]
        out = {}
        if self.init == "spatial":  # emitted[:emit] at count..; the other columns repeat a kept value
            body = x["body"]
            j = torch.minimum(torch.arange(W, device=dev)[None, :], (emit - 1).clamp(min=0)[:, None])
            dst = (count[:, None] + j).clamp(max=body.shape[1] - 1)
            value = torch.where((emit > 0)[:, None], o["emitted"].gather(1, j), body.gather(1, dst))
            out["next_body"] = body.scatter(1, dst, value)
        a = o["a"]  # rows 1..W-1 combined (float32, as the host loop) and forced as the rule reads them: [N, W - 1, S]
        later = cfg_combined(self.rule, o["logits"].float(), a["cond_rows"], a["uncond_rows"], a["cfg_scale"],
                          a["cfg_interval"], count, x["forced_columns"])[:, 1:]
        columns = torch.arange(self.view_ids.shape[0], device=dev)
        if self.sampling:
            p = self.rule.filtered(later.to(self.accept_dtype), x["temperature"], x.get("top_k"), x.get("top_p"))
            cdf = torch.cumsum(p, dim=2)
            u = self.race(x, 0, self.M)[:, 1:, 1].to(p.dtype)
            drawn = (cdf <= (u * cdf[..., -1])[..., None]).sum(dim=2)
            draws = torch.minimum(drawn, torch.where(p > 0, columns, torch.full_like(columns, -1)).amax(dim=2))
        else:
            draws = later.argmax(dim=2)  # the first maximum, as numpy's
        row = accepted[:, None] + slots  # rows 1..W-1 as the next slots
        valid = row <= W - 1
        take = (row - 1).clamp(0, W - 2)
        picked = draws.gather(1, take)
        out["next_window_kept"] = torch.where(active, valid.sum(dim=1), x["window_kept"])
        out["next_window_drafts"] = torch.where(active[:, None], torch.where(valid, picked, torch.zeros_like(picked)),
                                                x["window_drafts"])
        if self.sampling:
            q = p.gather(1, take[..., None].expand(-1, -1, p.shape[2]))
            q = torch.where(valid[..., None], q, torch.zeros_like(q)).to(x["window_q"].dtype)
            out["next_window_q"] = torch.where(active[:, None, None], q, x["window_q"])
        return out


def window_phases(tree, columns, codes, vocab, max_position, sampling, inplace, init, accept_dtype=torch.float64):
    """{name: module} of a Jacobi window's step over the chain `tree` (W = depth + 1 slots)."""
    common = (tree, columns, codes, vocab, max_position, sampling, inplace, init, accept_dtype)
    out = {"begin": WindowBegin(*common).eval()}
    for filters in SAMPLING_FILTERS if sampling else [()]:
        out["+".join(("accept",) + filters)] = WindowAccept(*common, filters).eval()
    return out
