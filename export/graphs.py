"""The engine graphs of a LlamaGen engine as torch modules: exactly what goes to ONNX, and what the
runtime's torch backend runs. Inputs and outputs follow lantern.runtime.contracts.GRAPHS, in order.

The target and drafter graphs take a cache form (lantern.export.cache_forms) when they are built:
the plain one (contracts target, drafter) or the in-place one (target_inplace, drafter_inplace,
plus the commit graph); graph_modules(..., attention=) picks it, once."""
import torch
import torch.nn as nn

from lantern.export import cache_forms
from lantern.export.cache_forms import PLAIN


class ConditionC2IGraph(nn.Module):
    def __init__(self, target):
        super().__init__()
        self.table = target.cls_embedding.embedding_table

    def forward(self, class_ids):
        return self.table(class_ids)[:, None, :]


class ConditionT2IGraph(nn.Module):
    """LlamaGen's sampler feeds `uncond_embedding` for the unconditional half; here a flag per row
    selects it so the runtime never needs the buffer itself."""

    def __init__(self, target):
        super().__init__()
        self.cap_proj = target.cls_embedding.cap_proj
        self.register_buffer("uncond_embedding", target.cls_embedding.uncond_embedding.clone())

    def forward(self, caption, unconditional):
        caption = torch.where(unconditional[:, None, None], self.uncond_embedding.to(caption.dtype), caption)
        return self.cap_proj(caption)


class TargetGraph(nn.Module):
    """The target embeds its own ids: an id below V is an image token, an id V + j is row j of
    cond_embeds (the condition tokens of prefill). Caches come one input per layer (then, in the
    in-place form, write_index)."""

    def __init__(self, target, kv=PLAIN):
        super().__init__()
        self.target = target
        self.vocab = target.args.vocab_size
        self.kv = kv

    def forward(self, input_ids, cond_embeds, position_ids, attention_mask, *cache_inputs):
        write_index, keys, values = self.kv.split(cache_inputs)
        is_cond = input_ids >= self.vocab
        tokens = self.target.tok_embeddings(torch.where(is_cond, 0, input_ids))
        rows = (input_ids - self.vocab).clamp(0, cond_embeds.shape[1] - 1)
        cond = torch.gather(cond_embeds, 1, rows[..., None].expand(-1, -1, cond_embeds.shape[2]))
        x = torch.where(is_cond[..., None], cond.to(tokens.dtype), tokens)
        return self.target(x, position_ids, attention_mask, keys, values, write_index, self.kv)


class DrafterGraph(nn.Module):
    """Drafter layer + the target's output head + CFG combination + filtering + top-K, so only K
    candidates per node cross to the host.

    CFG without shape inputs: row b's unconditional partner is row cfg_pair[b] (itself without
    CFG), combined = l[pair] + cfg_scale * (l - l[pair]). Filtering follows LlamaGen's sampler:
    logits / temperature, keep the top_k best, keep the nucleus (a token stays while the
    probability mass before it is <= top_p), renormalise. Top-k here keeps exactly top_k by rank
    (LlamaGen keeps ties at the threshold too); this only shapes the drafter's proposal, which
    acceptance corrects for."""

    def __init__(self, drafter, target, candidates, kv=PLAIN):
        super().__init__()
        self.drafter = drafter
        self.head = target.output
        self.register_buffer("rope", target.rope.clone())
        self.candidates = candidates
        self.kv = kv
        # Ids past the image codes (an embedded demo, lantern.export.embed) are never drafted: the
        # head still computes them, as a model of that vocabulary would, and they lose the top-K.
        codes, vocab = target.args.codes, target.args.vocab_size
        self.register_buffer("not_code", torch.arange(vocab) >= codes if codes < vocab else None)

    def forward(self, target_hidden, input_ids, position_ids, attention_mask, past_keys_0, past_values_0,
                cfg_pair, cfg_scale, temperature, top_k, top_p, write_index=None):
        """write_index: the in-place form's last input (absent in the plain form)."""
        hidden, new_k, new_v = self.drafter(target_hidden, input_ids, position_ids, attention_mask,
                                            [past_keys_0], [past_values_0], self.rope, write_index, self.kv)
        logits = self.head(hidden).float()
        partner = logits[cfg_pair]
        combined = partner + cfg_scale * (logits - partner)
        if self.not_code is not None:
            combined = combined.masked_fill(self.not_code, float("-inf"))
        values, ids = torch.topk(combined, self.candidates, dim=-1)
        scaled = values / temperature
        rank = torch.arange(self.candidates, device=values.device)
        scaled = torch.where((top_k > 0) & (rank >= top_k), torch.full_like(scaled, float("-inf")), scaled)
        probs = torch.softmax(scaled, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        probs = torch.where((top_p < 1) & (mass_before > top_p), torch.zeros_like(probs), probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        return hidden, new_k, new_v, ids, probs


class VQDecoderGraph(nn.Module):
    """codes int64 [B, h, w] -> image float32 [B, 3, Hpx, Wpx] in [-1, 1] (the vq_decoder graph),
    for any VQ model with decode_codes (LlamaGen's, Chameleon's)."""

    def __init__(self, vq):
        super().__init__()
        self.vq = vq

    def forward(self, codes):
        return self.vq.decode_codes(codes).float()


def graph_modules(target, drafter=None, vq=None, candidates=None, attention="plain"):
    """{graph name: (contract name, module)} for an engine of these models; attention: the cache
    form of the target and drafter graphs ('plain' or 'inplace', see lantern.export.cache_forms)."""
    kv, suffix = (PLAIN, "") if attention == "plain" else (cache_forms.IN_PLACE, "_inplace")
    graphs = {
        "condition": (f"condition_{target.args.model_type}",
                      ConditionC2IGraph(target) if target.args.model_type == "c2i" else ConditionT2IGraph(target)),
        "target": ("target" + suffix, TargetGraph(target, kv)),
    }
    if drafter is not None:
        graphs["drafter"] = ("drafter" + suffix, DrafterGraph(drafter, target, candidates or min(2048, target.args.codes),
                                                             kv))
        if attention == "inplace":
            graphs["commit"] = ("commit", cache_forms.CommitGraph())
    if vq is not None:
        graphs["vq_decoder"] = ("vq_decoder", VQDecoderGraph(vq))
    return {name: (contract, module.eval()) for name, (contract, module) in graphs.items()}
