"""Real-size engines with random weights in the real checkpoint layouts, through the real loaders
and commands: export, integrity hashing, check, a few generated tokens on ONNX Runtime CPU and
TensorRT-RTX plans for SM89. Prints one JSON object per engine.

    python -m lantern.tools.bench.real_size [--config gpt-xl-c2i ...] [--dtype fp16] [--layers N]
                                            [--stages write,export,hash,check,tokens,trt]

Configurations (the paper's models; targets with a LANTERN-shaped drafter and the VQ decoder):
  gpt-xl-c2i      LlamaGen GPT-XL (775M), class-conditional, llamagen-pt + config, VQ-16
  gpt-xl-t2i      LlamaGen GPT-XL, text-conditional (120 caption tokens), LANTERN HF layout, VQ-16
  anole-7b        Anole-7b (Chameleon 7B, vocabulary 65,536), Hugging Face layout, Meta's VQ-GAN
  lumina-mgpt-7b  Lumina-mGPT-7B, xllmx layout, Meta's VQ-GAN
--layers N keeps every width and the vocabulary and builds N target layers instead of all: the
7B shapes' per-layer costs are measured at two depths and the full depth extrapolated from them
(labelled so in the JSON).

The 7B shapes fit because nothing holds their target: the writer makes each tensor from its own
seeded generator and appends it to model.safetensors (chameleon_checkpoints.save_random_target),
and `lantern-export onnx` leaves large safetensors tensors on disk until each is written
(lantern.export.streaming). What still loads a whole 7B model (check's fp32 torch reference, ONNX
Runtime sessions for tokens, the TensorRT builder) is refused up front with the number it needs.

Every stage is a child process of its own, so its peak RSS (getrusage of that child) is its own.
A stage is refused before it starts when its estimate exceeds --memory-limit-gib (default 12: the
machine is shared) or the disk cannot hold what it writes, with the number it needs; a watchdog
ends a child whose RSS passes the limit anyway (reported, never an OOM kill).
The estimates are bytes per target parameter per stage (RSS_PER_PARAM, DISK_PER_PARAM).
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from lantern.export import cli
from lantern.export.check import check_engine
from lantern.runtime.generator import Engine
from lantern.runtime.manifest import read_manifest
from lantern.tools.latency import default_condition

CONFIGS = ("gpt-xl-c2i", "gpt-xl-t2i", "anole-7b", "lumina-mgpt-7b")
STAGES = ("write", "export", "hash", "check", "tokens", "trt")
GIB = 1 << 30
# Peak RSS per target parameter of a stage (bytes), an upper estimate to refuse a stage before it
# starts: the writer holds the model and a copy of its state (fp32 for LlamaGen, bf16 for
# Chameleon); the export loads the target in fp32 (4) and exports a copy in the graph dtype (2);
# check holds the fp32 torch reference and the ONNX Runtime session; the TensorRT builder the
# parsed weights and the plan. The watchdog (run_stage) is the backstop.
RSS_PER_PARAM = {"write": 8.0, "export": 7.0, "check": 8.0, "tokens": 4.0, "trt": 6.0, "hash": 0.1}
# The Chameleon family's writer streams the target and its export reads safetensors lazily
# (lantern.export.streaming): both hold the drafter and the largest tensors, not the target
# (measured on Anole-7b fp16, 7.0B target parameters: write 2.4 GB, export 1.8 GB peak RSS).
STREAMED_RSS_PER_PARAM = {"write": 0.5, "export": 0.6}
DISK_PER_PARAM = {"write": 2.2, "export": 2.2, "trt": 4.5}


# ---------------------------------------------------------------------------------------------
# Shapes and random checkpoints


def shapes(config, layers=None, count=True):
    """{family, model config object, layers, full_layers, and with count the target parameters
    (counted from the shapes on the meta device: the first count in a process costs seconds, since
    meta normal_ imports torch._dynamo, so the writer, which needs only the config, skips it)}."""
    if config.startswith("gpt-xl"):
        from lantern.export import llamagen

        args = llamagen.make_config("GPT-XL", model_type=config[-3:])
        full = args
        if layers is not None:
            args = llamagen.make_config("GPT-XL", model_type=config[-3:], n_layer=layers)
        out = {"family": "llamagen", "args": args, "layers": args.n_layer, "full_layers": full.n_layer}
        if count:
            out.update(parameters=_llamagen_parameters(args), full_parameters=_llamagen_parameters(full))
        return out
    from lantern.export import chameleon_checkpoints as ck

    family = "anole" if config == "anole-7b" else "lumina_mgpt"
    real = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008)
    full = ck.tiny_config(family=family, num_hidden_layers=32, **real)
    cfg = ck.tiny_config(family=family, num_hidden_layers=layers or 32, **real)
    out = {"family": family, "args": cfg, "layers": cfg.num_hidden_layers, "full_layers": 32}
    if count:
        out.update(parameters=_chameleon_parameters(cfg), full_parameters=_chameleon_parameters(full))
    return out


def _parameters(build):
    """Parameters of the module `build()` makes, counted on the meta device (no memory)."""
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in build().parameters())


def _llamagen_parameters(args):
    from lantern.export import llamagen

    return _parameters(lambda: llamagen.Transformer(args))


def _chameleon_parameters(config):
    from lantern.export import chameleon as ch

    return _parameters(lambda: ch.ChameleonTarget(config))


def write_sources(config, layers, root, with_vq=True):
    """Random checkpoints in the real layouts: {target, drafter, vq (None without), export options}."""
    import torch

    shape = shapes(config, layers, count=False)
    os.makedirs(root, exist_ok=True)
    if shape["family"] == "llamagen":
        from lantern.export import checkpoints, llamagen, vq

        args = shape["args"]
        target = llamagen.init_random(llamagen.Transformer(args)).eval()
        if args.model_type == "c2i":
            config_file = os.path.join(root, "config.json")
            with open(config_file, "w") as f:
                json.dump({k: getattr(args, k) for k in ("dim", "n_layer", "n_head", "n_kv_head", "vocab_size",
                                                         "num_classes", "block_size", "multiple_of", "cls_token_num",
                                                         "model_type")}, f)
            target_path = os.path.join(root, "target.pt")
            checkpoints.save_llamagen_pt(target, target_path)
            options = ["--config", config_file]
        else:
            target_path = os.path.join(root, "target")
            checkpoints.save_hf_target(target, target_path)
            options = []
        drafter = llamagen.init_random(llamagen.Drafter(llamagen.DrafterArgs.for_target(args)), seed=1).eval()
        del target
        checkpoints.save_drafter(drafter, os.path.join(root, "drafter"), fmt="safetensors")
        del drafter
        if with_vq:
            torch.manual_seed(2)
            vq.save_vq(vq.VQModel(vq.VQ_CONFIGS["VQ-16"]).eval(), os.path.join(root, "vq.pt"))
        return {"target": target_path, "drafter": os.path.join(root, "drafter"),
                "vq": os.path.join(root, "vq.pt") if with_vq else None, "options": options}

    from lantern.export import chameleon as ch
    from lantern.export import chameleon_checkpoints as ck
    from lantern.export import chameleon_vq as cvq

    config_obj = shape["args"]
    # the target tensor by tensor (a 7B one never in memory); the drafter (0.5B) as a module
    ck.save_random_target(config_obj, os.path.join(root, "target"), seed=0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the checkpoints' dtype: never an fp32 copy of the model
    try:
        drafter = ch.init_random(ch.ChameleonDrafter(ck.tiny_drafter_config(config_obj)), seed=1).eval()
        if shape["family"] == "lumina_mgpt":
            drafter = ck.tie_qk_norm_rows(drafter)
        ck.save_drafter(drafter, os.path.join(root, "drafter"), fmt="safetensors")  # read lazily by the export
        del drafter
    finally:
        torch.set_default_dtype(previous)
    # the text tokenizer lives beside the VQ-GAN (Meta's layout): written without the VQ too
    os.makedirs(os.path.join(root, "vq"), exist_ok=True)
    ck.save_text_tokenizer(os.path.join(root, "vq", "text_tokenizer.json"))
    if with_vq:
        cvq.save_vq(cvq.init_random(cvq.ChameleonVQ(cvq.ChameleonVQConfig()), seed=4).eval(), os.path.join(root, "vq"))
    return {"target": os.path.join(root, "target"), "drafter": os.path.join(root, "drafter"),
            "vq": os.path.join(root, "vq") if with_vq else None, "options": []}


# ---------------------------------------------------------------------------------------------
# Stages (each in a child process: `--stage NAME`)


def stage_write(spec):
    sources = write_sources(spec["config"], spec["layers"], spec["src"], with_vq=not spec.get("no_vq"))
    with open(os.path.join(spec["src"], "sources.json"), "w") as f:
        json.dump(sources, f)
    return {"source_bytes": _tree_bytes(spec["src"])}


def stage_export(spec):
    with open(os.path.join(spec["src"], "sources.json")) as f:
        src = json.load(f)
    argv = ["onnx", "--target", src["target"], *src["options"], "--drafter", src["drafter"],
            *(["--vq", src["vq"]] if src["vq"] else []), "--dtype", spec["dtype"], "--out", spec["engine"], "--no-progress",
            "--no-graph-cache"]  # the export is what this stage times
    code = cli.main(argv)
    if code:
        raise RuntimeError(f"lantern-export onnx exited {code}")

    m = read_manifest(spec["engine"], verify=False)
    return {"engine_bytes": _tree_bytes(spec["engine"]),
            "files": {n: os.path.getsize(os.path.join(spec["engine"], n)) for n in sorted(os.listdir(spec["engine"]))},
            "graphs": sorted(m.graphs)}


def stage_hash(spec):
    t = time.perf_counter()
    read_manifest(spec["engine"], verify=True)
    first = time.perf_counter() - t
    t = time.perf_counter()
    read_manifest(spec["engine"], verify=True)
    return {"hash_first_open_s": round(first, 2), "hash_second_open_s": round(time.perf_counter() - t, 3)}


def stage_check(spec):
    report = check_engine(spec["engine"], verify=False)
    worst = max((r for r in report["results"] if "max_abs" in r), key=lambda r: r["max_abs"] / max(r["bound"], 1e-30))
    return {"check_ok": report["ok"], "check_outputs": len(report["results"]), "check_atol": report["atol"],
            "check_rtol": report["rtol"], "check_failures": report["failures"][:5],
            "check_worst": {k: worst[k] for k in ("graph", "case", "output", "max_abs", "bound")}}


class _Enough(Exception):
    pass


def stage_tokens(spec):
    """A few speculative steps (greedy lantern++; exact without a VQ decoder) on ONNX Runtime CPU."""

    engine = Engine(spec["engine"], threads=2)
    condition = default_condition(engine.manifest, 1)  # a class, a blank caption or a five-token prompt
    records = []

    def observer(record):
        records.append(int(record.accepted.sum()) + int(record.active.sum()))
        if len(records) >= spec["steps"]:
            raise _Enough

    start = time.perf_counter()
    relaxed = dict(mode="lantern++", lam=2.0, k=10) if engine.neighbors is not None else dict(mode="exact")
    try:
        engine.generate(**condition, **relaxed, greedy=True, observer=observer)
    except _Enough:
        pass
    seconds = time.perf_counter() - start
    return {"tokens_mode": relaxed["mode"], "tokens_steps": len(records), "tokens_generated": sum(records), "tokens_seconds": round(seconds, 2),
            "tokens_per_step": records}


def stage_trt(spec):
    code = cli.main(["trt", spec["engine"], "--flavor", "tensorrt-rtx", "--compute-capability", "89", "--batch", "1"])
    if code:
        raise RuntimeError(f"lantern-export trt exited {code}")
    m = read_manifest(spec["engine"], verify=False)
    (key, build), = m.tensorrt.items()
    return {"trt_key": key, "trt_version": build.version,
            "plan_bytes": {g: os.path.getsize(os.path.join(spec["engine"], p.file)) for g, p in build.plans.items()},
            "plan_profiles": {g: len(p.profiles) for g, p in build.plans.items()}}


def _tree_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


# ---------------------------------------------------------------------------------------------
# Running the stages


def _rss_bytes(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def run_stage(name, spec, limit_bytes):
    """One stage in a child process: its result, seconds and peak RSS; killed (and said so) if its
    RSS passes the limit."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "lantern.tools.bench.real_size", "--stage", name,
                             "--spec", json.dumps(spec)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    over = []

    def watch():
        while proc.poll() is None:
            if _rss_bytes(proc.pid) > limit_bytes:
                over.append(_rss_bytes(proc.pid))
                proc.kill()
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, err = proc.communicate()
    watcher.join()
    seconds = round(time.perf_counter() - start, 1)
    if over:
        return {"error": f"ended by the watchdog: RSS {over[0] / GIB:.1f} GiB passed the {limit_bytes / GIB:g} GiB limit",
                "seconds": seconds}
    lines = [line for line in out.splitlines() if line.startswith("{\"stage_result\"")]
    if proc.returncode != 0 or not lines:
        tail = " ".join((err or out).strip().splitlines()[-3:])
        return {"error": f"exit {proc.returncode}: {tail[-600:]}", "seconds": seconds}
    result = json.loads(lines[-1])["stage_result"]
    result["seconds"] = seconds
    return result


def rss_per_param(stage, family):
    return STREAMED_RSS_PER_PARAM.get(stage, RSS_PER_PARAM[stage]) if family != "llamagen" else RSS_PER_PARAM[stage]


def estimate(stage, parameters, dtype, family="llamagen"):
    """(peak RSS bytes, disk bytes) a stage needs for a target of `parameters` parameters."""
    width = 4 if dtype == "fp32" else 2
    rss = rss_per_param(stage, family) * parameters * (1.0 if width == 2 or stage == "write" else 1.3)
    disk = DISK_PER_PARAM.get(stage, 0) * parameters * width / 2
    return rss, disk


def bench_one(config, dtype, layers, stages, workdir, limit_bytes, steps, keep=False, vq=True):
    shape = shapes(config, layers)
    row = {"config": config, "dtype": dtype, "layers": shape["layers"], "full_layers": shape["full_layers"],
           "target_parameters": shape["parameters"], "full_target_parameters": shape["full_parameters"]}
    root = tempfile.mkdtemp(prefix=f"{config}-{shape['layers']}L-", dir=workdir)
    spec = {"config": config, "layers": shape["layers"] if layers else None, "dtype": dtype, "steps": steps,
            "src": os.path.join(root, "src"), "engine": os.path.join(root, "engine"), "no_vq": not vq}
    try:
        for stage in stages:
            rss, disk = estimate(stage, shape["parameters"], dtype, shape["family"])
            free = shutil.disk_usage(root).free
            if rss > limit_bytes:
                row[stage] = {"refused": f"needs about {rss / GIB:.1f} GiB RSS ({rss_per_param(stage, shape['family']):g} bytes per "
                                         f"parameter x {shape['parameters'] / 1e9:.2f}B); the limit is "
                                         f"{limit_bytes / GIB:g} GiB"}
                break
            if disk > free:
                row[stage] = {"refused": f"needs about {disk / GIB:.1f} GiB of disk under {root}; "
                                         f"{free / GIB:.1f} GiB free"}
                break
            result = run_stage(stage, spec, limit_bytes)
            row[stage] = result
            print(json.dumps({"config": config, "layers": shape["layers"], "stage": stage, **result}), flush=True)
            if "error" in result:
                break
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    return row


def extrapolate(rows):
    """Per-layer costs from two depths of one configuration and their full-depth extrapolation."""
    out = {}
    by_config = {}
    for r in rows:
        by_config.setdefault((r["config"], r["dtype"]), []).append(r)
    for (config, dtype), rs in by_config.items():
        rs = sorted(rs, key=lambda r: r["layers"])
        if len(rs) < 2 or rs[0]["layers"] == rs[-1]["layers"] or rs[-1]["layers"] == rs[-1]["full_layers"]:
            continue
        a, b = rs[0], rs[-1]
        span, full = b["layers"] - a["layers"], b["full_layers"]
        item = {"label": f"EXTRAPOLATED from {a['layers']} and {b['layers']} layers to {full} (linear in layers)"}
        for stage, key in (("export", "seconds"), ("export", "peak_rss_mib"), ("export", "engine_bytes"),
                           ("hash", "hash_first_open_s"), ("trt", "seconds"), ("trt", "peak_rss_mib"),
                           ("check", "seconds"), ("check", "peak_rss_mib")):
            va, vb = a.get(stage, {}).get(key), b.get(stage, {}).get(key)
            if isinstance(va, (int, float)) and isinstance(vb, (int, float)):
                per = (vb - va) / span
                item[f"{stage}_{key}_per_layer"] = round(per, 3)
                item[f"{stage}_{key}_at_{full}_layers"] = round(vb + per * (full - b["layers"]), 1)
        pa, pb = a.get("trt", {}).get("plan_bytes"), b.get("trt", {}).get("plan_bytes")
        if pa and pb:
            per = (sum(pb.values()) - sum(pa.values())) / span
            item["trt_plan_bytes_per_layer"] = int(per)
            item[f"trt_plan_bytes_at_{full}_layers"] = int(sum(pb.values()) + per * (full - b["layers"]))
        out[f"{config}/{dtype}"] = item
    return out


def _child_main(name, spec):
    fn = {"write": stage_write, "export": stage_export, "hash": stage_hash, "check": stage_check,
          "tokens": stage_tokens, "trt": stage_trt}[name]
    result = fn(spec)
    result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps({"stage_result": result}), flush=True)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--dtype", nargs="+", default=["fp16"], choices=("fp32", "fp16", "bf16"))
    p.add_argument("--layers", type=int, nargs="+", help="target layers to build (default: all); two values give "
                                                        "per-layer costs and a full-depth extrapolation")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--steps", type=int, default=3, help="speculative steps in the tokens stage")
    p.add_argument("--memory-limit-gib", type=float, default=12.0)
    p.add_argument("--workdir", help="where checkpoints and engines go (default: the temp dir); removed after")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints and engines")
    p.add_argument("--no-vq", dest="vq", action="store_false", help="export without the VQ decoder and neighbours")
    p.add_argument("--stage", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stage:
        return _child_main(args.stage, json.loads(args.spec))
    stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages or stages[0] != "write":
        p.error(f"--stages must start with write and name only {','.join(STAGES)}")
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    rows = []
    for config in args.config:
        for dtype in args.dtype:
            for layers in args.layers or [None]:
                row = bench_one(config, dtype, layers, stages, args.workdir, args.memory_limit_gib * GIB, args.steps,
                                args.keep, args.vq)
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary = extrapolate(rows)
    if summary:
        print(json.dumps({"extrapolated": summary}), flush=True)
    return 0 if all(not any("error" in v for v in r.values() if isinstance(v, dict)) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
