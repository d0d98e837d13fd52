"""The demo model embedded exactly in a released LlamaGen shape (GPT-B, GPT-L, ...): the demo's
trained behaviour at a real model's cost.

The demo target (dim d, heads of width hd, vocabulary 256) and its drafter are written into the
corner of a larger model's matrices, zeros elsewhere, with the compensations that keep the function
identical (ratio r = D / d, head widths HD = m * hd):
  - residual dims 0..d-1 carry the demo's stream; the rest stay exactly 0 (every matrix writing the
    stream has zero rows there, the embeddings zero columns);
  - RMSNorm averages over D dims, so mean_D = mean_d / r: eps / r and gains / sqrt(r) give the same
    normalised values;
  - attention scales by 1/sqrt(HD), not 1/sqrt(hd): the query rows are multiplied by sqrt(m);
  - LlamaGen's 2D RoPE gives pair p of an hd-wide head the frequency base^(-4p/hd) on the row half
    (p < hd/4) and the same on the column half; an HD-wide head's pair m*p has that frequency, so
    the demo's pair p goes to pair m*p of its half (checked against llamagen.rope_table);
  - head h of the demo is head h of the larger model (its other heads and FFN units are zero);
  - layers past the demo's are identities: their output projections (wo, w2) are zero;
  - the vocabulary grows to the shape's 16384 ids: the head computes them all (zero rows), and the
    config's image_codes (the demo's 256) keeps them from being sampled or drafted.
Dense kernels do the same work on zeros, so the engine costs what the shape costs and decodes what
the demo decodes, drafts and acceptance included. The demo's VQ is used as it is.

    paths = write_embedded(demo_dir, "GPT-B", out_dir)   # real checkpoint formats, ~10 s for GPT-B
"""
import argparse
import json
import math
import os
import sys
import time

import torch

from lantern.export import checkpoints, llamagen
from lantern.runtime.errors import LanternError

VOCAB = 16384  # LlamaGen's image vocabulary (its VQ-16 codebook)
DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_model")  # package data


def demo_sources(model_dir):
    """The demo's checkpoint paths {target, target_config, drafter, vq}, all present."""
    files = {"target": "gpt.pt", "target_config": "gpt_config.json", "drafter": "drafter", "vq": "vq.pt"}
    paths = {k: os.path.join(model_dir, v) for k, v in files.items()}
    missing = [v for v in paths.values() if not os.path.exists(v)]
    if missing:
        raise LanternError(f"{model_dir}: the demo model is incomplete (missing {', '.join(missing)}); "
                           f"retrain it with `python -m lantern.tools.train.demo --out {model_dir}`")
    return paths


def positions(demo_args, big_args):
    """Where each coordinate of the demo's head goes in the larger head: index [hd] -> [0, HD),
    or a LanternError saying why the construction does not hold for these shapes."""
    hd, HD = demo_args.head_dim, big_args.head_dim
    if HD % hd:
        raise LanternError(f"head width {HD} is not a multiple of the demo's {hd}: its RoPE frequencies are not "
                           f"the demo's")
    m, quarter, big_quarter = HD // hd, hd // 4, HD // 4
    pairs = [m * p if p < quarter else big_quarter + m * (p - quarter) for p in range(hd // 2)]
    small, large = llamagen.rope_table(demo_args), llamagen.rope_table(big_args)
    if demo_args.rope_base != big_args.rope_base or not torch.allclose(small, large[:, pairs], atol=1e-6):
        raise LanternError("the larger head's RoPE table does not hold the demo's frequencies")
    return torch.tensor([2 * q + e for q in pairs for e in (0, 1)])


def embedded_config(demo_args, shape):
    """ModelArgs of `shape` (a GPT_CONFIGS name) holding the demo: its grid, classes, RoPE base,
    the shape's layers, heads and width, vocabulary 16384 with the demo's codes as image_codes."""
    if shape not in llamagen.GPT_CONFIGS:
        raise LanternError(f"unknown shape {shape!r}; valid: {', '.join(llamagen.GPT_CONFIGS)}")
    n_layer, n_head, dim = llamagen.GPT_CONFIGS[shape]
    return embedded_args(demo_args, n_layer, n_head, dim, shape=shape)


def embedded_args(demo_args, n_layer, n_head, dim, vocab_size=VOCAB, shape=None):
    """ModelArgs of any larger shape holding the demo (embedded_config for a named one), or a
    LanternError saying why the construction does not hold."""
    a = demo_args
    shape = shape or f"dim {dim}, {n_layer} layers, {n_head} heads"
    ratio = dim / a.dim
    big = llamagen.ModelArgs(
        dim=dim, n_layer=n_layer, n_head=n_head, rope_base=a.rope_base, norm_eps=a.norm_eps / ratio,
        num_classes=a.num_classes, class_dropout_prob=a.class_dropout_prob, model_type=a.model_type,
        vocab_size=max(vocab_size, a.vocab_size), cls_token_num=a.cls_token_num, block_size=a.block_size,
        image_codes=a.codes)
    llamagen.validate_config(big, source=shape)
    too_small = [f"{what} {b} < {s}" for what, b, s in (
        ("dim", big.dim, a.dim), ("layers", big.n_layer, a.n_layer), ("heads", big.n_head, a.n_head),
        ("kv heads", big.kv_heads, a.kv_heads), ("FFN", big.ffn_hidden, a.ffn_hidden)) if b < s]
    if too_small or a.model_type != "c2i" or a.n_head != a.kv_heads:
        raise LanternError(f"{shape} cannot hold the demo model exactly: "
                           + (", ".join(too_small) or "only a c2i target without grouped-query attention embeds"))
    try:
        positions(a, big)
    except LanternError as e:
        raise LanternError(f"{shape} cannot hold the demo model exactly: {e}") from None
    return big


def _corner(big, small, rows=None, cols=None):
    """big[rows, cols] = small, index lists or None (the first rows / columns)."""
    rows = torch.arange(small.shape[0]) if rows is None else rows
    if small.dim() == 1:
        big[rows] = small
        return
    cols = torch.arange(small.shape[1]) if cols is None else cols
    big[rows[:, None], cols[None, :]] = small


def _head_index(heads, width, big_width, pos):
    """Rows of `heads` heads of `width` coordinates in a layout of `big_width`-wide heads."""
    return torch.cat([h * big_width + pos for h in range(heads)])


def _embed_block(big, small, a, b, pos):
    """One decoder block of the demo (args a) into one of the larger model (args b)."""
    attn, ffn = small.attention, small.feed_forward
    ratio = b.dim / a.dim
    q, k, v = attn.wqkv.weight.split([a.n_head * a.head_dim, a.kv_heads * a.head_dim, a.kv_heads * a.head_dim])
    q_rows = _head_index(a.n_head, a.head_dim, b.head_dim, pos)
    kv_rows = _head_index(a.kv_heads, a.head_dim, b.head_dim, pos)
    w = big.attention.wqkv.weight
    _corner(w, q * math.sqrt(b.head_dim / a.head_dim), q_rows)  # 1/sqrt(HD) in place of 1/sqrt(hd)
    _corner(w, k, b.n_head * b.head_dim + kv_rows)
    _corner(w, v, (b.n_head + b.kv_heads) * b.head_dim + kv_rows)
    _corner(big.attention.wo.weight, attn.wo.weight, None, q_rows)
    for name in ("w1", "w3", "w2"):
        _corner(getattr(big.feed_forward, name).weight, getattr(ffn, name).weight)
    for name in ("attention_norm", "ffn_norm"):
        norm = getattr(small, name)
        if isinstance(norm, llamagen.RMSNorm):
            _corner(getattr(big, name).weight, norm.weight / math.sqrt(ratio))


def _zeros(cls, args):
    """cls(args) with every parameter 0, without the random initialisation (seconds at GPT-B)."""
    with torch.device("meta"):
        module = cls(args)
    module = module.to_empty(device="cpu")
    for p in module.parameters():
        p.zero_()
    return module


@torch.no_grad()
def embed_target(demo, big_args):
    """The demo Transformer inside a Transformer of big_args (embedded_config), fp32."""
    a, b = demo.args, big_args
    demo = demo.float()
    pos = positions(a, b)
    big = _zeros(llamagen.Transformer, b)
    big.rope = llamagen.rope_table(b)
    _corner(big.tok_embeddings.weight, demo.tok_embeddings.weight)
    _corner(big.cls_embedding.embedding_table.weight, demo.cls_embedding.embedding_table.weight)
    _corner(big.output.weight, demo.output.weight)
    _corner(big.norm.weight, demo.norm.weight / math.sqrt(b.dim / a.dim))
    for small, layer in zip(demo.layers, big.layers):
        _embed_block(layer, small, a, b, pos)
    return big.eval()


@torch.no_grad()
def embed_drafter(demo_drafter, demo_args, big_args):
    """The demo's drafter widened to the larger target (big_args): same layout, fp32."""
    d, b = demo_drafter.args, big_args
    demo_drafter = demo_drafter.float()
    ratio = b.dim / d.dim
    args = llamagen.DrafterArgs(dim=b.dim, n_head=b.n_head, n_kv_head=None, intermediate_size=b.ffn_hidden,
                                vocab_size=b.vocab_size, norm_eps=d.norm_eps / ratio, fc_bias=d.fc_bias)
    if d.intermediate_size > args.intermediate_size or (d.dim, d.n_head, d.kv_heads) != (demo_args.dim,) + (
            demo_args.n_head,) * 2:
        raise LanternError("the demo drafter's FFN or heads do not fit the larger shape (it must have the target's "
                           "width and heads, without grouped-query attention)")
    big = _zeros(llamagen.Drafter, args)
    _corner(big.embed_tokens.weight, demo_drafter.embed_tokens.weight)
    fc = demo_drafter.fc.weight  # [d, 2d]: token embedding half, then target hidden half
    _corner(big.fc.weight, fc[:, :d.dim])
    _corner(big.fc.weight, fc[:, d.dim:], None, b.dim + torch.arange(d.dim))
    if d.fc_bias:
        _corner(big.fc.bias, demo_drafter.fc.bias)
    _embed_block(big.layers[0], demo_drafter.layers[0], d.block_args(), args.block_args(),
                 positions(demo_args, b))
    return big.eval()


def write_embedded(demo_dir, shape, out):
    """Write the demo (a directory as export/demo_model) embedded in `shape` (a GPT_CONFIGS name,
    or embedded_args' keywords as a dict) to `out`: gpt.pt + gpt_config.json (LlamaGen .pt),
    drafter/ (LANTERN layout); returns the paths as demo_sources does, the VQ being the demo's."""
    src = demo_sources(demo_dir)
    target, _ = checkpoints.load_target(src["target"], config_file=src["target_config"])
    drafter, _ = checkpoints.load_drafter(src["drafter"], target.args)
    big_args = embedded_config(target.args, shape) if isinstance(shape, str) else embedded_args(target.args, **shape)
    os.makedirs(out, exist_ok=True)
    paths = {"target": os.path.join(out, "gpt.pt"), "target_config": os.path.join(out, "gpt_config.json"),
             "drafter": os.path.join(out, "drafter"), "vq": src["vq"]}
    big = embed_target(target, big_args)
    namespace = argparse.Namespace(gpt_model=shape if isinstance(shape, str) else None, gpt_type="c2i",
                                   vocab_size=big_args.vocab_size, num_classes=big_args.num_classes,
                                   cls_token_num=big_args.cls_token_num, class_dropout_prob=big_args.class_dropout_prob)
    checkpoints.save_llamagen_pt(big, paths["target"], args_namespace=namespace)
    with open(paths["target_config"], "w") as f:
        json.dump(big_args.to_dict(), f, indent=2)
    del big
    checkpoints.save_drafter(embed_drafter(drafter, target.args, big_args), paths["drafter"], fmt="safetensors")
    return paths


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m lantern.export.embed", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="GPT-B", help="a LlamaGen config name (default GPT-B)")
    p.add_argument("--model-dir", default=DEMO_DIR, help="the demo checkpoints (default: the bundled ones)")
    p.add_argument("--out", required=True, help="directory for the embedded checkpoints")
    args = p.parse_args(argv)
    try:
        t = time.perf_counter()
        paths = write_embedded(args.model_dir, args.shape, args.out)
    except LanternError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {paths['target']}, {paths['target_config']} and {paths['drafter']} "
          f"in {time.perf_counter() - t:.1f} s (VQ: {paths['vq']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
