"""LlamaGen's VQ image tokenizer (VQ-16 / VQ-8): model, named configs, strict checkpoint loading.

The module tree and parameter names follow LlamaGen's `tokenizer/tokenizer_image/vq_model.py`, so
its released checkpoints (`vq_ds16_c2i.pt`, `vq_ds16_t2i.pt`, ...) load with strict key and shape
checks:

    encoder.conv_in, encoder.conv_blocks.{level}.{res.{j}, attn.{j}, downsample.conv},
    encoder.mid.{0,1,2}, encoder.norm_out, encoder.conv_out
    decoder.conv_in, decoder.mid.{0,1,2}, decoder.conv_blocks.{j}.{res, attn, upsample.conv},
    decoder.norm_out, decoder.conv_out
    quant_conv (1x1, z_channels -> codebook_embed_dim), post_quant_conv (1x1, back)
    quantize.embedding.weight [codebook_size, codebook_embed_dim], quantize.codebook_used [65536]

Decoding codes into pixels: look up the code vectors (L2-normalised when the codebook is), lay them
out as (B, D, h, w), post_quant_conv, then the decoder; the image comes out in [-1, 1]. Everything
in that path is a plain op (Gather, Conv, GroupNorm, Sigmoid/Mul, MatMul, Softmax, nearest Resize),
so it exports to ONNX; `CodeDecoder` is the module to export.
"""
import argparse
import dataclasses
import os
import re
import tempfile
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lantern.export.checkpoints import load_strict
from lantern.export.safeload import load_state_file
from lantern.runtime.errors import LanternError

# LlamaGen registers a fixed-size buffer (65536 entries, float32, whatever the codebook size): a
# ring of the code indices seen during its last training steps, used only to log codebook usage.
# Inference never reads it; we keep it so real checkpoints load strictly and ours match them.
CODEBOOK_USED_SIZE = 65536


@dataclass
class VQConfig:
    """Architecture of a LlamaGen VQ tokenizer. Field names follow LlamaGen's ModelArgs; `ch` and
    `num_res_blocks` are fixed there (128 and 2, Encoder/Decoder defaults) and are fields here so
    scaled-down tokenizers can be described. Loss weights (commit_loss_beta, entropy_loss_ratio)
    only matter to a trainer and do not change any weight, so they are not part of the config."""

    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    codebook_l2_norm: bool = True  # LlamaGen's default; its training script never turns it off
    codebook_show_usage: bool = True  # whether the `quantize.codebook_used` buffer exists
    encoder_ch_mult: tuple = (1, 1, 2, 2, 4)
    decoder_ch_mult: tuple = (1, 1, 2, 2, 4)
    z_channels: int = 256
    ch: int = 128
    num_res_blocks: int = 2
    dropout_p: float = 0.0

    def __post_init__(self):
        self.encoder_ch_mult = tuple(int(m) for m in self.encoder_ch_mult)
        self.decoder_ch_mult = tuple(int(m) for m in self.decoder_ch_mult)
        if len(self.encoder_ch_mult) != len(self.decoder_ch_mult):
            # The code grid must come out the size the decoder expects to upsample from.
            raise LanternError(
                f"VQ config: encoder_ch_mult {list(self.encoder_ch_mult)} and decoder_ch_mult "
                f"{list(self.decoder_ch_mult)} need the same number of levels")
        for name in ("codebook_size", "codebook_embed_dim", "z_channels", "ch", "num_res_blocks"):
            if getattr(self, name) < 1:
                raise LanternError(f"VQ config: {name} must be >= 1, got {getattr(self, name)}")
        for m in self.encoder_ch_mult + self.decoder_ch_mult:
            # Every GroupNorm in the network has 32 groups.
            if m < 1 or (self.ch * m) % 32:
                raise LanternError(
                    f"VQ config: ch * ch_mult must be a positive multiple of 32 (GroupNorm(32)), "
                    f"got ch={self.ch}, mult={m}")

    @property
    def downsample(self):
        """Pixels per code along each side (16 for VQ-16)."""
        return 2 ** (len(self.encoder_ch_mult) - 1)

    def to_dict(self):
        d = dataclasses.asdict(self)
        d["encoder_ch_mult"] = list(self.encoder_ch_mult)
        d["decoder_ch_mult"] = list(self.decoder_ch_mult)
        return d


VQ_CONFIGS = {
    "VQ-16": VQConfig(),
    "VQ-8": VQConfig(encoder_ch_mult=(1, 2, 2, 4), decoder_ch_mult=(1, 2, 2, 4)),
    # Scaled down for the demo pipeline and tests: same 16x downsampling and 8-dim L2-normalised
    # codes as VQ-16, a quarter of the width, one res block per level, a 1024-code vocabulary.
    "VQ-16-tiny": VQConfig(codebook_size=1024, z_channels=64, ch=32, num_res_blocks=1),
}


def vq_config(name, **overrides):
    """A named config (VQ-16, VQ-8, VQ-16-tiny) with field overrides, e.g. codebook_size=4096."""
    if name not in VQ_CONFIGS:
        raise LanternError(f"unknown VQ model {name!r}; valid: {', '.join(VQ_CONFIGS)}")
    try:
        return dataclasses.replace(VQ_CONFIGS[name], **overrides)
    except TypeError as e:
        raise LanternError(f"VQ config {name}: {e}") from None


# ----------------------------------------------------------------------------- building blocks

def swish(x):
    return x * torch.sigmoid(x)


def group_norm(channels):
    # LlamaGen's only norm in released tokenizers ('group'); eps 1e-6 as in taming-transformers.
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    """norm → swish → conv3x3 → norm → swish → dropout → conv3x3, plus a 1x1 `nin_shortcut` on
    the skip path when the channel count changes."""

    def __init__(self, in_channels, out_channels, dropout):
        super().__init__()
        self.norm1 = group_norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = group_norm(out_channels)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x):
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(self.dropout(swish(self.norm2(h))))
        skip = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return skip + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all spatial positions, with 1x1 convs as projections."""

    def __init__(self, channels):
        super().__init__()
        self.norm = group_norm(channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        y = self.norm(x)
        q = self.q(y).reshape(b, c, h * w).transpose(1, 2)  # (b, hw, c)
        k = self.k(y).reshape(b, c, h * w)  # (b, c, hw)
        v = self.v(y).reshape(b, c, h * w).transpose(1, 2)  # (b, hw, c)
        # Plain matmul + softmax rather than scaled_dot_product_attention: exports to any opset.
        weights = torch.softmax(torch.bmm(q, k) * (c ** -0.5), dim=-1)  # (b, hw query, hw key)
        out = torch.bmm(weights, v).transpose(1, 2).reshape(b, c, h, w)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    """Stride-2 conv3x3 after padding one zero row/column on the bottom/right only (the padding
    of the taming-transformers VQGAN, which the weights were trained with)."""

    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    """Nearest-neighbor x2 then conv3x3."""

    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Level(nn.Module):
    """One resolution of the encoder or decoder: `res` blocks, with an `attn` block after each
    one at the lowest resolution only. The owner adds `downsample` / `upsample` where needed."""

    def __init__(self, res, attn):
        super().__init__()
        self.res = nn.ModuleList(res)
        self.attn = nn.ModuleList(attn)

    def forward(self, x):
        for i, block in enumerate(self.res):
            x = block(x)
            if len(self.attn):
                x = self.attn[i](x)
        return x


def mid_blocks(channels, dropout):
    # `mid.0`, `mid.1`, `mid.2`: res, attention, res at the lowest resolution.
    return nn.ModuleList([ResnetBlock(channels, channels, dropout), AttnBlock(channels),
                          ResnetBlock(channels, channels, dropout)])


class Encoder(nn.Module):
    """image (B, 3, H, W) → latent (B, z_channels, H/2^(L-1), W/2^(L-1)), L = len(ch_mult)."""

    def __init__(self, cfg):
        super().__init__()
        mult = cfg.encoder_ch_mult
        last = len(mult) - 1
        self.conv_in = nn.Conv2d(3, cfg.ch, 3, padding=1)
        blocks, c_in = [], cfg.ch
        for level, m in enumerate(mult):
            c_out = cfg.ch * m
            res = [ResnetBlock(c_in if j == 0 else c_out, c_out, cfg.dropout_p) for j in range(cfg.num_res_blocks)]
            attn = [AttnBlock(c_out) for _ in range(cfg.num_res_blocks)] if level == last else []
            blocks.append(Level(res, attn))
            if level != last:
                blocks[-1].downsample = Downsample(c_out)
            c_in = c_out
        self.conv_blocks = nn.ModuleList(blocks)
        self.mid = mid_blocks(c_in, cfg.dropout_p)
        self.norm_out = group_norm(c_in)
        self.conv_out = nn.Conv2d(c_in, cfg.z_channels, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        for level in self.conv_blocks:
            h = level(h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        for block in self.mid:
            h = block(h)
        return self.conv_out(swish(self.norm_out(h)))


class Decoder(nn.Module):
    """latent (B, z_channels, h, w) → image (B, 3, h·2^(L-1), w·2^(L-1)). `conv_blocks.0` is the
    lowest resolution (ch_mult[-1]); each level has num_res_blocks + 1 res blocks."""

    def __init__(self, cfg):
        super().__init__()
        mult = cfg.decoder_ch_mult
        last = len(mult) - 1
        c_in = cfg.ch * mult[last]
        self.conv_in = nn.Conv2d(cfg.z_channels, c_in, 3, padding=1)
        self.mid = mid_blocks(c_in, cfg.dropout_p)
        blocks = []
        for level in reversed(range(len(mult))):
            c_out = cfg.ch * mult[level]
            n = cfg.num_res_blocks + 1
            res = [ResnetBlock(c_in if j == 0 else c_out, c_out, cfg.dropout_p) for j in range(n)]
            attn = [AttnBlock(c_out) for _ in range(n)] if level == last else []
            blocks.append(Level(res, attn))
            if level != 0:
                blocks[-1].upsample = Upsample(c_out)
            c_in = c_out
        self.conv_blocks = nn.ModuleList(blocks)
        self.norm_out = group_norm(c_in)
        self.conv_out = nn.Conv2d(c_in, 3, 3, padding=1)

    def forward(self, z):
        h = self.conv_in(z)
        for block in self.mid:
            h = block(h)
        for level in self.conv_blocks:
            h = level(h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


class Quantizer(nn.Module):
    """The codebook (`quantize.embedding.weight`) and LlamaGen's usage buffer."""

    def __init__(self, cfg):
        super().__init__()
        self.l2_norm = cfg.codebook_l2_norm
        self.embedding = nn.Embedding(cfg.codebook_size, cfg.codebook_embed_dim)
        # LlamaGen's initialisation: uniform(±1/N), then unit rows when the codebook is normalised.
        with torch.no_grad():
            self.embedding.weight.uniform_(-1.0 / cfg.codebook_size, 1.0 / cfg.codebook_size)
            if self.l2_norm:
                self.embedding.weight.copy_(F.normalize(self.embedding.weight, dim=-1))
        if cfg.codebook_show_usage:
            self.register_buffer("codebook_used", torch.zeros(CODEBOOK_USED_SIZE))

    def vectors(self):
        w = self.embedding.weight
        return F.normalize(w, p=2, dim=-1) if self.l2_norm else w


class VQModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.quantize = Quantizer(config)
        self.quant_conv = nn.Conv2d(config.z_channels, config.codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(config.codebook_embed_dim, config.z_channels, 1)

    def code_vectors(self):
        """[codebook_size, D]: the vectors the decoder consumes for each code (unit rows when the
        codebook is L2-normalised; the stored weights otherwise)."""
        return self.quantize.vectors()

    # The training path is spelled out in three steps so a trainer can insert its straight-through
    # estimator and losses between them: z = encode_latents(x); codes = nearest_codes(z);
    # zq = lookup(codes); recon = decode_latents(z + (zq - z).detach()).

    def encode_latents(self, images):
        """images (B, 3, H, W) in [-1, 1] → z (B, D, H/s, W/s), unit vectors along D when the
        codebook is L2-normalised (both sides of the nearest-code search are normalised)."""
        z = self.quant_conv(self.encoder(images))
        return F.normalize(z, p=2, dim=1) if self.config.codebook_l2_norm else z

    def nearest_codes(self, z):
        """z (B, D, h, w) → codes (B, h, w): index of the nearest code vector by L2 distance
        (lowest index on ties, as argmin)."""
        b, d, h, w = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, d)
        e = self.code_vectors()
        dist = (flat * flat).sum(1, keepdim=True) + (e * e).sum(1) - 2 * flat @ e.t()
        return dist.argmin(dim=1).reshape(b, h, w)

    def lookup(self, codes):
        """codes (B, h, w) integer → code vectors (B, D, h, w)."""
        if codes.dim() != 3:
            raise LanternError(f"codes must be (batch, height, width), got shape {tuple(codes.shape)}")
        return self.code_vectors()[codes].permute(0, 3, 1, 2)

    def decode_latents(self, zq):
        """(B, D, h, w) code vectors → images (B, 3, h·s, w·s), nominally in [-1, 1] (not clamped)."""
        return self.decoder(self.post_quant_conv(zq))

    def encode(self, images):
        """images (B, 3, H, W) in [-1, 1], H and W multiples of config.downsample → codes (B, h, w)."""
        return self.nearest_codes(self.encode_latents(images))

    def decode_codes(self, codes):
        """codes (B, h, w) → images (B, 3, H, W) in [-1, 1]."""
        return self.decode_latents(self.lookup(codes))


class CodeDecoder(nn.Module):
    """codes → images as a module's forward, the graph exported to ONNX."""

    def __init__(self, vq):
        super().__init__()
        self.vq = vq

    def forward(self, codes):
        return self.vq.decode_codes(codes)


# ----------------------------------------------------------------------------- checkpoints

def _first_few(keys, n=5):
    keys = sorted(map(str, keys))
    more = f" (+{len(keys) - n} more)" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def _pick_state_dict(obj, path, weights):
    """The state dict inside a checkpoint object, and which entry it came from.

    LlamaGen's VQ training writes {'model', 'optimizer', 'discriminator', 'optimizer_disc', 'steps',
    'args'} plus 'ema' when trained with --ema. Its code extraction (extract_codes_*.py) and
    samplers (sample_c2i.py, sample_t2i.py) load 'model', and so does LANTERN's
    generate_codebook.py; the GPTs were trained on codes from those weights, so 'model' is the
    default. vq_demo.py and reconstruction_vq_ddp.py prefer 'ema' when present: pass weights='ema'
    to get that. A file holding only 'ema' (or 'state_dict') uses it; a bare state dict is used as is.
    """
    if not isinstance(obj, dict):
        raise LanternError(f"{path}: expected a state dict or a dict with 'model'/'ema', got {type(obj).__name__}")
    if weights is not None:
        if not isinstance(obj.get(weights), dict):
            raise LanternError(f"{path}: no {weights!r} weights in the checkpoint (top-level keys: {_first_few(obj)})")
        return obj[weights], weights
    if "quantize.embedding.weight" in obj:
        return obj, "raw"
    for name in ("model", "ema", "state_dict"):
        if isinstance(obj.get(name), dict):
            return obj[name], name
    raise LanternError(f"{path}: not a VQ checkpoint: no 'model'/'ema' entry and no "
                       f"quantize.embedding.weight (top-level keys: {_first_few(obj)})")


def _shape(sd, key, ndim, path):
    t = sd.get(key)
    if t is None:
        raise LanternError(f"{path}: cannot infer the VQ config: key {key} is missing "
                           f"(is this a LlamaGen VQ tokenizer checkpoint?)")
    if not isinstance(t, torch.Tensor) or t.dim() != ndim:
        raise LanternError(f"{path}: cannot infer the VQ config: {key} should be a {ndim}-D tensor")
    return tuple(t.shape)


def _mult(width, ch, key, path):
    if width % ch:
        raise LanternError(f"{path}: cannot infer the VQ config: {key} has {width} channels, "
                           f"not a multiple of ch={ch}")
    return width // ch


def infer_config(state_dict, path="checkpoint", l2_norm=True):
    """A VQConfig from tensor shapes and the key set. Not recoverable from shapes: whether the
    codebook is L2-normalised (pass l2_norm; LlamaGen always normalises) and dropout (0)."""
    sd = state_dict
    n_codes, dim = _shape(sd, "quantize.embedding.weight", 2, path)
    z_channels = _shape(sd, "post_quant_conv.weight", 4, path)[0]
    ch = _shape(sd, "encoder.conv_in.weight", 4, path)[0]

    def levels(prefix):
        found = {int(m.group(1)) for k in sd if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
        return max(found) + 1 if found else 0

    n_enc, n_dec = levels("encoder.conv_blocks."), levels("decoder.conv_blocks.")
    if n_enc == 0 or n_dec == 0:
        raise LanternError(f"{path}: cannot infer the VQ config: no encoder/decoder conv_blocks keys")
    enc = tuple(_mult(_shape(sd, f"encoder.conv_blocks.{i}.res.0.conv1.weight", 4, path)[0], ch,
                      f"encoder.conv_blocks.{i}", path) for i in range(n_enc))
    # Decoder block j runs at level L-1-j: read it back into ch_mult order.
    dec = tuple(_mult(_shape(sd, f"decoder.conv_blocks.{j}.res.0.conv1.weight", 4, path)[0], ch,
                      f"decoder.conv_blocks.{j}", path) for j in range(n_dec))[::-1]
    num_res = levels("encoder.conv_blocks.0.res.")
    try:
        return VQConfig(codebook_size=n_codes, codebook_embed_dim=dim, codebook_l2_norm=l2_norm,
                        codebook_show_usage="quantize.codebook_used" in sd,
                        encoder_ch_mult=enc, decoder_ch_mult=dec, z_channels=z_channels, ch=ch,
                        num_res_blocks=num_res)
    except LanternError as e:
        raise LanternError(f"{path}: the tensor shapes give an impossible config ({e})") from None


def config_name(config):
    """The VQ_CONFIGS name equal to `config`, or None for a custom one."""
    return next((name for name, c in VQ_CONFIGS.items() if c == config), None)


def load_vq(path, config=None, weights=None):
    """Load a LlamaGen VQ tokenizer strictly: a .pt holding {'model': sd} and/or {'ema': sd} (see
    _pick_state_dict for which is used), a bare state dict (.pt/.bin) or a .safetensors file.

    config: None (inferred from the tensors), a name from VQ_CONFIGS, or a VQConfig.
    weights: None ('model', else 'ema', else 'state_dict', else the bare dict), or 'model'/'ema'.
    Returns (model in eval mode, info dict: format, role, family, config_name, parameters, dtype,
    weights, path, config (as a dict), config_source).
    """
    path = os.fspath(path)
    obj = load_state_file(path)
    state_dict, used = _pick_state_dict(obj, path, weights)
    # LlamaGen's training checkpoints carry their argparse Namespace; use its l2-norm flag if there.
    args = obj.get("args") if isinstance(obj, dict) else None
    l2_norm = bool(getattr(args, "codebook_l2_norm", True)) if isinstance(args, argparse.Namespace) else True
    if config is None:
        config, source = infer_config(state_dict, path, l2_norm=l2_norm), "inferred from tensor shapes"
    elif isinstance(config, str):
        config, source = vq_config(config), f"named {config}"
    elif isinstance(config, VQConfig):
        source = "given"
    else:
        raise LanternError(f"config must be None, a VQ model name or a VQConfig, got {type(config).__name__}")
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise LanternError(f"{path}: {key} is a {type(value).__name__}, not a tensor")
    # Missing/unexpected keys and the first shape mismatch become errors naming them; never partial.
    model = load_strict(VQModel(config), state_dict, path)
    info = {"format": "vq", "role": "tokenizer", "family": "llamagen-vq", "config_name": config_name(config),
            "parameters": sum(p.numel() for p in model.parameters()),
            "dtype": str(model.quantize.embedding.weight.dtype).replace("torch.", ""),
            "weights": used, "path": path, "config": config.to_dict(), "config_source": source}
    return model, info


def save_vq(model, path):
    """Write `model` the way LlamaGen's training does ({'model': state_dict}, torch.save), atomically:
    a temporary file in the same directory, renamed over `path` once complete."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"model": model.state_dict()}, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
