"""`lantern-run serve ENGINE`: an HTTP image endpoint on Ray Serve around lantern.tools.image_service.

Routes (JSON unless said otherwise):
  POST /v1/images   a request (see ImageService.parse): the images as base64 PNGs with their
                    tokens and the batch's stats, or one image/png (response "png")
  GET  /v1/engine   what the engine serves: family, modes, condition kind, batch sizes, tuned trees
  GET  /healthz     200 {"status": "ok"} while a replica serves the engine; 503 with the reason
                    when it cannot open it, or at capacity (no API key needed)
Every response carries one `x-request-id`. With an API key configured every route but /healthz
needs `Authorization: Bearer KEY` (or `x-api-key: KEY`). Every refusal is one JSON line; 503
means capacity (or an engine a replica cannot open) and carries Retry-After.

The socket is lantern's HTTP front (lantern.tools.serve_http: head and body limits and deadlines,
the key, routes), in this process; behind it Ray does the production work: replicas (one per
GPU with --gpus-per-replica 1), request batching (`serve.batch`, counted in images),
backpressure (a full queue is answered 503 at once), health checks and replacement of dead
replicas, cancellation when a client disconnects (the generate call stops between steps once
all its clients are gone), Prometheus metrics (Ray's metrics export, `lantern_*` names) and
multi-node clusters (--address). Ray's own HTTP proxy is not started. With a loopback --host and
no --address the Ray node this command starts binds every port of its own to 127.0.0.1 too.

From Python: `server = start(engine_dir, ServeOptions(...), host, port)` ... `server.stop()`, or
`lantern.tools.serve_app.build_app(engine_dir, options)` for your own `serve.run` behind Ray's
proxy (the Ray application; this module imports no Ray, so `lantern-run` works without the
`serve` extra).
"""
import json
import os
import signal
import threading
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from lantern.runtime.backends import DEFAULT, names
from lantern.runtime.conditions import condition_adapter
from lantern.runtime.enginedir import inside
from lantern.runtime.errors import LanternError
from lantern.runtime.manifest import read_manifest
from lantern.runtime.memory import available_memory
from lantern.runtime.plan import check_memory as check_plan_memory
from lantern.runtime.tree import build_tree, root_only
from lantern.tools.latency import default_condition
from lantern.tools.image_service import MAX_BODY_BYTES, read_api_key
from lantern.tools.serve_http import Front, FrontServer

LOOPBACK = ("127.0.0.1", "localhost", "::1")
BATCHING = ("continuous", "calls")


@dataclass(frozen=True)
class ServeOptions:
    backend: str = DEFAULT
    threads: Optional[int] = None  # intra-op threads per replica (None: the backend's default)
    replicas: int = 1
    gpus_per_replica: float = 0.0
    cpus_per_replica: float = 1.0
    max_batch: int = 8  # images a replica runs at once (its running batch's slots)
    batching: str = "continuous"  # continuous: images join and leave a running batch each step;
    # calls: requests grouped into one generate call each (the way before; for comparison)
    batch_wait_s: float = 0.01  # calls: how long a batch waits to fill
    max_images_per_request: Optional[int] = None  # default: max_batch
    max_queued_requests: int = 64  # beyond these (waiting for a replica) a request is answered 503 at once
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = 20.0  # the whole request body within this, or 408
    api_key: Optional[str] = None
    shutdown_timeout_s: float = 60.0  # in-flight requests get this long to finish on shutdown


class Server:
    """A running `lantern-run serve`: the HTTP front at `url` and the Ray application behind it."""

    def __init__(self, front, url):
        self.front, self.url = front, url

    def stop(self):
        """Stop taking requests, let Serve drain in-flight ones (shutdown_timeout_s), stop Ray."""
        import ray
        from ray import serve

        self.front.stop()
        serve.shutdown()
        ray.shutdown()


def start(engine_dir, options, host="127.0.0.1", port=8000, address=None, num_cpus=None, object_store_memory=None,
          log_to_driver=True):
    """Connect to (address) or start a Ray cluster, run the app and lantern's HTTP front on
    host:port (0: a free port; Server.url says which). Returns a Server."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    local_only = host in LOOPBACK and not address
    if local_only:  # Ray's single-machine mode: the node's address is 127.0.0.1 (read at import)
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray._private import ray_constants

    from lantern.tools.serve_app import build_app

    if local_only:
        # Ray imported before the variable was set (in a test, an embedding program) read it already;
        # with it off, a node address of 127.0.0.1 makes gcs, raylet, workers and agents bind to it
        ray_constants.ENABLE_RAY_CLUSTER = False
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=log_to_driver)
    else:
        ray.init(num_cpus=num_cpus, object_store_memory=object_store_memory, include_dashboard=False,
                 log_to_driver=log_to_driver, _node_ip_address="127.0.0.1" if local_only else None)
    from ray import serve

    try:
        if local_only and ray.util.get_node_ip_address() != "127.0.0.1":
            raise LanternError(f"Ray's node took address {ray.util.get_node_ip_address()}, not the loopback; "
                               f"refusing to expose its ports for a --host {host} endpoint")
        serve.start(proxy_location="Disabled")
        handle = serve.run(build_app(engine_dir, options), name="lantern", route_prefix=None)
        front = Front(handle, api_key=options.api_key, max_body_bytes=options.max_body_bytes,
                      body_timeout_s=options.body_timeout_s)
        server = FrontServer(front, host, port)
    except BaseException:
        serve.shutdown()
        ray.shutdown()
        raise
    return Server(server, f"http://{host}:{server.port}")


def add_parser(sub):
    p = sub.add_parser("serve", help="serve an engine over HTTP on Ray Serve (POST /v1/images)")
    p.add_argument("engine", help="engine directory (on every node of the cluster, at this path)")
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP proxy listens on")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", help="an existing Ray cluster (e.g. ray://head:10001 or auto); default: start one here")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--gpus-per-replica", type=float, default=0.0, help="1 pins one replica per GPU")
    p.add_argument("--cpus-per-replica", type=float, default=1.0)
    p.add_argument("--backend", default=DEFAULT, choices=names(export=False),  # the runtime opens these alone
                   help=f"the runner (default {DEFAULT})")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per replica")
    p.add_argument("--max-batch", type=int, default=8, help="images a replica runs at once")
    p.add_argument("--batching", choices=BATCHING, default="continuous",
                   help="continuous: images join a running batch at any step and leave when done (default); "
                        "calls: one generate call per group of requests, run to its slowest image (for comparison)")
    p.add_argument("--batch-wait-ms", type=float, default=10.0, help="--batching calls: how long a batch waits to fill")
    p.add_argument("--max-images-per-request", type=int, default=None, help="default: --max-batch")
    p.add_argument("--max-queued-requests", type=int, default=64, help="beyond these a request is answered 503 at once")
    p.add_argument("--body-timeout-s", type=float, default=20.0, help="a request body must arrive within this (408)")
    p.add_argument("--api-key-file", help="file holding the API key every route but /healthz requires")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray node (without --address)")
    p.set_defaults(func=run_serve)


def options_from(args):
    return ServeOptions(backend=args.backend, threads=args.threads, replicas=args.replicas,
                        gpus_per_replica=args.gpus_per_replica, cpus_per_replica=args.cpus_per_replica,
                        max_batch=args.max_batch, batching=args.batching, batch_wait_s=args.batch_wait_ms / 1000,
                        max_images_per_request=args.max_images_per_request,
                        max_queued_requests=args.max_queued_requests, body_timeout_s=args.body_timeout_s,
                        api_key=read_api_key(args.api_key_file) if args.api_key_file else None)


def check_memory(engine_dir, manifest, options):
    """Refuse, in one line before Ray starts, replicas this machine cannot hold: each holds the
    step plan of its widest call (max_batch images with CFG, over the exported tree and every
    tuned one), as generate refuses one."""
    dtype = np.dtype(np.float16 if manifest.dtype == "fp16" else np.float32)  # the runners' cache dtype
    prefix = condition_adapter(manifest, dtype, engine_dir).prefix(
        True, **default_condition(manifest, options.max_batch))
    trees = [build_tree(manifest.tree) if manifest.tree else root_only()]
    trees += [build_tree(inside(engine_dir, t.file)) for entry in manifest.tuned_trees.values() for t in entry.trees
              if t.file is not None]
    for tree in trees:
        check_plan_memory(manifest, tree, prefix, dtype.itemsize, available_memory(), copies=options.replicas)


def run_serve(args):
    options = options_from(args)
    manifest = read_manifest(args.engine)  # an engine that cannot open is one error line here, before Ray starts
    if not args.address:  # a cluster's replicas run on its nodes, with memory of their own
        check_memory(args.engine, manifest, options)
    server = start(args.engine, options, host=args.host, port=args.port, address=args.address, num_cpus=args.num_cpus)
    print(f"serving {args.engine} on {server.url}/v1/images "
          f"({json.dumps({k: v for k, v in asdict(options).items() if k != 'api_key'})}); Ctrl-C stops",
          flush=True)
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    finally:  # Serve drains in-flight requests for up to shutdown_timeout_s, then stops
        server.stop()
    return 0
