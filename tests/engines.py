"""Tiny engine directories exported through the real CLI from checkpoints in the real formats."""
import json
import os

import numpy as np
import torch

from lantern.export import checkpoints, cli, vq
from tiny import tiny_drafter, tiny_target


def tiny_vq(vocab, seed=0):
    torch.manual_seed(seed)
    config = vq.VQConfig(codebook_size=vocab, codebook_embed_dim=8, z_channels=32, ch=32, num_res_blocks=1,
                         encoder_ch_mult=(1, 1, 2), decoder_ch_mult=(1, 1, 2))
    return vq.VQModel(config).eval()


def build_engine(root, model_type="c2i", tree="mc_sim_7b_63", drafter=True, with_vq=True, block_size=36,
                 vocab=64, extra=()):
    """Write a tiny target (+ drafter, VQ) to disk and export it. Returns the engine directory.
    c2i targets are written as LlamaGen .pt files with a config JSON, t2i targets in LANTERN's
    Hugging Face layout, so the session's engines go through both loaders."""
    root = str(root)
    target = tiny_target(model_type, n_kv_head=2, block_size=block_size, vocab_size=vocab)
    src = os.path.join(root, f"src-{model_type}")
    os.makedirs(src, exist_ok=True)
    out = os.path.join(root, f"engine-{model_type}")
    if model_type == "c2i":
        a = target.args
        config = os.path.join(src, "config.json")
        with open(config, "w") as f:
            json.dump({k: getattr(a, k) for k in ("dim", "n_layer", "n_head", "n_kv_head", "vocab_size", "num_classes",
                                                   "block_size", "multiple_of", "cls_token_num", "model_type")}, f)
        checkpoints.save_llamagen_pt(target, os.path.join(src, "c2i.pt"))
        argv = ["onnx", "--target", os.path.join(src, "c2i.pt"), "--config", config, "--out", out]
    else:
        checkpoints.save_hf_target(target, os.path.join(src, "target"))
        argv = ["onnx", "--target", os.path.join(src, "target"), "--out", out]
    if drafter:
        checkpoints.save_drafter(tiny_drafter(target), os.path.join(src, "drafter"))
        argv += ["--drafter", os.path.join(src, "drafter"), "--tree", tree, "--candidates", "16"]
    if with_vq:
        vq.save_vq(tiny_vq(vocab), os.path.join(src, "vq.pt"))
        argv += ["--vq", os.path.join(src, "vq.pt")]
    assert cli.main(argv + ["--no-progress"] + list(extra)) == 0
    return out


def captions(n, cls=6, dim=24, seed=1):
    rng = np.random.default_rng(seed)
    mask = np.ones((n, cls), dtype=bool)
    for i in range(n):
        mask[i, : i % 3] = False  # left padding
    return rng.normal(size=(n, cls, dim)).astype(np.float32), mask


def manifest(directory):
    with open(os.path.join(directory, "manifest.json")) as f:
        return json.load(f)
