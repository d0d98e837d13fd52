"""The two proposers as the torch device step (lantern.runtime.backends.torch_step) runs them:
mixins of TorchDeviceStep, reading and writing the step's tensors (self.node_tokens,
self.candidates, self.candidate_probs, the caches, the feeds), device ops only, shapes fixed by
the plan, as the rest of the step.

The drafter tree (lantern.runtime.proposers.DraftTree, ported): draft0 over the pending pairs,
then one drafter call per depth whose children come from the drafter's top-K (greedy) or the
exponential race over the race uniforms (sampling); forced tokens where the grammar puts them;
after acceptance the next step's draft0 feeds (_set_pending).

The drafter-free jacobi window (lantern.runtime.jacobi.JacobiWindow, the specification, ported
op for op): a plan with no drafter calls (plan.drafts False) whose chain of W slots is verified
in one target call. Its state is the re-drafts (columns [N, W-1]), their q ([N, W-1, S] over the view's S columns; in
sampling only) and how many there are per image; the spatial init also keeps the generated body
[N, length]. Fresh drafts and re-drafts' draws read the streams' race block, two uniforms per
slot, greedy too; q is dense, so acceptance's candidates are every column. After verification the
rows 1..W-1 (CFG-combined, forced tokens applied, as the host's combined_logits) give the next
window's re-drafts: argmax, or a draw from SamplingAcceptance.filtered's p by inverse CDF."""


class DeviceDrafting:
    """The drafter tree's half of the step: _draft before verification, _set_pending after."""

    def _children(self, out, cols, nodes, width, race):
        """The first `width` children (vocabulary ids) [N, n, width] of the n parents at the
        call's columns cols [N, n] (None: every column, in order), tree nodes `nodes`: greedy,
        the drafter's top candidates in rank order, straight from its top-K ids (always image
        ids); sampling, drawn without replacement in draw order by the exponential race
        (lantern.runtime.sampling.Sampling.children) over the race uniforms [N, n, K], and the
        candidates (as columns) and their probabilities kept for acceptance."""
        ids = out["topk_ids"][: self.N]
        if cols is not None:
            ids = ids.gather(1, cols[..., None].expand(-1, -1, ids.shape[2]))
        if not self.sampling:
            return ids[..., :width]
        probs = out["topk_probs"][: self.N]
        if cols is not None:
            probs = probs.gather(1, cols[..., None].expand(-1, -1, probs.shape[2]))
        self.candidates[:, nodes] = self.column_of_id[ids]
        self.candidate_probs[:, nodes] = probs.float()
        keys = -self.torch.log(race) / self.candidate_probs[:, nodes].to(self.torch.float64)
        first = self.torch.sort(keys, dim=-1, stable=True).indices[..., :width]
        return ids.gather(2, first)

    def _force_drafts(self, level):
        """As Decoding.force_drafts: every draft at a forced body index is the forced token,
        drawn by the drafter with probability 1 (its parents' candidates say so)."""
        torch, nodes = self.torch, level["nodes"]
        body = self.count - 1 + level["depth"]
        inside = (body >= 0) & (body < self.forced_column.shape[0])
        column = torch.where(inside, self.forced_column[body.clamp(0, self.forced_column.shape[0] - 1)], -1)
        is_forced = column >= 0
        forced = self._ids(column.clamp(min=0))[:, None]
        self.node_tokens[:, nodes] = torch.where(is_forced[:, None], forced, self.node_tokens[:, nodes])
        if self.sampling:
            parents = level["parents"]
            here = is_forced[:, None, None]
            self.candidates[:, parents] = torch.where(here, column[:, None, None], self.candidates[:, parents])
            self.candidate_probs[:, parents] = torch.where(here, self.first_candidate.float(),
                                                           self.candidate_probs[:, parents])

    def _draft(self, active, race):
        torch = self.torch
        B, iob = self.B, self.image_of_row
        cache = self.drafter
        if self.cfg_interval_on:  # past the interval an image's rows are their own CFG partners
            late = (self.count >= self.accept_feeds["cfg_interval"])[iob]  # a tensor: the graph reads its value
            pairs = torch.where(late, self.batch_rows, self.cfg_partners)
            for cfg_pair in self.cfg_pairs:
                cfg_pair.copy_(pairs)
        self._mask("draft0", cache, cache.length)
        out = self._run("draft0", "drafter")
        cache.append(out, self.pair_index[None, :].expand(B, -1), torch.where(active, self.pending, 0)[iob])
        last = self.pending - 1
        parents = self._children(out, last[:, None], slice(0, 1), self.widths[0], race[:, :1] if self.sampling else None)
        hidden = out["hidden_out"]
        root_position = self.target.length - self.offset  # [B]: every node of depth d sits at root + d
        for index, level in enumerate(self.levels):
            depth, nodes = level["depth"], level["nodes"]
            tokens = parents[:, level["slots"], level["ranks"]]  # [N, T]
            self.node_tokens[:, nodes] = tokens
            if not self.plain_view:  # a prompt style that forces tokens (Lumina-mGPT's line ends)
                self._force_drafts(level)
                tokens = self.node_tokens[:, nodes]
            if depth == self.depth:
                break
            regime = f"draft{depth}"
            feeds = self.feeds[regime]
            if depth == 1:  # every depth-1 node's parent is the root, at draft0's column `last`
                column = last[iob][:, None, None].expand(feeds["target_hidden"].shape)
                torch.gather(hidden, 1, column, out=feeds["target_hidden"])
            else:  # the parents are the last call's nodes, in the tree's order
                torch.index_select(hidden, 1, level["slots"], out=feeds["target_hidden"])
            torch.index_select(tokens, 0, iob, out=feeds["input_ids"])
            feeds["position_ids"].copy_((root_position + depth).clamp(0, self.max_position)[:, None])
            self._mask(regime, cache, self.first_slots[regime], self.ancestors[depth])
            out = self._run(regime, "drafter")
            cache.write(out, self.scratch_slots[depth])
            parents = self._children(out, None, nodes, self.widths[index + 1], race[:, nodes] if self.sampling else None)
            hidden = out["hidden_out"]

    def _set_pending(self, hidden, cols, tokens, counts):
        """draft0's feeds for the next step, as Decoding.set_pending builds them on the host."""
        torch = self.torch
        iob = self.image_of_row
        feeds = self.feeds["draft0"]
        real = self.pair_index[None, :] < counts[:, None]  # [N, W]
        torch.gather(hidden, 1, cols[..., None].expand(feeds["target_hidden"].shape), out=feeds["target_hidden"])
        torch.index_select(torch.where(real, tokens, 0), 0, iob, out=feeds["input_ids"])
        first = self.target.length - self.offset - counts[iob] + 1  # the first pair's position
        torch.clamp(first[:, None] + self.pair_index[None, :], 0, self.max_position, out=feeds["position_ids"])
        torch.bitwise_or(self.pair_block[None] & real[iob][:, None, :], self.pair_self[None], out=self.blocks["draft0"])
        self.pending.copy_(counts)


class DeviceJacobiWindow:
    """The jacobi window's half of the step: _propose_window before verification, _commit_window
    after (JacobiWindow.propose and commit, op for op)."""

    def _propose_window(self, race):
        """JacobiWindow.propose: node tokens 1..W-1 and q (candidate_probs, node i holds the q of
        slot i + 1) from the re-drafts where slot <= kept, fresh drafts after, forced tokens where
        the grammar puts them."""
        torch, codes = self.torch, self.codes
        redraft = self.slots <= self.kept[:, None]  # [N, W - 1]
        fresh = (race[:, 1:, 0] * codes).to(torch.int64).clamp(max=codes - 1)
        if self.init == "spatial":
            fresh = self._spatial(redraft, fresh)
        cols = torch.where(redraft, self.redrafts, fresh)
        if self.sampling:
            q = self.candidate_probs
            if self.init == "uniform":
                fresh_q = self.uniform_q[None, None, :]
            else:
                fresh_q = (self.columns == cols[..., None]).to(q.dtype)
            q[:, :-1] = torch.where(redraft[..., None], self.redraft_q, fresh_q)
            q[:, -1].zero_()  # node W - 1 has no child
        if not self.plain_view:
            column = self._forced_at(self.count[:, None] - 1 + self.slots)
            is_forced = column >= 0
            cols = torch.where(is_forced, column, cols)
            if self.sampling:
                one_hot = (self.columns == column[..., None]).to(q.dtype)
                q[:, :-1] = torch.where(is_forced[..., None], one_hot, q[:, :-1])
        self.node_tokens[:, 1:] = self._ids(cols)

    def _forced_at(self, body):
        """VocabularyView.forced_at: the forced column at body indices, -1 where free or past the end."""
        L = self.forced_column.shape[0]
        inside = (body >= 0) & (body < L)
        return self.torch.where(inside, self.forced_column[body.clamp(0, L - 1)], -1)

    def _spatial(self, redraft, fresh):
        """JacobiWindow._spatial: the code one grid row above each slot (left on the first
        row), from the body or the window's earlier slots; the fresh code where that is not one."""
        torch, count, W = self.torch, self.count, self.depth + 1
        body = count[:, None] - 1 + self.slots
        source = torch.where(body >= self.stride, body - self.stride, body - 1)
        cols = fresh.clone()
        for i in range(W - 1):
            s = source[:, i]
            emitted = s < count
            from_window = (s - count).clamp(0, W - 2)[:, None]
            generated = self.column_of_id[self.body.gather(1, s.clamp(0, self.length - 1)[:, None])[:, 0]]
            window = torch.where(redraft.gather(1, from_window), self.redrafts.gather(1, from_window),
                                 cols.gather(1, from_window))[:, 0]
            seen = torch.where(emitted, generated, window)
            ok = (s >= 0) & (seen >= 0) & (seen < self.codes)
            cols[:, i] = torch.where(ok, seen, fresh[:, i])
        return cols

    def _commit_window(self, combined, active, accepted, race, emitted, emit):
        """JacobiWindow.commit: rows 1..W-1 of this verification, drawn from their processed p
        (greedy: argmax), become the next window's re-drafts, shifted by what was accepted; and
        the spatial init's body gets this step's tokens."""
        torch, W = self.torch, self.depth + 1
        if self.init == "spatial":  # emitted[:emit] at count..; the other columns repeat a kept value
            j = torch.minimum(self.pair_columns, (emit - 1).clamp(min=0)[:, None])
            dst = (self.count[:, None] + j).clamp(max=self.length - 1)
            value = torch.where((emit > 0)[:, None], emitted.gather(1, j), self.body.gather(1, dst))
            self.body.scatter_(1, dst, value)
        # the re-drafts' logits as the host's combined_logits gives them: the view's columns, forced tokens applied
        later = combined[:, 1:].index_select(2, self.view_ids)  # [N, W - 1, S]
        if not self.plain_view:
            column = self._forced_at(self.count[:, None] + self.slots)
            is_forced = column[..., None] >= 0
            keep = (is_forced & (self.columns == column[..., None])) | (~is_forced & (self.columns < self.codes))
            later = torch.where(keep, later, float("-inf"))
        if self.sampling:
            a = self.accept_feeds
            p = self.accept_module.filtered(later.to(self.accept_dtype), a["temperature"], a["top_k"], a["top_p"])
            cdf = torch.cumsum(p, dim=2)
            u = race[:, 1:, 1].to(p.dtype)
            drawn = (cdf <= (u * cdf[..., -1])[..., None]).sum(dim=2)
            last = torch.where(p > 0, self.columns, -1).amax(dim=2)
            draws = torch.minimum(drawn, last)
        else:
            draws = later.argmax(dim=2)  # the first maximum, as numpy's
        row = accepted[:, None] + self.slots  # rows 1..W-1 as the next slots
        valid = row <= W - 1
        take = (row - 1).clamp(0, W - 2)
        picked = draws.gather(1, take)
        self.kept.copy_(torch.where(active, valid.sum(dim=1), self.kept))
        self.redrafts.copy_(torch.where(active[:, None], torch.where(valid, picked, 0), self.redrafts))
        if self.sampling:
            q = p.gather(1, take[..., None].expand(-1, -1, p.shape[2]))
            q = torch.where(valid[..., None], q, 0.0).to(self.redraft_q.dtype)
            self.redraft_q.copy_(torch.where(active[:, None, None], q, self.redraft_q))
