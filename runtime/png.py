"""Minimal PNG output for decoded images: numpy + zlib, no imaging library (the runtime host may
have neither PIL nor torch).

Writes 8-bit RGB (colour type 2), one IDAT chunk, filter type 0 (None) on every row, no
interlacing: the simplest valid PNG. Files are written atomically (temporary file in the same
directory, then os.replace), so a reader never sees half an image, with the mode any new file
gets (0o666 less the umask; tempfile.mkstemp's 0600 made PNGs private beside a 0644 stats.json).
"""
import math
import os
import struct
import zlib

import numpy as np

from lantern.runtime.errors import LanternError
from lantern.runtime.outdir import write_file

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind, data):
    # length, type, data, CRC-32 over type + data (PNG spec, section 5.3)
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(image, compress_level=6):
    """PNG bytes for an [H, W, 3] uint8 array."""
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise LanternError(f"PNG image must be uint8 [height, width, 3], got {image.dtype} {list(image.shape)}")
    h, w, _ = image.shape
    if h < 1 or w < 1:
        raise LanternError(f"PNG image must not be empty, got {list(image.shape)}")
    rows = np.zeros((h, 1 + 3 * w), dtype=np.uint8)  # column 0: each row's filter byte, 0 = None
    rows[:, 1:] = image.reshape(h, 3 * w)
    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit, RGB, deflate, filter 0, no interlace
    return (PNG_SIGNATURE + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(rows.tobytes(), compress_level)) + _chunk(b"IEND", b""))


def write_png(path, image):
    """Write an [H, W, 3] uint8 image to `path` atomically, mode 0o666 less the umask."""

    data = encode_png(image)
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise LanternError(f"{path}: output directory {directory} does not exist")
    write_file(path, data)


def to_uint8(image, layout="auto"):
    """A float image in [-1, 1] (the VQ decoder's range) → uint8 [H, W, 3].

    layout: 'chw', 'hwc' or 'auto' (CHW when exactly one of the first and last axes has size 3).
    Values outside [-1, 1] are clipped; the mapping is floor(127.5 * (x + 1) + 0.5), the same as
    torchvision's save_image on (x + 1) / 2 and LlamaGen's clamp(127.5 x + 128).
    """
    x = np.asarray(image)
    if x.ndim != 3:
        raise LanternError(f"image must be 3-D (CHW or HWC), got shape {list(x.shape)}")
    if layout == "auto":
        if x.shape[0] == 3 and x.shape[2] != 3:
            layout = "chw"
        elif x.shape[2] == 3 and x.shape[0] != 3:
            layout = "hwc"
        else:
            raise LanternError(f"cannot tell CHW from HWC for shape {list(x.shape)}; pass layout='chw' or 'hwc'")
    if layout == "chw":
        x = x.transpose(1, 2, 0)
    elif layout != "hwc":
        raise LanternError(f"layout must be 'auto', 'chw' or 'hwc', got {layout!r}")
    if x.shape[2] != 3:
        raise LanternError(f"image must have 3 channels, got shape {list(x.shape)} as HWC")
    x = x.astype(np.float64)
    if np.isnan(x).any():
        raise LanternError("image contains NaN values")
    return np.floor(np.clip((x + 1.0) * 127.5 + 0.5, 0.0, 255.0)).astype(np.uint8)


def image_grid(images, ncols=None, pad=2, pad_value=255):
    """Tile equally sized [H, W, 3] uint8 images into one, row by row, `pad` pixels of
    `pad_value` between and around them. ncols defaults to ceil(sqrt(count))."""
    images = [np.asarray(im) for im in images]
    if not images:
        raise LanternError("image_grid needs at least one image")
    h, w = images[0].shape[:2]
    for i, im in enumerate(images):
        if im.dtype != np.uint8 or im.shape != (h, w, 3):
            raise LanternError(f"image {i}: expected uint8 {[h, w, 3]}, got {im.dtype} {list(im.shape)}")
    ncols = ncols or math.ceil(math.sqrt(len(images)))
    if ncols < 1:
        raise LanternError(f"ncols must be >= 1, got {ncols}")
    nrows = math.ceil(len(images) / ncols)
    grid = np.full((pad + nrows * (h + pad), pad + ncols * (w + pad), 3), pad_value, dtype=np.uint8)
    for i, im in enumerate(images):
        r, c = divmod(i, ncols)
        y, x = pad + r * (h + pad), pad + c * (w + pad)
        grid[y:y + h, x:x + w] = im
    return grid
