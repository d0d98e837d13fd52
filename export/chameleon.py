"""Chameleon family (Anole-7b, Lumina-mGPT-7B) target and its LANTERN drafter, inference only,
made for speculative decoding.

Faithful to Hugging Face transformers' `models/chameleon/modeling_chameleon.py` and to
jadohu/LANTERN's copies (`models/kv_variants/modeling_anole_kv.py`, `modeling_lumina_mgpt_kv.py`,
`models/drafters/cnets_anole.py`, `cnets_lumina_mgpt.py`): parameter names are the Hugging Face
ones without the `model.` prefix, so a checkpoint's keys map one to one. Like export/llamagen.py,
nothing here keeps state: every call takes explicit position ids, an explicit boolean attention
mask (any tree mask) and one cache input per layer, and the cache form it is handed decides how a
layer meets its cache (lantern.export.cache_forms: plain, mask [B, 1, T, P + T] and the new
tokens' K/V returned; or in place, a static cache written at write_index, mask [B, 1, T, S]).
Unlike LlamaGen, the target embeds its own token ids (Chameleon prompts are token ids).

What must be exactly right (REFERENCE.md §5.1):
  - pre-norm LLaMA block (or the `swin_norm` order), RMSNorm in fp32, SiLU-gated MLP, no biases;
  - qk-norm after the q/k projections and before RoPE: layer norm over head_dim, eps fixed at 1e-5,
    no affine, then * weight + bias per head (weight and bias are [heads, head_dim]);
  - RoPE in the half-split (rotate_half) form with base `rope_theta`, computed from the explicit
    positions (no table, so any position works);
  - final norm, untied lm_head, logits in fp32;
  - the drafter takes the target's final-norm hidden state.

Read top to bottom: config, RoPE, blocks, target, drafter, graphs (what goes to ONNX), engine record.
"""
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lantern.export import cache_forms
from lantern.export.cache_forms import PLAIN
from lantern.export.layers import GatedMLP, RMSNorm, count_parameters, init_random, run_layers  # noqa: F401 (count_parameters, init_random: this family's too)
from lantern.runtime.errors import LanternError
from lantern.export.graphs import VQDecoderGraph

# ---------------------------------------------------------------------------------------------
# Config (Hugging Face ChameleonConfig field names)

# Token ids every released Chameleon checkpoint shares (text_tokenizer.json; REFERENCE §5.2).
BOS, PAD, EOS = 0, 1, 2
IMAGE_END = 8196  # <eoss>
IMAGE_START = 8197  # <racm3:break>
END_OF_TURN = 8710  # <reserved08706>: Anole's and Lumina's separator after the prompt
NEW_LINE = 8803  # <reserved08799>: Lumina's end of an image row
# An image token is named "IMGIMG" + the code's decimal digits written as letters A..J + "Z".
IMAGE_NAME_PREFIX, IMAGE_NAME_SUFFIX = "IMGIMG", "Z"

# The only architectures whose checkpoints this module reads; they differ in the qk-norm layout.
ARCHITECTURES = {
    "ChameleonForConditionalGeneration": ("anole", "hf"),  # q_norm [heads, head_dim]
    "ChameleonXLLMXForConditionalGeneration": ("lumina_mgpt", "xllmx"),  # [model_parallel_size, head_dim]
}
QK_NORM_EPS = 1e-5  # hard-coded in every ChameleonLayerNorm.forward, whatever the config says


@dataclass(frozen=True)
class ChameleonConfig:
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    intermediate_size: int = 11008
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    vocab_size: int = 65536
    max_position_embeddings: int = 4096
    swin_norm: bool = False
    model_parallel_size: int = 1
    family: str = "anole"  # "anole" or "lumina_mgpt"
    qk_norm_layout: str = "hf"  # on disk: "hf" [heads, head_dim] or "xllmx" [model_parallel_size, head_dim]
    # Image tokens are the ids [image_token_start, image_token_end); the VQ code of id i is
    # i - image_token_start. LANTERN assumes start 4 (`nearest_latents[x - 4] + 4`); the loader
    # checks it against the checkpoint's vocabulary_map where there is one.
    image_token_start: int = 4
    image_token_end: int = 8196

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

    @property
    def num_image_tokens(self):
        return self.image_token_end - self.image_token_start

    def to_dict(self):
        return dataclasses.asdict(self)

    def validate(self, source="config"):
        if self.hidden_size % self.num_attention_heads:
            raise LanternError(f"{source}: hidden_size {self.hidden_size} is not divisible by "
                               f"num_attention_heads {self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise LanternError(f"{source}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                               f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise LanternError(f"{source}: head_dim {self.head_dim} must be even for rotate_half RoPE")
        for heads in (self.num_attention_heads, self.num_key_value_heads):
            if heads % self.model_parallel_size:
                raise LanternError(f"{source}: {heads} heads are not divisible by model_parallel_size "
                                   f"{self.model_parallel_size} (the xllmx qk-norm repeats rows per shard)")
        if not 0 <= self.image_token_start < self.image_token_end <= self.vocab_size:
            raise LanternError(f"{source}: image tokens [{self.image_token_start}, {self.image_token_end}) "
                               f"do not fit the vocabulary of {self.vocab_size}")
        if self.family not in ("anole", "lumina_mgpt") or self.qk_norm_layout not in ("hf", "xllmx"):
            raise LanternError(f"{source}: unknown family/layout {self.family!r}/{self.qk_norm_layout!r}")
        return self

    @classmethod
    def from_hf(cls, config, source="config.json", **overrides):
        """From a Hugging Face / xllmx config.json dict. Options that no released Chameleon uses
        (RoPE scaling, biases, tied embeddings, other activations) are refused, not ignored."""
        arch = (config.get("architectures") or [None])[0]
        if arch not in ARCHITECTURES:
            raise LanternError(f"{source}: architecture {arch!r} is not a Chameleon model; expected one of "
                               f"{', '.join(ARCHITECTURES)}")
        family, layout = ARCHITECTURES[arch]
        rope = config.get("rope_parameters") or {}  # transformers >= 5 writes RoPE settings here
        unsupported = {
            "rope_scaling": config.get("rope_scaling") not in (None, {}),
            "rope_type": rope.get("rope_type", "default") != "default",
            "hidden_act": config.get("hidden_act", "silu") != "silu",
            "attention_bias": bool(config.get("attention_bias", False)),
            "mlp_bias": bool(config.get("mlp_bias", False)),
            "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise LanternError(f"{source}: unsupported settings {', '.join(f'{k}={config.get(k, rope.get(k))!r}' for k in bad)} "
                               f"(no released Chameleon model uses them)")
        try:
            heads = config["num_attention_heads"]
            fields = dict(
                hidden_size=config["hidden_size"], num_hidden_layers=config["num_hidden_layers"],
                num_attention_heads=heads, num_key_value_heads=config.get("num_key_value_heads") or heads,
                intermediate_size=config["intermediate_size"], rms_norm_eps=config.get("rms_norm_eps", 1e-5),
                rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
                vocab_size=config["vocab_size"], max_position_embeddings=config.get("max_position_embeddings", 4096),
                swin_norm=bool(config.get("swin_norm", False)),
                model_parallel_size=config.get("model_parallel_size") or 1, family=family, qk_norm_layout=layout)
        except KeyError as e:
            raise LanternError(f"{source}: config lacks {e.args[0]!r}") from None
        vocabulary_map = config.get("vocabulary_map")
        if vocabulary_map is not None:
            fields["image_token_start"], fields["image_token_end"] = image_token_range(vocabulary_map, source)
        fields.update(overrides)
        return cls(**fields).validate(source)


def image_code_of_name(name):
    """The VQ code an `IMGIMG...Z` token name stands for: digits are written as letters A..J
    (transformers' ChameleonImageVocabularyMapping.bpe2img; LANTERN's chameleon_vae_ori/vocab.py)."""
    body = name[len(IMAGE_NAME_PREFIX):-len(IMAGE_NAME_SUFFIX)]
    if not (name.startswith(IMAGE_NAME_PREFIX) and name.endswith(IMAGE_NAME_SUFFIX) and body
            and all("A" <= c <= "J" for c in body)):
        raise ValueError(f"not an image token name: {name!r}")
    return int("".join(str(ord(c) - ord("A")) for c in body))


def image_token_name(code):
    return IMAGE_NAME_PREFIX + "".join(chr(ord("A") + int(d)) for d in str(code)) + IMAGE_NAME_SUFFIX


def image_token_range(vocabulary_map, source="vocabulary_map"):
    """[start, end) of the image-token ids, checking that code = id - start for every one of them:
    the runtime (and LANTERN's neighbor lookup) maps codes to ids by that offset."""
    codes = {}
    for name, token_id in vocabulary_map.items():
        if name.startswith(IMAGE_NAME_PREFIX):
            try:
                codes[int(token_id)] = image_code_of_name(name)
            except ValueError:
                raise LanternError(f"{source}: malformed image token name {name!r}") from None
    if not codes:
        raise LanternError(f"{source}: vocabulary_map has no IMGIMG image tokens")
    start, end = min(codes), max(codes) + 1
    for token_id in range(start, end):
        if codes.get(token_id) != token_id - start:
            raise LanternError(f"{source}: image token id {token_id} has code {codes.get(token_id)}, not "
                               f"{token_id - start}; only the contiguous mapping code = id - {start} is supported")
    return start, end


# ---------------------------------------------------------------------------------------------
# RoPE: the LLaMA half-split form. Frequencies theta^(-2i/d) in fp32, angles position * frequency
# in fp32, cos/sin cast to the activation dtype, rotation in that dtype (transformers'
# ChameleonRotaryEmbedding + apply_rotary_pos_emb). Computed from the position ids on every call,
# so there is no table to outgrow and no buffer to keep in fp32 when the model is cast.


def rope_cos_sin(position_ids, head_dim, theta, dtype):
    """position_ids [B, T] -> cos, sin [B, T, 1, head_dim] (broadcast over heads)."""
    # made on the ids' device: a CPU table would be a host copy per call (and no CUDA capture)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=position_ids.device).float()
                                / head_dim))
    angles = position_ids[..., None].float() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype)[:, :, None, :], angles.sin().to(dtype)[:, :, None, :]


def apply_rope(x, cos, sin):
    """x [B, T, H, hd]: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------------------------------------
# Blocks (Hugging Face parameter names)


class QKNorm(nn.Module):
    """ChameleonLayerNorm: statistics over head_dim only, then each head's own weight and bias.
    Parameters are [heads, head_dim] (the Hugging Face layout); the xllmx layout's
    [model_parallel_size, head_dim] rows are repeated over heads by the loader."""

    def __init__(self, heads, head_dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, head_dim))
        self.bias = nn.Parameter(torch.zeros(heads, head_dim))

    def forward(self, x):  # x [B, T, heads, head_dim]
        return F.layer_norm(x, x.shape[-1:], eps=QK_NORM_EPS) * self.weight + self.bias


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)
        self.q_norm = QKNorm(self.heads, self.head_dim)
        self.k_norm = QKNorm(self.kv_heads, self.head_dim)

    def forward(self, x, cos, sin, mask, past_k, past_v, write_index=None, kv=PLAIN):
        """x [B, T, D]; past_k/v [B, Hkv, P, hd]; mask bool (True = attend) as the cache form kv
        wants it. Returns the output and the form's K/V (new entries or updated caches)."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(B, T, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin).transpose(1, 2)
        k = apply_rope(k, cos, sin).transpose(1, 2)
        out, k, v = kv.layer(q, k, v, past_k, past_v, mask, write_index)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), k, v


class DecoderLayer(nn.Module):
    """Pre-norm: h = x + attn(norm(x)); out = h + mlp(norm(h)) (ChameleonDecoderLayer)."""

    def __init__(self, c):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, ("gate_proj", "up_proj", "down_proj"))
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, mask, past_k, past_v, write_index=None, kv=PLAIN):
        attn, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask, past_k, past_v, write_index, kv)
        h = x + attn
        return h + self.mlp(self.post_attention_layernorm(h)), k, v


class SwinDecoderLayer(DecoderLayer):
    """swin_norm (Chameleon-30B/34B): the norms move to the sublayer outputs,
    h = x + norm(attn(x)); out = h + norm(mlp(h)) (ChameleonSwinDecoderLayer). Same parameters."""

    def forward(self, x, cos, sin, mask, past_k, past_v, write_index=None, kv=PLAIN):
        attn, k, v = self.self_attn(x, cos, sin, mask, past_k, past_v, write_index, kv)
        h = x + self.input_layernorm(attn)
        return h + self.post_attention_layernorm(self.mlp(h)), k, v


# ---------------------------------------------------------------------------------------------
# Target


class ChameleonTarget(nn.Module):
    """ChameleonForConditionalGeneration without the VQ encoder (which only tokenizes input
    images) and without transformers' image-logit mask (its forward sets every image logit to
    finfo.min; LANTERN's copies disable that, since images are what we generate)."""

    def __init__(self, config):
        super().__init__()
        c = self.config = config.validate()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        layer = SwinDecoderLayer if c.swin_norm else DecoderLayer
        self.layers = nn.ModuleList(layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, input_ids, position_ids, attention_mask, past_keys, past_values, write_index=None, kv=PLAIN):
        """input_ids, position_ids [B, T] int64; attention_mask [B, 1, T, P + T] bool;
        past_keys/values: one [B, Hkv, P, hd] tensor per layer.
        Returns logits [B, T, V] (fp32), hidden [B, T, D] after the final norm, and the new
        tokens' keys and values [L, B, Hkv, T, hd] (RoPE applied, as cached). With
        kv = cache_forms.IN_PLACE: mask [B, 1, T, S] over static caches [B, Hkv, S, hd],
        write_index [B], and the updated caches come back instead (keys of every layer, then values)."""
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        x, *caches = run_layers(self.layers, x, (cos, sin, attention_mask), past_keys, past_values, write_index, kv)
        hidden = self.norm(x)
        return (self.lm_head(hidden).float(), hidden, *caches)

    def empty_cache(self, batch, capacity=0, dtype=None):
        return _empty_cache(self.config, batch, capacity, dtype or self.lm_head.weight.dtype)


# ---------------------------------------------------------------------------------------------
# Drafter (LANTERN's EAGLE-1 for Chameleon, drafters/cnets_anole.py and cnets_lumina_mgpt.py: Model):
# h' = layers(fc(cat(embed(x_{t+1}), h_t))), logits = target.lm_head(h'). Unlike LlamaGen's
# drafter, its layers are whole target layers (input_layernorm and qk-norm included) and there is
# no final norm. Those files build the pre-norm ChameleonDecoderLayer whatever swin_norm says.
# Lumina's Model has an `embed_upscale` factor that is 1.0 (applied only when > 1), so it is left out.
# Positions: LANTERN gives the pair (h_t, x_{t+1}) position t (topK_genrate_v1: ids[:, 1:] with
# arange), one less than the target position of x_{t+1}; RoPE only sees differences, so any
# constant shift per row gives the same drafts (the unconditional row's clamp at 0 aside).


@dataclass(frozen=True)
class DrafterConfig(ChameleonConfig):
    fc_bias: bool = True  # config.json "bias" (absent = True, as EaModel reads it)

    @classmethod
    def from_hf(cls, config, source="config.json", **overrides):
        # A drafter's config.json is the target's with num_hidden_layers 1; LANTERN ships both
        # drafters with "ChameleonForConditionalGeneration", so the family is the target's.
        overrides.setdefault("fc_bias", bool(config.get("bias", True)))
        return super().from_hf(config, source, **overrides)


class ChameleonDrafter(nn.Module):
    def __init__(self, config):
        super().__init__()
        c = self.config = config.validate()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=c.fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))

    def forward(self, target_hidden, input_ids, position_ids, attention_mask, past_keys, past_values,
                write_index=None, kv=PLAIN):
        """target_hidden [B, T, D]: the target's final-norm hidden state h_t; input_ids [B, T]:
        the next token x_{t+1} (embedding first in the concatenation, as LANTERN's Model.forward);
        position_ids: x_{t+1}'s positions; mask and caches as the target's with L = num_hidden_layers.
        Returns the drafter's hidden states [B, T, D] (for the next depth, and through the target's
        lm_head for logits) and the new K/V [L, B, Hkv, T, hd] (in place: the updated caches)."""
        x = self.fc(torch.cat([self.embed_tokens(input_ids).to(target_hidden.dtype), target_hidden], dim=-1))
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        return run_layers(self.layers, x, (cos, sin, attention_mask), past_keys, past_values, write_index, kv)

    def empty_cache(self, batch, capacity=0, dtype=None):
        return _empty_cache(self.config, batch, capacity, dtype or self.fc.weight.dtype)


def _empty_cache(c, batch, capacity, dtype):
    """Per-layer lists of zero caches [B, Hkv, capacity, hd] (keys, values)."""
    make = lambda: [torch.zeros(batch, c.num_key_value_heads, capacity, c.head_dim, dtype=dtype)
                    for _ in range(c.num_hidden_layers)]
    return make(), make()


def check_drafter_fits(drafter_config, target_config, source="drafter"):
    d, t = drafter_config, target_config
    for field in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "rope_theta"):
        if getattr(d, field) != getattr(t, field):
            raise LanternError(f"{source}: drafter {field} {getattr(d, field)} does not fit the target's "
                               f"{getattr(t, field)}")


# ---------------------------------------------------------------------------------------------
# Graphs: exactly what goes to ONNX (lantern.runtime.contracts), inputs and outputs in order.


class TargetGraph(nn.Module):
    """input_ids, position_ids, attention_mask, past_keys_0.., past_values_0.. ->
    logits, hidden, new_keys, new_values (in place: ..., write_index -> logits, hidden,
    present_keys_0.., present_values_0..). No cond_embeds: Chameleon prompts are token ids."""

    def __init__(self, target, kv=PLAIN):
        super().__init__()
        self.target = target
        self.kv = kv

    def forward(self, input_ids, position_ids, attention_mask, *cache_inputs):
        write_index, keys, values = self.kv.split(cache_inputs)
        return self.target(input_ids, position_ids, attention_mask, keys, values, write_index, self.kv)


class DrafterGraph(nn.Module):
    """Drafter + the target's lm_head restricted to the image tokens + CFG + filters + top-K.

    Only image ids are ever drafted (LANTERN sets every other id to finfo.min before its top-k;
    the runtime forces Lumina's end-of-line/end-of-image tokens itself). Computing the head over
    the image rows only is that mask, exactly, for K <= the number of image tokens, and saves 7/8
    of the head's work at vocab 65536.

    CFG: combined = l[cfg_pair] + cfg_scale * (l - l[cfg_pair]) per row (a row that is its own
    pair gets its own logits). Filtering as LlamaGen's sampler and lantern.export.graphs: / temperature,
    keep the top_k best by rank (0 = off), keep the nucleus (a token stays while the mass before
    it is <= top_p), renormalise over the K candidates."""

    def __init__(self, drafter, target, candidates, kv=PLAIN):
        super().__init__()
        c = target.config
        if drafter.config.num_hidden_layers != 1:
            raise LanternError(f"the drafter graph has one cache input (past_keys_0), but this drafter has "
                               f"{drafter.config.num_hidden_layers} layers")
        if not 1 <= candidates <= c.num_image_tokens:
            raise LanternError(f"drafter candidates K={candidates} must be in [1, {c.num_image_tokens}] "
                               f"(the image tokens)")
        self.drafter = drafter
        self.image_head = nn.Parameter(target.lm_head.weight[c.image_token_start:c.image_token_end].detach(),
                                       requires_grad=False)
        self.first_image_id = c.image_token_start
        self.candidates = candidates
        self.kv = kv

    def forward(self, target_hidden, input_ids, position_ids, attention_mask, past_keys_0, past_values_0,
                cfg_pair, cfg_scale, temperature, top_k, top_p, write_index=None):
        """write_index: the in-place form's last input (absent in the plain form)."""
        hidden, new_k, new_v = self.drafter(target_hidden, input_ids, position_ids, attention_mask,
                                            [past_keys_0], [past_values_0], write_index, self.kv)
        logits = F.linear(hidden, self.image_head).float()
        partner = logits[cfg_pair]
        combined = partner + cfg_scale * (logits - partner)
        values, index = torch.topk(combined, self.candidates, dim=-1)
        probs = _filtered_probs(values, temperature, top_k, top_p)
        return hidden, new_k, new_v, index + self.first_image_id, probs


def _filtered_probs(values, temperature, top_k, top_p):
    """values: the K best logits, best first -> their probabilities after temperature, top-k
    (by rank) and top-p, renormalised over the K."""
    scaled = values / temperature
    rank = torch.arange(values.shape[-1], device=values.device)
    scaled = torch.where((top_k > 0) & (rank >= top_k), torch.full_like(scaled, float("-inf")), scaled)
    probs = torch.softmax(scaled, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    probs = torch.where((top_p < 1) & (mass_before > top_p), torch.zeros_like(probs), probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def graph_modules(target, drafter=None, vq=None, candidates=None, attention="plain"):
    """{graph name: (contract name, module)} of a Chameleon engine (no embed or condition graph);
    attention: the cache form of the target and drafter graphs ('plain' or 'inplace')."""
    kv, suffix = (PLAIN, "") if attention == "plain" else (cache_forms.IN_PLACE, "_inplace")
    graphs = {"target": ("target_ids" + suffix, TargetGraph(target, kv))}
    if drafter is not None:
        graphs["drafter"] = ("drafter" + suffix, DrafterGraph(drafter, target, candidates or
                                                              min(2048, target.config.num_image_tokens), kv))
        if attention == "inplace":
            graphs["commit"] = ("commit", cache_forms.CommitGraph())
    if vq is not None:

        graphs["vq_decoder"] = ("vq_decoder", VQDecoderGraph(vq))
    return {name: (contract, module.eval()) for name, (contract, module) in graphs.items()}
