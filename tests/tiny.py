"""Tiny LlamaGen-shaped models and masks shared by the tests."""
import numpy as np
import torch

from lantern.export import llamagen


def tiny_args(model_type="c2i", **overrides):
    fields = dict(dim=32, n_layer=2, n_head=4, n_kv_head=None, vocab_size=64, num_classes=10,
                  block_size=16, model_type=model_type, caption_dim=24, multiple_of=16,
                  cls_token_num=1 if model_type == "c2i" else 6)
    fields.update(overrides)
    return llamagen.validate_config(llamagen.ModelArgs(**fields))


def tiny_target(model_type="c2i", seed=0, **overrides):
    return llamagen.init_random(llamagen.Transformer(tiny_args(model_type, **overrides)), seed=seed).eval()


def tiny_drafter(target, seed=1, **overrides):
    return llamagen.init_random(llamagen.Drafter(llamagen.DrafterArgs.for_target(target.args, **overrides)), seed=seed).eval()


def causal_mask(batch, length, past=0):
    """[B, 1, T, past + T] bool: every slot of the past plus causal over the new tokens."""
    new = np.tril(np.ones((length, length), dtype=bool))
    full = np.concatenate([np.ones((length, past), dtype=bool), new], axis=1)
    return torch.from_numpy(np.broadcast_to(full, (batch, 1, length, past + length)).copy())


def positions(batch, start, length):
    return torch.arange(start, start + length).expand(batch, length)
