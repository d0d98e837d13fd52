"""Requests in, images out: the serving logic without a serving framework. The Ray Serve
deployment (lantern.tools.serve) wraps it; another front end (PyTriton, a plain HTTP server)
could wrap the same object.

    service = ImageService(Engine("engines/demo"), max_batch=8)
    request = service.parse(b'{"classes": [3], "seed": 7, "settings": {"mode": "lantern++"}}')
    [result] = service.run([request])            # ImageResult, or the exception for that request
    status, content_type, body = service.respond(result)

A request is a condition (class labels, caption features or prompts), generation settings, a seed
and a response form. `run` groups requests by their settings key, so one generate call never
mixes settings, pads each group to one of the engine's batch sizes (static shapes: a size with
TensorRT plans where the engine has them) and splits the images back. Image j of a request with
seed s draws from its own random stream, seeded s + j (lantern.runtime.streams), so a request's
images equal `Engine.generate(<its settings>, <its condition>, seed=s, tree=service.tree_for(request))`
whatever it was batched with; the draft tree is pinned per settings key (the tree tuned for the
max batch, else the exported one) so the padded size never changes it either.

The service serves one snapshot of its engine directory: the Engine holds its graphs, tables and
manifest in memory, and the tuned trees are read here once, hash-checked against the manifest
(a file that no longer matches drops its entry, as opening the engine does), so re-running
`lantern-run tune` or a file changed under a running server never changes what it serves.
Error messages never name the engine's path (`public`).
"""
import base64
import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from lantern.runtime.backends import runs_plans
from lantern.runtime.enginedir import open_file
from lantern.runtime.errors import LanternError
from lantern.runtime.png import encode_png
from lantern.runtime.settings import GenerationSettings
from lantern.runtime.streams import image_seeds
from lantern.runtime.tree import build_tree, root_only

MAX_BODY_BYTES = 4 * 2**20  # caption features of a few images as JSON numbers fit easily
CONDITION_FIELDS = ("classes", "caption", "caption_mask", "prompt", "prompt_ids", "grid")
REQUEST_FIELDS = CONDITION_FIELDS + ("n", "seed", "settings", "response")
# JSON type of each GenerationSettings field in a request
SETTINGS = {"mode": str, "lam": float, "delta": float, "k": int, "greedy": bool, "temperature": float, "top_k": int,
            "top_p": float, "cfg_scale": float, "cfg_interval": int, "tau": float, "proposer": str, "window": int,
            "init": str}
RESPONSES = ("json", "png")
MAX_DEPTH = 8  # JSON nesting a request needs: object > caption > image > token > feature, with room
logger = logging.getLogger(__name__)


class RequestError(LanternError):
    """A request the service refuses: an HTTP status and one line saying why."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


class Cancelled(Exception):
    """Every request of a generate call went away (client disconnect); the call stopped between steps."""


@dataclass(frozen=True)
class ImageRequest:
    request_id: str
    condition: dict  # Engine.generate's condition arguments, one entry per image
    images: int
    seed: int
    settings: GenerationSettings  # resolved against the engine
    key: str  # requests with equal keys may share a generate call
    response: str
    cancelled: threading.Event = field(default_factory=threading.Event, compare=False)


@dataclass(frozen=True)
class ImageResult:
    request: ImageRequest
    tokens: np.ndarray  # [images, rows * columns] VQ codes
    images: object  # uint8 [images, H, W, 3], or None where the engine has no VQ decoder
    stats: dict  # of the generate call that made them (batch_images: how many it made)


def _typed(name, value, kind):
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is not bool and isinstance(value, bool) or not isinstance(value, kind):
        raise RequestError(400, f"settings.{name} must be {'a number' if kind is float else kind.__name__}, "
                                f"got {value!r}")
    return value


def batch_sizes(engine, max_batch):
    """Images per generate call the service pads to: the TensorRT plans' batches on a backend that
    runs them (the shapes that have plans), else powers of two up to max_batch, and max_batch."""
    if runs_plans(engine.backend.name) and engine.manifest.tensorrt:
        sizes = sorted({b for p in engine.manifest.tensorrt for b in p.batches if b <= max_batch})
        if sizes:
            return tuple(sizes)
    sizes = {1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch} | {max_batch}
    return tuple(sorted(sizes))


class ImageService:
    """Parse, batch and run image requests on one Engine, one generate call at a time."""

    def __init__(self, engine, max_batch=8, max_images_per_request=None, max_body_bytes=MAX_BODY_BYTES):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise LanternError(f"max batch must be an integer >= 1, got {max_batch!r}")
        self.engine = engine
        self.max_batch = max_batch
        self.max_images = max_images_per_request or max_batch
        if self.max_images > max_batch:
            raise LanternError(f"images per request ({self.max_images}) cannot exceed the max batch ({max_batch})")
        self.max_body_bytes = max_body_bytes
        self.sizes = batch_sizes(engine, max_batch)
        self.trees = self._tuned_trees()  # settings key -> the tree its calls use (snapshot, see above)
        if getattr(engine.condition, "tokenizer_path", None):
            engine.condition.tokenizer()  # read now, with the rest of the snapshot
        self._lock = threading.Lock()  # one generate at a time on the engine

    def _tuned_trees(self):
        """{settings key: Tree} of the trees `lantern-run tune` chose at the max batch on this
        backend, each file read once and checked against its sha256 in the manifest; a jacobi
        window (an int) where tune found it faster (parse pins it into the request's settings)."""
        m, trees = self.engine.manifest, {}
        for key, entry in m.tuned_trees.items():
            if entry.backend != self.engine.backend.name:
                continue
            chosen = entry.tree_for(self.max_batch)
            if chosen.window is not None or chosen.file is None:
                trees[key] = chosen.window if chosen.window is not None else root_only()
                continue
            try:
                trees[key] = self._read_tree(chosen)
            except LanternError as e:
                logger.warning("tuned tree %s ignored (%s); its settings use the exported tree until "
                               "`lantern-run tune` runs again", key, self.public(str(e)))
        return trees

    def _read_tree(self, chosen):
        m, name = self.engine.manifest, chosen.file
        try:
            with open_file(self.engine.directory, name) as f:
                data = f.read()
        except OSError as e:
            raise LanternError(f"cannot read {name} ({e.strerror})") from None
        if hashlib.sha256(data).hexdigest() != m.files[name].sha256:
            raise LanternError(f"{name} does not match its sha256 in the manifest")
        try:
            spec = json.loads(data)
        except ValueError as e:
            raise LanternError(f"{name} is not JSON ({e})") from None
        tree = build_tree(spec, name=chosen.name)
        if tree.max_width > m.candidates or not tree.contiguous:
            raise LanternError(f"{name} does not fit the drafter's {m.candidates} candidates in rank order")
        return tree

    def public(self, message):
        return public(message, self.engine.directory)

    # -- what the engine serves -------------------------------------------------------------------
    def describe(self):
        m = self.engine.manifest
        return {
            "family": m.family,
            "modes": list(m.modes),
            "condition": m.condition.kind,
            "num_classes": getattr(self.engine.condition, "num_classes", None),
            "grid": [m.image.grid_height, m.image.grid_width],
            "tree": self.engine.tree.name if self.engine.tree else None,
            "tuned_trees": {key: {"backend": t.backend, "trees": {str(x.images): x.name for x in t.trees}}
                            for key, t in m.tuned_trees.items()},
            "backend": self.engine.backend.name,
            "batch_sizes": list(self.sizes),
            "max_images_per_request": self.max_images,
            "images": "vq_decoder" in m.graphs,
            "settings": dataclasses.asdict(GenerationSettings()),
        }

    # -- requests ---------------------------------------------------------------------------------
    def parse(self, body, request_id=None):
        """JSON bytes -> ImageRequest, checked as far as the engine can check it without running
        (raises RequestError with a 4xx status)."""
        if len(body) > self.max_body_bytes:
            raise RequestError(413, f"request body is {len(body)} bytes; the limit is {self.max_body_bytes}")
        try:
            data = json.loads(body, parse_constant=_no_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(400, f"request body is not JSON ({str(e).splitlines()[0]})") from None
        except RecursionError:
            raise RequestError(400, f"request body is JSON nested deeper than {MAX_DEPTH} levels") from None
        if not isinstance(data, dict):
            raise RequestError(400, "request body must be a JSON object")
        if _depth(data) > MAX_DEPTH:
            raise RequestError(400, f"request body is JSON nested deeper than {MAX_DEPTH} levels")
        unknown = sorted(set(data) - set(REQUEST_FIELDS))
        if unknown:
            raise RequestError(400, f"unknown request field(s) {', '.join(unknown)}; valid: {', '.join(REQUEST_FIELDS)}")
        settings = self._settings(data.get("settings", {}))
        pick = self.trees.get(settings.key) if settings.mode != "ar" else None
        if isinstance(pick, int):  # tune measured the jacobi proposer's window faster: pinned like a tree
            settings = settings.replace(proposer="jacobi", window=pick)
        elif pick is not None and settings.proposer == "jacobi":  # tune found AR faster than every window
            settings = settings.replace(mode="ar")
        n = data.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise RequestError(400, f"n (images per condition) must be an integer >= 1, got {n!r}")
        seed = data.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63 - self.max_images:
            raise RequestError(400, f"seed must be an integer in [0, 2**63 - {self.max_images}), got {seed!r}")
        response = data.get("response", "json")
        if response not in RESPONSES:
            raise RequestError(400, f"response must be one of {', '.join(RESPONSES)}, got {response!r}")
        condition = {name: data[name] for name in CONDITION_FIELDS if data.get(name) is not None}
        try:  # the engine's own checks of the condition (kinds, class range, caption shape, positions)
            prefix = self.engine.condition.prefix(settings.cfg, **condition)
            self.engine.check_positions(prefix)
        except LanternError as e:
            raise RequestError(400, str(e)) from None
        except (TypeError, ValueError, OverflowError) as e:
            raise RequestError(400, f"malformed condition ({str(e).splitlines()[0]})") from None
        if "caption" in condition and not np.isfinite(np.asarray(condition["caption"], dtype=np.float32)).all():
            raise RequestError(400, "caption features must be finite float32 numbers")
        images = prefix.images * n
        if images > self.max_images:
            raise RequestError(400, f"{images} images in one request; the limit is {self.max_images}")
        if response == "png" and images != 1:
            raise RequestError(400, "response 'png' returns one image; ask for one image or use 'json'")
        if response == "png" and "vq_decoder" not in self.engine.manifest.graphs:
            raise RequestError(400, "this engine has no VQ decoder; use response 'json' for tokens")
        condition = _per_image(condition, prefix.images, n)
        request_id = request_id or uuid.uuid4().hex
        # the settings key plus what else fixes the calls' shapes: the grid and the prompt rows' length
        key = f"{settings.key}_grid{prefix.grid[0]}x{prefix.grid[1]}_prefix{prefix.ids.shape[1]}"
        return ImageRequest(request_id=request_id, condition=condition, images=images, seed=seed,
                            settings=settings, key=key, response=response)

    def _settings(self, raw):
        if not isinstance(raw, dict):
            raise RequestError(400, "settings must be a JSON object")
        unknown = sorted(set(raw) - set(SETTINGS))
        if unknown:
            raise RequestError(400, f"unknown setting(s) {', '.join(unknown)}; valid: {', '.join(SETTINGS)}")
        values = {name: _typed(name, value, SETTINGS[name]) for name, value in raw.items()
                  if not (name == "k" and value is None)}
        try:
            return GenerationSettings(**values).resolve(self.engine.manifest, "this engine")
        except LanternError as e:
            raise RequestError(400, str(e)) from None
        except OverflowError as e:  # an integer too large for a float comparison
            raise RequestError(400, f"a setting is out of range ({e})") from None

    # -- running ----------------------------------------------------------------------------------
    def run(self, requests):
        """One result per request, in order: an ImageResult, or the exception that request gets
        (RequestError for what the engine refused, Cancelled, or the engine's failure)."""
        results = {}
        for group in self.calls(requests):
            try:
                for request, result in zip(group, self._generate(group)):
                    results[id(request)] = result
            except Exception as e:  # noqa: BLE001 -- the failure belongs to this group's requests only
                if isinstance(e, LanternError) and not isinstance(e, RequestError):
                    e = RequestError(503, self.public(str(e)))  # e.g. the batch needs more memory than the replica has
                for request in group:
                    results[id(request)] = e
        return [results[id(r)] for r in requests]

    def calls(self, requests):
        """Requests -> generate calls: lists of requests with one settings key and at most
        max_batch images between them, in arrival order."""
        groups = {}
        for request in requests:
            groups.setdefault(request.key, []).append(request)
        calls = []
        for group in groups.values():
            current, images = [], 0
            for request in group:
                if current and images + request.images > self.max_batch:
                    calls.append(current)
                    current, images = [], 0
                current.append(request)
                images += request.images
            calls.append(current)
        return calls

    def padded_size(self, images):
        return next(size for size in self.sizes if size >= images)

    def tree_for(self, request):
        """The draft tree every generate call of this request's settings uses: the one `lantern-run
        tune` chose for these settings at the max batch on this backend (read at start), else the
        engine's; none where no drafter tree runs (ar, a drafter-free proposer)."""
        s = request.settings
        return None if s.mode == "ar" or s.proposer != "tree" else self.trees.get(s.key, self.engine.tree)

    def _generate(self, group):
        live = [r for r in group if not r.cancelled.is_set()]
        if not live:
            raise Cancelled("the client went away before its batch started")
        images = sum(r.images for r in live)
        size = self.padded_size(images)
        condition = _concat([r.condition for r in live], pad=size - images)
        seeds = [s for r in live for s in image_seeds(r.seed, r.images)] + [0] * (size - images)
        tree = self.tree_for(live[0])

        def stop_when_abandoned(record):
            if all(r.cancelled.is_set() for r in live):
                raise Cancelled("every client of this batch went away")

        with self._lock:
            start = time.perf_counter()
            out = self.engine.generate(live[0].settings, **condition, seed=seeds, tree=tree,
                                       observer=stop_when_abandoned)
            decode_start = time.perf_counter()
            pictures = self.engine.decode(out.tokens[:images], out.grid) \
                if "vq_decoder" in self.engine.manifest.graphs else None
            decode_seconds = time.perf_counter() - decode_start
        stats = dict(out.stats, batch_images=size, requested_images=images, decode_seconds=decode_seconds,
                     generate_seconds=decode_start - start)
        results, at = {}, 0
        for r in live:
            part = slice(at, at + r.images)
            results[id(r)] = ImageResult(r, out.tokens[part], None if pictures is None else pictures[part], stats)
            at += r.images
        return [results.get(id(r), Cancelled("the client went away")) for r in group]

    # -- responses --------------------------------------------------------------------------------
    def respond(self, result):
        """ImageResult or exception -> (HTTP status, content type, body bytes)."""
        if isinstance(result, RequestError):
            return error_response(result.status, self.public(str(result)))
        if isinstance(result, Cancelled):
            return error_response(499, str(result))
        if isinstance(result, Exception):
            return error_response(500, self.public(f"generation failed: {type(result).__name__}: {result}"))
        r = result.request
        if r.response == "png":
            return 200, "image/png", encode_png(result.images[0])
        images = []
        for j in range(r.images):
            item = {"seed": r.seed + j, "tokens": result.tokens[j].tolist()}
            if result.images is not None:
                item["png_base64"] = base64.b64encode(encode_png(result.images[j])).decode("ascii")
            images.append(item)
        body = {"request_id": r.request_id, "key": r.key, "images": images, "stats": _json_stats(result.stats)}
        return 200, "application/json", json.dumps(body).encode()


def error_response(status, message):
    return status, "application/json", json.dumps({"error": " ".join(message.splitlines())[:1000]}).encode()


def public(message, directory):
    """A message with the engine directory's path left out (responses never name server paths)."""
    directory = os.fspath(directory)
    for path in sorted({directory, os.path.abspath(directory), os.path.realpath(directory)}, key=len, reverse=True):
        message = message.replace(path + os.sep, "").replace(path, "the engine")
    return message


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def _depth(value):
    """How deeply a parsed JSON value nests (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, level = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


ROWS = ("classes", "caption", "caption_mask", "prompt", "prompt_ids")  # condition entries given per image
ROW_RANK = {"classes": 0, "caption": 2, "caption_mask": 1, "prompt": 0, "prompt_ids": 1}  # rank of one image's entry


def _per_image(condition, images, n):
    """A checked condition as lists with one entry per image, each condition n times in a row
    (image j of the request = condition j // n); a caption without a mask gets the all-true mask
    so every request of a caption engine has the same entries."""
    out = {"grid": condition["grid"]} if "grid" in condition else {}
    if "caption" in condition and "caption_mask" not in condition:
        condition = dict(condition, caption_mask=np.ones(np.shape(condition["caption"])[:-1], dtype=bool).tolist())
    for name in ROWS:
        if name in condition:
            rows = condition[name]
            rows = [rows] if np.ndim(rows) == ROW_RANK[name] else list(rows)
            if len(rows) != images:
                raise RequestError(400, f"{name} has {len(rows)} entries for {images} image(s)")
            out[name] = [row for row in rows for _ in range(n)]
    return out


def _concat(conditions, pad):
    """The conditions of several requests as one generate call's, plus `pad` copies of the last
    image's condition (their images are dropped)."""
    out = {"grid": conditions[0]["grid"]} if "grid" in conditions[0] else {}
    for name in ROWS:
        if name in conditions[0]:
            rows = [row for c in conditions for row in c[name]]
            rows += [rows[-1]] * pad
            out[name] = np.asarray(rows, dtype=np.float32) if name == "caption" else rows
    return out


def _json_stats(stats):
    keep = ("mode", "tree", "images", "batch_images", "requested_images", "steps_per_image", "mean_accepted_length",
            "seconds", "generate_seconds", "decode_seconds", "phase_seconds", "backend", "continuous")
    return {k: stats[k] for k in keep if k in stats}


def read_api_key(path):
    try:
        with open(path) as f:
            key = f.read().strip()
    except OSError as e:
        raise LanternError(f"{path}: cannot read the API key ({e.strerror})") from None
    if len(key) < 16:
        raise LanternError(f"{path}: an API key must be at least 16 characters")
    return key
