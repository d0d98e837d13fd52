"""Acceptance per step, host path vs device path, on GPT-B shapes (vocabulary 16384, a 1000-wide
neighbour table), as JSON. Host path: the verification logits cross to the host
([rows, nodes, V] float32) and the numpy rules run there (CFG combination included, as the loop
does it). Device path: the greedy acceptance graph (lantern.export.accept_graphs) runs where the
logits are; only the outcome crosses back. Both are timed on ONNX Runtime CPU / numpy here, side
by side in one run; on a CPU "device" and host are the same memory, so the bytes are what a GPU
would move, and the times say what acceptance costs on each path on this machine.

    python -m lantern.tools.bench_device_step [--tree mc_sim_7b_63] [--cfg 4] [--batch 1 8]
        [--threads 2] [--repeats 30]

What it does not measure yet: the whole step on the device (drafting and bookkeeping as graphs,
one CUDA graph per step), and any GPU.
"""
import argparse
import json
import os
import tempfile
import time

import numpy as np

from lantern.runtime import accept as acceptance
from lantern.runtime.tree import build_tree, root_only

VOCAB, TABLE = 16384, 1000


def median_ms(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * float(np.median(times))


def host_accept(tree, raw, images, scale, tokens, rule, neighbours):
    logits = raw.copy()  # the device -> host copy of the verification logits
    if len(raw) > images:
        cond, uncond = logits[:images], logits[images:]
        logits = uncond + np.float32(scale) * (cond - uncond)
    return acceptance.accept_greedy_batch(tree, tokens, logits, rule, neighbours)


def bench(tree, images, cfg, rule, session, repeats, rng):
    rows = 2 * images if cfg > 1 else images
    M = tree.num_nodes
    raw = rng.normal(size=(rows, M, VOCAB)).astype(np.float32) * 3
    neighbours = np.stack([rng.permutation(VOCAB)[:TABLE] for _ in range(64)])[rng.integers(0, 64, VOCAB)]
    neighbours = neighbours.astype(np.int64)
    top = raw[:images].argmax(axis=2)
    parents = np.maximum(tree.parents, 0)
    tokens = np.where(rng.random((images, M)) < 0.6, top[:, parents], rng.integers(0, VOCAB, (images, M)))
    cond_rows = np.arange(images)
    feeds = dict(logits=raw, cond_rows=cond_rows, uncond_rows=cond_rows + images if cfg > 1 else cond_rows,
                 cfg_scale=np.array([cfg], np.float32), cfg_interval=np.array([-1]),
                 count=np.ones(images, np.int64), forced_columns=np.full(2048, -1, np.int64), tokens=tokens,
                 neighbours=neighbours, k=np.array([rule.k]), lam=np.array([getattr(rule, "lam", 1.0)], np.float32),
                 delta=np.array([getattr(rule, "delta", 0.0)], np.float32))
    outputs = ["accepted", "next_token", "path"]
    host = median_ms(lambda: host_accept(tree, raw, images, cfg, tokens, rule, neighbours), repeats)
    device = median_ms(lambda: session.run(outputs, feeds), repeats)
    want = host_accept(tree, raw, images, cfg, tokens, rule, neighbours)
    got = session.run(outputs, feeds)
    agree = bool(np.array_equal(got[0], want.accepted) and np.array_equal(got[1], want.next_token))
    outcome_bytes = images * 8 * (2 + tree.depth + 1)
    return {
        "tree": tree.name, "nodes": M, "images": images, "cfg": cfg, "mode": "ar" if not tree.depth else rule.name,
        "host_path": {"bytes_device_to_host": raw.nbytes, "bytes_host_to_device": tokens.nbytes, "syncs": 1,
                      "launches": 0, "accept_ms": round(host, 3)},
        "device_path": {"bytes_device_to_host": outcome_bytes, "bytes_host_to_device": tokens.nbytes + 8 * images,
                        "syncs": 1, "launches": 1, "accept_ms": round(device, 3)},
        "device_over_host": round(device / host, 2),
        "same_outcome": agree,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", default="mc_sim_7b_63")
    p.add_argument("--cfg", type=float, default=4.0)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args(argv)
    import onnxruntime as ort

    from lantern.export.accept_graphs import export_acceptance

    rng = np.random.default_rng(0)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for tree in (root_only(), build_tree(args.tree)):
            path = os.path.join(tmp, f"accept-{tree.num_nodes}.onnx")
            export_acceptance(tree, np.arange(VOCAB), VOCAB, VOCAB, path)
            options = ort.SessionOptions()
            options.intra_op_num_threads = args.threads
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            rules = [acceptance.Exact()] if not tree.depth else [acceptance.Exact(),
                                                                 acceptance.LanternPP(k=100, lam=2.0)]
            for rule in rules:
                for images in args.batch:
                    results.append(bench(tree, images, args.cfg, rule, session, args.repeats, rng))
    print(json.dumps({"benchmark": "device_step_acceptance", "vocab": VOCAB, "neighbour_table": TABLE,
                      "threads": args.threads, "backend": "onnxruntime-cpu", "results": results}, indent=1))


if __name__ == "__main__":
    main()
