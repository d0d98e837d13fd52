"""Tiny LlamaGen-shaped models and masks shared by the tests.

The models are peaked (PEAKED_STD): with init_random's default std 0.02 a tiny target is nearly
uniform (max p 0.02 over 64 tokens) and attention is flat, so a position, RoPE-row or CFG-row bug
moves logits by ~1e-3 and flips no greedy token (issue 30; tests/test_canary.py measures it). The
drafter imitates its target (imitate_target), so speculative steps accept drafts without training.
OLD_STD builds the models tests/data/regression_v1.npz was made with."""
import numpy as np
import torch

from lantern.export import llamagen

PEAKED_STD = 0.3  # target max p ~0.3, a one-position shift flips ~30% of greedy argmaxes (test_canary)
OLD_STD = 0.02  # init_random's default, the models before issue 30
# Chameleon family (qk-norm keeps its attention position-sensitive at any std): token embeddings
# ten times the layers' init, so a drafter imitating the first layer agrees with the two-layer
# target (its top-10 holds the next token ~75% of the time, ~10% at a plain std 0.3), and the
# head scaled up for peaked logits (max p ~0.2 over 8192 codes; argmaxes do not change)
CHAMELEON_STD, CHAMELEON_EMBEDDING_RMS, CHAMELEON_HEAD_SCALE = 0.1, 1.0, 4.0


def tiny_args(model_type="c2i", **overrides):
    fields = dict(dim=32, n_layer=2, n_head=4, n_kv_head=None, vocab_size=64, num_classes=10,
                  block_size=16, model_type=model_type, caption_dim=24, multiple_of=16,
                  cls_token_num=1 if model_type == "c2i" else 6)
    fields.update(overrides)
    return llamagen.validate_config(llamagen.ModelArgs(**fields))


def tiny_target(model_type="c2i", seed=0, std=PEAKED_STD, **overrides):
    return llamagen.init_random(llamagen.Transformer(tiny_args(model_type, **overrides)), seed=seed, std=std).eval()


@torch.no_grad()
def tiny_chameleon_target(config, seed=0):
    """A peaked Chameleon-family target (chameleon.ChameleonTarget) for config."""
    from lantern.export import chameleon

    target = chameleon.init_random(chameleon.ChameleonTarget(config), seed=seed, std=CHAMELEON_STD).eval()
    target.embed_tokens.weight.mul_(CHAMELEON_EMBEDDING_RMS / CHAMELEON_STD)
    target.lm_head.weight.mul_(CHAMELEON_HEAD_SCALE)
    return target


def tiny_drafter(target, seed=1, imitate=True, **overrides):
    """A drafter for target; imitate (and shapes as the target's): one that agrees with it often
    (imitate_target), else init_random's."""
    drafter = llamagen.init_random(llamagen.Drafter(llamagen.DrafterArgs.for_target(target.args, **overrides)),
                                   seed=seed).eval()
    return imitate_target(drafter, target) if imitate else drafter


@torch.no_grad()
def imitate_target(drafter, target):
    """Make drafter approximate the target's next prediction without training: fc passes the
    token embedding through (drafter embeddings = the target's) beside its random mix of the
    target's hidden state (kept, so draft0's hidden states still matter), and the drafter's
    block is the target's first layer. LlamaGen's drafter block has no input norm, so the
    target's norm (its weight over the embeddings' RMS) is folded into the copied wqkv. Chameleon
    drafters (chameleon.ChameleonDrafter) take the whole first layer, norms included."""
    llama = isinstance(target, llamagen.Transformer)
    dim = drafter.fc.weight.shape[0]
    drafter.embed_tokens.weight.copy_(target.tok_embeddings.weight if llama else target.embed_tokens.weight)
    drafter.fc.weight[:, :dim] = torch.eye(dim)
    if drafter.fc.bias is not None:
        drafter.fc.bias.zero_()
    if not llama:
        drafter.layers[0].load_state_dict(target.layers[0].state_dict())
        return drafter
    source, block = target.layers[0], drafter.layers[0]
    block.load_state_dict({k: v for k, v in source.state_dict().items() if not k.startswith("attention_norm")})
    rms = target.tok_embeddings.weight.pow(2).mean().sqrt()
    block.attention.wqkv.weight.mul_(source.attention_norm.weight[None, :] / rms)
    return drafter


def causal_mask(batch, length, past=0):
    """[B, 1, T, past + T] bool: every slot of the past plus causal over the new tokens."""
    new = np.tril(np.ones((length, length), dtype=bool))
    full = np.concatenate([np.ones((length, past), dtype=bool), new], axis=1)
    return torch.from_numpy(np.broadcast_to(full, (batch, 1, length, past + length)).copy())


def positions(batch, start, length):
    return torch.arange(start, start + length).expand(batch, length)
