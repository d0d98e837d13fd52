"""The layers both model families share (LlamaGen, the Chameleon family): RMSNorm, the gated MLP,
attention over [cache, new tokens], the layer runner, random initialisation. Each family's module
keeps what is its own (parameter names, RoPE, qk-norm, block order) and builds on these.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """Statistics in fp32 whatever the model dtype (both families' public code does this)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class GatedMLP(nn.Module):
    """The SiLU-gated MLP without biases, down(silu(gate(x)) * up(x)). `names`: the family's names
    of the gate, up and down projections, which its checkpoints' parameter names follow."""

    def __init__(self, dim, hidden, names):
        super().__init__()
        self.names = names
        for name, (fan_in, fan_out) in zip(names, ((dim, hidden), (dim, hidden), (hidden, dim))):
            setattr(self, name, nn.Linear(fan_in, fan_out, bias=False))

    def forward(self, x):
        gate, up, down = (getattr(self, name) for name in self.names)
        return down(F.silu(gate(x)) * up(x))


def attend(q, past_k, past_v, k, v, mask):
    """Softmax attention over [cache, new] without concatenating them: a concatenation would copy
    the whole cache every step in the exported graph. Scores are computed per part and joined
    (they are only [T, P + T]), softmax in fp32; query heads are grouped by KV head, so
    grouped-query attention never repeats the cache either.
    q [B, H, T, hd]; caches [B, Hkv, P, hd]; k, v [B, Hkv, T, hd]; mask bool [B, 1, T, P + T]."""
    B, H, T, hd = q.shape
    Hkv, P = past_k.shape[1], past_k.shape[2]
    grouped = q.reshape(B, Hkv, (H // Hkv) * T, hd) * (1.0 / math.sqrt(hd))
    scores = torch.cat([grouped @ past_k.transpose(-1, -2), grouped @ k.transpose(-1, -2)], dim=-1)
    scores = scores.reshape(B, H, T, P + T).float().masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype).reshape(B, Hkv, (H // Hkv) * T, P + T)
    out = probs[..., :P] @ past_v + probs[..., P:] @ v
    return out.reshape(B, H, T, hd)


def run_layers(layers, x, inputs, past_keys, past_values, write_index, kv):
    """x through every layer, each called as layer(x, *inputs, past_k, past_v, write_index, kv)
    (inputs: the family's position encoding and the mask). Returns x and the cache form's
    outputs (kv.outputs)."""
    keys, values = [], []
    for layer, past_k, past_v in zip(layers, past_keys, past_values):
        x, k, v = layer(x, *inputs, past_k, past_v, write_index, kv)
        keys.append(k)
        values.append(v)
    return (x, *kv.outputs(keys, values))


def init_random(model, seed=0, std=0.02):
    """Deterministic random weights (tests, timing, the demo's starting point): norm weights near
    1 and norm biases (qk-norm) near 0, so activations stay in a trained model's range; an
    unconditional caption buffer gets unit-scale rows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("uncond_embedding"):
                b.copy_(torch.randn(b.shape, generator=gen) / math.sqrt(b.shape[-1]))
    return model


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())
