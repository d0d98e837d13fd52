"""The acceptance graphs on ONNX Runtime CPU against the numpy host path, per acceptance call, on
GPT-B shapes: vocabulary 16384 (every id an image code), mc_sim_7b_63 (26 nodes), CFG scale 4
(2 rows per image), a 1000-wide neighbor table, the drafter's 2048 candidates per node. Prints JSON.

    python -m lantern.tools.bench.accept_graphs [--batch 1 4] [--repeats 5] [--threads 2] [--cases 20]

Per kind (greedy, sampling), rule (exact; LANTERN++ k 1000, lam 2) and batch: the median ms of
one graph call (session.run, feeds already in place) and of the host path (the logits copied as
the loop copies them off the device, the CFG combination, lantern.runtime.accept), and whether
they decided the same. Sampling runs with top-k 2000 (LlamaGen's default), temperature 1, drafts
drawn from a drafter that is a noisy copy of the target by the loop's exponential race, the
uniforms as the streams draw them. Then the float32 disagreement rate: over --cases random
steps per batch, how many images' accepted paths (and next tokens, on an agreeing path) the
float32 graph decided differently from the float64 specification.
"""
import argparse
import json
import os
import tempfile
import time

import numpy as np

from lantern.runtime import accept as acceptance
from lantern.runtime.sampling import Sampling
from lantern.runtime.tree import build_tree
from lantern.tools.bench.device_step import median_ms

VOCAB, TABLE, CANDIDATES, CFG = 16384, 1000, 2048, 4.0
TOP_K = 2000


def make_case(tree, images, rule, rng, kind, table):
    """Random CFG verification logits [2N, M, V], drafts and the graph's feeds."""
    M = tree.num_nodes
    raw = (rng.normal(size=(2 * images, M, VOCAB)) * 2.5).astype(np.float32)
    combined = raw[images:] + np.float32(CFG) * (raw[:images] - raw[images:])
    cond_rows = np.arange(images)
    feeds = dict(logits=raw, cond_rows=cond_rows, uncond_rows=cond_rows + images, cfg_scale=np.array([CFG], np.float32),
                 cfg_interval=np.array([-1]), count=np.ones(images, np.int64),
                 forced_columns=np.full(256, -1, np.int64))
    parents = np.maximum(tree.parents, 0)
    if kind == "greedy":
        top = combined.argmax(axis=2)
        tokens = np.where(rng.random((images, M)) < 0.6, top[:, parents], rng.integers(0, VOCAB, (images, M)))
    else:
        noisy = combined + rng.normal(size=combined.shape).astype(np.float32) * 2.0
        ids = np.argpartition(-noisy, CANDIDATES, axis=2)[..., :CANDIDATES]
        q = np.exp(np.take_along_axis(noisy, ids, axis=2) - noisy.max(axis=2, keepdims=True))
        probs = (q / q.sum(axis=2, keepdims=True)).astype(np.float32)
        tokens = np.zeros((images, M), dtype=np.int64)
        race = rng.random((images, M, CANDIDATES))
        for level in tree.levels:
            drawn = Sampling().children(ids[:, level.parents], probs[:, level.parents], level.width,
                                        race[:, level.parents])
            tokens[:, level.nodes] = drawn[:, np.arange(len(level.nodes)), level.ranks]
        feeds.update(draft_ids=ids.astype(np.int64), draft_probs=probs,
                     uniforms=rng.random((images, M)).astype(np.float32))
    tokens[:, 0] = rng.integers(0, VOCAB, images)
    feeds.update(tokens=tokens, neighbors=table, k=np.array([rule.k]),
                 lam=np.array([getattr(rule, "lam", 1.0)], np.float32), delta=np.zeros(1, np.float32))
    if kind == "sampling":
        feeds.update(temperature=np.ones(1, np.float32), top_k=np.array([TOP_K]), top_p=np.ones(1, np.float32))
    return feeds


def host_path(tree, kind, rule, feeds, images):
    raw = feeds["logits"].copy()  # the device -> host copy of the verification logits
    cond, uncond = raw[:images], raw[images:]
    logits = uncond + np.float32(CFG) * (cond - uncond)
    if kind == "greedy":
        return acceptance.accept_greedy_batch(tree, feeds["tokens"], logits, rule, feeds["neighbors"])
    return acceptance.accept_sampling_batch(tree, feeds["tokens"], logits, feeds["draft_ids"], feeds["draft_probs"], rule,
                                            feeds["uniforms"], feeds["neighbors"], top_k=TOP_K)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cases", type=int, default=20, help="random steps per batch for the float32 disagreement rate")
    p.add_argument("--tree", default="mc_sim_7b_63")
    args = p.parse_args(argv)
    import onnxruntime as ort

    from lantern.export.accept_graphs import OUTPUTS, export_acceptance

    tree = build_tree(args.tree)
    rng = np.random.default_rng(0)
    table = np.stack([rng.permutation(VOCAB)[:TABLE] for _ in range(64)])[rng.integers(0, 64, VOCAB)].astype(np.int64)
    rules = [acceptance.Exact(), acceptance.LanternPP(k=TABLE, lam=2.0)]
    results, disagreement = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("greedy", "sampling"):
            path = os.path.join(tmp, f"{kind}.onnx")
            start = time.perf_counter()
            export_acceptance(tree, np.arange(VOCAB), VOCAB, VOCAB, path, kind=kind, candidates=CANDIDATES)
            export_s = time.perf_counter() - start
            options = ort.SessionOptions()
            options.intra_op_num_threads = args.threads
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            for rule in rules:
                for images in args.batch:
                    feeds = make_case(tree, images, rule, rng, kind, table)
                    graph_ms = median_ms(lambda: session.run(list(OUTPUTS), feeds), args.repeats)
                    host_ms = median_ms(lambda: host_path(tree, kind, rule, feeds, images), args.repeats)
                    got = dict(zip(OUTPUTS, session.run(list(OUTPUTS), feeds)))
                    want = host_path(tree, kind, rule, feeds, images)
                    results.append({"kind": kind, "mode": rule.name, "k": rule.k, "images": images,
                                    "graph_ms": round(graph_ms, 2), "host_ms": round(host_ms, 2),
                                    "graph_over_host": round(graph_ms / host_ms, 2), "export_s": round(export_s, 1),
                                    "same_path": bool(np.array_equal(got["path"], want.path)),
                                    "same_next_token": bool(np.array_equal(got["next_token"], want.next_token))})
            for rule in rules:
                paths = tokens = images_seen = 0
                for _ in range(args.cases):
                    images = max(args.batch)
                    feeds = make_case(tree, images, rule, rng, kind, table)
                    got = dict(zip(OUTPUTS, session.run(list(OUTPUTS), feeds)))
                    want = host_path(tree, kind, rule, feeds, images)
                    same = (got["path"] == want.path).all(axis=1)
                    images_seen += images
                    paths += int((~same).sum())
                    tokens += int((same & (got["next_token"] != want.next_token)).sum())
                disagreement.append({"kind": kind, "mode": rule.name, "images": images_seen, "paths_differ": paths,
                                     "next_tokens_differ": tokens})
    print(json.dumps({"benchmark": "acceptance_graphs", "backend": "onnxruntime-cpu", "threads": args.threads,
                      "vocab": VOCAB, "tree": tree.name, "nodes": tree.num_nodes, "cfg_scale": CFG,
                      "neighbor_table": TABLE, "candidates": CANDIDATES, "top_k": TOP_K, "results": results,
                      "float32_vs_spec": disagreement}, indent=1))


if __name__ == "__main__":
    main()
