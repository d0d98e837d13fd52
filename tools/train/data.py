"""Procedural class-conditional images for the demo model: coloured shapes on textured backgrounds.

No downloads: every image is drawn from a seed. 15 classes = 5 shapes x 3 colours; class id =
shape_index * 3 + colour_index, named like "red circle". Each image jitters the shape's position,
size, rotation and hue, and sits on a desaturated background made of a random gradient, blurred
low-frequency noise and a little pixel noise, so the VQ and the GPT have texture to model while a
person (and a small CNN) still tells the classes apart at a glance.

    images, labels = make_dataset(1000, seed=0)   # uint8 [N, 32, 32, 3], int64 [N]
    x = to_tensor(images)                         # float [N, 3, 32, 32] in [-1, 1]
"""
import numpy as np
from lantern.runtime.png import image_grid, write_png

SHAPES = ("circle", "square", "triangle", "cross", "ring")
COLOURS = {"red": (0.90, 0.12, 0.10), "green": (0.10, 0.72, 0.18), "blue": (0.12, 0.28, 0.95)}
CLASS_NAMES = tuple(f"{c} {s}" for s in SHAPES for c in COLOURS)
NUM_CLASSES = len(CLASS_NAMES)
IMAGE_SIZE = 32


def class_name(label):
    return CLASS_NAMES[int(label)]


# ---------------------------------------------------------------------------------------------
# Signed distances (negative inside) of the shapes, centred at the origin, "radius" r [N, 1, 1].


def _box(x, y, half_w, half_h):
    dx, dy = np.abs(x) - half_w, np.abs(y) - half_h
    outside = np.hypot(np.maximum(dx, 0), np.maximum(dy, 0))
    return outside + np.minimum(np.maximum(dx, dy), 0)


def _triangle(x, y, r):
    # Equilateral triangle pointing up (image y grows downwards), circumradius r.
    k = np.sqrt(3.0)
    y = -y + 0.25 * r  # centre the triangle's bounding box
    side = r * k / 2 * 1.15
    x = np.abs(x) - side
    y = y + side / k
    flip = x + k * y > 0
    x, y = np.where(flip, (x - k * y) / 2, x), np.where(flip, (-k * x - y) / 2, y)
    x = x - np.clip(x, -2 * side, 0)
    return -np.hypot(x, y) * np.sign(y)


def _sdf(shape, x, y, r):
    if shape == "circle":
        return np.hypot(x, y) - r
    if shape == "ring":
        return np.abs(np.hypot(x, y) - 0.78 * r) - 0.30 * r
    if shape == "square":
        return _box(x, y, 0.82 * r, 0.82 * r)
    if shape == "triangle":
        return _triangle(x, y, 1.1 * r)
    if shape == "cross":
        return np.minimum(_box(x, y, r, 0.32 * r), _box(x, y, 0.32 * r, r))
    raise ValueError(f"unknown shape {shape!r}")


# ---------------------------------------------------------------------------------------------
# Drawing


def _smooth_noise(rng, n, size, cells):
    """Bilinear upsampling of a random cells x cells grid: [n, size, size] in about [-1, 1]."""
    coarse = rng.uniform(-1, 1, (n, cells + 1, cells + 1))
    t = np.linspace(0, cells, size, endpoint=False) + 0.5 * cells / size
    i = np.minimum(t.astype(int), cells - 1)
    f = t - i
    rows = coarse[:, i] * (1 - f)[None, :, None] + coarse[:, i + 1] * f[None, :, None]
    return rows[:, :, i] * (1 - f) + rows[:, :, i + 1] * f


def _draw(rng, labels, size):
    n = len(labels)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5

    # Background: a grey-ish tone, a random linear gradient, blotchy noise, fine grain.
    tone = rng.uniform(0.30, 0.80, (n, 1, 1, 1))
    tint = rng.uniform(-0.06, 0.06, (n, 1, 1, 3))
    angle = rng.uniform(0, 2 * np.pi, (n, 1, 1))
    gradient = 0.18 * ((np.cos(angle) * (xx - size / 2) + np.sin(angle) * (yy - size / 2)) / size)
    blotch = 0.10 * _smooth_noise(rng, n, size, 4)
    background = tone + tint + (gradient + blotch)[..., None]
    background = background + rng.normal(0, 0.025, (n, size, size, 3))

    # Foreground: jittered centre, size, rotation, hue and a soft shading gradient.
    scale = size / 32
    r = rng.uniform(7.0, 10.5, (n, 1, 1)) * scale
    cx = size / 2 + rng.uniform(-4.5, 4.5, (n, 1, 1)) * scale
    cy = size / 2 + rng.uniform(-4.5, 4.5, (n, 1, 1)) * scale
    theta = rng.uniform(-0.30, 0.30, (n, 1, 1))
    x, y = xx - cx, yy - cy
    xr, yr = np.cos(theta) * x + np.sin(theta) * y, -np.sin(theta) * x + np.cos(theta) * y
    colours = np.array(list(COLOURS.values()))
    alpha = np.zeros((n, size, size))
    for s, shape in enumerate(SHAPES):
        mine = labels // len(COLOURS) == s
        if mine.any():
            # Anti-aliased coverage: one pixel of soft edge.
            alpha[mine] = np.clip(0.5 - _sdf(shape, xr[mine], yr[mine], r[mine]) / scale, 0, 1)
    base = colours[labels % len(COLOURS)][:, None, None, :]
    base = base * rng.uniform(0.80, 1.05, (n, 1, 1, 1)) + rng.uniform(-0.06, 0.06, (n, 1, 1, 3))
    shade = 1.0 + 0.15 * (-(yr / r))[..., None]  # lit from above
    foreground = base * shade + rng.normal(0, 0.02, (n, size, size, 3))

    image = alpha[..., None] * foreground + (1 - alpha[..., None]) * background
    return np.clip(np.round(image * 255), 0, 255).astype(np.uint8)


def make_dataset(n, seed=0, size=IMAGE_SIZE, chunk=1024):
    """n images with balanced labels in a seeded random order -> (uint8 [n, size, size, 3], int64 [n]).
    Deterministic in (n, seed, size): the same arguments give the same bytes."""
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % NUM_CLASSES).astype(np.int64)
    images = np.empty((n, size, size, 3), dtype=np.uint8)
    for start in range(0, n, chunk):
        images[start:start + chunk] = _draw(rng, labels[start:start + chunk], size)
    return images, labels


def to_tensor(images):
    """uint8 [N, H, W, 3] -> float32 torch tensor [N, 3, H, W] in [-1, 1]."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def main():
    import argparse


    p = argparse.ArgumentParser(description="Write a PNG grid of demo dataset images (one row per class).")
    p.add_argument("--out", default="demo_data.png")
    p.add_argument("--per-class", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zoom", type=int, default=3)
    a = p.parse_args()
    images, labels = make_dataset(NUM_CLASSES * a.per_class * 2, seed=a.seed)
    rows = [images[labels == c][:a.per_class] for c in range(NUM_CLASSES)]
    tiles = [im.repeat(a.zoom, 0).repeat(a.zoom, 1) for row in rows for im in row]
    write_png(a.out, image_grid(tiles, ncols=a.per_class))
    print(f"wrote {a.out}: rows are {', '.join(CLASS_NAMES)}")


if __name__ == "__main__":
    main()
