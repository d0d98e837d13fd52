"""Benchmark the codebook neighbor table at LlamaGen's size: 16384 random unit codes of dimension
8, k = all (16383 per code). Prints one JSON object; the goal is < 60 s and < 2 GiB peak RSS on
a 2-core machine.

    python -m lantern.tools.bench.neighbors [--codes N] [--dim D] [--k K] [--threads T]
"""
import argparse
import json
import os
import platform
import resource
import sys
import time

import numpy as np

from lantern.export.neighbors import nearest_neighbors, usable_cpus


def peak_rss_mib():
    # ru_maxrss is KiB on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024 if sys.platform == "darwin" else 1024)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codes", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--k", type=int, default=None, help="default: all (codes - 1)")
    parser.add_argument("--threads", type=int, default=None, help="default: all usable CPUs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    codes = rng.standard_normal((args.codes, args.dim)).astype(np.float32)
    codes /= np.linalg.norm(codes, axis=1, keepdims=True)
    rss_before = peak_rss_mib()
    start = time.perf_counter()
    table = nearest_neighbors(codes, k=args.k, threads=args.threads)
    seconds = time.perf_counter() - start
    peak = peak_rss_mib()
    print(json.dumps({
        "codes": args.codes, "dim": args.dim, "k": int(table.shape[1]), "dtype": str(table.dtype),
        "output_mib": round(table.nbytes / 2**20, 1),
        "seconds": round(seconds, 2),
        "peak_rss_mib": round(peak, 1), "rss_before_mib": round(rss_before, 1),
        "threads": args.threads or usable_cpus(), "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpu": platform.processor() or platform.machine(), "numpy": np.__version__,
        "goal": {"seconds": 60, "peak_rss_mib": 2048},
        "ok": seconds < 60 and peak < 2048,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
