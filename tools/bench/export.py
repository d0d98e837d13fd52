"""Export benchmark: a LlamaGen-shaped target (default GPT-XL, 775M parameters) with random
weights, written in the real llamagen-pt format (plus a random drafter directory), then exported
by `lantern-export onnx` in a child process. Prints JSON: wall times and peak RSS.

    python -m lantern.tools.bench.export [--model GPT-XL] [--dtype fp32|fp16] [--check]

Peak RSS, from getrusage: this process's (building and saving the checkpoint), the export's
(`peak_rss_export_mib`) and the largest child's (export or `check`); `peak_rss_total_mib` is
self + largest child, an upper bound of what the whole run held at once.
The goal is an export within 24 GiB. Needs disk for the checkpoint and the engine (about 2x the
model size in fp32) under --workdir.
"""
import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

LIMIT_GIB = 24


def _mib(kib):
    return round(kib / 1024, 1)


def build_checkpoints(model, workdir, image_size, with_drafter):
    from lantern.export import checkpoints, llamagen

    args = llamagen.make_config(model, image_size=image_size)
    target = llamagen.init_random(llamagen.Transformer(args)).eval()
    path = os.path.join(workdir, f"{model}.pt")
    checkpoints.save_llamagen_pt(target, path, args_namespace=argparse.Namespace(
        gpt_model=model, gpt_type=args.model_type, image_size=image_size, downsample_size=16,
        num_classes=args.num_classes, cls_token_num=args.cls_token_num, vocab_size=args.vocab_size))
    parameters = llamagen.count_parameters(target)
    drafter = None
    if with_drafter:
        d = llamagen.init_random(llamagen.Drafter(llamagen.DrafterArgs.for_target(args)), seed=1).eval()
        drafter = os.path.join(workdir, "drafter")
        checkpoints.save_drafter(d, drafter)
        del d
    del target
    gc.collect()
    return path, drafter, parameters


def _child(argv):
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "lantern.export.cli", *argv], capture_output=True, text=True)
    seconds = round(time.perf_counter() - start, 1)
    if proc.returncode not in (0, 1):
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"lantern-export {argv[0]} failed with exit code {proc.returncode}")
    return seconds, proc


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="GPT-XL", help="LlamaGen config name (default GPT-XL)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "fp16", "bf16"))
    parser.add_argument("--image-size", type=int, default=256, help="256 -> 256 image tokens (default)")
    parser.add_argument("--no-drafter", action="store_true", help="export the target graphs only")
    parser.add_argument("--check", action="store_true", help="also run `lantern-export check` on the engine")
    parser.add_argument("--workdir", default=None, help="where the checkpoint and engine go (default: a temp dir)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="bench_export-") as workdir:
        start = time.perf_counter()
        target, drafter, parameters = build_checkpoints(args.model, workdir, args.image_size, not args.no_drafter)
        build_s = round(time.perf_counter() - start, 1)
        out = os.path.join(workdir, "engine")
        cmd = ["onnx", "--target", target, "--out", out, "--dtype", args.dtype, "--no-progress", "--no-graph-cache"]
        if drafter:
            cmd += ["--drafter", drafter]
        export_s, proc = _child(cmd)
        export_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the export is the only child yet
        result = {"model": args.model, "parameters": parameters, "dtype": args.dtype, "drafter": bool(drafter),
                  "checkpoint_format": "llamagen-pt", "checkpoint_bytes": os.path.getsize(target),
                  "build_and_save_s": build_s, "export_s": export_s,
                  "engine_bytes": sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)),
                  "engine_files": sorted(os.listdir(out))}
        if args.check:
            result["check_s"], proc = _child(["check", out])
            result["check_ok"] = proc.returncode == 0
            result["check_report"] = proc.stdout.strip().splitlines()
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result.update(peak_rss_self_mib=_mib(own), peak_rss_export_mib=_mib(export_rss), peak_rss_children_mib=_mib(children),
                  peak_rss_total_mib=_mib(own + children), limit_gib=LIMIT_GIB,
                  within_limit=(own + children) / 2**20 <= LIMIT_GIB)
    print(json.dumps(result, indent=2))
    return 0 if result["within_limit"] and result.get("check_ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
