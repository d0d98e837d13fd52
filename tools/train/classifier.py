"""A small CNN classifier of the demo classes, for the quality harness (class accuracy of generated
images, and a Fréchet distance on its penultimate features).

Files: `classifier.safetensors` (state dict) and `classifier.json` next to it (architecture and
class names). Plain ops only (Conv, ReLU, MaxPool, mean, Linear), so it also exports to ONNX.

    model = load_classifier("export/demo_model/classifier.safetensors")
    logits = model(images)          # images [B, 3, H, W] in [-1, 1]
    feats = model.features(images)  # [B, feature_dim]
"""
import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from lantern.export.checkpoints import load_strict
from lantern.export.safeload import load_state_file
from lantern.runtime.errors import LanternError
from lantern.tools.train import data as demo_data

ARCHITECTURE = "lantern-demo-cnn"


class Classifier(nn.Module):
    """conv-conv-pool (w), conv-conv-pool (2w), conv (4w), global average, fc -> features, fc -> logits."""

    def __init__(self, num_classes, width=32, feature_dim=128):
        super().__init__()
        w = width
        self.convs = nn.Sequential(
            nn.Conv2d(3, w, 3, padding=1), nn.ReLU(), nn.Conv2d(w, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * w, 4 * w, 3, padding=1), nn.ReLU())
        self.fc = nn.Linear(4 * w, feature_dim)
        self.head = nn.Linear(feature_dim, num_classes)

    def features(self, images):
        """images [B, 3, H, W] in [-1, 1] -> penultimate features [B, feature_dim] (after ReLU)."""
        return F.relu(self.fc(self.convs(images).mean(dim=(2, 3))))

    def forward(self, images):
        return self.head(self.features(images))


def _augment(x, gen):
    """Light blur on half the batch and a little noise: generated images are softer than real ones."""
    blurred = F.avg_pool2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), 3, stride=1)
    pick = (torch.rand(len(x), 1, 1, 1, generator=gen) < 0.5).float()
    x = pick * (0.5 * x + 0.5 * blurred) + (1 - pick) * x
    return x + 0.03 * torch.randn(x.shape, generator=gen)


def train_classifier(images, labels, num_classes, *, steps=2000, batch_size=128, lr=2e-3, seed=0, log=print):
    """images float [N, 3, H, W] in [-1, 1], labels int64 [N] -> (model in eval mode, summary)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = Classifier(num_classes).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    start, ema = time.time(), None
    bar = tqdm(range(steps), desc="classifier", mininterval=10)
    for step in bar:
        idx = torch.randint(len(images), (batch_size,), generator=gen)
        loss = F.cross_entropy(model(_augment(images[idx], gen)), labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if (step + 1) % 100 == 0:
            bar.set_postfix(loss=f"{ema:.3f}")
            log(f"classifier step {step + 1}/{steps}: loss {ema:.4f}")
    model.eval()
    return model, {"steps": steps, "batch_size": batch_size, "lr": lr, "train_seconds": time.time() - start,
                   "final_train_loss": ema, "parameters": sum(p.numel() for p in model.parameters())}


@torch.no_grad()
def accuracy(model, images, labels, batch_size=512):
    hits = sum((model(images[i:i + batch_size]).argmax(-1) == labels[i:i + batch_size]).sum().item()
               for i in range(0, len(images), batch_size))
    return hits / len(images)


def _config_path(path):
    return os.path.splitext(os.fspath(path))[0] + ".json"


def save_classifier(model, path, class_names):
    from safetensors.torch import save_file

    config = {"architecture": ARCHITECTURE, "num_classes": model.head.out_features,
              "width": model.convs[0].out_channels, "feature_dim": model.fc.out_features,
              "image_size": demo_data.IMAGE_SIZE, "input_range": [-1.0, 1.0], "class_names": list(class_names)}
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.fspath(path))
    with open(_config_path(path), "w") as f:
        json.dump(config, f, indent=2)


def load_classifier(path):
    """classifier.safetensors (with classifier.json next to it) -> Classifier in eval mode;
    `model.class_names` lists the class names, `model.config` is the JSON."""
    config_file = _config_path(path)
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LanternError(f"{config_file}: cannot read the classifier description ({e})") from None
    if config.get("architecture") != ARCHITECTURE:
        raise LanternError(f"{config_file}: architecture {config.get('architecture')!r} is not {ARCHITECTURE!r}")
    model = Classifier(config["num_classes"], config["width"], config["feature_dim"])
    load_strict(model, load_state_file(path), os.fspath(path))
    model.class_names, model.config = config["class_names"], config
    return model


def main():
    p = argparse.ArgumentParser(description="Train the demo classifier on the procedural dataset.")
    p.add_argument("--out", required=True, help="output .safetensors (the .json goes next to it)")
    p.add_argument("--images", type=int, default=20000)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    images, labels = demo_data.make_dataset(a.images, seed=a.seed)
    model, summary = train_classifier(demo_data.to_tensor(images), torch.from_numpy(labels), demo_data.NUM_CLASSES,
                                      steps=a.steps, seed=a.seed)
    test, test_labels = demo_data.make_dataset(2000, seed=a.seed + 1000)
    print(summary, "held-out accuracy", accuracy(model, demo_data.to_tensor(test), torch.from_numpy(test_labels)))
    save_classifier(model, a.out, demo_data.CLASS_NAMES)


if __name__ == "__main__":
    main()
