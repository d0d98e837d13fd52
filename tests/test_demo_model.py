"""The shipped demo model (export/demo_model) loads through the real loaders and works: the VQ
decodes target generations, the classifier recognises real images, the drafter agrees with the
target far above chance."""
import json
import os

import numpy as np
import pytest
import torch

from lantern.export.checkpoints import detect_format, load_drafter
from lantern.export.vq import load_vq
from lantern.runtime.png import encode_png, to_uint8
from lantern.tools.train import data as demo_data
from lantern.tools.train.classifier import accuracy, load_classifier
from lantern.tools.train.demo import DEMO_DIR, load_demo
from lantern.tools.train.drafter import collect_generations, evaluate_drafter
from lantern.tools.train.target import generate, load_demo_target


@pytest.fixture(scope="module")
def demo():
    # Small per-token work: one thread is fastest, and far faster than two on a busy 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_demo()
    torch.set_num_threads(threads)


def test_artefacts_load_through_the_real_loaders():
    vq, vq_info = load_vq(os.path.join(DEMO_DIR, "vq.pt"))
    target, info = load_demo_target(os.path.join(DEMO_DIR, "gpt.pt"))
    drafter, _ = load_drafter(os.path.join(DEMO_DIR, "drafter"), target.args)
    classifier = load_classifier(os.path.join(DEMO_DIR, "classifier.safetensors"))
    assert detect_format(os.path.join(DEMO_DIR, "vq.pt")) == "vq"
    assert detect_format(os.path.join(DEMO_DIR, "gpt.pt")) == "llamagen-pt"
    assert detect_format(os.path.join(DEMO_DIR, "drafter")) == "drafter"
    assert info["format"] == "llamagen-pt" and info["weights"] == "model"
    a = target.args
    assert (a.vocab_size, a.num_classes, a.block_size) == (vq.config.codebook_size, demo_data.NUM_CLASSES, 64)
    assert a.n_layer >= 4 and a.class_dropout_prob > 0
    assert vq_info["config"]["codebook_l2_norm"] and demo_data.IMAGE_SIZE // vq.config.downsample == a.grid_size
    assert drafter.args.dim == a.dim and drafter.args.vocab_size == a.vocab_size
    assert classifier.class_names == list(demo_data.CLASS_NAMES)


def test_shipped_size_is_small():
    total = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(DEMO_DIR) for f in files)
    assert total <= 30 * 2**20


def test_vq_decodes_a_greedy_target_generation(demo):
    vq, target = demo["vq"], demo["target"]
    tokens = generate(target, torch.tensor([0, 7]), cfg_scale=3.0, temperature=0)
    assert tokens.shape == (2, 64) and int(tokens.min()) >= 0 and int(tokens.max()) < vq.config.codebook_size
    assert torch.equal(tokens, generate(target, torch.tensor([0, 7]), cfg_scale=3.0, temperature=0))
    with torch.no_grad():
        images = vq.decode_codes(tokens.view(2, 8, 8))
    assert images.shape == (2, 3, 32, 32) and torch.isfinite(images).all()
    assert images.abs().max() < 1.5 and images.std() > 0.1  # an image, not a flat or exploded field
    png = encode_png(to_uint8(images[0].numpy(), layout="chw"))
    assert png.startswith(b"\x89PNG")


def test_classifier_recognises_real_images(demo):
    classifier = demo["classifier"]
    images, labels = demo_data.make_dataset(150, seed=4242)
    x = demo_data.to_tensor(images)
    assert accuracy(classifier, x, torch.from_numpy(labels)) >= 0.9  # chance is 1/15
    with torch.no_grad():
        features = classifier.features(x[:4])
    assert features.shape == (4, classifier.config["feature_dim"]) and torch.isfinite(features).all()


def test_drafter_top1_agrees_with_the_target(demo):
    target, drafter = demo["target"], demo["drafter"]
    data = collect_generations(target, 15, cfg_scale=3.0, seed=777)
    agreement = evaluate_drafter(drafter, target, data, cfg_scale=3.0)
    # Chance is 1/vocab (0.4%); on 300 held-out generations the shipped drafter agrees with the
    # target's greedy choice at 24% of positions on CFG-combined logits (36% per half).
    assert agreement["top1_cfg"] > 0.10
    assert agreement["top1_cond"] > 0.15
    assert agreement["top5_cfg"] > agreement["top1_cfg"]


def test_metrics_and_card_describe_the_shipped_files():
    with open(os.path.join(DEMO_DIR, "metrics.json")) as f:
        metrics = json.load(f)
    assert metrics["classifier"]["held_out_accuracy"] > 0.9
    assert metrics["drafter"]["agreement"]["top1_cfg"] > 10 * metrics["drafter"]["agreement"]["chance"]
    card = open(os.path.join(DEMO_DIR, "MODEL_CARD.md")).read()
    assert "python -m lantern.tools.train.demo" in card
    assert np.isclose(metrics["sizes_mb"]["total"], sum(v for k, v in metrics["sizes_mb"].items() if k != "total"))
