"""Serving benchmark: `lantern-run serve` (its HTTP front and Ray application, as the command
runs them) on this machine, loopback only, under 1, 8, 32, 64 and 128 concurrent clients, with 1
and 2 replicas, continuous batching (the server's default) and per-call batching (`--batching
calls`, the way before) side by side. Prints JSON: throughput (images/s), p50/p95/p99 latency,
mean images per generate call and the engines' busy share (from the answers' own timings) per
level, whether every answer is token-equal to direct generation of the same request, and the
memory (RSS) of all Ray processes.

    python -m lantern.tools.bench.serve engines/demo --max-batch 8

With continuous batching there are no generate calls: an answer's `requested_images` is the
number of images its steps ran beside, itself included (the mean over its steps), and its
`generate_seconds` the time of its prefill and those steps, so "images per call" is the running
batch's mean occupancy and the busy share the engine's.

Requests sample (default mode ar with CFG, the fastest on a CPU for the demo model), one image
each: request i asks for class i % C with seed i % 3C, so the expected tokens of every request
come from 3C directly generated images (per-image seeds) before the server starts.
"""
import argparse
import concurrent.futures
import contextlib
import json
import os
import sys
import time

import numpy as np
from lantern.runtime.generator import Engine
from lantern.tools.image_service import ImageService
from lantern.tools.serve import ServeOptions, start
from lantern.tools.serve_client import post


def process_family(root_pid):
    """root_pid and every descendant (Ray's processes are the driver's), read from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    family, frontier = {root_pid}, [root_pid]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in family:
                family.add(child)
                frontier.append(child)
    return family


def _tree_rss(root_pid):
    """Bytes resident in root_pid and all its descendants."""
    family = process_family(root_pid)
    total = 0
    for pid in family:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def _request(i, classes):
    return int(classes[i % len(classes)]), i % (3 * len(classes))  # class, seed


def _level(url, clients, requests, settings, classes, expected, replicas):
    def one(i):
        c, seed = _request(i, classes)
        t = time.perf_counter()
        status, body = post(url, {"classes": [c], "seed": seed, "settings": settings}, timeout=600)
        seconds = time.perf_counter() - t
        if status != 200:
            return status, seconds, None, None, False, 0.0
        stats = body["stats"]
        correct = body["images"][0]["tokens"] == expected[c, seed]
        busy = stats["generate_seconds"] + stats["decode_seconds"]  # of the call this request rode in
        return status, seconds, stats["batch_images"], stats["requested_images"], correct, busy

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(one, range(requests)))
    wall = time.perf_counter() - start
    ok = [a for a in answers if a[0] == 200]
    latency = np.array([a[1] for a in ok]) if ok else np.zeros(1)
    # one image per request: a call that served r requests is seen r times, each with requested_images r
    calls = sum(1 / a[3] for a in ok)
    busy = sum(a[5] / a[3] for a in ok)
    return {
        "clients": clients,
        "requests": requests,
        "answered_200": len(ok),
        "statuses": sorted({a[0] for a in answers}),
        "all_correct": all(a[4] for a in answers),
        "images_per_s": len(ok) / wall,
        # per request: the size of the generate call it rode in (padding included)
        "mean_batch_images": float(np.mean([a[2] for a in ok])) if ok else 0.0,
        "mean_batch_requested_images": float(np.mean([a[3] for a in ok])) if ok else 0.0,
        "mean_images_per_call": len(ok) / calls if ok else 0.0,
        "engine_busy_share": busy / (wall * replicas),
        "p50_s": float(np.percentile(latency, 50)),
        "p95_s": float(np.percentile(latency, 95)),
        "p99_s": float(np.percentile(latency, 99)),
        "seconds": wall,
    }


def _replicas(args, batching, replicas, levels, settings, classes, expected):
    """One server with this batching and this many replicas, measured at every level."""
    options = ServeOptions(threads=max(1, os.cpu_count() // replicas), replicas=replicas,
                           cpus_per_replica=min(1.0, os.cpu_count() / replicas), max_batch=args.max_batch,
                           batching=batching, batch_wait_s=args.batch_wait_ms / 1000,
                           max_queued_requests=max(args.clients) * 2)
    t = time.perf_counter()
    server = start(args.engine, options, port=0, num_cpus=os.cpu_count(), object_store_memory=100 * 2**20,
                   log_to_driver=False)  # stdout is the report
    try:
        url = server.url
        result = {"startup_s": time.perf_counter() - t, "levels": []}
        _level(url, 2, 4, settings, classes, expected, replicas)  # warm every replica's plans
        for clients, requests in levels:
            result["levels"].append(_level(url, clients, requests, settings, classes, expected, replicas))
            print(json.dumps(result["levels"][-1]), file=sys.stderr, flush=True)
        if args.long_run and replicas == max(args.replicas):
            result["long_run"] = _level(url, max(args.clients), args.long_run, settings, classes, expected,
                                        replicas)
        result["ray_rss_bytes"] = _tree_rss(os.getpid())
    finally:
        server.stop()
    return result


def run(args):
    settings = {"mode": args.mode, "cfg_scale": args.cfg_scale, "lam": args.lam, "k": args.k, "greedy": args.greedy}
    if args.proposer != "tree":
        settings.update(proposer=args.proposer, window=args.window)
    engine = Engine(args.engine, threads=1)
    service = ImageService(engine, max_batch=args.max_batch)  # the settings and tree the server will use
    probe = service.parse(json.dumps({"classes": [0], "settings": settings}).encode())
    classes = np.arange(engine.manifest.condition.num_classes)
    wanted = [_request(i, classes) for i in range(3 * len(classes))]
    expected = {}
    for first in range(0, len(wanted), len(classes)):
        part = wanted[first: first + len(classes)]
        tokens = engine.generate(probe.settings, classes=[c for c, _ in part], seed=[s for _, s in part],
                                 tree=service.tree_for(probe)).tokens
        expected.update({key: row.tolist() for key, row in zip(part, tokens)})
    del engine, service
    report = {"engine": os.path.abspath(args.engine), "settings": settings, "max_batch": args.max_batch,
              "cpus": os.cpu_count(), "load_average": os.getloadavg(), "batching": {}}
    levels = [(c, max(args.requests_per_client * c, 4 * c)) for c in args.clients]
    with contextlib.redirect_stdout(sys.stderr):  # Ray prints its shutdown notes to stdout; it holds the report
        for batching in args.batching:
            runs = {str(r): _replicas(args, batching, r, levels, settings, classes, expected) for r in args.replicas}
            report["batching"][batching] = dict(_summary(runs, args.replicas), replicas=runs)
    report["load_average_after"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    return 0


def _summary(runs, replicas):
    """Throughput past saturation (each level against the best), occupancy at 32+ clients, p95
    at 64, and what a second replica adds, for one batching."""
    one = runs[str(min(replicas))]["levels"]
    rate = {lv["clients"]: lv["images_per_s"] for lv in one}
    out = {"all_correct": all(lv["all_correct"] for r in runs.values() for lv in r["levels"])}
    if rate:
        peak = max(rate.values())
        out["vs_peak"] = {str(c): r / peak for c, r in rate.items()}
        out["last_vs_peak"] = rate[max(rate)] / peak
        busy = [lv["mean_images_per_call"] for lv in one if lv["clients"] >= 32]
        if busy:
            out["min_images_per_call_32_plus"] = min(busy)
        out["p95_s_64"] = next((lv["p95_s"] for lv in one if lv["clients"] == 64), None)
    if 1 in rate and 32 in rate:
        out["speedup_32_vs_1"] = rate[32] / rate[1]
    if len(replicas) > 1:
        a, b = (runs[str(r)]["levels"][-1]["images_per_s"] for r in (min(replicas), max(replicas)))
        out["speedup_replicas"] = b / a
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--long-run", type=int, default=1000, help="requests at the most clients (0: skip)")
    p.add_argument("--max-batch", type=int, default=16, help="images a replica runs at once (128 clients = 8x)")
    p.add_argument("--batching", nargs="+", choices=("continuous", "calls"), default=["continuous", "calls"],
                   help="the servers measured: continuous batching (the default) and per-call batching (before)")
    p.add_argument("--batch-wait-ms", type=float, default=100.0,
                   help="--batching calls: how long a batch waits to fill (20 ms measured: half-full batches at "
                        "32-64 clients)")
    p.add_argument("--mode", default="ar")
    p.add_argument("--proposer", default="tree", choices=("tree", "jacobi"), help="where drafts come from")
    p.add_argument("--window", type=int, default=6, help="--proposer jacobi: the window")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (default: sampling)")
    p.add_argument("--cfg-scale", type=float, default=3.0)
    p.add_argument("--lam", type=float, default=5.0)
    p.add_argument("--k", type=int, default=20)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
