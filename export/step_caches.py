"""The KV caches as the step graphs (lantern.export.step_graphs) keep them, in both forms of
lantern.runtime.kvcache: which slots each row sees (visible [B, S]) and how many it holds
(length [B]) are state; the K/V themselves are the engine's buffers.

Plain graphs return their new tokens' K/V and attend over [cache, block]: a call's mask is the
visible slots then its block [B, T, T]; the entries kept are written with one ScatterND per
buffer (run in place where input and output share memory). In-place graphs write their new
entries themselves at write_index and attend over the whole static cache: a call's mask places
its block at the slots it writes, and the target's accepted path is moved to the slots after the
committed ones by the engine's commit graph, whose feeds (write_index, src_slots) the accept
phase writes."""
import torch


def call_feeds(regime, visible, block, start, inplace, extra=None):
    """{REGIME.attention_mask (and, in place, REGIME.write_index)} of a call of block [B, T, T]
    whose entries go at slots start [B] .. + T - 1 (in place), with extra [T, S] slots seen."""
    B, S = visible.shape
    T = block.shape[1]
    cache = visible[:, None, :].expand(B, T, S)
    if extra is not None:
        cache = cache | extra[None]
    if not inplace:
        return {f"{regime}.attention_mask": torch.cat([cache, block], dim=2)[:, None]}
    slots = (start[:, None] + torch.arange(T, device=start.device)[None, :])[:, None, :].expand(B, T, T)
    return {f"{regime}.attention_mask": cache.scatter(2, slots, block)[:, None], f"{regime}.write_index": start}


def cache_names(model, inplace):
    """(inputs, outputs) naming the K/V buffers of `model` a phase writes (none in place)."""
    if inplace:
        return (), ()
    return (f"{model}_keys", f"{model}_values"), (f"{model}_keys_out", f"{model}_values_out")


def scatter_slots(cache, slots, values):
    """cache [L, B, H, S, Dh] with values [L, B, H, W, Dh] written at slots [B, W] of each row:
    one ScatterND over (layer, row, head, slot). In place: run as torch ops the cache buffer itself
    is written (and returned); exported, the in-place write is the graph's ScatterND from its
    cache input to its cache output, which the runner binds to the same buffer."""
    L, B, H, _, _ = cache.shape
    W = slots.shape[1]
    layer = torch.arange(L, device=slots.device)[:, None, None, None].expand(L, B, H, W)
    row = torch.arange(B, device=slots.device)[None, :, None, None].expand(L, B, H, W)
    head = torch.arange(H, device=slots.device)[None, None, :, None].expand(L, B, H, W)
    return cache.index_put_((layer, row, head, slots[None, :, None, :].expand(L, B, H, W)), values)


def append(x, model, regime, inplace, src, counts, visible, length):
    """Row b keeps the call's entries src[b, :counts[b]] after its committed ones: the outputs
    that do it (the K/V buffers, or the commit graph's feeds) and the new (visible, length). The
    block's other columns repeat the last kept entry (with none kept: slot `length`, left
    invisible), so no scatter has two different values for one place."""
    W = src.shape[1]
    index = torch.arange(W, device=src.device)[None, :]
    j = torch.minimum(index, (counts - 1).clamp(min=0)[:, None])
    dst = (length[:, None] + j).clamp(max=visible.shape[1] - 1)
    out = {}
    if not inplace:
        new_keys = x[f"{regime}.new_keys"]
        L, B, H, _, Dh = new_keys.shape
        take = src.gather(1, j)[None, :, None, :, None].expand(L, B, H, W, Dh)
        out[f"{model}_keys_out"] = scatter_slots(x[f"{model}_keys"], dst, new_keys.gather(3, take))
        out[f"{model}_values_out"] = scatter_slots(x[f"{model}_values"], dst, x[f"{regime}.new_values"].gather(3, take))
    elif regime == "verify":  # entry i was written at length + i: the path's move to length + j, the rest stay
        out.update({"commit.write_index": length,
                    "commit.src_slots": length[:, None] + torch.where(index < counts[:, None], src, index)})
    visible = visible.scatter(1, dst, visible.gather(1, dst) | (counts > 0)[:, None])
    return out, visible, length + counts


def write_scratch(x, model, regime, inplace, slots):
    """The call's entries to fixed slots [B, T] of every row (the drafter's scratch): the outputs
    that write them (none in place: the call wrote there itself)."""
    if inplace:
        return {}
    return {f"{model}_keys_out": scatter_slots(x[f"{model}_keys"], slots, x[f"{regime}.new_keys"]),
            f"{model}_values_out": scatter_slots(x[f"{model}_values"], slots, x[f"{regime}.new_values"])}
