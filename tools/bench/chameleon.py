"""Chameleon-7B-shaped measurements with random weights. Prints JSON.

  python -m lantern.tools.bench.chameleon export [--layers 1 2] [--dtype bf16] [--workdir DIR]
  python -m lantern.tools.bench.chameleon latency [--layers 2] [--threads 2] [--context 512]

export   For each layer count: a Chameleon target at full 7B width (hidden 4096, 32 heads, FFN
         11008, vocab 65536) written as an Anole HF checkpoint (bf16 safetensors), then loaded
         and exported (target graph, --dtype) in a child process: wall time and peak RSS (VmHWM)
         of the child. A linear fit over the layer counts extrapolates to 32 layers.
latency  L(T): the fp32 target graph of a layer slice on ONNX Runtime CPU (--threads intra-op
         threads, no spinning), batch 2 (a CFG pair), T new tokens after --context cached
         tokens, median of --repeats calls, T = 1, 2, 4, 8, 16, 32, 64.
Timings on a shared machine vary with its load; compare ratios from one run.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from lantern.runtime.contracts import resolved_io

SEVEN_B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008,
               vocab_size=65536)


def _config(layers):
    from lantern.export.chameleon_checkpoints import tiny_config

    return tiny_config(num_hidden_layers=layers, **SEVEN_B)


def write_checkpoint(directory, layers, seed=0):
    """A random 7B-width target straight into bf16 (never a whole fp32 copy), saved as Anole HF."""
    import torch

    from lantern.export import chameleon, chameleon_checkpoints

    with torch.device("meta"):
        model = chameleon.ChameleonTarget(_config(layers))
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    chameleon.init_random(model, seed=seed)
    chameleon_checkpoints.save_hf_anole(model, directory, shards=max(1, layers // 4))
    return chameleon.count_parameters(model)


def target_io(model, float_dtype):
    """The target graph's contract resolved for this model, as the export resolves it."""
    from lantern.export.families import FAMILIES, LoadedModel

    family = FAMILIES["chameleon"]
    models = {"target": LoadedModel(model, {})}
    return resolved_io("target_ids", family.dims("target", models, None), float_dtype,
                       layers=family.layers("target", models))


def _status_kib(*fields):
    with open("/proc/self/status") as f:
        values = {line.split(":")[0]: int(line.split()[1]) for line in f if line.split(":")[0] in fields}
    return [values[k] for k in fields]


def export_child(checkpoint, out, dtype):
    """Runs in the child: load + export the target graph; prints its own timings as JSON.
    Memory: VmHWM (peak resident, including the checkpoint's memory-mapped pages, which are clean
    page cache the kernel can drop and re-read) and the peak of RssAnon sampled every 20 ms
    (memory that must exist: what decides whether an export fits)."""
    import threading

    import torch

    from lantern.export import chameleon, chameleon_checkpoints
    from lantern.export.graph_export import export_graph
    from lantern.export.onnx_export import DTYPE_NAMES, DTYPES

    peak_anon, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak_anon[0] = max(peak_anon[0], _status_kib("RssAnon")[0])
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    model, _ = chameleon_checkpoints.load_target(checkpoint)
    model = model.to(DTYPES[dtype])
    loaded = time.perf_counter()
    graphs = chameleon.graph_modules(model)
    files = export_graph(graphs["target"][1], target_io(model, DTYPE_NAMES[dtype]),
                         os.path.join(out, "target.onnx"))
    done = time.perf_counter()
    stop.set()
    sampler.join()
    # VmHWM, not getrusage: ru_maxrss survives exec, so a child forked from a big parent would
    # report the parent's size.
    (hwm_kib,) = _status_kib("VmHWM")
    print(json.dumps({"load_s": round(loaded - start, 1), "export_s": round(done - loaded, 1),
                      "peak_rss_mib": round(hwm_kib / 1024, 1), "peak_anon_mib": round(peak_anon[0] / 1024, 1),
                      "files": {f: os.path.getsize(os.path.join(out, f)) for f in files},
                      "torch_threads": torch.get_num_threads()}))


def run_export(args):
    rows = []
    for layers in args.layers:
        with tempfile.TemporaryDirectory(dir=args.workdir, prefix="bench_chameleon-") as workdir:
            checkpoint, out = os.path.join(workdir, "anole"), os.path.join(workdir, "engine")
            os.makedirs(out)
            t = time.perf_counter()
            parameters = write_checkpoint(checkpoint, layers)
            write_s = time.perf_counter() - t
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "lantern.tools.bench.chameleon", "_export-child", checkpoint,
                                   out, args.dtype], capture_output=True, text=True)
            wall = time.perf_counter() - t
            if proc.returncode:
                sys.stderr.write(proc.stderr[-4000:])
                raise SystemExit(f"export of {layers} layers failed")
            child = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append({"layers": layers, "parameters": parameters, "write_checkpoint_s": round(write_s, 1),
                         "child_wall_s": round(wall, 1), **child,
                         "checkpoint_bytes": sum(os.path.getsize(os.path.join(checkpoint, f)) for f in os.listdir(checkpoint))})
    result = {"shape": SEVEN_B, "dtype": args.dtype, "runs": rows}
    if len(rows) >= 2:
        x = np.array([r["layers"] for r in rows], dtype=float)
        fit = {}
        for key in ("peak_rss_mib", "peak_anon_mib", "export_s", "load_s", "child_wall_s"):
            slope, intercept = np.polyfit(x, [r[key] for r in rows], 1)
            fit[key] = {"per_layer": round(float(slope), 2), "fixed": round(float(intercept), 1),
                        "at_32_layers": round(float(intercept + 32 * slope), 1)}
        result["linear_fit"] = fit
    print(json.dumps(result, indent=2))


def run_latency(args):
    import torch

    from lantern.export import chameleon
    from lantern.export.graph_export import export_graph

    torch.set_num_threads(args.threads)
    import onnxruntime as ort

    config = _config(args.layers)
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="bench_chameleon-") as workdir:
        with torch.device("meta"):
            model = chameleon.ChameleonTarget(config)
        model = model.to_empty(device="cpu")
        chameleon.init_random(model).eval()
        path = os.path.join(workdir, "target.onnx")
        t = time.perf_counter()
        export_graph(chameleon.graph_modules(model)["target"][1], target_io(model, "float32"), path)
        export_s = time.perf_counter() - t
        graph_bytes = sum(os.path.getsize(os.path.join(workdir, f)) for f in os.listdir(workdir))
        del model
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        B, P, c = 2, args.context, config
        rng = np.random.default_rng(0)
        caches = {f"past_{kind}_{i}": rng.standard_normal((B, c.num_key_value_heads, P, c.head_dim), dtype=np.float32)
                  for kind in ("keys", "values") for i in range(c.num_hidden_layers)}
        curve = {}
        for T in args.tokens:
            mask = np.ones((B, 1, T, P + T), dtype=bool)
            mask[..., P:] = np.tril(np.ones((T, T), dtype=bool))
            feeds = {"input_ids": rng.integers(4, 8196, (B, T)), "position_ids": np.tile(np.arange(P, P + T), (B, 1)),
                     "attention_mask": mask, **caches}
            session.run(None, feeds)  # warm-up
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                session.run(None, feeds)
                times.append(time.perf_counter() - t)
            curve[T] = float(np.median(times))
    one = curve[args.tokens[0]]
    print(json.dumps({"shape": {**SEVEN_B, "num_hidden_layers": args.layers}, "dtype": "fp32", "batch": B, "context": P,
                      "threads": args.threads, "repeats": args.repeats, "export_s": round(export_s, 1),
                      "latency_ms": {str(T): round(s * 1e3, 1) for T, s in curve.items()},
                      "relative_to_T1": {str(T): round(s / one, 2) for T, s in curve.items()},
                      "graph_bytes": graph_bytes}, indent=2))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_export-child"]:
        return export_child(*argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="export time and peak memory of 7B-width layer slices")
    e.add_argument("--layers", type=int, nargs="+", default=[1, 2])
    e.add_argument("--dtype", default="bf16", choices=("fp32", "fp16", "bf16"))
    e.add_argument("--workdir", default=None)
    e.set_defaults(func=run_export)
    lat = sub.add_parser("latency", help="L(T) of a 7B-width layer slice on ONNX Runtime CPU")
    lat.add_argument("--layers", type=int, default=2)
    lat.add_argument("--threads", type=int, default=2)
    lat.add_argument("--context", type=int, default=512)
    lat.add_argument("--repeats", type=int, default=3)
    lat.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    lat.add_argument("--workdir", default=None)
    lat.set_defaults(func=run_latency)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
