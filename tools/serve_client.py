"""`lantern-run client URL`: ask a `lantern-run serve` endpoint for images (standard library only).

    lantern-run client http://127.0.0.1:8000 --classes 3,7 --seed 0 --mode lantern++ --out out/

The same request with curl:
    curl -s http://127.0.0.1:8000/v1/images -H 'content-type: application/json' \\
         -d '{"classes": [3], "seed": 0, "settings": {"mode": "lantern++"}, "response": "png"}' -o image.png
"""
import base64
import json
import os
import urllib.error
import urllib.request

import numpy as np

from lantern.runtime.cli import _classes
from lantern.runtime.errors import LanternError
from lantern.tools.image_service import read_api_key


def post(url, payload, api_key=None, timeout=300.0):
    """POST a request to URL/v1/images: (HTTP status, decoded JSON body or raw bytes for PNG)."""
    return request(url.rstrip("/") + "/v1/images", json.dumps(payload).encode(), api_key, timeout)


def request(url, body=None, api_key=None, timeout=300.0, headers=None):
    """One HTTP call: (status, JSON object for JSON answers, else the bytes)."""
    h = {"content-type": "application/json", **(headers or {})}
    if api_key:
        h["authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=body, headers=h, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as answer:
            status, kind, data = answer.status, answer.headers.get("content-type", ""), answer.read()
    except urllib.error.HTTPError as e:
        status, kind, data = e.code, e.headers.get("content-type", ""), e.read()
    except (urllib.error.URLError, OSError) as e:
        raise LanternError(f"{url}: cannot reach the server ({getattr(e, 'reason', e)})") from None
    return status, json.loads(data) if kind.startswith("application/json") else data


def add_parser(sub):
    p = sub.add_parser("client", help="request images from a `lantern-run serve` endpoint")
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--classes", type=_classes, help="class labels (c2i engines)")
    p.add_argument("--prompt", action="append", help="text prompt (Chameleon-family engines); repeatable")
    p.add_argument("--n", type=int, default=1, help="images per condition")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", default=None)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--cfg-scale", type=float, default=None)
    p.add_argument("--settings", default="{}", help="more settings as JSON, e.g. '{\"lam\": 5, \"k\": 20}'")
    p.add_argument("--api-key-file")
    p.add_argument("--out", required=True, help="directory for image_*.png, tokens.npy and response.json")
    p.set_defaults(func=run_client)


def run_client(args):
    try:
        settings = json.loads(args.settings)
    except ValueError:
        raise LanternError(f"--settings must be a JSON object, got {args.settings!r}") from None
    if args.mode is not None:
        settings["mode"] = args.mode
    if args.cfg_scale is not None:
        settings["cfg_scale"] = args.cfg_scale
    if args.greedy:
        settings["greedy"] = True
    payload = {"n": args.n, "seed": args.seed, "settings": settings}
    if args.classes:
        payload["classes"] = args.classes
    if args.prompt:
        payload["prompt"] = args.prompt
    key = None
    if args.api_key_file:

        key = read_api_key(args.api_key_file)
    status, body = post(args.url, payload, api_key=key)
    if status != 200:
        raise LanternError(f"server answered {status}: {body.get('error') if isinstance(body, dict) else body[:200]}")
    os.makedirs(args.out, exist_ok=True)
    for i, image in enumerate(body["images"]):
        if "png_base64" in image:
            with open(os.path.join(args.out, f"image_{i:03d}.png"), "wb") as f:
                f.write(base64.b64decode(image.pop("png_base64")))
    np.save(os.path.join(args.out, "tokens.npy"), np.array([im["tokens"] for im in body["images"]], dtype=np.int64))
    with open(os.path.join(args.out, "response.json"), "w") as f:
        json.dump({"request_id": body["request_id"], "key": body["key"], "stats": body["stats"]}, f, indent=2)
    stats = body["stats"]
    where = (f"beside {stats.get('requested_images', 0):.1f} images on average in a running batch of "
             f"{stats.get('batch_images')}" if stats.get("continuous") else f"in a batch of {stats.get('batch_images')}")
    print(f"{len(body['images'])} image(s), request {body['request_id']}, {stats.get('seconds', 0):.2f} s {where} "
          f"-> {args.out}")
    return 0
