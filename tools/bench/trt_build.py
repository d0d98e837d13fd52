"""TensorRT build benchmark: one exact optimization profile per call shape (what `lantern-export
trt` builds) against one profile spanning all of them, per graph of an engine directory. Prints
JSON: per graph and strategy, the number of profiles, build seconds (median and min of --repeat
builds) and plan size.

    python -m lantern.tools.bench.trt_build ENGINE_DIR [--batch 1 4] [--compute-capability 89]
        [--graphs target drafter] [--cfg | --no-cfg] [--flavor tensorrt-rtx] [--repeat 3]

The call shapes are the static step plans' (lantern.export.trt_export.call_shapes): prefill,
AR and tree verification for the target, draft0 .. draft{depth-1} for the drafter, for every
batch and CFG setting, with the engine's default tree. Runtime latency needs a GPU; this
measures the build side only, on whatever machine runs it (TensorRT-RTX builds ahead of time
on a CPU). The spanning profile's opt is the largest call (TensorRT tunes kernels there).
"""
import argparse
import json
import os
import statistics
import sys
from lantern.export import trt_export
from lantern.export.tensorrt_build import build_plan, spanning_profile
from lantern.runtime.manifest import read_manifest


def measure(onnx_path, exact, spanning, flavor, compute_capabilities, repeat=1):
    out = {}
    for name, profiles in (("per_call_shape", exact), ("spanning", spanning)):
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
    cfg = parser.add_mutually_exclusive_group()
    cfg.add_argument("--cfg", dest="cfg", action="store_true", default=None, help="only with CFG (default: both)")
    cfg.add_argument("--no-cfg", dest="cfg", action="store_false", help="only without CFG")
    parser.add_argument("--flavor", default="tensorrt-rtx")
    parser.add_argument("--repeat", type=int, default=3, help="builds per strategy (median and min reported)")
    args = parser.parse_args(argv)

    m = read_manifest(args.engine)
    trees = trt_export._trees(m, [])
    cfgs = trt_export._cfgs(m, args.cfg)
    calls = trt_export.call_shapes(m, args.batch, cfgs, trees)
    result = {"engine": os.path.abspath(args.engine), "dtype": m.dtype, "trees": [t.name for t in trees],
              "batch": args.batch, "cfg": list(cfgs), "compute_capabilities": args.compute_capability, "graphs": {}}
    for graph in args.graphs:
        if graph not in calls:
            continue
        profiles = trt_export.graph_profiles(m, graph, calls[graph])
        exact = [p for _, p in profiles]
        opts = [{name: triple[1] for name, triple in p.items()} for p in exact]
        largest = max(opts, key=lambda o: sum(__import__("math").prod(s) for s in o.values()))
        spanning = [spanning_profile(opts, opt=largest)]
        path = os.path.join(args.engine, m.graphs[graph].file)
        files = [path] + ([os.path.join(args.engine, m.graphs[graph].external_data)]
                          if m.graphs[graph].external_data else [])
        entry = {"calls": len(calls[graph]), "onnx_mib": round(sum(os.path.getsize(f) for f in files) / 2**20, 2)}
        entry.update(measure(path, exact, spanning, args.flavor, args.compute_capability, args.repeat))
        result["graphs"][graph] = entry
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
