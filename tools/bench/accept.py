"""How much of a decoding step does host-side acceptance cost? Prints JSON.

    python -m lantern.tools.bench.accept [--repeats 200] [--seed 0]

Times greedy acceptance (LANTERN++, k = 1000) and sampling acceptance (LANTERN++, top-k 2000, the
drafter's 2048 candidates per node as its graph returns them) for one image on the 57-node tree (`naive_extend_57`) over a 16384-token vocabulary, and divides each median by the
time of one tree-verification step of a GPT-B-shaped target. No engine exists yet, so the step is
a stand-in, named as such in the output: numpy fp32 matmuls with the shapes and FLOPs of GPT-B
verifying 58 tokens (root + 57 nodes) against 256 cached positions on 2 BLAS threads
(12 layers, dim 768, FFN 2048 = find_multiple(int(2*4*768/3), 256), vocab 16384; FLOPs =
2 * params * T for the weights plus 4 * T * (past + T) * dim per layer for attention; no
softmax, norms or activations). The goal is acceptance <= 5% of that step.

Inputs are synthetic: logits ~ N(0, 2.5^2), a drafter that is a noisy copy of the target, a
random neighbor table of the real shape [16384, 16383] uint16 (only its first k columns are
read). Two greedy cases: drafts sampled from the drafter (typical), and every draft its
parent's argmax (all 57 nodes evaluated: the worst case).
"""
import os
import sys

# The stand-in step runs on 2 BLAS threads, like the CPU engine measurements (REFERENCE.md §6).
# OpenBLAS reads this when numpy loads, so it must be set before numpy is imported.
_NUMPY_WAS_LOADED = "numpy" in sys.modules
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "2")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from lantern.runtime.accept import LanternPP, accept_greedy, accept_sampling_batch, filtered_probs  # noqa: E402
from lantern.runtime.tree import build_tree  # noqa: E402
from lantern.runtime.generator import Engine
from lantern.tools.latency import verify_latency

GPT_B = dict(layers=12, dim=768, heads=12, ffn=2048, vocab=16384)
PAST = 256
GOAL = 0.05


def _summary(seconds):
    """Median (the figure used), plus p90 and min: a min far below the median means the machine
    was busy during the run."""
    return dict(median_ms=float(np.median(seconds) * 1e3), p90_ms=float(np.percentile(seconds, 90) * 1e3),
                min_ms=float(np.min(seconds) * 1e3))


def stand_in_step(tokens, repeats, rng):
    """Median ms of the matmuls of one GPT-B tree-verification step, and its FLOPs."""
    c = GPT_B
    d, f, h, s = c["dim"], c["ffn"], c["heads"], PAST + tokens
    hd = d // h

    def weight(rows, cols):  # variance-preserving scale keeps activations finite without norms
        return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(rows ** -0.5)

    layers = [dict(wqkv=weight(d, 3 * d), wo=weight(d, d), w13=weight(d, 2 * f), w2=weight(f, d))
              for _ in range(c["layers"])]
    head = weight(d, c["vocab"])
    keys = np.stack([weight(hd, s) for _ in range(h)])  # [h, hd, S]
    values = np.stack([weight(s, hd) for _ in range(h)])  # [h, S, hd]
    x0 = rng.standard_normal((tokens, d), dtype=np.float32)

    def step():
        x = x0
        for w in layers:
            qkv = x @ w["wqkv"]
            q = qkv[:, :d].reshape(tokens, h, hd).transpose(1, 0, 2)
            att = (q @ keys) @ values  # [h, T, S] then [h, T, hd]
            x = att.transpose(1, 0, 2).reshape(tokens, d) @ w["wo"]
            x = (x @ w["w13"])[:, :f] @ w["w2"]
        return x @ head

    params = c["layers"] * (4 * d * d + 3 * d * f) + d * c["vocab"]
    flops = 2 * params * tokens + c["layers"] * 4 * tokens * s * d
    step()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return _summary(times), flops, params


def _engine_step(directory, tokens, acceptance_ms):
    """The real thing: one `tokens`-token verification on an exported engine (ONNX Runtime CPU,
    2 threads, context PAST), and the acceptance timings as fractions of it."""

    engine = Engine(directory, threads=2)
    step_ms = 1e3 * verify_latency(engine, (tokens,), context=PAST)[tokens]
    return {"engine": os.path.abspath(directory), "model": engine.manifest.model.get("config_name"),
            "median_ms": step_ms, "acceptance_fractions": [ms / step_ms for ms in acceptance_ms],
            "meets_goal": bool(max(acceptance_ms) / step_ms <= GOAL)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", help="also time the real tree-verification step of this engine directory "
                                         "(e.g. the GPT-B engine `bench_runtime --engine DIR` builds in DIR/engine)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)

    tree = build_tree("naive_extend_57")
    n, vocab, k, top_k = tree.num_nodes, GPT_B["vocab"], 1000, 2000
    rule = LanternPP(k=k, lam=5.0)
    candidates = 2048
    logits = (rng.standard_normal((n, vocab), dtype=np.float32) * 2.5)
    drafter_logits = logits + rng.standard_normal((n, vocab), dtype=np.float32)
    table = rng.integers(0, vocab - 1, size=(vocab, vocab - 1), dtype=np.uint16)
    table += table >= np.arange(vocab, dtype=np.uint16)[:, None]  # skip self: ids != row

    def draft(q, gen):
        """Drafts from q without replacement (Gumbel top-k), in rank order, per node."""
        tokens = np.zeros(n, dtype=np.int64)
        for node, kids in enumerate(tree.children):
            if kids:
                with np.errstate(divide="ignore"):
                    keys = np.log(q[node]) + gen.gumbel(size=vocab)
                best = np.argpartition(-keys, len(kids))[:len(kids)]
                tokens[list(kids)] = best[np.argsort(-keys[best])]
        return tokens

    # greedy: drafts from the unfiltered drafter, and the all-accepted worst case
    q_greedy = filtered_probs(drafter_logits)
    typical = [draft(q_greedy, rng) for _ in range(20)]
    top = logits.argmax(axis=1)
    worst = np.zeros(n, dtype=np.int64)
    worst[1:] = top[tree.parents[1:]]
    greedy = {}
    for case, token_sets in (("drafts_from_drafter", typical), ("all_accepted", [worst])):
        lengths = [accept_greedy(tree, t, logits, rule, table).accept_length for t in token_sets]
        times = []
        for r in range(args.repeats):
            tokens = token_sets[r % len(token_sets)]
            start = time.perf_counter()
            accept_greedy(tree, tokens, logits, rule, table)
            times.append(time.perf_counter() - start)
        greedy[case] = dict(_summary(times), mean_accept_length=float(np.mean(lengths)))

    # sampling, top-k 2000: target and drafter filtered alike; the drafter's K best candidates
    q_sampling = filtered_probs(drafter_logits, top_k=top_k)
    ids = np.argsort(-q_sampling, axis=1, kind="stable")[:, :candidates]
    probs = np.take_along_axis(q_sampling, ids, axis=1)
    probs /= probs.sum(axis=1, keepdims=True)
    q_sparse = np.zeros_like(q_sampling)
    np.put_along_axis(q_sparse, ids, probs, axis=1)
    cases = [draft(q_sparse, rng) for _ in range(args.repeats)]
    lengths = []
    times = []
    for tokens in cases:
        uniforms = rng.random((1, n))
        start = time.perf_counter()
        got = accept_sampling_batch(tree, tokens[None], logits[None], ids[None], probs[None], rule, uniforms, table,
                                    top_k=top_k)
        times.append(time.perf_counter() - start)
        lengths.append(int(got.accepted[0]))
    sampling = dict(_summary(times), mean_accept_length=float(np.mean(lengths)))

    step, flops, params = stand_in_step(n, repeats=max(5, min(20, args.repeats)), rng=rng)
    step_ms = step["median_ms"]
    for entry in list(greedy.values()) + [sampling]:
        entry["fraction_of_step"] = entry["median_ms"] / step_ms
    worst_fraction = max(e["fraction_of_step"] for e in list(greedy.values()) + [sampling])

    report = {
        "tree": tree.name, "tree_tokens": n, "vocab": vocab,
        "rule": dict(mode=rule.name, k=rule.k, lam=rule.lam), "drafter_candidates": candidates,
        "greedy_lanternpp": greedy,
        "sampling_lanternpp_topk2000": dict(top_k=top_k, temperature=1.0, top_p=1.0, **sampling),
        "step_stand_in": {
            "name": "numpy_fp32_matmul_stand_in_for_gpt_b_tree_verification_step",
            "what": "matmuls only, GPT-B shapes: 12 layers, dim 768, 12 heads, FFN 2048, vocab 16384, "
                    f"T = {n} tokens, past {PAST}; not an engine",
            "params_in_matmuls": params, "flops": flops, **step,
            "gflop_per_s": flops / step_ms / 1e6,
            "blas_threads": "unknown: numpy was imported before the benchmark set it" if _NUMPY_WAS_LOADED
            else os.environ["OPENBLAS_NUM_THREADS"],
        },
        "goal_fraction_of_step": GOAL,
        "meets_goal": bool(worst_fraction <= GOAL),
    }
    if args.engine:
        report["engine_step"] = _engine_step(args.engine, n, [greedy[c]["median_ms"] for c in greedy]
                                             + [sampling["median_ms"]])
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
