"""Train the demo VQ tokenizer: LlamaGen's VQ architecture, scaled down, on the procedural dataset.

Losses as LlamaGen's VQ training minus the perceptual and GAN terms: L2 reconstruction through a
straight-through estimator, codebook loss |zq - sg(z)|^2 and commitment 0.25 |z - sg(zq)|^2 on
L2-normalised vectors. Codes unused for `restart_every` steps are restarted on random encoder
outputs of the current batch, so the whole codebook stays in use.

    python -m lantern.tools.train.vq --out vq.pt
"""
import argparse
import math
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from lantern.export.vq import VQConfig, VQModel, save_vq
from lantern.tools.train import data as demo_data

BETA = 0.25  # LlamaGen's commitment weight


def demo_vq_config(codebook_size=256):
    """32x32 images -> 8x8 codes (4x downsampling), 8-dim L2-normalised codes, narrow channels."""
    return VQConfig(codebook_size=codebook_size, codebook_embed_dim=8, z_channels=64, ch=32,
                    encoder_ch_mult=(1, 2, 2), decoder_ch_mult=(1, 2, 2), num_res_blocks=1)


def vq_step(model, x):
    """One forward with the straight-through estimator -> (losses dict, codes, latents z)."""
    z = model.encode_latents(x)
    codes = model.nearest_codes(z)
    zq = model.lookup(codes)
    recon = model.decode_latents(z + (zq - z).detach())
    losses = {"recon": F.mse_loss(recon, x),
              "codebook": F.mse_loss(zq, z.detach()),
              "commit": BETA * F.mse_loss(z, zq.detach())}
    return losses, codes, z


@torch.no_grad()
def restart_dead_codes(model, counts, z, gen):
    """Point every code with zero count at a random latent vector of the batch. Returns how many."""
    dead = (counts == 0).nonzero().flatten()
    if len(dead):
        latents = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
        pick = torch.randint(len(latents), (len(dead),), generator=gen)
        noise = 0.01 * torch.randn(len(dead), z.shape[1], generator=gen)
        model.quantize.embedding.weight[dead] = F.normalize(latents[pick] + noise, dim=-1)
    return len(dead)


def _lr(step, steps, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_vq(images, config, *, steps=1000, batch_size=64, lr=1e-3, seed=0, restart_every=100,
             log=print):
    """images: float [N, 3, H, W] in [-1, 1]. Returns (model in eval mode, summary dict)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = VQModel(config).train()
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.95))
    counts = torch.zeros(config.codebook_size, dtype=torch.long)
    restarted, start, ema = 0, time.time(), None
    bar = tqdm(range(steps), desc="vq", mininterval=10)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, lr, warmup=50)
        x = images[torch.randint(len(images), (batch_size,), generator=gen)]
        losses, codes, z = vq_step(model, x)
        loss = sum(losses.values())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        counts += torch.bincount(codes.flatten(), minlength=config.codebook_size)
        ema = {k: v.item() for k, v in losses.items()} if ema is None else \
            {k: 0.95 * ema[k] + 0.05 * v.item() for k, v in losses.items()}
        if (step + 1) % restart_every == 0:
            used = int((counts > 0).sum())
            if step + 1 < 0.9 * steps:  # leave the last stretch to settle
                restarted += restart_dead_codes(model, counts, z.detach(), gen)
            bar.set_postfix(recon=f"{ema['recon']:.4f}", used=used)
            log(f"vq step {step + 1}/{steps}: recon {ema['recon']:.4f} codebook {ema['codebook']:.4f} "
                f"commit {ema['commit']:.4f} codes used {used}/{config.codebook_size}")
            counts.zero_()
        # LlamaGen's ring of recently used code indices (logging only; kept for format fidelity).
        used_ring = model.quantize.codebook_used
        flat = codes.flatten().float()[-len(used_ring):]
        used_ring.copy_(torch.cat([used_ring[len(flat):], flat]))
    model.eval()
    return model, {"steps": steps, "batch_size": batch_size, "lr": lr, "train_seconds": time.time() - start,
                   "final_losses": ema, "codes_restarted": restarted}


@torch.no_grad()
def encode_images(model, images, batch_size=256):
    """float [N, 3, H, W] -> codes int64 [N, h, w]."""
    return torch.cat([model.encode(images[i:i + batch_size])
                      for i in tqdm(range(0, len(images), batch_size), desc="encode", mininterval=10)])


@torch.no_grad()
def evaluate_vq(model, images, batch_size=256):
    """Reconstruction MSE (in [-1, 1] units), PSNR, codebook usage and perplexity on `images`."""
    mse, counts = 0.0, torch.zeros(model.config.codebook_size)
    for i in range(0, len(images), batch_size):
        x = images[i:i + batch_size]
        codes = model.encode(x)
        mse += F.mse_loss(model.decode_codes(codes).clamp(-1, 1), x, reduction="sum").item()
        counts += torch.bincount(codes.flatten(), minlength=len(counts)).float()
    mse /= images.numel()
    p = counts / counts.sum()
    perplexity = math.exp(-(p[p > 0] * p[p > 0].log()).sum().item())
    return {"mse": mse, "psnr_db": 10 * math.log10(4.0 / mse), "codes_used": int((counts > 0).sum()),
            "perplexity": perplexity}


def main():
    p = argparse.ArgumentParser(description="Train the demo VQ tokenizer (LlamaGen VQ architecture, scaled down).")
    p.add_argument("--out", required=True, help="output .pt (LlamaGen's VQ checkpoint format)")
    p.add_argument("--images", type=int, default=30000)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--codebook-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    images, _ = demo_data.make_dataset(a.images, seed=a.seed)
    model, summary = train_vq(demo_data.to_tensor(images), demo_vq_config(a.codebook_size), steps=a.steps,
                              batch_size=a.batch_size, seed=a.seed)
    held_out, _ = demo_data.make_dataset(1000, seed=a.seed + 1000)
    print(summary, evaluate_vq(model, demo_data.to_tensor(held_out)))
    save_vq(model, a.out)


if __name__ == "__main__":
    main()
