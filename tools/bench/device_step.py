"""What only this measures: kernels per torch device step by part (--kernels), and host vs device
step paths over batch sizes and sampling (bytes each way, launches, syncs). Prints JSON. One engine's phases, L(T) and speed-up
on one runner are `lantern-run profile`'s.

Whole step (--engine DIR or --gpt GPT-B; the default section): real generations on one engine,
each mode (ar, exact, lantern++; CFG), greedy and sampling (temperature 1, top-k --top-k; rows
with "sampling": true), on ONNX Runtime CPU, on onnxruntime-torch (the same sessions inside the
torch backend) and on the torch backend on the CPU, each with the host step and the device step
(each the whole step on the device, lantern.runtime.graph_step.GraphStep: torch and
onnxruntime-torch over the step's modules, lantern.export.step_graphs; ONNX Runtime over the
engine's exported step graphs, which `lantern-export accept` adds), side by side in one run. Per step: ms, host time (the
loop's time outside engine work; the device step counts all of its work as engine time),
engine launches, and, through RecordingBackend, the bytes that cross the host boundary each way
and the synchronisations. On a CPU "device" and host are the same memory, so the bytes are what
a GPU would move. DIR may be an in-place engine (`lantern-export onnx --attention inplace`): the
torch device step runs it as it runs a plain one (ONNX Runtime's device step needs the step
graphs `lantern-export accept` adds; without them its rows say skipped).

Acceptance alone (device_acceptance, tools/gpu_check.py's device-path section): on GPT-B shapes
(vocabulary 16384, a 1000-wide neighbor table) the host path copies the verification logits
([rows, nodes, V] float32) to the host and runs the numpy rules there (CFG combination included,
as the loop does it); the device path runs the greedy acceptance module (the step graphs' accept
rule, lantern.export.accept_graphs) where the logits are, and only the outcome crosses back.

    python -m lantern.tools.bench.device_step [--gpt GPT-B | --engine DIR] [--cfg-scale 4]
        [--batch 1 8] [--threads 2] [--modes ar exact lantern++]
    python -m lantern.tools.bench.device_step --kernels [--gpt GPT-B | --engine DIR] [--batch 1]

Kernels (--kernels): per mode, the ops one device step of the torch backend dispatches that
write memory (about one kernel each in the step's CUDA graph), by part: target, drafter (and an
in-place engine's commit graph), acceptance (the rule inside the accept phase), and the step's
own drafting, masks and commits (the other phases, and the copies into the calls' buffers); on the fp32 engine (an fp16 one adds
its casts to every graph, which barely moves the ratio). Small-batch GPU steps are launch-bound,
so the speculative step's kernels over AR's predict its cost in AR steps.

What it does not measure: any GPU (tools/gpu_check.py has the device step's CUDA section).
"""
import argparse
import collections
import hashlib
import json
import os
import tempfile
import time

import numpy as np

from lantern.runtime import accept as acceptance
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.tree import build_tree, root_only
from lantern.runtime.backends import ONNXRUNTIME, ONNXRUNTIME_TORCH, TORCH
from lantern.runtime.backends.onnxruntime import OnnxRuntimeBackend
from lantern.runtime.backends.torch import TorchBackend
from lantern.runtime.manifest import read_manifest
from lantern.tools.crossings import RecordingBackend

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
    argmax, a neighbor table, and the acceptance module's feeds (numpy)."""
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


def export_gpt(root, model, dtype, with_vq=False):
    """A random-weight LlamaGen engine of `model`'s shape (weights don't matter for timings);
    with_vq: with a random VQ-16 tokenizer, so its neighbor table serves lantern and lantern++."""
    import torch

    from lantern.export import checkpoints, llamagen, vq
    from lantern.export.onnx_export import export_engine

    args = llamagen.make_config(model)
    src = os.path.join(root, f"src-{model}")  # the manifest points here: one per shape (gpu_check exports several)
    os.makedirs(src, exist_ok=True)
    checkpoints.save_llamagen_pt(llamagen.init_random(llamagen.Transformer(args)), os.path.join(src, "gpt.pt"))
    drafter = llamagen.init_random(llamagen.Drafter(llamagen.DrafterArgs.for_target(args)), seed=1)
    checkpoints.save_drafter(drafter, os.path.join(src, "drafter"), fmt="safetensors")
    tokenizer = None
    if with_vq:
        tokenizer = os.path.join(src, "vq.pt")
        vq.save_vq(vq.VQModel(vq.VQ_CONFIGS["VQ-16"]).eval(), tokenizer)
    out = os.path.join(root, model)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    export_engine(out, os.path.join(src, "gpt.pt"), target_options={"name": model},
                  drafter=os.path.join(src, "drafter"), vq=tokenizer, tree="mc_sim_7b_63", dtype=dtype, candidates=64)
    return out


def step_record(engine, recorder, path, mode, images, cfg, classes, sampling=False, top_k=0):
    """One generation's per-step figures (greedy, or sampling with temperature 1 and top_k) on
    `path` (host or device; the plan is made before the generation's clock starts; the device
    step's streams table, uploaded once per generation, is setup, not counted). Crossings: the device path's from its first step on; the
    host path's from the end of its first step (an observer marks it; the host path reads
    decisions anyway, the device path would read more), per later step."""
    run = Engine(engine.directory, backend=recorder, step=path)
    k = min(100, run.manifest.neighbors.k) if mode == "lantern++" and run.manifest.neighbors else None
    kw = dict(mode=mode, greedy=not sampling, cfg_scale=cfg, classes=classes, k=k)
    if sampling:
        kw.update(temperature=1.0, top_k=top_k, seed=list(range(len(classes))))
    marks = []
    observer = (lambda record: marks.append(len(recorder.events))) if path == "host" else None
    try:
        out = run.generate(observer=observer, **kw)
    finally:  # the backend is shared by every row: the plan's buffers (and graphs) go with the row
        run.release()
        recorder.last_step = None
    s = out.stats
    if path == "host":
        counted, counted_steps = recorder.totals(marks[0]), max(s["steps"] - 1, 1)
    else:
        counted, counted_steps = recorder.totals(recorder.start), max(s["steps"], 1)
    steps = max(s["steps"], 1)
    step_seconds = s["seconds"] - s["phase_seconds"]["prefill"]
    engine_seconds = s["engine_seconds"] - min(s["phase_seconds"]["prefill"], s["engine_seconds"])
    return {"mode": mode, "sampling": sampling, "step": s["step"], "images": len(classes), "steps": s["steps"],
            "ms_per_step": round(1000 * step_seconds / steps, 3),
            "host_ms_per_step": round(1000 * max(step_seconds - engine_seconds, 0) / steps, 3),
            "bytes_device_to_host_per_step": round(counted["to_host"] / counted_steps),
            "bytes_host_to_device_per_step": round(counted["to_device"] / counted_steps),
            "syncs_per_step": round(counted["sync"] / counted_steps, 2),
            "host_launches_per_step": round(counted["launch"] / counted_steps, 2),
            "engine_calls_per_step": s["engine_calls_per_step"],
            "mean_accepted_length": round(s["mean_accepted_length"], 3),
            "tokens_sha1": hashlib.sha1(np.ascontiguousarray(out.tokens, np.int64).tobytes()).hexdigest()[:12]}


def whole_step(engine_dir, modes=("ar", "exact", "lantern++"), batches=(1, 8), cfg=4.0, threads=2,
               samplings=(False, True), top_k=0, backends=None):
    """Per step, host vs device, for each backend (default: those the CPU has; else {name:
    opened backend}), greedy and sampling: a list of records (a path that cannot run a
    generation: a record with "skipped" and why). Each backend and path runs one untimed
    generation first, so no row carries first-run costs."""
    from lantern.export.torch_backend import open_onnxruntime_torch_backend, open_torch_backend

    manifest = read_manifest(engine_dir)
    if backends is None:
        backends = {f"{ONNXRUNTIME.name}-cpu": OnnxRuntimeBackend(engine_dir, manifest, threads=threads),
                    f"{ONNXRUNTIME_TORCH.name}-cpu": open_onnxruntime_torch_backend(engine_dir, threads=threads,
                                                                                    manifest=manifest),
                    f"{TORCH.name}-cpu": open_torch_backend(engine_dir, threads=threads, manifest=manifest)}
    num_classes = manifest.condition.num_classes or 1
    warm_mode = next((m for m in modes if m != "ar" and m in manifest.modes), modes[0])
    results = []
    for name, backend in backends.items():
        recorder = RecordingBackend(backend)
        engine = Engine(engine_dir, backend=recorder)
        for path in ("host", "device"):  # warm-up: the sessions' first runs are not the first row's step time
            for sampling in samplings:  # a speculative mode, so the drafter's and every step graph's sessions run
                try:
                    step_record(engine, recorder, path, warm_mode, 1, cfg, [1 % num_classes], sampling, top_k)
                except LanternError:
                    pass  # that row is a skipped record below
        for mode in modes:
            if mode not in manifest.modes:
                continue
            for images in batches:
                classes = [int(c) % num_classes for c in range(1, images + 1)]
                for sampling in samplings:
                    for path in ("host", "device"):
                        try:
                            record = step_record(engine, recorder, path, mode, images, cfg, classes, sampling, top_k)
                        except LanternError as e:  # e.g. no step graphs (or plans) for this tree or kind
                            record = {"mode": mode, "sampling": sampling, "step": path, "images": images,
                                      "skipped": str(e)}
                        results.append(dict(record, backend=name))
    return results


def step_backend(engine_dir, device="cuda", cuda_graphs=True, threads=None):
    """The torch backend step_timing and step_kernels measure: the engine's graphs as torch
    modules on `device` with the step's modules for its device step."""
    from lantern.export.onnx_export import load_graph_modules
    from lantern.export.step_export import step_phase_factory

    manifest = read_manifest(engine_dir)
    modules = {name: module for name, (_, module) in load_graph_modules(manifest).items()}
    return TorchBackend(modules, manifest, device=device, threads=threads, cuda_graphs=cuda_graphs,
                        step_phases=step_phase_factory(manifest))


def step_timing(engine_dir, device="cuda", cuda_graphs=True, modes=("ar", "exact", "lantern++"), batches=(1, 8),
                cfg=4.0, threads=None, warmup=True, backend=None):
    """gpu_check's device-step section for one engine: on the torch backend on `device` (CUDA
    graphs per call for the host step, one per step for the device step, or none; or on
    `backend`, a torch backend opened already: tensorrt-torch), per step path, mode and batch:
    ms per step, host share of the step time, and the speculative step in AR steps; greedy, CFG.
    Each generation runs once, after one warm-up of its plan (warmup)."""
    manifest = read_manifest(engine_dir)
    backend = backend or step_backend(engine_dir, device, cuda_graphs, threads)
    num_classes = manifest.condition.num_classes or 1
    runs, engine = [], None
    for path in ("host", "device"):
        if engine is not None:
            engine.release()  # the backend is shared: the last path's plan goes first
        engine = Engine(engine_dir, backend=backend, step=path)
        for images in batches:
            classes = [c % num_classes for c in range(1, images + 1)]
            for mode in modes:
                if mode not in manifest.modes:
                    continue
                k = min(100, manifest.neighbors.k) if mode == "lantern++" and manifest.neighbors else None
                kw = dict(mode=mode, greedy=True, cfg_scale=cfg, classes=classes, k=k)
                if warmup:  # the plan, its CUDA graphs, first-call costs
                    engine.generate(**kw)
                s = engine.generate(**kw).stats
                steps = max(s["steps"], 1)
                step_seconds = s["seconds"] - s["phase_seconds"]["prefill"]
                engine_seconds = s["engine_seconds"] - min(s["phase_seconds"]["prefill"], s["engine_seconds"])
                runs.append({"step": s["step"], "mode": mode, "images": images, "steps": s["steps"],
                             "ms_per_step": round(1000 * step_seconds / steps, 3),
                             "host_share": round(max(step_seconds - engine_seconds, 0) / max(step_seconds, 1e-9), 3),
                             "mean_accepted_length": round(s["mean_accepted_length"], 3)})
    engine.release()
    for run in runs:  # the step in AR steps, per path and batch
        ar = next((r for r in runs if r["mode"] == "ar" and r["step"] == run["step"] and r["images"] == run["images"]),
                  None)
        if ar is not None and run["mode"] != "ar":
            run["step_in_ar_steps"] = round(run["ms_per_step"] / ar["ms_per_step"], 2)
    return {"device": str(backend.device), "cuda_graphs": bool(backend.cuda_graphs), "backend": backend.name,
            "runs": runs}


def count_kernels(fn, parts=(), ops=None):
    """{part: ops fn() dispatches that write memory} (a new tensor, or an in-place write; views,
    no-op conversions and bare allocations write none): each is about one kernel in a CUDA graph
    of fn (a sort, a top-k or a split-K matmul may launch a few). parts: {name: module}; an op
    inside a call of one counts under its name, the rest under "step". ops: a Counter that also
    gets (part, op name) counts, to see where a part's kernels go."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    counts, inside = collections.Counter(), []
    allocates_only = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
                      "aten::new_empty_strided"}  # memory, no kernel

    def enter(name):
        def hook(module, args):
            inside.append(name)
        return hook

    def leave(module, args, out):
        inside.pop()  # returns None: the call's output stays as it is

    handles = []
    for name, module in dict(parts).items():
        handles += [module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave)]

    def storages(values):
        return {v.untyped_storage().data_ptr() for v in values if isinstance(v, torch.Tensor)}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func._schema.name in allocates_only:
                return out
            writes = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
            flat = out if isinstance(out, (tuple, list)) else (out,)
            if writes or storages(flat) - storages(list(args) + list(kwargs.values())):
                part = inside[-1] if inside else "step"
                counts[part] += 1
                if ops is not None:
                    ops[part, func._schema.name.split("::")[-1]] += 1
            return out

    try:
        with torch.inference_mode(), Count():
            fn()
    finally:
        for handle in handles:
            handle.remove()
    return dict(counts)


def step_kernels(engine_dir, backend, modes=("ar", "exact", "lantern++"), images=1, cfg=4.0):
    """Per mode, about the kernels one device step of the torch backend runs (count_kernels: the
    ops its CUDA graph replays: the GraphStep's call list, run as TorchBackend.run_all runs it),
    by part: the target's and drafter's calls (and an in-place engine's commit graph), acceptance
    (the accept phase's rule), and the step's own drafting, masks and commits ("step": the other
    phases' ops, and the copies of their outputs into the buffers the next call reads). Counted
    on one eager step after a greedy generation (its images are done: the step's shapes and ops
    are the same). A GPU step of small batches is launch-bound, so their ratio predicts the
    speculative step in AR steps before a GPU measures it."""
    manifest = read_manifest(engine_dir)
    engine = Engine(engine_dir, backend=backend, step="device")
    classes = [c % (manifest.condition.num_classes or 1) for c in range(1, images + 1)]
    graphs = {name: m for name, m in backend.modules.items()  # the engine's own graphs, not the step's phases
              if name in backend.manifest.graphs and isinstance(m, backend.torch.nn.Module)}
    out = {}
    for mode in modes:
        if mode not in manifest.modes:
            continue
        k = min(100, manifest.neighbors.k) if mode == "lantern++" and manifest.neighbors else None
        engine.generate(mode=mode, greedy=True, cfg_scale=cfg, classes=classes, k=k)
        step = backend._steps[id(engine._plan)]
        calls = step.calls[step.steps_run % 2]  # the state's current buffers
        accept = next(backend.phase_modules[c.graph] for c in calls if c.regime == "accept")
        ops = collections.Counter()
        counts = count_kernels(lambda: [backend.run(c) for c in calls], {**graphs, "accept": accept.rule}, ops)
        out[mode] = {"kernels": sum(counts.values()), "by_part": dict(sorted(counts.items())),
                     "step_ops": {f"{part}/{op}": n for (part, op), n in ops.most_common() if part in ("step", "accept")}}
    engine.release()
    ar = out.get("ar", {}).get("kernels")
    for mode, row in out.items():
        if ar and mode != "ar":
            row["in_ar_steps"] = round(row["kernels"] / ar, 2)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", help="whole step on this c2i engine directory")
    p.add_argument("--gpt", default="GPT-B", help="whole step on a random-weight LlamaGen of this shape (fp32)")
    p.add_argument("--modes", nargs="+", default=["ar", "exact", "lantern++"])
    p.add_argument("--cfg-scale", type=float, default=4.0)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sampling", choices=["both", "greedy", "only"], default="both",
                   help="whole step: greedy rows, sampling rows, or both")
    p.add_argument("--top-k", type=int, default=0, help="whole step's sampling rows: top-k (0 = off)")
    p.add_argument("--kernels", action="store_true",
                   help="kernels per device step by part (what one CUDA graph replays), per mode, batch --batch's first")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = args.engine
        if engine_dir is None:
            from lantern.export.accept_engine import add_step_graphs

            engine_dir = export_gpt(tmp, args.gpt, "fp32", with_vq="lantern++" in args.modes or "lantern" in args.modes)
            if not args.kernels:
                add_step_graphs(engine_dir)  # ONNX Runtime's device step, greedy and sampling
        if args.kernels:
            from lantern.export.torch_backend import open_torch_backend

            kernels = step_kernels(engine_dir, open_torch_backend(engine_dir, threads=args.threads), args.modes,
                                   args.batch[0], args.cfg_scale)
            print(json.dumps({"benchmark": "device_step_kernels", "engine": args.engine or f"{args.gpt} random fp32",
                              "images": args.batch[0], "cfg": args.cfg_scale, "results": kernels}, indent=1))
            return 0
        samplings = {"both": (False, True), "greedy": (False,), "only": (True,)}[args.sampling]
        results = whole_step(engine_dir, args.modes, args.batch, args.cfg_scale, args.threads, samplings, args.top_k)
    print(json.dumps({"benchmark": "device_step_whole", "engine": args.engine or f"{args.gpt} random fp32",
                      "cfg": args.cfg_scale, "threads": args.threads, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    main()
