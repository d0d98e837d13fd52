"""Meta Chameleon's VQ-GAN (a taming-transformers `VQModel`), decoder side: read `vqgan.yaml` +
`vqgan.ckpt`, decode VQ codes into pixels, write tiny random ones in the same layout.

Source of the architecture: jadohu/LANTERN `models/base_models/*/chameleon_vae_ori/vqgan.py`
(Meta's `chameleon/inference/vqgan.py`) and `image_tokenizer.py` (REFERENCE.md §5.5):

  vqgan.yaml   model.params: embed_dim, n_embed, ddconfig {z_channels, resolution, in_channels,
               out_ch, ch, ch_mult, num_res_blocks, attn_resolutions, dropout, double_z}, lossconfig
  vqgan.ckpt   a pickle {"state_dict": {encoder.*, decoder.*, quant_conv.*, post_quant_conv.*,
               quantize.embedding.weight [n_embed, embed_dim], ...}}

Decoding: code vectors (quantize.embedding, not normalised) laid out NCHW -> post_quant_conv (1x1)
-> Decoder: conv_in, mid (Resnet, Attn, Resnet), levels from the lowest resolution up, each with
num_res_blocks + 1 ResnetBlocks (an AttnBlock after each where the level's resolution is in
attn_resolutions) and a nearest x2 upsample + conv3x3 except at level 0, GroupNorm(32, eps 1e-6),
swish, conv_out; no tanh. The image is clamped to [-1, 1] here, the first step of Meta's
_pil_from_chw_tensor (then (x + 1) / 2 * 255 truncated to uint8, which the runtime does).

The encoder (input images -> codes) is not built: image generation never needs it. Its weights
(encoder.*, quant_conv.*) and a training loss's (loss.*) are recognised and skipped; any other
unknown key is an error, as are missing or mis-shaped decoder keys.

The blocks are taming-transformers' and share LlamaGen's VQ parameter names, so they come from
lantern.export.vq; the decoder's module tree (mid.block_1, up.{level}.block.{j}, ...) is taming's.
"""
import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from lantern.export.checkpoints import load_strict
from lantern.export.safeload import load_pickle
from lantern.export.vq import AttnBlock, ResnetBlock, Upsample, group_norm, swish
from lantern.runtime.errors import LanternError

CONFIG_FILE, CHECKPOINT_FILE = "vqgan.yaml", "vqgan.ckpt"
SKIPPED_PREFIXES = ("encoder.", "quant_conv.", "loss.")  # encoder side and training loss


@dataclass(frozen=True)
class ChameleonVQConfig:
    """ddconfig + the codebook. Defaults are Chameleon's (ChameleonVQVAEConfig, REFERENCE §5.5)."""

    n_embed: int = 8192
    embed_dim: int = 256
    z_channels: int = 256
    ch: int = 128
    ch_mult: tuple = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    attn_resolutions: tuple = ()
    resolution: int = 512
    out_ch: int = 3
    in_channels: int = 3
    dropout: float = 0.0
    double_z: bool = False

    # Names the export code shares with LlamaGen's VQ config.
    @property
    def codebook_size(self):
        return self.n_embed

    @property
    def codebook_l2_norm(self):
        return False  # taming's VectorQuantizer2 uses the stored vectors as they are

    @property
    def downsample(self):
        return 2 ** (len(self.ch_mult) - 1)

    def to_dict(self):
        d = dataclasses.asdict(self)
        d["ch_mult"], d["attn_resolutions"] = list(self.ch_mult), list(self.attn_resolutions)
        return d

    def validate(self, source="vqgan.yaml"):
        for name in ("n_embed", "embed_dim", "z_channels", "ch", "num_res_blocks", "out_ch"):
            if getattr(self, name) < 1:
                raise LanternError(f"{source}: {name} must be >= 1, got {getattr(self, name)}")
        if not self.ch_mult or any(m < 1 or (self.ch * m) % 32 for m in self.ch_mult):
            raise LanternError(f"{source}: ch * ch_mult must be positive multiples of 32 (GroupNorm(32)), "
                               f"got ch={self.ch}, ch_mult={list(self.ch_mult)}")
        return self


def config_from_yaml(path):
    """ChameleonVQConfig from a taming `vqgan.yaml` (model.params.{n_embed, embed_dim, ddconfig})."""
    import yaml

    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
        params = doc["model"]["params"]
        dd = params["ddconfig"]
        config = ChameleonVQConfig(
            n_embed=int(params["n_embed"]), embed_dim=int(params["embed_dim"]), z_channels=int(dd["z_channels"]),
            ch=int(dd["ch"]), ch_mult=tuple(int(m) for m in dd["ch_mult"]), num_res_blocks=int(dd["num_res_blocks"]),
            attn_resolutions=tuple(int(r) for r in dd.get("attn_resolutions") or ()),
            resolution=int(dd.get("resolution", 512)), out_ch=int(dd.get("out_ch", 3)),
            in_channels=int(dd.get("in_channels", 3)), dropout=float(dd.get("dropout", 0.0)),
            double_z=bool(dd.get("double_z", False)))
    except OSError as e:
        raise LanternError(f"{path}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise LanternError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    except (KeyError, TypeError) as e:
        raise LanternError(f"{path}: not a taming VQModel config (missing model.params / ddconfig field {e})") from None
    if params.get("remap") is not None:
        raise LanternError(f"{path}: a quantizer `remap` is not supported (Chameleon's VQ-GAN has none)")
    return config.validate(path)


# ---------------------------------------------------------------------------------------------
# Model


class Decoder(nn.Module):
    """taming's Decoder: z (B, z_channels, h, w) -> (B, out_ch, h * 2^(L-1), w * 2^(L-1))."""

    def __init__(self, c):
        super().__init__()
        levels = len(c.ch_mult)
        block_in = c.ch * c.ch_mult[-1]
        resolution = c.resolution // 2 ** (levels - 1)  # the latent grid the config was trained at
        self.conv_in = nn.Conv2d(c.z_channels, block_in, 3, padding=1)
        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(block_in, block_in, c.dropout)
        self.mid.attn_1 = AttnBlock(block_in)
        self.mid.block_2 = ResnetBlock(block_in, block_in, c.dropout)
        up = [None] * levels
        for level in reversed(range(levels)):
            block_out = c.ch * c.ch_mult[level]
            stage = nn.Module()
            stage.block = nn.ModuleList()
            stage.attn = nn.ModuleList()
            for _ in range(c.num_res_blocks + 1):
                stage.block.append(ResnetBlock(block_in, block_out, c.dropout))
                block_in = block_out
                if resolution in c.attn_resolutions:
                    stage.attn.append(AttnBlock(block_in))
            if level != 0:
                stage.upsample = Upsample(block_in)
                resolution *= 2
            up[level] = stage
        self.up = nn.ModuleList(up)  # up[0] is the full resolution, as taming orders it
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, c.out_ch, 3, padding=1)

    def forward(self, z):
        h = self.conv_in(z)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for level in reversed(range(len(self.up))):
            stage = self.up[level]
            for j, block in enumerate(stage.block):
                h = block(h)
                if len(stage.attn):
                    h = stage.attn[j](h)
            if level != 0:
                h = stage.upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


class Quantize(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embedding = nn.Embedding(c.n_embed, c.embed_dim)


class ChameleonVQ(nn.Module):
    """The decoding half of Chameleon's VQModel (decoder, post_quant_conv, codebook)."""

    def __init__(self, config):
        super().__init__()
        self.config = config.validate()
        self.decoder = Decoder(config)
        self.quantize = Quantize(config)
        self.post_quant_conv = nn.Conv2d(config.embed_dim, config.z_channels, 1)

    def code_vectors(self):
        """[n_embed, embed_dim]: quantize.embedding.weight, the vectors the decoder consumes (and
        the ones LANTERN's generate_codebook.py measures neighbor distances on)."""
        return self.quantize.embedding.weight

    def decode_codes(self, codes):
        """codes (B, h, w) int64 in [0, n_embed) -> image (B, out_ch, 16h, 16w) in [-1, 1]."""
        z = self.quantize.embedding(codes).permute(0, 3, 1, 2)  # get_codebook_entry: NHWC -> NCHW
        return self.decoder(self.post_quant_conv(z)).clamp(-1.0, 1.0)


# ---------------------------------------------------------------------------------------------
# Loading and writing


def load_vq(directory):
    """A directory with vqgan.yaml + vqgan.ckpt -> (ChameleonVQ in fp32, info)."""
    directory = os.fspath(directory)
    config_path, ckpt_path = (os.path.join(directory, n) for n in (CONFIG_FILE, CHECKPOINT_FILE))
    for path in (config_path, ckpt_path):
        if not os.path.isfile(path):
            raise LanternError(f"{directory}: no {os.path.basename(path)} (a Chameleon VQ directory holds "
                               f"{CONFIG_FILE} and {CHECKPOINT_FILE})")
    config = config_from_yaml(config_path)
    obj = load_pickle(ckpt_path)
    if not isinstance(obj, dict) or not isinstance(obj.get("state_dict"), dict):
        raise LanternError(f"{ckpt_path}: expected a dict with a 'state_dict' (taming/Lightning checkpoint)")
    state = {k: v for k, v in obj["state_dict"].items() if not k.startswith(SKIPPED_PREFIXES)}
    model = load_strict(ChameleonVQ(config), state, ckpt_path).float()
    info = {"format": "chameleon-vqgan", "role": "vq", "family": "chameleon", "path": directory,
            "weights": ckpt_path, "config": config.to_dict(),
            "parameters": sum(p.numel() for p in model.parameters()), "dtype": "float32",
            "skipped_keys": sum(1 for k in obj["state_dict"] if k.startswith(SKIPPED_PREFIXES))}
    return model, info


def save_vq(model, directory, extra_state=None):
    """Write `model` as Meta's layout: vqgan.yaml + vqgan.ckpt {"state_dict": ...}. extra_state
    adds keys the loader must skip (e.g. encoder weights), as a real checkpoint has them."""
    import yaml

    c = model.config
    os.makedirs(directory, exist_ok=True)
    doc = {"model": {"target": "taming.models.vqgan.VQModel", "params": {
        "embed_dim": c.embed_dim, "n_embed": c.n_embed,
        "ddconfig": {"double_z": c.double_z, "z_channels": c.z_channels, "resolution": c.resolution,
                     "in_channels": c.in_channels, "out_ch": c.out_ch, "ch": c.ch, "ch_mult": list(c.ch_mult),
                     "num_res_blocks": c.num_res_blocks, "attn_resolutions": list(c.attn_resolutions),
                     "dropout": c.dropout},
        "lossconfig": {"target": "taming.modules.losses.vqperceptual.DummyLoss"}}}}
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state.update(extra_state or {})
    torch.save({"state_dict": state}, os.path.join(directory, CHECKPOINT_FILE))


def tiny_config(**overrides):
    """A scaled-down VQ-GAN with Chameleon's 16x downsampling and 8192 codes (tests, demos)."""
    fields = dict(n_embed=8192, embed_dim=8, z_channels=32, ch=32, ch_mult=(1, 1, 2, 2, 2), num_res_blocks=1,
                  attn_resolutions=(), resolution=64)
    fields.update(overrides)
    return ChameleonVQConfig(**fields)


def init_random(model, seed=0):
    """Random weights in a range where the decoder's output is not saturated; codebook vectors
    ~N(0, 1) like a trained codebook's scale."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith(".weight"):  # GroupNorm scales
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name == "quantize.embedding.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.dim() == 4:
                fan_in = p.shape[1] * p.shape[2] * p.shape[3]
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in ** 0.5)
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return model
