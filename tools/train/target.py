"""Train the demo target: a scaled-down class-conditional LlamaGen GPT on the VQ codes of the dataset.

Next-token cross-entropy over the 64 image tokens after one class token, with LlamaGen's 10% class
dropout to the null class (row num_classes of the class table) so CFG works at sampling time.
Initialisation follows LlamaGen (normal(0, 0.02), zero output head). Also here: `generate`, the
KV-cached CFG sampler the demo pipeline, the drafter's data and the tests use.

    python -m lantern.tools.train.target --vq vq.pt --out gpt.pt
"""
import argparse
import json
import math
import os
import time
from argparse import Namespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from lantern.export.checkpoints import load_target, save_llamagen_pt
from lantern.export.llamagen import count_parameters, ModelArgs, Transformer, validate_config
from lantern.export.vq import load_vq
from lantern.tools.train import data as demo_data
from lantern.tools.train.vq import encode_images

CLASS_DROPOUT = 0.1


def demo_gpt_args(vocab_size, num_classes, grid=8, dim=192, n_layer=4, n_head=6):
    return validate_config(ModelArgs(dim=dim, n_layer=n_layer, n_head=n_head, vocab_size=vocab_size,
                                     num_classes=num_classes, class_dropout_prob=CLASS_DROPOUT,
                                     model_type="c2i", cls_token_num=1, block_size=grid * grid))


def init_weights(model, seed):
    """LlamaGen's initialisation: Linear and Embedding ~ N(0, 0.02), output head zero, norms one."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.copy_(0.02 * torch.randn(module.weight.shape, generator=gen))
        model.output.weight.zero_()
    return model


def causal_mask(batch, length):
    return torch.ones(length, length, dtype=torch.bool).tril().expand(batch, 1, length, length)


def sequence_forward(model, labels, codes):
    """Teacher-forced forward over [class, codes[:, :-1]] -> (logits, hidden) [B, T, ...]; the
    logits at index i predict codes[:, i]; hidden is the target's state after the final norm."""
    B, T = codes.shape
    x = torch.cat([model.embed_condition(labels), model.embed_tokens(codes[:, :-1])], dim=1)
    keys, values = model.empty_cache(B)
    logits, hidden, _, _ = model(x, torch.arange(T).expand(B, T), causal_mask(B, T), keys, values)
    return logits, hidden


def _lr(step, steps, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def train_target(codes, labels, args, *, steps=1500, batch_size=64, lr=1e-3, seed=0, log=print):
    """codes: int64 [N, grid*grid]; labels: int64 [N]. Returns (model in eval mode, summary)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = init_weights(Transformer(args), seed).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    start, ema = time.time(), None
    bar = tqdm(range(steps), desc="target", mininterval=10)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, lr, warmup=100)
        idx = torch.randint(len(codes), (batch_size,), generator=gen)
        y, cls = codes[idx], labels[idx].clone()
        cls[torch.rand(batch_size, generator=gen) < CLASS_DROPOUT] = args.num_classes  # CFG null class
        logits, _ = sequence_forward(model, cls, y)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab_size), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if (step + 1) % 100 == 0:
            bar.set_postfix(loss=f"{ema:.3f}")
            log(f"target step {step + 1}/{steps}: loss {ema:.4f}")
    model.eval()
    return model, {"steps": steps, "batch_size": batch_size, "lr": lr, "train_seconds": time.time() - start,
                   "final_train_loss": ema, "parameters": count_parameters(model)}


@torch.no_grad()
def evaluate_target(model, codes, labels, batch_size=256):
    """Mean next-token cross-entropy (nats) on held-out codes, with their true classes."""
    total = 0.0
    for i in range(0, len(codes), batch_size):
        logits, _ = sequence_forward(model, labels[i:i + batch_size], codes[i:i + batch_size])
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), codes[i:i + batch_size].reshape(-1),
                                 reduction="sum").item()
    return total / codes.numel()


# ---------------------------------------------------------------------------------------------
# Sampling (LlamaGen's generate.py semantics: CFG batch [cond; uncond], logits u + s (c - u),
# then temperature and top-k; the same token goes to both halves).


def sample_logits(logits, temperature, top_k, gen):
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=gen)[:, 0]


@torch.no_grad()
def generate(model, labels, *, cfg_scale=3.0, temperature=1.0, top_k=0, seed=0):
    """Class ids [B] -> image tokens [B, grid*grid]. temperature 0 is greedy; cfg_scale 1 skips CFG."""
    gen = torch.Generator().manual_seed(seed)
    B, use_cfg = len(labels), cfg_scale != 1.0
    cond = torch.cat([labels, model.unconditional(B)]) if use_cfg else labels
    x = model.embed_condition(cond)
    keys, values = model.empty_cache(len(cond))
    tokens = []
    for t in range(model.args.block_size):
        mask = torch.ones(len(cond), 1, 1, keys.shape[3] + 1, dtype=torch.bool)
        logits, _, k, v = model(x, torch.full((len(cond), 1), t), mask, keys, values)
        keys, values = torch.cat([keys, k], dim=3), torch.cat([values, v], dim=3)
        logits = logits[:, -1]
        if use_cfg:
            logits = logits[B:] + cfg_scale * (logits[:B] - logits[B:])
        token = sample_logits(logits, temperature, top_k, gen)
        tokens.append(token)
        x = model.embed_tokens(torch.cat([token, token]) if use_cfg else token)[:, None]
    return torch.stack(tokens, dim=1)


# ---------------------------------------------------------------------------------------------
# Files: LlamaGen's .pt plus the ModelArgs as a config file (the model is no released size, so
# load_target needs it: load_target(gpt.pt, config_file=gpt_config.json)).


def save_target(model, path, image_size, downsample_size):
    a = model.args
    namespace = Namespace(gpt_model=None, gpt_type="c2i", image_size=image_size, downsample_size=downsample_size,
                          num_classes=a.num_classes, cls_token_num=a.cls_token_num, vocab_size=a.vocab_size,
                          class_dropout_prob=a.class_dropout_prob)
    save_llamagen_pt(model, path, key="model", args_namespace=namespace)
    with open(config_path(path), "w") as f:
        json.dump(a.to_dict(), f, indent=2)


def config_path(gpt_path):
    return os.path.join(os.path.dirname(os.path.abspath(gpt_path)), "gpt_config.json")


def load_demo_target(path):
    model, info = load_target(path, config_file=config_path(path))
    return model, info


def main():
    p = argparse.ArgumentParser(description="Train the demo LlamaGen target on VQ codes of the demo dataset.")
    p.add_argument("--vq", required=True)
    p.add_argument("--out", required=True, help="output .pt (LlamaGen format); gpt_config.json goes next to it")
    p.add_argument("--images", type=int, default=30000)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    vq, _ = load_vq(a.vq)
    images, labels = demo_data.make_dataset(a.images, seed=a.seed)
    codes = encode_images(vq, demo_data.to_tensor(images)).flatten(1)
    args = demo_gpt_args(vq.config.codebook_size, demo_data.NUM_CLASSES, grid=demo_data.IMAGE_SIZE // vq.config.downsample)
    model, summary = train_target(codes, torch.from_numpy(labels), args, steps=a.steps, seed=a.seed)
    print(summary)
    save_target(model, a.out, demo_data.IMAGE_SIZE, vq.config.downsample)


if __name__ == "__main__":
    main()
