"""Train the demo LANTERN/EAGLE-1 drafter by self-distillation on the target's own generations.

Data: the target samples images with CFG (as at inference); then one teacher-forced pass per CFG
half records its hidden states h (after the final norm) for the conditional and the unconditional
half (the drafter runs on both halves at inference, and CFG combines its two logits).

Pairing (REFERENCE.md section 4): the sequence is x_0 = class, x_1..x_64 = image tokens, and h_i is
the target's hidden state at index i. Drafter input i = (h_i, x_{i+1}) at the target position of
x_{i+1}; it predicts x_{i+2}, so its teacher is the target's distribution at index i + 1,
softmax(head(h_{i+1})), and (EAGLE's regression term) its output hidden state should match h_{i+1}.
The drafter's logits go through the target's output head, which stays frozen; the token
embedding starts as a copy of the target's and stays frozen too, as in EAGLE.

    python -m lantern.tools.train.drafter --target gpt.pt --out drafter/
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from lantern.export.checkpoints import save_drafter
from lantern.export.llamagen import count_parameters, Drafter, DrafterArgs
from lantern.tools.train.target import causal_mask, generate, load_demo_target, sequence_forward

HIDDEN_WEIGHT = 1.0  # weight of the hidden-state regression next to the distillation loss


def make_drafter(target, seed=0):
    args = DrafterArgs.for_target(target.args)
    drafter = Drafter(args)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in drafter.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(0.02 * torch.randn(module.weight.shape, generator=gen))
                if module.bias is not None:
                    module.bias.zero_()
        drafter.embed_tokens.weight.copy_(target.tok_embeddings.weight)
    drafter.embed_tokens.weight.requires_grad_(False)
    return drafter


@torch.no_grad()
def collect_generations(target, n, *, cfg_scale, temperature=1.0, top_k=0, seed=0, batch_size=256,
                        num_classes=None):
    """n target generations with balanced classes -> dict(tokens [n, T], labels [n],
    hidden [2, n, T, D]: the target's states for the conditional and the unconditional half)."""
    num_classes = num_classes or target.args.num_classes
    labels = torch.arange(n) % num_classes
    tokens, hidden = [], []
    for b, i in enumerate(tqdm(range(0, n, batch_size), desc="generate", mininterval=10)):
        y = labels[i:i + batch_size]
        x = generate(target, y, cfg_scale=cfg_scale, temperature=temperature, top_k=top_k, seed=seed + b)
        _, h_cond = sequence_forward(target, y, x)
        _, h_uncond = sequence_forward(target, target.unconditional(len(y)), x)
        tokens.append(x)
        hidden.append(torch.stack([h_cond, h_uncond]))
    return {"tokens": torch.cat(tokens), "labels": labels, "hidden": torch.cat(hidden, dim=1)}


def drafter_forward(drafter, target, hidden, tokens):
    """hidden [B, T, D] (h_0..h_{T-1}), tokens [B, T] (x_1..x_T) -> the drafter's hidden states
    [B, T-1, D] for inputs (h_i, x_{i+1}), i = 0..T-2, each predicting x_{i+2}."""
    B, T = tokens.shape
    keys, values = drafter.empty_cache(B)
    out, _, _ = drafter(hidden[:, :-1], tokens[:, :-1], torch.arange(1, T).expand(B, T - 1),
                        causal_mask(B, T - 1), keys, values, target.rope)
    return out


def drafter_losses(drafter, target, hidden, tokens):
    out = drafter_forward(drafter, target, hidden, tokens)
    teacher = F.softmax(target.output(hidden[:, 1:]).float(), dim=-1)
    log_q = F.log_softmax(target.output(out).float(), dim=-1)
    return {"distill": -(teacher * log_q).sum(-1).mean(),
            "hidden": F.smooth_l1_loss(out, hidden[:, 1:])}


def train_drafter(target, data, *, steps=1500, batch_size=64, lr=1e-3, seed=0, log=print):
    """data from collect_generations. Both CFG halves are training rows. Returns (drafter, summary)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    for p in target.parameters():
        p.requires_grad_(False)
    drafter = make_drafter(target, seed).train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    hidden = data["hidden"].flatten(0, 1)  # [2n, T, D]: cond rows, then uncond rows
    tokens = data["tokens"].repeat(2, 1)
    start, ema = time.time(), None
    bar = tqdm(range(steps), desc="drafter", mininterval=10)
    for step in bar:
        warm = min(1.0, (step + 1) / 100)
        for g in opt.param_groups:
            g["lr"] = lr * warm * (0.05 + 0.95 * 0.5 * (1 + torch.cos(torch.tensor(step / steps * torch.pi)).item()))
        idx = torch.randint(len(tokens), (batch_size,), generator=gen)
        losses = drafter_losses(drafter, target, hidden[idx], tokens[idx])
        loss = losses["distill"] + HIDDEN_WEIGHT * losses["hidden"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema = {k: v.item() for k, v in losses.items()} if ema is None else \
            {k: 0.98 * ema[k] + 0.02 * v.item() for k, v in losses.items()}
        if (step + 1) % 100 == 0:
            bar.set_postfix(distill=f"{ema['distill']:.3f}")
            log(f"drafter step {step + 1}/{steps}: distill {ema['distill']:.4f} hidden {ema['hidden']:.4f}")
    drafter.eval()
    drafter.embed_tokens.weight.requires_grad_(True)
    return drafter, {"steps": steps, "batch_size": batch_size, "lr": lr, "train_seconds": time.time() - start,
                     "final_losses": ema, "parameters": count_parameters(drafter)}


@torch.no_grad()
def evaluate_drafter(drafter, target, data, cfg_scale):
    """Top-1 agreement of the drafter with the target's greedy choice on (held-out) generations:
    per CFG half, on the CFG-combined logits (what speculative decoding compares), top-5 recall of
    the target's choice, and how often the drafter's top-1 is the token the target actually sampled."""
    cond, uncond = data["hidden"]
    tokens = data["tokens"]
    q_c = target.output(drafter_forward(drafter, target, cond, tokens)).float()
    q_u = target.output(drafter_forward(drafter, target, uncond, tokens)).float()
    p_c, p_u = target.output(cond[:, 1:]).float(), target.output(uncond[:, 1:]).float()
    q_cfg, p_cfg = q_u + cfg_scale * (q_c - q_u), p_u + cfg_scale * (p_c - p_u)
    greedy = p_cfg.argmax(-1)
    top5 = q_cfg.topk(5, dim=-1).indices
    vocab = p_c.shape[-1]
    return {"top1_cond": (q_c.argmax(-1) == p_c.argmax(-1)).float().mean().item(),
            "top1_uncond": (q_u.argmax(-1) == p_u.argmax(-1)).float().mean().item(),
            "top1_cfg": (q_cfg.argmax(-1) == greedy).float().mean().item(),
            "top5_cfg": (top5 == greedy[..., None]).any(-1).float().mean().item(),
            "top1_matches_sampled": (q_cfg.argmax(-1) == tokens[:, 1:]).float().mean().item(),
            "chance": 1.0 / vocab, "positions": int(greedy.numel())}


def main():
    p = argparse.ArgumentParser(description="Train the demo drafter on the target's own generations.")
    p.add_argument("--target", required=True, help="gpt.pt with gpt_config.json next to it")
    p.add_argument("--out", required=True, help="output drafter directory")
    p.add_argument("--generations", type=int, default=2048)
    p.add_argument("--cfg-scale", type=float, default=3.0)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    target, _ = load_demo_target(a.target)
    data = collect_generations(target, a.generations, cfg_scale=a.cfg_scale, seed=a.seed)
    held_out = collect_generations(target, 256, cfg_scale=a.cfg_scale, seed=a.seed + 10_000)
    drafter, summary = train_drafter(target, data, steps=a.steps, seed=a.seed)
    print(summary, evaluate_drafter(drafter, target, held_out, a.cfg_scale))
    save_drafter(drafter, a.out, fmt="safetensors")


if __name__ == "__main__":
    main()
