"""LlamaGen target and its LANTERN/EAGLE-1 drafter, inference only, made for speculative decoding.

Faithful to FoundationVision/LlamaGen `autoregressive/models/gpt.py` (configs, parameter names,
2D RoPE, RMSNorm in fp32, CFG null class / unconditional caption) and to jadohu/LANTERN's
drafter layout. Unlike LlamaGen's own forward, nothing here keeps state: every call takes explicit
position ids, an explicit boolean attention mask (any tree mask) and the KV cache as one tensor
[B, H_kv, P, head_dim] per layer. How a layer meets its cache is the cache form it is handed
(lantern.export.cache_forms): by default the plain form (mask [B, 1, T, P + T], the new tokens'
K/V returned, the caller keeps what it accepts); the in-place form writes them into a static
cache at `write_index` and attends over all of it (mask [B, 1, T, S]). The caller (the runtime)
owns the cache.

Read top to bottom: configs, RoPE, blocks, target, drafter.
"""
import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from lantern.export.cache_forms import PLAIN
from lantern.export.layers import GatedMLP, RMSNorm, count_parameters, init_random, run_layers  # noqa: F401 (count_parameters, init_random: this family's too)
from lantern.runtime.errors import LanternError

# ---------------------------------------------------------------------------------------------
# Configs (LlamaGen's ModelArgs field names)


class _Heads:
    @property
    def kv_heads(self):
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self):
        return self.dim // self.n_head


@dataclass(frozen=True)
class ModelArgs(_Heads):
    dim: int = 4096
    n_layer: int = 32
    n_head: int = 32
    n_kv_head: Optional[int] = None
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    num_classes: int = 1000
    caption_dim: int = 2048
    class_dropout_prob: float = 0.1  # > 0 means the class table has a null row (CFG)
    model_type: str = "c2i"
    vocab_size: int = 16384
    cls_token_num: int = 1
    block_size: int = 256
    # Not in LlamaGen's ModelArgs: the FFN width when a converted checkpoint states it.
    intermediate_size: Optional[int] = None
    # Not in LlamaGen's ModelArgs: how many ids, from 0, are image tokens (VQ codes) when the
    # vocabulary has more (the demo embedded in a larger shape, lantern.export.embed: the rest are
    # computed and never sampled or drafted). None: every id is a code, as in LlamaGen.
    image_codes: Optional[int] = None

    @property
    def ffn_hidden(self):
        if self.intermediate_size:
            return self.intermediate_size
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return _find_multiple(hidden, self.multiple_of)

    @property
    def codes(self):
        """The image tokens: ids [0, codes)."""
        return self.image_codes or self.vocab_size

    @property
    def grid_size(self):
        return math.isqrt(self.block_size)

    @property
    def max_positions(self):
        return self.cls_token_num + self.block_size

    def to_dict(self):
        return dataclasses.asdict(self)


def _find_multiple(n, k):
    return n if n % k == 0 else n + k - (n % k)


# (n_layer, n_head, dim) of every released LlamaGen model.
GPT_CONFIGS = {
    "GPT-B": (12, 12, 768),
    "GPT-L": (24, 16, 1024),
    "GPT-XL": (36, 20, 1280),
    "GPT-XXL": (48, 24, 1536),
    "GPT-XXXL": (48, 40, 2560),
    "GPT-1B": (22, 32, 2048),
    "GPT-3B": (24, 32, 3200),
    "GPT-7B": (32, 32, 4096),
}

_FIELDS = {f.name for f in dataclasses.fields(ModelArgs)}
# LlamaGen ModelArgs fields that only matter for training; accepted in config files and ignored.
_TRAINING_FIELDS = {"initializer_range", "token_dropout_p", "attn_dropout_p", "resid_dropout_p",
                    "ffn_dropout_p", "drop_path_rate", "max_batch_size", "max_seq_len"}


def make_config(name=None, *, config_file=None, image_size=256, downsample_size=16,
                model_type="c2i", num_classes=1000, **overrides):
    """ModelArgs from a named LlamaGen config (GPT-B … GPT-7B) or a JSON file of ModelArgs fields.

    block_size follows the image size ((image_size / downsample)^2 tokens) and cls_token_num the
    model type (1 for c2i, 120 for t2i), as LlamaGen's samplers set them; a config file wins.
    """
    if model_type not in ("c2i", "t2i"):
        raise LanternError(f"unknown model type {model_type!r}: expected 'c2i' or 't2i'")
    for option, value in (("image size", image_size), ("downsample size", downsample_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LanternError(f"{option} must be a positive integer, got {value!r}")
    if image_size % downsample_size:
        raise LanternError(f"image size {image_size} is not a multiple of the downsample size {downsample_size}")
    grid = image_size // downsample_size
    base = dict(model_type=model_type, num_classes=num_classes, block_size=grid * grid,
                cls_token_num=1 if model_type == "c2i" else 120)
    if config_file is not None:
        base.update(_read_config_file(config_file))
    elif name is not None:
        if name not in GPT_CONFIGS:
            raise LanternError(f"unknown model {name!r}; valid names: {', '.join(GPT_CONFIGS)}")
        n_layer, n_head, dim = GPT_CONFIGS[name]
        base.update(n_layer=n_layer, n_head=n_head, dim=dim)
    else:
        raise LanternError("no model config: give a model name (e.g. GPT-B) or a config file")
    base.update({k: v for k, v in overrides.items() if v is not None})
    return validate_config(ModelArgs(**base), source=config_file or name)


def _read_config_file(path):
    try:
        with open(path) as f:
            fields = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LanternError(f"{path}: cannot read config ({e})") from None
    if not isinstance(fields, dict):
        raise LanternError(f"{path}: a config file is a JSON object of ModelArgs fields")
    unknown = sorted(set(fields) - _FIELDS - _TRAINING_FIELDS)
    if unknown:
        raise LanternError(f"{path}: unknown config fields {unknown}; valid: {sorted(_FIELDS)}")
    return {k: v for k, v in fields.items() if k in _FIELDS}


# What every config field may hold: (kind, low, high, may be None). "int": an integer (not a
# bool, not 768.0) in [low, high]; "float": a finite number in (low, high]; "prob": a number in
# [0, 1]. The upper bounds are far above any released model and keep a typo from allocating
# terabytes before the checkpoint's shapes are compared.
_FIELD_LIMITS = {
    "dim": ("int", 1, 1 << 16, False), "n_layer": ("int", 1, 1024, False), "n_head": ("int", 1, 1024, False),
    "n_kv_head": ("int", 1, 1024, True), "multiple_of": ("int", 1, 1 << 16, False),
    "ffn_dim_multiplier": ("float", 0, 64, True), "rope_base": ("float", 0, 1e12, False),
    "norm_eps": ("float", 0, 1, False), "num_classes": ("int", 1, 1 << 24, False),
    "caption_dim": ("int", 1, 1 << 16, False), "class_dropout_prob": ("prob", 0, 1, False),
    "vocab_size": ("int", 2, 1 << 24, False), "cls_token_num": ("int", 1, 1 << 12, False),
    "block_size": ("int", 1, 1 << 20, False), "intermediate_size": ("int", 1, 1 << 20, True),
    "image_codes": ("int", 1, 1 << 24, True),
}


def check_field(name, value, kind, low, high, optional=False):
    """None when `value` fits, else a phrase saying what `name` must be."""
    if value is None and optional:
        return None
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            return f"{name} must be an integer in [{low}, {high}], got {value!r}"
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        what = "a number in [0, 1]" if kind == "prob" else f"a finite number in ({low:g}, {high:g}]"
        return f"{name} must be {what}, got {value!r}"
    if (kind == "prob" and not 0 <= value <= 1) or (kind == "float" and not low < value <= high):
        return f"{name} must be {'in [0, 1]' if kind == 'prob' else f'in ({low:g}, {high:g}]'}, got {value!r}"
    return None


def validate_config(args, source=None):
    """Check every field's type and range, then how they fit together; LanternError naming the
    field (and `source`, the file or name the config came from)."""
    where = f"{source}: " if source else ""
    if args.model_type not in ("c2i", "t2i"):
        raise LanternError(f"{where}unknown model type {args.model_type!r}: expected 'c2i' or 't2i'")
    for name, (kind, low, high, optional) in _FIELD_LIMITS.items():
        problem = check_field(name, getattr(args, name), kind, low, high, optional)
        if problem:
            raise LanternError(f"{where}config field {problem}")
    if args.dim % args.n_head:
        raise LanternError(f"{where}dim {args.dim} is not divisible by n_head {args.n_head}")
    if args.n_head % args.kv_heads:
        raise LanternError(f"{where}n_head {args.n_head} is not a multiple of n_kv_head {args.kv_heads}")
    if args.head_dim % 4:
        raise LanternError(f"{where}head_dim {args.head_dim} must be divisible by 4 for LlamaGen's 2D RoPE")
    if args.codes > args.vocab_size:
        raise LanternError(f"{where}image_codes {args.codes} exceeds vocab_size {args.vocab_size}")
    if args.grid_size ** 2 != args.block_size:
        raise LanternError(f"{where}block_size {args.block_size} is not a square number of image tokens")
    return args


# ---------------------------------------------------------------------------------------------
# 2D RoPE as LlamaGen builds it: a real table [cls_token_num + grid^2, head_dim / 2, 2] of
# (cos, sin); the first head_dim/4 pairs rotate with the grid row, the rest with the column, and
# the condition tokens' rows are zero (their rotated queries and keys vanish).


def rope_table(args):
    quarter = args.head_dim // 4
    freqs = 1.0 / (args.rope_base ** (torch.arange(0, quarter, dtype=torch.float32) * 2 / (args.head_dim // 2)))
    grid = args.grid_size
    by_index = torch.outer(torch.arange(grid, dtype=torch.float32), freqs)  # [grid, quarter]
    angles = torch.cat([by_index[:, None, :].expand(grid, grid, quarter),  # row
                        by_index[None, :, :].expand(grid, grid, quarter)], dim=-1)  # column
    table = torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1).flatten(0, 1)
    return torch.cat([torch.zeros(args.cls_token_num, args.head_dim // 2, 2), table])


def apply_rope(x, rope):
    """x [B, T, H, hd]; rope [B, T, hd/2, 2]. Rotates adjacent pairs (x[2i], x[2i+1]) in fp32."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = rope[:, :, None, :, 0], rope[:, :, None, :, 1]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return rotated.flatten(3).type_as(x)


# ---------------------------------------------------------------------------------------------
# Blocks (LlamaGen parameter names)


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = args.n_head, args.kv_heads, args.head_dim
        self.wqkv = nn.Linear(args.dim, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x, rope, mask, past_k, past_v, write_index=None, kv=PLAIN):
        """x [B, T, D]; past_k/v [B, Hkv, P, hd]; mask bool (True = attend) as the cache form kv
        wants it. Returns the output and the form's K/V (new entries or updated caches)."""
        B, T, _ = x.shape
        q_size, kv_size = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rope(q.view(B, T, self.n_head, self.head_dim), rope).transpose(1, 2)
        k = apply_rope(k.view(B, T, self.n_kv_head, self.head_dim), rope).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        out, k, v = kv.layer(q, k, v, past_k, past_v, mask, write_index)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1)), k, v


class Block(nn.Module):
    def __init__(self, args, input_norm=True):
        super().__init__()
        # The drafter's only layer has no input norm (EAGLE-1): its input is already fc-mixed.
        self.attention_norm = RMSNorm(args.dim, args.norm_eps) if input_norm else nn.Identity()
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = GatedMLP(args.dim, args.ffn_hidden, ("w1", "w3", "w2"))

    def forward(self, x, rope, mask, past_k, past_v, write_index=None, kv=PLAIN):
        attn, k, v = self.attention(self.attention_norm(x), rope, mask, past_k, past_v, write_index, kv)
        h = x + attn
        return h + self.feed_forward(self.ffn_norm(h)), k, v


# ---------------------------------------------------------------------------------------------
# Target


class LabelEmbedder(nn.Module):
    def __init__(self, args):
        super().__init__()
        rows = args.num_classes + (1 if args.class_dropout_prob > 0 else 0)
        self.embedding_table = nn.Embedding(rows, args.dim)


class MLP(nn.Module):
    def __init__(self, in_features, hidden_features, out_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features, bias=False)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class CaptionEmbedder(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.cap_proj = MLP(args.caption_dim, args.dim, args.dim)
        self.register_buffer("uncond_embedding", torch.zeros(args.cls_token_num, args.caption_dim))


class Transformer(nn.Module):
    """LlamaGen GPT. forward() is the graph exported to ONNX; embeddings are separate calls so
    prefill (condition embeddings), AR steps and tree verification share one forward."""

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.cls_embedding = LabelEmbedder(args) if args.model_type == "c2i" else CaptionEmbedder(args)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", rope_table(args), persistent=False)

    @property
    def null_class(self):
        """The class id LlamaGen's sampler uses for the unconditional half of a CFG batch."""
        return self.args.num_classes

    def embed_tokens(self, token_ids):
        return self.tok_embeddings(token_ids)

    def embed_condition(self, cond):
        """c2i: class ids [B] (null_class for unconditional) -> [B, 1, D].
        t2i: caption features [B, cls_token_num, caption_dim] -> [B, cls_token_num, D]; LlamaGen's
        sampler zeroes padded caption rows and passes `uncond_embedding` for the unconditional half."""
        if self.args.model_type == "c2i":
            return self.cls_embedding.embedding_table(cond)[:, None, :]
        return self.cls_embedding.cap_proj(cond)

    def unconditional(self, batch):
        """The unconditional condition input for `batch` images (CFG's second half)."""
        if self.args.model_type == "c2i":
            if self.args.class_dropout_prob <= 0:
                raise LanternError("this model has no null class row, so it cannot run CFG")
            return torch.full((batch,), self.null_class, dtype=torch.long)
        return self.cls_embedding.uncond_embedding.expand(batch, -1, -1)

    def forward(self, inputs_embeds, position_ids, attention_mask, past_keys, past_values, write_index=None,
                kv=PLAIN):
        """inputs_embeds [B, T, D]; position_ids [B, T] (rows of the RoPE table);
        attention_mask [B, 1, T, P + T] bool; past_keys/values [L, B, Hkv, P, hd] (or per-layer lists).
        Returns logits [B, T, V] (fp32), hidden [B, T, D] after the final norm, and the new
        tokens' keys and values [L, B, Hkv, T, hd]. With kv = cache_forms.IN_PLACE: mask
        [B, 1, T, S] over static caches [B, Hkv, S, hd] per layer, write_index [B], and the
        updated caches come back instead (keys of every layer, then values)."""
        rope = self.rope[position_ids]
        x, *caches = run_layers(self.layers, inputs_embeds, (rope, attention_mask), past_keys, past_values,
                                 write_index, kv)
        hidden = self.norm(x)
        return (self.output(hidden).float(), hidden, *caches)

    def empty_cache(self, batch, capacity=0, dtype=None):
        a = self.args
        shape = (a.n_layer, batch, a.kv_heads, capacity, a.head_dim)
        dtype = dtype or self.output.weight.dtype
        return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Drafter (EAGLE-1 as in LANTERN): h' = layer(fc(concat(embed(x_{t+1}), h_t))), logits = head(h').


@dataclass(frozen=True)
class DrafterArgs(_Heads):
    dim: int
    n_head: int
    n_kv_head: Optional[int]
    intermediate_size: int
    vocab_size: int
    norm_eps: float = 1e-6
    fc_bias: bool = True

    def to_dict(self):
        return dataclasses.asdict(self)

    def block_args(self):
        """ModelArgs for the shared Block (only the fields a block reads matter)."""
        return ModelArgs(dim=self.dim, n_layer=1, n_head=self.n_head, n_kv_head=self.n_kv_head,
                         intermediate_size=self.intermediate_size, norm_eps=self.norm_eps,
                         vocab_size=self.vocab_size)

    def validate(self, source=None):
        """Check every field's type and range and how the heads fit; LanternError naming the field."""
        where = f"{source}: " if source else ""
        for name in ("dim", "n_head", "n_kv_head", "intermediate_size", "vocab_size", "norm_eps"):
            kind, low, high, optional = _FIELD_LIMITS[name]
            problem = check_field(name, getattr(self, name), kind, low, high, optional and name == "n_kv_head")
            if problem:
                raise LanternError(f"{where}drafter config field {problem}")
        if not isinstance(self.fc_bias, bool):
            raise LanternError(f"{where}drafter config field bias must be true or false, got {self.fc_bias!r}")
        if self.dim % self.n_head:
            raise LanternError(f"{where}drafter dim {self.dim} is not divisible by its {self.n_head} heads")
        if self.n_head % self.kv_heads:
            raise LanternError(f"{where}drafter n_head {self.n_head} is not a multiple of n_kv_head {self.kv_heads}")
        return self

    @classmethod
    def for_target(cls, target_args, **overrides):
        fields = dict(dim=target_args.dim, n_head=target_args.n_head, n_kv_head=target_args.n_kv_head,
                      intermediate_size=target_args.ffn_hidden, vocab_size=target_args.vocab_size)
        fields.update(overrides)
        return cls(**fields)


class Drafter(nn.Module):
    """One decoder layer without input norm and without final norm; the output head and the RoPE
    table are the target's (passed in), so the drafter's positions follow the target's geometry:
    the input pair (h_t, x_{t+1}) takes the position of x_{t+1}."""

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.fc = nn.Linear(2 * args.dim, args.dim, bias=args.fc_bias)
        self.layers = nn.ModuleList([Block(args.block_args(), input_norm=False)])

    def forward(self, target_hidden, input_ids, position_ids, attention_mask, past_keys, past_values, rope,
                write_index=None, kv=PLAIN):
        """target_hidden [B, T, D] (h_t); input_ids [B, T] (x_{t+1}); position_ids [B, T] = the
        target positions of x_{t+1}; mask, cache, write_index and kv as the target's with L = 1.
        Returns the drafter's hidden states [B, T, D] (feed them back as h for the next depth and
        through the target's output head for logits) and the new K/V [1, B, Hkv, T, hd] (in
        place: the updated cache's keys and values)."""
        x = self.fc(torch.cat([self.embed_tokens(input_ids).to(target_hidden.dtype), target_hidden], dim=-1))
        return run_layers(self.layers, x, (rope[position_ids], attention_mask), past_keys, past_values, write_index, kv)

    def empty_cache(self, batch, capacity=0, dtype=None):
        a = self.args
        shape = (1, batch, a.kv_heads, capacity, a.head_dim)
        dtype = dtype or self.fc.weight.dtype
        return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
