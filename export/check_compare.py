"""`lantern-export check`'s comparison of two backends' outputs: the tolerance per dtype
(TOLERANCES, IMAGE_ATOL for VQ images, BF16_COMPUTED for a backend computing in bf16), max
|a - b| <= atol + rtol * max |reference| per float output, the drafter's top-k ids at the ranks
clear of a near-tie, and quantized graphs' relative RMS error at their scheme's tolerance after
their record is verified. lantern.export.check's docstring states the rules and their reasons."""
import os

import numpy as np

from lantern.export import quantize
from lantern.runtime.errors import LanternError

TOLERANCES = {"fp32": (1e-5, 1e-4), "fp16": (1e-3, 1e-2), "bf16": (1e-4, 2e-3)}
IMAGE_ATOL = 1e-3
BF16_COMPUTED = (1e-2, 5e-2)  # a backend that computes bf16 in bf16 (tensorrt) against the fp32 upcast


def _compare_float(got, want, atol, rtol):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return {"ok": False, "max_abs": float("inf"), "max_rel": float("inf"), "scale": None,
                "note": f"shape {list(got.shape)} != {list(want.shape)}"}
    scale = float(np.abs(want).max()) if want.size else 0.0
    if not np.isfinite(got).all() and np.isfinite(want).all():
        return {"ok": False, "max_abs": float("inf"), "max_rel": float("inf"), "scale": scale, "note": "non-finite"}
    max_abs = float(np.abs(got - want).max()) if want.size else 0.0
    return {"ok": max_abs <= atol + rtol * scale, "max_abs": max_abs, "max_rel": max_abs / scale if scale else 0.0,
            "scale": scale, "bound": atol + rtol * scale}


def _compare_rms(got, want, limit):
    """Relative RMS error ||got - want|| / ||want|| <= limit (a quantized graph's outputs)."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return {"ok": False, "max_abs": float("inf"), "max_rel": float("inf"), "rms_rel": float("inf"),
                "note": f"shape {list(got.shape)} != {list(want.shape)}"}
    scale = float(np.abs(want).max()) if want.size else 0.0
    if not np.isfinite(got).all() and np.isfinite(want).all():
        return {"ok": False, "max_abs": float("inf"), "max_rel": float("inf"), "rms_rel": float("inf"), "note": "non-finite"}
    max_abs = float(np.abs(got - want).max()) if want.size else 0.0
    rms_rel = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)) if want.size else 0.0
    return {"ok": rms_rel <= limit, "max_abs": max_abs, "max_rel": max_abs / scale if scale else 0.0,
            "scale": scale, "rms_rel": rms_rel, "bound": limit}


def _compare_ids_per_row(got_ids, want_ids, got_probs, want_probs):
    """Top-k ids of a quantized graph: its errors are far larger than float noise and uneven, so
    a rank counts as clear of a near-tie against its own row's error, measured element by
    element: the largest |log q - log p| over the ids both backends returned for that row. A
    rank whose reference gap to both neighbors exceeds 4x that must hold the same id (ranks
    whose id or a neighbor's has probability 0 on either side are not judged)."""
    if got_ids.shape != want_ids.shape:
        return {"ok": False, "note": f"shape {list(got_ids.shape)} != {list(want_ids.shape)}"}
    rows = want_ids.reshape(-1, want_ids.shape[-1])
    g_ids, g_p, w_p = got_ids.reshape(rows.shape), got_probs.reshape(rows.shape), want_probs.reshape(rows.shape)
    bad = clear = 0
    with np.errstate(divide="ignore", invalid="ignore"):
        for w, g, lg, lw in zip(rows, g_ids, np.log(g_p.astype(np.float64)), np.log(w_p.astype(np.float64))):
            finite_w, finite_g = np.isfinite(lw), np.isfinite(lg)
            common, wi, gi = np.intersect1d(w[finite_w], g[finite_g], return_indices=True)
            if common.size == 0:
                continue
            error = np.abs(lw[finite_w][wi] - lg[finite_g][gi]).max()
            gaps = lw[:-1] - lw[1:]
            gap = np.minimum(np.concatenate([[np.inf], gaps]), np.concatenate([gaps, [np.inf]]))
            # judged only where the rank and its neighbors have a measured error in both (a
            # filter boundary that moved leaves an id with probability 0 on one side)
            measured = np.isin(w, common)
            around = measured & np.concatenate([[True], measured[:-1]]) & np.concatenate([measured[1:], [True]])
            ok_rank = around & (gap > 4 * error + 1e-6)
            clear += int(ok_rank.sum())
            bad += int((ok_rank & (w != g)).sum())
    total = want_ids.size
    return {"ok": bad == 0, "mismatched": bad, "clear": clear, "skipped": total - clear,
            "note": f"{bad} of {clear} ranks clear of their row's error differ, {total - clear} near-ties or zero "
                    f"probabilities skipped"}


def quantization_tolerances(directory, manifest, tolerance=None):
    """{graph: (scheme, relative RMS limit)} of the quantized graphs, each verified against its
    record first. tolerance: one limit for all (default: the scheme's, quantize.TOLERANCES)."""

    limits = {}
    for name, g in manifest.graphs.items():
        q = g.quantization
        if q is None:
            continue
        try:
            quantize.verify_record(os.path.join(directory, g.file), q)
        except LanternError as e:
            raise LanternError(f"{e}: the graph does not match the manifest's quantization record; re-export the "
                               f"engine with `lantern-export onnx --quantize` or `lantern-export quantize`") from None
        limits[name] = (q.scheme, quantize.TOLERANCES[q.scheme] if tolerance is None else tolerance)
    return limits


def _compare_ids(got_ids, want_ids, got_probs, want_probs):
    """Top-k ids at the ranks that are clear of a near-tie in the reference (see the docstring)."""
    if got_ids.shape != want_ids.shape:
        return {"ok": False, "note": f"shape {list(got_ids.shape)} != {list(want_ids.shape)}"}
    with np.errstate(divide="ignore", invalid="ignore"):  # log(0) = -inf; -inf - -inf = nan: not clear
        lg, lw = np.log(got_probs.astype(np.float64)), np.log(want_probs.astype(np.float64))
        measurable = np.isfinite(lg) & np.isfinite(lw)
        err = float(np.abs(lg - lw)[measurable].max()) if measurable.any() else 0.0
        gaps = lw[..., :-1] - lw[..., 1:]  # rank r minus rank r + 1 (>= 0: sorted)
    above = np.concatenate([np.full(lw.shape[:-1] + (1,), np.inf), gaps], axis=-1)
    below = np.concatenate([gaps, np.full(lw.shape[:-1] + (1,), np.inf)], axis=-1)
    with np.errstate(invalid="ignore"):
        clear = measurable & (np.minimum(above, below) > 4 * err + 1e-6)
    bad = int(((got_ids != want_ids) & clear).sum())
    return {"ok": bad == 0, "mismatched": bad, "clear": int(clear.sum()), "skipped": int((~clear).sum()),
            "note": f"{bad} of {int(clear.sum())} clear ranks differ, {int((~clear).sum())} near-ties or zero "
                    f"probabilities skipped"}
