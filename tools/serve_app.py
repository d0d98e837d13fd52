"""The Ray Serve deployment behind `lantern-run serve` (see lantern.tools.serve): one replica holds
an ImageService; Ray batches, queues, health-checks and replaces replicas.

`lantern-run serve` calls its methods health / engine_info / images through a handle from its
HTTP front (lantern.tools.serve_http, which checks requests first); `__call__` answers the same
routes behind Ray's own HTTP proxy, for an application run with your own `serve.run`.

A replica that cannot open its engine (a damaged or missing file) stays up and answers every
route 503 with the reason, /healthz included, at once, instead of failing its constructor in a
loop while clients wait; it tries to open the engine again at most every REOPEN_S seconds, so a
repaired directory is served without a restart."""
import asyncio
import json
import logging
import time

from ray import serve
from ray.serve.metrics import Counter, Gauge, Histogram
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from lantern.runtime.backends import runner
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.tools.image_service import Cancelled, error_response, ImageService, public, RequestError
from lantern.tools.scheduler import Scheduler
from lantern.tools.serve_http import authorized, Gone, read_body, Refused, request_id, route

logger = logging.getLogger("ray.serve")
REOPEN_S = 5.0
ROUTE_HEADROOM = 32  # concurrent health / engine-info calls a full replica still takes
_LATENCY_BOUNDARIES = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60]


class ImageDeployment:
    """One replica: the engine opened once and run by a worker thread (so the event loop keeps
    taking requests and noticing disconnects): continuous batching (lantern.tools.scheduler: images
    join and leave a running batch at every step), or with `batching="calls"` one generate call per
    batch of requests (Ray's serve.batch)."""

    def __init__(self, engine_dir, options):
        _replica_grpc_on_loopback()
        self.engine_dir, self.options = engine_dir, options
        self.service, self.scheduler, self.problem, self.next_open = None, None, None, 0.0
        self._opening = asyncio.Lock()
        self._open()
        self.api_key = options.api_key.encode() if options.api_key else None
        self.generate_batch.set_max_batch_size(options.max_batch)
        self.generate_batch.set_batch_wait_timeout_s(options.batch_wait_s)
        self.waiting = 0  # image requests in this replica (running or waiting)
        # continuous: the replica holds this many image requests and answers 503 past them, so
        # Ray's own limit (max_ongoing_requests, with headroom) is never reached and /healthz
        # and /v1/engine never wait behind image requests
        self.capacity = options.max_batch + options.max_queued_requests
        self.metrics = dict(
            queue=Gauge("lantern_queued_requests", description="image requests waiting in this replica"),
            requests=Counter("lantern_requests", description="image requests answered", tag_keys=("status",)),
            images=Counter("lantern_images", description="images generated (rate() gives images/s)"),
            batch=Histogram("lantern_batch_images", description="images a request shared its steps with (per request; "
                                                                "calls: its generate call's, padding excluded)",
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

    def _open(self):
        """Open the engine (ImageService: a verified snapshot of its directory), or keep why not."""
        o = self.options
        try:
            # The Engine refuses a batch its memory headroom cannot hold (MemAvailable and the
            # container's cgroup limit), before any work: that request gets a 503 with the reason.
            engine = Engine(self.engine_dir, backend=o.backend, threads=o.threads,
                            device=runner(o.backend).device)
            service = ImageService(engine, max_batch=o.max_batch, max_images_per_request=o.max_images_per_request,
                                   max_body_bytes=o.max_body_bytes)
            if o.batching == "continuous" and not continuous(o):
                logger.warning("continuous batching does not run on the %s runner yet: batching by calls", o.backend)
            self.scheduler = Scheduler(service) if continuous(o) else None
            self.service, self.problem = service, None
        except Exception as e:  # noqa: BLE001 -- any failure to open is this replica's state, not a crash
            self.problem = public(f"{type(e).__name__}: {e}" if not isinstance(e, LanternError) else str(e),
                                  self.engine_dir)
            self.next_open = time.monotonic() + REOPEN_S
            logger.error("cannot open the engine: %s", self.problem)

    async def _ready(self):
        """The ImageService, or None (after a new try to open the engine once REOPEN_S have passed)."""
        if self.service is None and time.monotonic() >= self.next_open:
            async with self._opening:
                if self.service is None and time.monotonic() >= self.next_open:
                    await asyncio.to_thread(self._open)
        return self.service

    def _down(self):
        return error_response(503, f"the engine cannot be opened: {self.problem}")

    def check_health(self):
        # Ray's check: the replica works. An engine it cannot open is answered 503 (see above):
        # replacing the replica would not repair the directory.
        if self.service is not None and self.service.engine.backend is None:
            raise RuntimeError("engine closed")
        if self.scheduler is not None and not self.scheduler.thread.is_alive():
            raise RuntimeError("the scheduler's worker thread stopped")  # Ray replaces the replica

    async def health(self):
        if await self._ready() is None:
            body = {"status": "unavailable", "error": f"the engine cannot be opened: {self.problem}"}
            return 503, "application/json", json.dumps(body).encode()
        return 200, "application/json", b'{"status": "ok"}'

    async def engine_info(self):
        if await self._ready() is None:
            return self._down()
        return 200, "application/json", json.dumps(self.service.describe()).encode()

    async def images(self, body, given_id):
        """POST /v1/images with this body: (status, content type, body)."""
        rid = request_id([(b"x-request-id", given_id.encode())])
        start = time.perf_counter()
        if await self._ready() is None:
            return self._answer(self._down(), rid, start)
        try:
            item = self.service.parse(body, rid)
        except RequestError as e:
            return self._answer(self.service.respond(e), rid, start)
        if self.scheduler is not None and self.waiting >= self.capacity:
            return self._answer(error_response(503, "the server is at capacity; retry later"), rid, start)
        return await self._generate(item, rid, start)

    async def __call__(self, request: Request) -> Response:
        """The same routes behind Ray's HTTP proxy (the front's checks, but inside the replica)."""
        headers = request.headers.raw
        rid = request_id(headers)
        try:
            name = route(request.method, request.url.path)
            if name == "health":
                return _response(*await self.health(), rid)
            if not authorized(headers, self.api_key):
                raise Refused(401, "missing or wrong API key")
            if name == "engine_info":
                return _response(*await self.engine_info(), rid)
            body = await read_body(request.receive, headers, self.options.max_body_bytes, self.options.body_timeout_s)
        except Refused as e:
            return _response(*error_response(e.status, str(e)), rid)
        except (Gone, ClientDisconnect):
            return _response(*error_response(499, "client went away"), rid)
        return _response(*await self.images(body, rid), rid)

    async def _generate(self, item, rid, start):
        self.waiting += 1
        self.metrics["queue"].set(self.waiting)
        try:
            if self.scheduler is not None:
                result = await asyncio.wrap_future(self.scheduler.submit(item))
            else:
                result = await self.generate_batch(item)
            self._observe(result)
        except asyncio.CancelledError:
            item.cancelled.set()  # the batch's observer stops the generate call between steps
            logger.info("request %s cancelled by its client", rid)
            raise
        finally:
            self.waiting -= 1
            self.metrics["queue"].set(self.waiting)
        if isinstance(result, Exception) and not isinstance(result, (RequestError, Cancelled)):
            logger.error("request %s failed: %s: %s", rid, type(result).__name__, result)
        return self._answer(self.service.respond(result), rid, start)

    def _answer(self, answer, rid, start):
        status = answer[0]
        self.metrics["requests"].inc(tags={"status": str(status)})
        self.metrics["latency"].observe(time.perf_counter() - start)
        logger.info("request %s -> %d in %.3f s", rid, status, time.perf_counter() - start)
        return answer

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01, batch_size_fn=lambda items: sum(i.images for i in items))
    async def generate_batch(self, items):
        return await asyncio.to_thread(self.service.run, items)

    def _observe(self, result):
        """A served request's metrics (one observation per request)."""
        stats = getattr(result, "stats", None)
        if stats is None:
            return
        self.metrics["batch"].observe(stats["requested_images"])
        self.metrics["images"].inc(len(result.tokens))
        self.metrics["steps"].observe(stats["steps_per_image"])
        self.metrics["accepted"].observe(stats["mean_accepted_length"])
        self.metrics["phase"].observe(stats["generate_seconds"], tags={"phase": "generate"})
        self.metrics["phase"].observe(stats["decode_seconds"], tags={"phase": "decode"})
        for phase, seconds in stats["phase_seconds"].items():
            self.metrics["phase"].observe(seconds, tags={"phase": phase})


def _replica_grpc_on_loopback():
    """Serve starts each replica's inter-deployment gRPC server on [::]:0 whatever the node's
    address (ray 2.60, replica.py, after this constructor); on a loopback node it binds to
    127.0.0.1 instead, like every other port of the node (tests/test_serve_hardening.py checks)."""
    import ray
    from ray.serve._private import replica

    add_port = getattr(replica, "add_port_to_grpc_server", None)
    if add_port is None or getattr(add_port, "loopback", False) or ray.util.get_node_ip_address() != "127.0.0.1":
        return

    def loopback(server, address):
        return add_port(server, "127.0.0.1:0" if address == "[::]:0" else address)

    loopback.loopback = True
    replica.add_port_to_grpc_server = loopback


def _response(status, content_type, body, request_id):
    headers = {"x-request-id": request_id, **({"retry-after": "1"} if status == 503 else {})}
    return Response(content=body, status_code=status, media_type=content_type, headers=headers)


def continuous(options):
    """Whether replicas run continuous batching: asked for, on a runner it runs on (not yet the
    tensorrt runner's own CUDA arrays: those batch by calls)."""
    return options.batching == "continuous" and runner(options.backend).row_views


def build_app(engine_dir, options):
    """The Ray Serve application for an engine directory (a path every node of the cluster can read)."""
    if options.max_batch < 1 or options.replicas < 1 or options.max_queued_requests < 1:
        raise LanternError("max batch, replicas and max queued requests must be >= 1")
    if options.batching not in ("continuous", "calls"):
        raise LanternError(f"unknown batching {options.batching!r}; valid: continuous, calls")
    deployment = serve.deployment(
        ImageDeployment,
        name="lantern-images",
        num_replicas=options.replicas,
        ray_actor_options={"num_cpus": options.cpus_per_replica, "num_gpus": options.gpus_per_replica},
        # continuous: the replica itself holds max_batch + max_queued_requests image requests
        # (its scheduler's queue, in order) and refuses more at once, so they never bounce
        # between Ray's router and a full replica; the headroom above it keeps the health and
        # engine routes from waiting behind image requests. calls: enough to fill a batch while
        # the previous one runs
        max_ongoing_requests=options.max_batch + options.max_queued_requests + ROUTE_HEADROOM
        if continuous(options) else 2 * options.max_batch,
        max_queued_requests=options.max_queued_requests,
        graceful_shutdown_timeout_s=options.shutdown_timeout_s,
        health_check_period_s=10,
    )
    return deployment.bind(str(engine_dir), options)
