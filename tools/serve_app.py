"""The Ray Serve deployment behind `lantern-run serve` (see lantern.tools.serve): one replica holds
an ImageService; Ray batches, queues, health-checks and replaces replicas."""
import asyncio
import hmac
import json
import logging
import re
import time
import uuid

from ray import serve
from ray.serve.metrics import Counter, Gauge, Histogram
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.tools.image_service import Cancelled, error_response, ImageService, RequestError

logger = logging.getLogger("ray.serve")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_LATENCY_BOUNDARIES = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60]


class ImageDeployment:
    """One replica: the engine opened once, batches run one at a time in a worker thread (so the
    event loop keeps taking requests and noticing disconnects)."""

    def __init__(self, engine_dir, options):
        device = "cuda" if options.backend == "tensorrt" else None
        # The Engine refuses a batch its memory headroom cannot hold (MemAvailable and the
        # container's cgroup limit), before any work: that request gets a 503 with the reason.
        engine = Engine(engine_dir, backend=options.backend, threads=options.threads, device=device)
        self.service = ImageService(engine, max_batch=options.max_batch,
                                    max_images_per_request=options.max_images_per_request,
                                    max_body_bytes=options.max_body_bytes)
        self.api_key = options.api_key.encode() if options.api_key else None
        self.generate_batch.set_max_batch_size(options.max_batch)
        self.generate_batch.set_batch_wait_timeout_s(options.batch_wait_s)
        self.waiting = 0
        self.metrics = dict(
            queue=Gauge("lantern_queued_requests", description="image requests waiting in this replica"),
            requests=Counter("lantern_requests", description="image requests answered", tag_keys=("status",)),
            images=Counter("lantern_images", description="images generated (rate() gives images/s)"),
            batch=Histogram("lantern_batch_images", description="images per generate call (padding included)",
                            boundaries=[1, 2, 4, 8, 16, 32, 64]),
            steps=Histogram("lantern_steps_per_image", description="decoding steps per image",
                            boundaries=[16, 32, 64, 128, 256, 512, 1024, 2048]),
            accepted=Histogram("lantern_mean_accepted_length", description="tokens per target step",
                               boundaries=[1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6]),
            phase=Histogram("lantern_phase_seconds", description="seconds per generate call and phase",
                            boundaries=_LATENCY_BOUNDARIES, tag_keys=("phase",)),
            latency=Histogram("lantern_request_seconds", description="request latency in the replica",
                              boundaries=_LATENCY_BOUNDARIES),
        )

    def check_health(self):
        if self.service.engine.backend is None:
            raise RuntimeError("engine closed")

    async def __call__(self, request: Request) -> Response:
        given = request.headers.get("x-request-id", "")
        request_id = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        path, method = request.url.path.rstrip("/") or "/", request.method
        if path == "/healthz" and method == "GET":
            return _response(200, "application/json", b'{"status": "ok"}', request_id)
        if not self._authorized(request):
            return _response(*error_response(401, "missing or wrong API key"), request_id)
        if path == "/v1/engine" and method == "GET":
            return _response(200, "application/json", json.dumps(self.service.describe()).encode(), request_id)
        if path == "/v1/images" and method == "POST":
            return await self._images(request, request_id)
        if path in ("/healthz", "/v1/engine", "/v1/images"):
            return _response(*error_response(405, f"{method} is not allowed on {path}"), request_id)
        return _response(*error_response(404, f"no route {path}"), request_id)

    def _authorized(self, request):
        if self.api_key is None:
            return True
        given = request.headers.get("x-api-key", "")
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        return hmac.compare_digest(given.encode(), self.api_key)

    async def _images(self, request, request_id):
        start = time.perf_counter()
        try:
            body = await _read_body(request, self.service.max_body_bytes)
            item = self.service.parse(body, request_id)
        except RequestError as e:
            return self._answer(error_response(e.status, str(e)), request_id, start)
        except ClientDisconnect:
            return _response(*error_response(499, "client went away"), request_id)
        self.waiting += 1
        self.metrics["queue"].set(self.waiting)
        try:
            result = await self.generate_batch(item)
        except asyncio.CancelledError:
            item.cancelled.set()  # the batch's observer stops the generate call between steps
            logger.info("request %s cancelled by its client", request_id)
            raise
        finally:
            self.waiting -= 1
            self.metrics["queue"].set(self.waiting)
        if isinstance(result, Exception) and not isinstance(result, (RequestError, Cancelled)):
            logger.error("request %s failed: %s: %s", request_id, type(result).__name__, result)
        return self._answer(self.service.respond(result), request_id, start)

    def _answer(self, answer, request_id, start):
        status = answer[0]
        self.metrics["requests"].inc(tags={"status": str(status)})
        self.metrics["latency"].observe(time.perf_counter() - start)
        logger.info("request %s -> %d in %.3f s", request_id, status, time.perf_counter() - start)
        return _response(*answer, request_id)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01, batch_size_fn=lambda items: sum(i.images for i in items))
    async def generate_batch(self, items):
        results = await asyncio.to_thread(self.service.run, items)
        seen = set()
        for r in results:
            stats = getattr(r, "stats", None)
            if stats is None or id(stats) in seen:
                continue
            seen.add(id(stats))  # one observation per generate call
            self.metrics["batch"].observe(stats["batch_images"])
            self.metrics["images"].inc(stats["requested_images"])
            self.metrics["steps"].observe(stats["steps_per_image"])
            self.metrics["accepted"].observe(stats["mean_accepted_length"])
            self.metrics["phase"].observe(stats["generate_seconds"], tags={"phase": "generate"})
            self.metrics["phase"].observe(stats["decode_seconds"], tags={"phase": "decode"})
            for phase, seconds in stats["phase_seconds"].items():
                self.metrics["phase"].observe(seconds, tags={"phase": phase})
        return results


async def _read_body(request, limit):
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"request body is {declared} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestError(413, f"request body exceeds the limit of {limit} bytes")
    return bytes(body)


def _response(status, content_type, body, request_id):
    return Response(content=body, status_code=status, media_type=content_type, headers={"x-request-id": request_id})


def build_app(engine_dir, options):
    """The Ray Serve application for an engine directory (a path every node of the cluster can read)."""
    if options.max_batch < 1 or options.replicas < 1 or options.max_queued_requests < 1:
        raise LanternError("max batch, replicas and max queued requests must be >= 1")
    deployment = serve.deployment(
        ImageDeployment,
        name="lantern-images",
        num_replicas=options.replicas,
        ray_actor_options={"num_cpus": options.cpus_per_replica, "num_gpus": options.gpus_per_replica},
        # enough requests in a replica to fill a batch while the previous one runs
        max_ongoing_requests=2 * options.max_batch,
        max_queued_requests=options.max_queued_requests,
        graceful_shutdown_timeout_s=options.shutdown_timeout_s,
        health_check_period_s=10,
    )
    return deployment.bind(str(engine_dir), options)
