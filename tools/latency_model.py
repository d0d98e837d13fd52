"""The latency model the tree search (lantern.tools.tree_search) prices trees with: milliseconds of
one verification of T tree tokens, one drafter call of width w, host work per step and one AR
step, from measured points (Curve: made non-decreasing, interpolated, never extrapolated) or a
planning file. How a step's cost is composed of them: tree_search's docstring.
"""
import json
import math
import os

import numpy as np

from lantern.runtime.errors import LanternError
from lantern.runtime.tree import build_tree


class Curve:
    """y(x) from measured points, made non-decreasing (least-squares isotonic fit: noise must not
    make a bigger call look cheaper) and interpolated linearly between them. Asking outside the
    measured range is an error, never an extrapolation."""

    def __init__(self, points, what):
        items = _points(points, what)
        self.what = what
        self.measured = items
        self.x = np.array([x for x, _ in items], dtype=np.float64)
        self.y = _isotonic(np.array([y for _, y in items], dtype=np.float64))

    @property
    def max_x(self):
        return int(self.x[-1])

    def covers(self, x):
        return self.x[0] <= x <= self.x[-1]

    def __call__(self, x):
        if not self.covers(x):
            raise LanternError(f"{self.what}: {x} is outside the measured range "
                               f"{int(self.x[0])}..{int(self.x[-1])}")
        return float(np.interp(x, self.x, self.y))

    def to_json(self):
        return {str(x): y for x, y in self.measured}


def _points(points, what):
    if not isinstance(points, dict) or not points:
        raise LanternError(f"{what}: expected a non-empty {{size: milliseconds}} mapping")
    items = []
    for k, v in points.items():
        try:
            x, y = int(k), float(v)
        except (TypeError, ValueError):
            raise LanternError(f"{what}: point {k!r}: {v!r} is not size (integer): milliseconds") from None
        if x < 1 or not math.isfinite(y) or y < 0:
            raise LanternError(f"{what}: point {k!r}: {v!r} needs size >= 1 and finite milliseconds >= 0")
        items.append((x, y))
    items.sort()
    if items[0][0] != 1:
        raise LanternError(f"{what}: needs a point at size 1 (the smallest call)")
    if len({x for x, _ in items}) != len(items):
        raise LanternError(f"{what}: a size appears twice")
    return items


def _isotonic(y):
    """Pool adjacent violators: the non-decreasing sequence closest to y in least squares."""
    blocks = []  # [mean, count]
    for v in y:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks[-2], blocks.pop()
            blocks[-1] = [(m2 * c2 + m1 * c1) / (c2 + c1), c2 + c1]
    return np.concatenate([np.full(c, m) for m, c in blocks])


class LatencyModel:
    """Milliseconds per call regime, from measured points (or a planning file).

    verify_ms   {T: ms}: one target call over T tree tokens (root included), T = 1 .. max.
    draft_ms    {w: ms}: one drafter call of width w; or None with draft_fraction, meaning
                draft(w) = draft_fraction * verify(w) (a planning shorthand).
    host_ms     ms of host work per speculative step besides drafting: a number, or {T: ms}
                by tree size (acceptance and commit grow with the node count).
    draft_host_ms  ms of the loop's own work per drafter call (a step of depth D makes D calls).
    ar_ms       one AR step, host work included; default verify(1) + host(1).
    """

    def __init__(self, verify_ms, draft_ms=None, host_ms=0.0, ar_ms=None, draft_fraction=None, draft_host_ms=0.0):
        self.verify = Curve(verify_ms, "verification latency")
        if (draft_ms is None) == (draft_fraction is None):
            raise LanternError("latency model: give drafter latency as points (draft_ms) or as "
                               "draft_fraction of a verification of the same width, not both or neither")
        self.draft_fraction = None if draft_fraction is None else float(draft_fraction)
        if self.draft_fraction is not None and not (0 <= self.draft_fraction < math.inf):
            raise LanternError(f"latency model: draft_fraction must be >= 0, got {draft_fraction!r}")
        self.draft = None if draft_ms is None else Curve(draft_ms, "drafter latency")
        self.host = Curve(host_ms if isinstance(host_ms, dict) else {1: host_ms}, "host time")
        self.draft_host_ms = float(draft_host_ms)
        if not (0 <= self.draft_host_ms < math.inf):
            raise LanternError(f"latency model: draft_host_ms must be >= 0, got {draft_host_ms!r}")
        self.ar_ms = None if ar_ms is None else float(ar_ms)
        if self.ar_ms is not None and not (0 < self.ar_ms < math.inf):
            raise LanternError(f"latency model: ar_ms must be a positive number, got {ar_ms!r}")

    def drafter_ms(self, width):
        if self.draft is None:
            return self.draft_fraction * self.verify(width)
        return self.draft(width)

    def host_step_ms(self, nodes):
        return self.host(min(nodes, self.host.max_x))  # a constant beyond the last point

    def ar_step_ms(self):
        return self.ar_ms if self.ar_ms is not None else self.verify(1) + self.host_step_ms(1)

    def covers(self, tree):
        """True when every call of the tree's step lies within the measured points."""
        tree = build_tree(tree)
        widths = [tree.depth + 1] + [len(level.nodes) for level in tree.levels[:-1]]
        draft = self.verify if self.draft is None else self.draft
        return self.verify.covers(tree.num_nodes) and all(draft.covers(w) for w in widths)

    def step_ms(self, tree):
        """One speculative step of `tree`: depth-0 drafter call of width depth + 1, one call per
        depth 1..depth-1 of that depth's width, one verification of num_nodes tokens, host work.
        A root-only tree is AR."""
        tree = build_tree(tree)
        if tree.num_nodes == 1:
            return self.ar_step_ms()
        draft = self.drafter_ms(tree.depth + 1)
        draft += sum(self.drafter_ms(len(level.nodes)) for level in tree.levels[:-1])
        draft += tree.depth * self.draft_host_ms
        return draft + self.verify(tree.num_nodes) + self.host_step_ms(tree.num_nodes)

    def to_json(self):
        data = {"verify_ms": self.verify.to_json(), "host_ms": self.host.to_json(),
                "draft_host_ms": self.draft_host_ms}
        if self.draft is None:
            data["draft_fraction"] = self.draft_fraction
        else:
            data["draft_ms"] = self.draft.to_json()
        if self.ar_ms is not None:
            data["ar_ms"] = self.ar_ms
        return data

    @classmethod
    def from_json(cls, data):
        """From a dict or a .json file with the constructor's keys ("verify_ms", "draft_ms" or
        "draft_fraction", "host_ms", "draft_host_ms", "ar_ms"); unknown keys are an error,
        "note" is allowed."""
        if isinstance(data, (str, os.PathLike)):
            data = _read_json(data, "latency model")
        if not isinstance(data, dict):
            raise LanternError("latency model: expected a JSON object")
        known = {"verify_ms", "draft_ms", "draft_fraction", "host_ms", "draft_host_ms", "ar_ms", "note"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise LanternError(f"latency model: unknown keys {unknown}; known: {sorted(known)}")
        if "verify_ms" not in data:
            raise LanternError("latency model: 'verify_ms' ({T: ms}) is required")
        return cls(data["verify_ms"], data.get("draft_ms"), data.get("host_ms", 0.0), data.get("ar_ms"),
                   data.get("draft_fraction"), data.get("draft_host_ms", 0.0))


def _read_json(path, what):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LanternError(f"cannot read {what} file {os.fspath(path)}: {e}") from None
