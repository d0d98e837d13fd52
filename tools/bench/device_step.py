"""Acceptance per step, host path vs device path, on GPT-B shapes (vocabulary 16384, a 1000-wide
neighbor table), as JSON. Host path: the verification logits cross to the host
([rows, nodes, V] float32) and the numpy rules run there (CFG combination included, as the loop
does it). Device path: the greedy acceptance graph (lantern.export.accept_graphs) runs where the
logits are; only the outcome crosses back. Both are timed on ONNX Runtime CPU / numpy here, side
by side in one run; on a CPU "device" and host are the same memory, so the bytes are what a GPU
would move, and the times say what acceptance costs on each path on this machine.

    python -m lantern.tools.bench.device_step [--tree mc_sim_7b_63] [--cfg-scale 4] [--batch 1 8]
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


def host_accept(tree, raw, images, scale, tokens, rule, neighbors):
    logits = raw.copy()  # the device -> host copy of the verification logits
    if len(raw) > images:
        cond, uncond = logits[:images], logits[images:]
        logits = uncond + np.float32(scale) * (cond - uncond)
    return acceptance.accept_greedy_batch(tree, tokens, logits, rule, neighbors)


def make_case(tree, images, cfg, rule, rng, vocab=VOCAB, table=TABLE):
    """Random verification logits [rows, nodes, vocab] with drafts that are often the parent's
    argmax, a neighbor table, and the acceptance graph's feeds (numpy)."""
    rows = 2 * images if cfg > 1 else images
    M = tree.num_nodes
    raw = rng.normal(size=(rows, M, vocab)).astype(np.float32) * 3
    neighbors = np.stack([rng.permutation(vocab)[:table] for _ in range(64)])[rng.integers(0, 64, vocab)]
    neighbors = neighbors.astype(np.int64)
    top = raw[:images].argmax(axis=2)
    parents = np.maximum(tree.parents, 0)
    tokens = np.where(rng.random((images, M)) < 0.6, top[:, parents], rng.integers(0, vocab, (images, M)))
    cond_rows = np.arange(images)
    feeds = dict(logits=raw, cond_rows=cond_rows, uncond_rows=cond_rows + images if cfg > 1 else cond_rows,
                 cfg_scale=np.array([cfg], np.float32), cfg_interval=np.array([-1]),
                 count=np.ones(images, np.int64), forced_columns=np.full(2048, -1, np.int64), tokens=tokens,
                 neighbors=neighbors, k=np.array([rule.k]), lam=np.array([getattr(rule, "lam", 1.0)], np.float32),
                 delta=np.array([getattr(rule, "delta", 0.0)], np.float32))
    return feeds


def _record(tree, images, cfg, rule, feeds, host_ms, device_ms, same):
    outcome_bytes = images * 8 * (2 + tree.depth + 1)  # accepted, next token, path
    return {
        "tree": tree.name, "nodes": tree.num_nodes, "images": images, "cfg": cfg,
        "mode": "ar" if not tree.depth else rule.name,
        "host_path": {"bytes_device_to_host": feeds["logits"].nbytes, "bytes_host_to_device": feeds["tokens"].nbytes,
                      "syncs": 1, "launches": 0, "accept_ms": round(host_ms, 3)},
        "device_path": {"bytes_device_to_host": outcome_bytes,
                        "bytes_host_to_device": feeds["tokens"].nbytes + feeds["count"].nbytes,
                        "syncs": 1, "launches": 1, "accept_ms": round(device_ms, 3)},
        "device_over_host": round(device_ms / host_ms, 2),
        "same_outcome": same,
    }


def _host(tree, images, cfg, rule, feeds):
    return host_accept(tree, feeds["logits"], images, cfg, feeds["tokens"], rule, feeds["neighbors"])


def bench(tree, images, cfg, rule, session, repeats, rng):
    feeds = make_case(tree, images, cfg, rule, rng)
    outputs = ["accepted", "next_token", "path"]
    host = median_ms(lambda: _host(tree, images, cfg, rule, feeds), repeats)
    device = median_ms(lambda: session.run(outputs, feeds), repeats)
    want, got = _host(tree, images, cfg, rule, feeds), session.run(outputs, feeds)
    same = bool(np.array_equal(got[0], want.accepted) and np.array_equal(got[1], want.next_token))
    return _record(tree, images, cfg, rule, feeds, host, device, same)


def device_acceptance(device, batches=(1, 8), repeats=10, cfg=4.0, tree_name="mc_sim_7b_63", vocab=VOCAB,
                      table=TABLE):
    """gpu_check's device-path section: per step, the host path (verification logits copied to
    the host, numpy acceptance) against the acceptance module run on `device` where the logits
    are (the node tokens go up, the outcome comes back), timed with the device synchronised;
    one record per tree, rule and batch."""
    import torch

    from lantern.export.accept_graphs import INPUTS, GreedyAcceptance

    def sync():
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()

    rng = np.random.default_rng(0)
    results = []
    for tree in (root_only(), build_tree(tree_name)):
        module = GreedyAcceptance(tree, np.arange(vocab), vocab).to(device)
        table = min(table, vocab - 1)
        rules = [acceptance.Exact()] if not tree.depth else [acceptance.Exact(),
                                                             acceptance.LanternPP(k=min(100, table), lam=2.0)]
        for rule in rules:
            for images in batches:
                feeds = make_case(tree, images, cfg, rule, rng, vocab, table)
                on_device = {k: torch.as_tensor(v).to(device) for k, v in feeds.items()}
                logits = on_device["logits"]

                def host_step():
                    copied = {**feeds, "logits": logits.cpu().numpy()}
                    return _host(tree, images, cfg, rule, copied)

                def device_step():
                    step = {**on_device, "tokens": torch.as_tensor(feeds["tokens"]).to(device)}
                    with torch.no_grad():
                        out = module(*(step[name] for name in INPUTS))
                    return [o.cpu().numpy() for o in out[:3]]

                host = median_ms(lambda: (sync(), host_step()), repeats)
                dev = median_ms(lambda: (sync(), device_step()), repeats)
                want, got = host_step(), device_step()
                same = bool(np.array_equal(got[0], want.accepted) and np.array_equal(got[1], want.next_token)
                            and np.array_equal(got[2], want.path))
                results.append(dict(_record(tree, images, cfg, rule, feeds, host, dev, same), device=str(device)))
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", default="mc_sim_7b_63")
    p.add_argument("--cfg-scale", type=float, default=4.0)
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
                    results.append(bench(tree, images, args.cfg_scale, rule, session, args.repeats, rng))
    print(json.dumps({"benchmark": "device_step_acceptance", "vocab": VOCAB, "neighbor_table": TABLE,
                      "threads": args.threads, "backend": "onnxruntime-cpu", "results": results}, indent=1))


if __name__ == "__main__":
    main()
