"""TensorRT build benchmark: one optimization profile per call regime against one profile spanning
all regimes, for an engine directory's target and drafter graphs. Prints JSON: per graph and
strategy, the number of profiles, build seconds (median and min of --repeat builds) and plan size.

    python -m lantern.tools.bench_trt_build ENGINE_DIR [--batch 1 4] [--compute-capability 89]
        [--graphs target drafter] [--no-cfg] [--flavor tensorrt-rtx]

The call regimes follow the static step plan (PLAN_V2): prefill (target, T = condition tokens),
AR (target, T = 1), verify (target, T = tree nodes), draft0 (drafter, T = depth + 1) and one
drafter call per tree depth 1 .. depth-1 (T = nodes at that depth); the target's cache holds
condition + image tokens, the drafter's image tokens + nodes - 1. Shapes follow the engine's
current (v1) graph contracts: the target takes `inputs_embeds`, the drafter's `cond_batch` is a
shape tensor (its value N goes into each profile). Runtime latency needs a GPU; this measures
the build side only, on whatever machine runs it (TensorRT-RTX builds ahead of time on a CPU).
"""
import argparse
import json
import os
import statistics
import sys


def target_regimes(manifest, images, cfg=True):
    """{regime name: {input: shape}} of the target graph for `images` images."""
    io = manifest["graphs"]["target"]["io"]
    B = 2 * images if cfg else images
    dim = io["inputs_embeds"]["shape"][2]
    _, heads, _, head_dim = io["past_keys_0"]["shape"]
    C = manifest["condition"]["cls_token_num"]
    P = C + manifest["block_size"]  # condition + image tokens
    caches = [n for n in manifest["graphs"]["target"]["inputs"] if n.startswith("past_")]

    def call(T):
        shapes = {"inputs_embeds": (B, T, dim), "position_ids": (B, T), "attention_mask": (B, 1, T, P + T)}
        shapes.update({name: (B, heads, P, head_dim) for name in caches})
        return shapes

    nodes = (manifest.get("tree") or {}).get("nodes", 1)  # an engine without a drafter runs AR only
    return _distinct({"prefill": call(C), "ar": call(1), "verify": call(nodes)})


def drafter_regimes(manifest, images, cfg=True):
    """{regime name: {input: shape or (value,) for the cond_batch shape tensor}} of the drafter."""
    from lantern.runtime.tree import build_tree

    io = manifest["graphs"]["drafter"]["io"]
    B = 2 * images if cfg else images
    dim = io["target_hidden"]["shape"][2]
    _, heads, _, head_dim = io["past_keys_0"]["shape"]
    tree = build_tree(manifest["tree"])
    P = manifest["block_size"] + tree.num_nodes - 1  # image tokens (stable) + scratch

    def call(T):
        return {"target_hidden": (B, T, dim), "input_ids": (B, T), "position_ids": (B, T),
                "attention_mask": (B, 1, T, P + T), "past_keys_0": (B, heads, P, head_dim),
                "past_values_0": (B, heads, P, head_dim), "cond_batch": (images,)}

    regimes = {"draft0": call(tree.depth + 1)}
    regimes.update({f"draft{level.depth}": call(len(level.nodes)) for level in tree.levels[:-1]})
    return _distinct(regimes)


def _distinct(regimes):
    """Drop regimes whose shapes repeat an earlier one (e.g. c2i prefill == AR: both T = 1)."""
    out = {}
    for name, shapes in regimes.items():
        if shapes not in out.values():
            out[name] = shapes
    return out


def measure(onnx_path, regimes_by_batch, opt, flavor, compute_capabilities, repeat=1):
    from lantern.export.tensorrt_build import build_plan, exact_profile, spanning_profile

    all_regimes = [shapes for regimes in regimes_by_batch for shapes in regimes.values()]
    strategies = {"per_regime": [exact_profile(shapes) for shapes in all_regimes],
                  "spanning": [spanning_profile(all_regimes, opt=opt)]}
    out = {}
    for name, profiles in strategies.items():
        seconds = []
        for _ in range(repeat):
            _, record = build_plan(onnx_path, profiles, flavor=flavor, compute_capabilities=compute_capabilities)
            seconds.append(record["build_seconds"])
        out[name] = {"profiles": len(profiles), "build_seconds_median": round(statistics.median(seconds), 2),
                     "build_seconds_min": round(min(seconds), 2), "plan_mib": round(record["plan_bytes"] / 2**20, 2)}
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", help="engine directory (lantern-export onnx)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="images per call (default 1)")
    parser.add_argument("--compute-capability", nargs="+", default=["89"], help="targets (default 89)")
    parser.add_argument("--graphs", nargs="+", default=["target", "drafter"])
    parser.add_argument("--no-cfg", action="store_true", help="batch rows = images (default 2 x images: CFG)")
    parser.add_argument("--flavor", default="tensorrt-rtx")
    parser.add_argument("--repeat", type=int, default=3, help="builds per strategy (median and min reported)")
    args = parser.parse_args(argv)

    with open(os.path.join(args.engine, "manifest.json")) as f:
        manifest = json.load(f)
    regime_fns = {"target": target_regimes, "drafter": drafter_regimes}
    result = {"engine": os.path.abspath(args.engine), "dtype": manifest["dtype"], "tree": manifest["tree"]["name"],
              "batch": args.batch, "cfg": not args.no_cfg, "compute_capabilities": args.compute_capability,
              "graphs": {}}
    for graph in args.graphs:
        if graph not in manifest["graphs"]:
            continue
        by_batch = [regime_fns[graph](manifest, n, cfg=not args.no_cfg) for n in args.batch]
        # TensorRT picks kernels at opt: the target's most frequent call is verification at the
        # largest batch; the drafter's calls are equally frequent, so its opt is the largest.
        opt = by_batch[-1].get("verify") if graph == "target" else None
        path = os.path.join(args.engine, manifest["graphs"][graph]["file"])
        files = [path] + ([path + ".data"] if os.path.exists(path + ".data") else [])
        entry = {"regimes": {name: shapes["attention_mask"][2] for name, shapes in by_batch[0].items()},
                 "onnx_mib": round(sum(os.path.getsize(f) for f in files) / 2**20, 2)}
        entry.update(measure(path, by_batch, opt, args.flavor, args.compute_capability, args.repeat))
        result["graphs"][graph] = entry
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
