"""The KV caches as the torch device step keeps them (lantern.runtime.backends.torch_step): the
plan's K/V buffers, and which slots each row sees and how many it holds as device tensors, so a
step masks, appends and commits without reading anything back. `Cache` for plain graphs,
`InPlaceCache` for in-place ones (the forms of lantern.runtime.kvcache)."""
import numpy as np


class Cache:
    """A plain KV cache as the step keeps it: the plan's K/V buffers, and which slots each row
    sees and how many it holds as device tensors (state, refilled by load). A call reads the
    cache and returns its new tokens' K/V; append and write copy the entries kept."""

    def __init__(self, step, name, cache):
        self.torch, self.rows = step.torch, step.batch_rows
        self.keys, self.values, self.capacity = cache.keys, cache.values, cache.capacity
        self.visible = step._keep(f"{name}/visible", cache.visible)
        self.length = step._keep(f"{name}/length", cache.length, np.int64)

    def mask(self, feeds, block, start, extra=None):
        """The call's mask: the rows' visible slots (| extra [T, capacity]); its block columns
        are `block` itself (TorchDeviceStep.load made it their view). start: where the in-place
        form writes the call's entries."""
        visible = self.visible[:, None, :]
        mask = feeds["attention_mask"][:, 0, :, : self.capacity]
        if extra is None:
            mask.copy_(visible.expand_as(mask))
        else:
            self.torch.bitwise_or(visible, extra[None], out=mask)

    def _kept(self, counts, W):
        """Rows, entry indices and slots [B, W] of a W-wide block of which row b keeps its first
        counts[b]; the other columns repeat the last kept entry (with none kept: slot length,
        left invisible), so no scatter ever has two different values for one place."""
        torch = self.torch
        last = (counts - 1).clamp(min=0)[:, None]
        j = torch.minimum(torch.arange(W, device=counts.device)[None, :], last)
        dst = (self.length[:, None] + j).clamp(max=self.capacity - 1)
        return self.rows[:, None].expand(-1, W), j, dst

    def _advance(self, r, dst, counts):
        self.visible[r, dst] = self.visible[r, dst] | (counts > 0)[:, None]
        self.length += counts

    def append(self, out, src, counts):
        """Row b keeps the call's entries src[b, :counts[b]] after its committed ones."""
        r, j, dst = self._kept(counts, src.shape[1])
        s = src.gather(1, j)
        self.keys[:, r, :, dst] = out["new_keys"][:, r, :, s]
        self.values[:, r, :, dst] = out["new_values"][:, r, :, s]
        self._advance(r, dst, counts)

    def write(self, out, slots):
        """The call's entries to fixed slots [T] of every row (the drafter's scratch)."""
        self.keys[:, :, :, slots] = out["new_keys"]
        self.values[:, :, :, slots] = out["new_values"]


class InPlaceCache(Cache):
    """A static cache the graphs update in place (lantern.runtime.kvcache.InPlaceKVCache): a
    call writes its new entry j of row b at slot write_index[b] + j and attends over the whole
    cache, so its mask places the block at those slots; append only moves what is not where it
    belongs (the target's accepted path, with the plan's commit graph)."""

    def __init__(self, step, name, cache):
        super().__init__(step, name, cache)
        self.step = step
        self.moves = cache.commit is not None  # the target's cache of a plan that drafts

    def mask(self, feeds, block, start, extra=None):
        torch = self.torch
        feeds["write_index"].copy_(start)
        mask = feeds["attention_mask"][:, 0]  # [B, T, capacity]
        visible = self.visible[:, None, :]
        mask.copy_((visible if extra is None else visible | extra[None]).expand_as(mask))
        B, T = mask.shape[:2]
        slots = (start[:, None] + torch.arange(T, device=start.device))[:, None, :].expand(B, T, T)
        mask.scatter_(2, slots, block.expand(B, T, T))

    def append(self, out, src, counts):
        """Entry src[b, j] was written at slot length + src[b, j]; for j < counts[b] it belongs
        at length + j. The commit graph moves every row's block at once (the other columns copy
        their slot onto itself); where there is none (the drafter's pairs, AR) src is j already."""
        torch, W = self.torch, src.shape[1]
        if self.moves:
            j = torch.arange(W, device=src.device)[None, :]
            feeds = self.step.feeds["commit"]
            feeds["write_index"].copy_(self.length)
            feeds["src_slots"].copy_(self.length[:, None] + torch.where(j < counts[:, None], src, j))
            self.step._run("commit", "commit")
        r, _, dst = self._kept(counts, W)
        self._advance(r, dst, counts)

    def write(self, out, slots):
        pass  # the call wrote its fixed slots itself
