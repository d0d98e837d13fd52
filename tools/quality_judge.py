"""The quality harness's judge (lantern-run quality, tools/quality.py): a classifier's verdict on
generated images (its predicted class and penultimate features; the demo model's classifier by
default) and the Fréchet distance between feature sets, on the reference set's top principal
directions.
"""
import os

import numpy as np


def frechet_distance(a, b):
    """Fréchet distance between Gaussians fitted to feature sets a [n, d] and b [m, d]:
    |mu_a - mu_b|^2 + tr(Sa + Sb - 2 (Sa^1/2 Sb Sa^1/2)^1/2), numpy only (symmetric square roots)."""
    mu_a, mu_b = a.mean(0), b.mean(0)
    sa, sb = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    w, v = np.linalg.eigh(sa)
    root_a = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    middle = np.linalg.eigvalsh(root_a @ sb @ root_a)
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(sa) + np.trace(sb) - 2 * np.sqrt(np.clip(middle, 0, None)).sum())


def project(features, reference, dims):
    """Features on the reference set's top principal directions: with a few hundred samples a
    128-dim covariance is mostly estimation noise, and the Fréchet distance with it."""
    mean = reference.mean(0)
    _, _, vt = np.linalg.svd(reference - mean, full_matrices=False)
    return (features - mean) @ vt[:dims].T


def load_judge(path=None):
    """(classifier, its path): --classifier, else the demo model's (tools/train/classifier.py)."""
    from lantern.tools import demo
    from lantern.tools.train.classifier import load_classifier

    path = path or os.path.join(demo.DEMO_DIR, "classifier.safetensors")
    return load_classifier(path), path


def classify(classifier, images):
    """uint8 images [N, H, W, 3] -> (predicted classes [N], penultimate features [N, d] float64)."""
    import torch

    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1
    with torch.no_grad():
        logits, feats = classifier(x), classifier.features(x)
    return logits.argmax(-1).numpy(), feats.numpy().astype(np.float64)
