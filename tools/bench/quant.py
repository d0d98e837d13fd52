"""Quantized engines on ONNX Runtime CPU: speed and fidelity of int8 / int4 against fp32, one run.
Prints JSON.

  python -m lantern.tools.bench.quant [--model GPT-B] [--threads 2] [--repeats 7] [--workdir DIR]
                                      [--decisions] [--no-fidelity]

speed     (GPT-B-shaped target, random weights) the one-token step at batch 2 (CFG) with ~256
          cached tokens, and L(T) for T = 1, 2, 4, 8, 16, 26, 58 new tokens at the same context
          and batch, medians with every scheme timed in turn inside each repeat; one AR image
          (cfg 4, top-k 2000) through the real decoding loop (Engine.generate; a warm-up image,
          then two timed); quantization seconds and graph bytes.
fidelity  (the demo model: trained, so its logits mean something) the fp32 engine samples images
          (cfg 3); at every target call of that run the quantized targets see the same inputs,
          and we count how often their CFG-combined greedy token equals fp32's (teacher-forced
          greedy agreement) and the logits' relative RMS error. The same on GPT-B's random weights.
--decisions also times the alternatives the defaults were chosen against (head float / int4,
          ONNX Runtime's quantize_dynamic int8, accuracy level 0): see lantern.export.quantize.

Every session: `threads` intra-op threads, inter-op 1, no spinning (as the runtime's backend).
The engines are exported once into --workdir (default: a temporary directory).
"""
import argparse
import json
import os
import tempfile
import time

import numpy as np
from lantern.export.quantize import quantize_engine, quantize_graph, QuantizeOptions, RecordingBackend
from lantern.runtime.generator import Engine
from lantern.runtime.manifest import read_manifest

TOKENS = (1, 2, 4, 8, 16, 26, 58)


def export_engine(directory, model, threads, config_file=None, checkpoint=None):
    """A target-only engine (embed, condition, target) of `model` with random weights, or of the
    given checkpoint. Returns the engine directory (reused when it exists)."""
    out = os.path.join(directory, "engine")
    if os.path.isfile(os.path.join(out, "manifest.json")):
        return out
    import torch

    from lantern.export import checkpoints, llamagen
    from lantern.export.onnx_export import export_engine as export

    torch.set_num_threads(threads)
    os.makedirs(directory, exist_ok=True)
    if checkpoint is None:
        args = llamagen.make_config(model)
        checkpoint = os.path.join(directory, "gpt.pt")
        checkpoints.save_llamagen_pt(llamagen.init_random(llamagen.Transformer(args)), checkpoint)
        options = {"name": model}
    else:
        options = {"config_file": config_file}
    export(out, checkpoint, target_options=options)
    return out


def session(path, threads):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def step_feeds(sess, batch, tokens, context, capacity, seed=0):
    """Inputs for a target call of `tokens` new tokens after `context` cached ones, from the
    graph's own input list (so any contract version works): random embeddings / ids, caches
    of unit scale, the first `context` cache slots visible, causal over the new tokens."""
    rng = np.random.default_rng(seed)
    vocab = sess.get_outputs()[0].shape[-1]
    sizes = {"B": batch, "T": tokens, "P": capacity, "P+T": capacity + tokens}
    feeds = {}
    for value in sess.get_inputs():
        shape = [d if isinstance(d, int) else sizes[d] for d in value.shape]
        if value.name == "attention_mask":
            mask = np.zeros(shape, dtype=bool)
            mask[..., :context] = True
            mask[..., capacity:] = np.tril(np.ones((tokens, tokens), dtype=bool))
            feeds[value.name] = mask
        elif value.name == "position_ids":
            # Positions past the RoPE table (a 58-token call after 256) clamp onto it, as the runtime does.
            positions = np.minimum(context + np.arange(tokens), capacity - 1)
            feeds[value.name] = np.broadcast_to(positions, shape).astype(np.int64).copy()
        elif value.type == "tensor(int64)":
            feeds[value.name] = rng.integers(0, vocab, size=shape)
        elif value.name.startswith("past_"):
            feeds[value.name] = rng.normal(size=shape).astype(np.float32)
        else:
            feeds[value.name] = (0.02 * rng.normal(size=shape)).astype(np.float32)
    return feeds


def interleaved_medians(sessions, feeds, repeats):
    """Median seconds of sess.run(feeds) per session; each repeat runs every session once, so
    load from other processes falls on all of them alike."""
    for s in sessions.values():
        s.run(None, feeds)  # warm up
    times = {name: [] for name in sessions}
    for _ in range(repeats):
        for name, s in sessions.items():
            start = time.perf_counter()
            s.run(None, feeds)
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def fidelity(engine_dir, graphs, threads, classes, cfg_scale, top_k, seed=0):
    """Teacher-forced agreement along a sampled fp32 generation: at every target call the
    quantized graphs (`graphs`: {name: onnx path}) run on the same inputs; per scheme the
    fraction of calls' last positions whose CFG-combined greedy token equals fp32's, and the
    relative RMS error of the logits there."""

    engine = Engine(engine_dir, threads=threads)
    engine.backend = recorder = RecordingBackend(engine.backend)
    engine.generate(classes=classes, mode="ar", cfg_scale=cfg_scale, top_k=top_k, seed=seed)
    sessions = {"fp32": session(os.path.join(engine_dir, "target.onnx"), threads)}
    sessions.update({name: session(path, threads) for name, path in graphs.items()})
    seen = {name: [s.run(["logits"], feeds)[0][:, -1] for _, feeds in recorder.target_calls]
            for name, s in sessions.items()}
    n = len(classes)

    def combined(logits):  # rows: [cond; uncond] with CFG, as the decoding loop combines them
        return logits[n:] + cfg_scale * (logits[:n] - logits[n:]) if cfg_scale > 1 else logits

    reference = np.stack([combined(x) for x in seen["fp32"]])
    raw = np.stack(seen["fp32"])
    report = {}
    for name in graphs:
        q = np.stack(seen[name])
        report[name] = {
            "greedy_agreement": round(float((np.stack([combined(x) for x in seen[name]]).argmax(-1)
                                             == reference.argmax(-1)).mean()), 4),
            "logits_relative_rms": round(float(np.linalg.norm(q - raw) / np.linalg.norm(raw)), 4),
        }
    report["positions"] = int(reference.shape[0] * reference.shape[1])
    return report


def variants(target, out_dir, decisions):
    """{name: (onnx path, quantization seconds, record)} for the schemes (and alternatives)."""

    plan = {"int8": dict(scheme="int8"), "int4": dict(scheme="int4")}
    if decisions:
        plan.update({
            "int8 head float": dict(scheme="int8", head="float"),
            "int4 head float": dict(scheme="int4", head="float"),
            "int4 head int4": dict(scheme="int4", head="int4"),
            "int4 accuracy level 0": dict(scheme="int4", accuracy_level=0),
            "int8 accuracy level 0": dict(scheme="int8", accuracy_level=0),
        })
    made = {}
    for name, options in plan.items():
        path = os.path.join(out_dir, name.replace(" ", "_") + ".onnx")
        result = quantize_graph(target, path, **options)
        made[name] = (path, result["seconds"], result["record"])
    if decisions:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        path = os.path.join(out_dir, "int8_dynamic.onnx")
        start = time.perf_counter()
        quantize_dynamic(target, path, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
                         use_external_data_format=os.path.exists(target + ".data"))
        made["int8 quantize_dynamic"] = (path, round(time.perf_counter() - start, 3), None)
    return made


def image_seconds(engine_dir, scheme, threads, work, repeats=2):
    """One AR image (class 207, cfg 4, top-k 2000) through the decoding loop (Engine.generate),
    after one warm-up image: seconds of each timed run."""

    if scheme != "fp32":
        quantized = os.path.join(work, f"engine-{scheme}")
        if not os.path.isfile(os.path.join(quantized, "manifest.json")):
            quantize_engine(engine_dir, quantized, QuantizeOptions(scheme))
        engine_dir = quantized
    engine = Engine(engine_dir, threads=threads)
    run = dict(classes=[207], mode="ar", cfg_scale=4.0, top_k=2000)
    engine.generate(**run)
    return [round(engine.generate(**run, seed=i).stats["seconds"], 3) for i in range(repeats)]


def _bytes(path):
    return os.path.getsize(path) + (os.path.getsize(path + ".data") if os.path.exists(path + ".data") else 0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="GPT-B")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--context", type=int, default=256, help="cached tokens before the timed call (default 256)")
    p.add_argument("--workdir", help="reuse or create the engines here (default: a temporary directory)")
    p.add_argument("--decisions", action="store_true", help="also time the alternatives to the defaults")
    p.add_argument("--no-fidelity", action="store_true", help="skip the teacher-forced agreement runs")
    args = p.parse_args(argv)

    from importlib import resources

    import onnxruntime


    load_at_start = os.getloadavg()
    work = args.workdir or tempfile.mkdtemp(prefix="lantern-bench-quant-")
    gpt_dir = os.path.join(work, args.model)
    start = time.perf_counter()
    engine_dir = export_engine(gpt_dir, args.model, args.threads)
    export_seconds = round(time.perf_counter() - start, 1)
    target = os.path.join(engine_dir, "target.onnx")
    made = variants(target, gpt_dir, args.decisions)
    sessions = {"fp32": session(target, args.threads)} | {n: session(v[0], args.threads) for n, v in made.items()}

    manifest = read_manifest(engine_dir)
    capacity = manifest.condition.tokens + manifest.image.tokens
    context = min(args.context, capacity - 1)
    step = interleaved_medians(sessions, step_feeds(sessions["fp32"], 2, 1, context, capacity), args.repeats)
    slow = {n for n in sessions if "accuracy level 0" in n}  # hundreds of ms per step: one-token step only
    curve = {}
    for T in TOKENS:
        timed = {n: s for n, s in sessions.items() if n not in slow}
        curve[T] = interleaved_medians(timed, step_feeds(sessions["fp32"], 2, T, context, capacity),
                                       max(3, args.repeats // 2))
    report = {
        "benchmark": "quantized engines, ONNX Runtime CPU",
        "note": "timings from a shared 2-core machine (other jobs running); medians, every scheme timed in turn",
        "onnxruntime": onnxruntime.__version__,
        "model": args.model, "random_weights": True, "threads": args.threads, "batch": 2, "context": context,
        "export_seconds": export_seconds,
        "quantize_seconds": {n: v[1] for n, v in made.items()},
        "graph_bytes": {"fp32": _bytes(target)} | {n: _bytes(v[0]) for n, v in made.items()},
        "one_token_step_ms": {n: round(1000 * t, 2) for n, t in step.items()},
        "step_speedup_vs_fp32": {n: round(step["fp32"] / t, 2) for n, t in step.items()},
        "latency_ms": {n: {str(T): round(1000 * curve[T][n], 2) for T in TOKENS} for n in sessions if n not in slow},
        "latency_ratio_vs_T1": {n: {str(T): round(curve[T][n] / curve[1][n], 2) for T in TOKENS}
                                for n in sessions if n not in slow},
    }
    images = {s: image_seconds(engine_dir, s, args.threads, gpt_dir) for s in ("fp32", "int8", "int4")}
    report["ar_image_seconds"] = {s: float(np.median(t)) for s, t in images.items()}
    report["ar_image_seconds_runs"] = images
    report["ar_image_speedup_vs_fp32"] = {s: round(report["ar_image_seconds"]["fp32"] / v, 2)
                                          for s, v in report["ar_image_seconds"].items()}
    report["load_average_1_5_15_min"] = {"start": load_at_start, "after_speed": os.getloadavg()}
    del sessions
    if not args.no_fidelity:
        graphs = {n: v[0] for n, v in made.items()}
        report["fidelity_gpt_b_random"] = fidelity(engine_dir, graphs, args.threads, [207, 360], 4.0, 2000)
        demo = resources.files("lantern.export") / "demo_model"
        demo_dir = export_engine(os.path.join(work, "demo"), None, args.threads,
                                 config_file=str(demo / "gpt_config.json"), checkpoint=str(demo / "gpt.pt"))
        demo_made = variants(os.path.join(demo_dir, "target.onnx"), os.path.join(work, "demo"), args.decisions)
        report["fidelity_demo"] = fidelity(demo_dir, {n: v[0] for n, v in demo_made.items()}, args.threads,
                                           list(range(15)) * 2, 3.0, 0)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
