"""`lantern-run profile ENGINE`: where a step of this engine goes on this machine, and what
speculative decoding buys here.

It generates --images images with the given settings and, on the same engine, runner, classes
and seeds in the same run, with mode `ar`; each after one untimed generation of the same call (the
sessions' first-run costs). Per step it reports each phase's time (the generation's stats:
draft, verify, accept, commit; host = step time - engine time), engine calls and host launches,
the bytes that cross the host boundary per image (lantern.tools.crossings.RecordingBackend
around the opened backend), the verification call's latency L(T) at
mid-generation context (T = 1, 2, 4, ... up to the tree's nodes; lantern.tools.latency), the
step's cost in AR steps, acceptance per depth (the observer's StepRecords), the mean accepted
length, the measured speed-up over `ar` and the process's peak memory. --runner a,b repeats it
per runner, side by side.

It reads the step only through its seams: the backend protocol (run(), device_step()), the
generation's stats and the observer, so it profiles whatever step the engine runs.

--out DIR (written whole, or not at all): profile.json (all of the above), profile.png (L(T)
and acceptance per depth; needs matplotlib, from the export extra) and trace.json, a few steps'
engine calls as Chrome trace events (Perfetto, chrome://tracing): one track of steps, one of
calls named by regime (draft0, draft1, ..., verify; a device step's phases too: begin,
level1, ..., accept; a step replayed as one CUDA graph is one "step" event); the gaps between
calls are host time. --engine-trace adds, on rows of their own, the engine's own profiler's events of those steps (ONNX Runtime's profiler; torch.profiler
for the torch-based runners; lantern.tools.profile_trace). On CUDA each traced call and step is
an NVTX range named by its regime, so Nsight Systems shows the phases.
"""
import contextlib
import copy
import json
import os
import resource
import time

import numpy as np

from lantern.runtime.backends import runner
from lantern.runtime.cli import _classes, add_generation_options, device_of, generation_settings, open_engine
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.outdir import only_files, OutputDirectory, write_file
from lantern.runtime.tree import build_tree
from lantern.tools.crossings import RecordingBackend
from lantern.tools.latency import default_condition, plan_for, release, time_call, verify_tree
from lantern.tools.profile_trace import engine_profiler, in_window, nvtx_ranges, TracedBackend

FILES = ("profile.json", "profile.png", "trace.json")
PHASES = ("draft", "verify", "accept", "commit")


# ---------------------------------------------------------------------------------------------
# The command


def add_parser(sub, backend_loaders=None):
    """backend_loaders: as lantern.runtime.cli.add_parser's (lantern-run adds torch)."""
    p = sub.add_parser("profile", help="per step: phase times, engine calls, bytes across the host boundary, L(T), "
                                       "acceptance per depth, speed-up over ar; a table, JSON, a plot and a trace")
    p.add_argument("engine", help="engine directory")
    add_generation_options(p)
    p.add_argument("--images", type=int, default=2, help="images per generation (default 2)")
    p.add_argument("--classes", type=_classes, help="class labels (c2i engines; default 0, 1, ...)")
    p.add_argument("--runner", help="comma-separated runners to profile side by side (default: --backend)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per L(T) point (default 5)")
    p.add_argument("--trace-steps", type=int, default=3, help="steps in trace.json (default 3)")
    p.add_argument("--engine-trace", action="store_true",
                   help="add the engine's own profiler's events of the traced steps to trace.json (ONNX Runtime's "
                        "profiler, on from the sessions' start, so the figures include its cost; torch.profiler)")
    p.add_argument("--out", help="write profile.json, profile.png and trace.json into this directory")
    p.add_argument("--force", action="store_true", help="replace --out if it holds an earlier profile")
    p.set_defaults(func=run, backend_loaders=dict(backend_loaders or {}))


def run(args):
    for name, value in (("--images", args.images), ("--repeats", args.repeats), ("--trace-steps", args.trace_steps)):
        if value < 1:
            raise LanternError(f"{name} must be >= 1, got {value}")
    names = [n.strip() for n in (args.runner or args.backend).split(",") if n.strip()]
    for name in names:
        runner(name)  # one line naming the valid runners for an unknown one
    if args.engine_trace and not args.out:
        raise LanternError("--engine-trace writes into trace.json: give --out DIR")
    settings = generation_settings(args)
    engines = {}
    for name in names:  # opened and checked up front: nothing is generated before every runner fits
        engines[name] = open_probed(args, name)
        check_memory(engines[name], args, settings)
    # --out is checked and locked before the work, and placed whole after it
    out = OutputDirectory(args.out, force=args.force, replaceable=only_files(FILES, "lantern-run profile")) \
        if args.out else contextlib.nullcontext()
    with out as stage:
        started = time.perf_counter()
        results = [profile_runner(engines[name], name, args, settings) for name in names]
        report = {"engine": os.path.abspath(args.engine), "settings": settings_of(args, settings),
                  "images": args.images, "seed": args.seed, "threads": args.threads or os.cpu_count(),
                  "runners": results, "seconds": round(time.perf_counter() - started, 3),
                  "peak_memory_bytes": peak_memory(),
                  "peak_memory_note": "the whole process's peak resident memory (getrusage maxrss), all runners "
                                      "included; device memory is not counted"}
        traces = [r.pop("_trace") for r in results]
        print(table(report))
        if stage is not None:
            write_outputs(stage, report, traces)
    if args.out:
        print(f"-> {args.out}")
    return 0


def open_probed(args, name):
    """The engine on runner `name` as `generate` opens it, its backend wrapped so that every call
    is timed and every host crossing counted."""
    per_runner = copy.copy(args)
    per_runner.backend = name
    device = device_of(per_runner)
    profiler = engine_profiler(name, device) if args.engine_trace else None
    if profiler is not None and profiler.backend_options:  # ONNX Runtime: no loader, its profiler is an option
        opened = Engine(args.engine, backend=name, threads=args.threads, device=device, step=args.step,
                        **profiler.backend_options)
    else:
        opened = open_engine(per_runner)
    # the same backend, wrapped: a second Engine over it (the first one verified the directory)
    traced = TracedBackend(RecordingBackend(opened.backend), ranges=nvtx_ranges(device), profiler=profiler)
    return Engine(args.engine, backend=traced, step=args.step, verify=False)


def check_memory(engine, args, settings):
    """Refuse in one line, before anything is generated, a profile this machine cannot hold: the
    generation's tree (or the widest L(T) call, as wide) over --images images."""
    tree = build_tree(args.tree) if args.tree else engine.tree
    if settings.mode != "ar" and tree is not None:
        prefix = engine.condition.prefix(settings.cfg, **condition_of(engine, args))
        engine.check_memory(tree, prefix)
        engine.check_memory(verify_tree(tree.num_nodes), prefix)


def condition_of(engine, args):
    if args.classes is not None:
        if len(args.classes) != args.images:
            raise LanternError(f"--classes gives {len(args.classes)} labels for --images {args.images}")
        return {"classes": args.classes}
    return default_condition(engine.manifest, args.images)


def settings_of(args, settings):
    return {"mode": settings.mode, "lam": args.lam, "delta": args.delta, "k": args.k, "greedy": args.greedy,
            "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
            "cfg_scale": args.cfg_scale, "cfg_interval": args.cfg_interval, "tree": args.tree}


def peak_memory():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def profile_runner(engine, name, args, settings):
    """One runner's profile: the requested mode and ar, their step-cost ratio and speed-up, L(T)."""
    modes = [settings.mode] + (["ar"] if settings.mode != "ar" else [])
    runs, traces = {}, {}
    for mode in modes:
        try:
            runs[mode], traces[mode] = profile_generation(engine, args, settings.replace(mode=mode), args.trace_steps)
        except LanternError:
            if mode != "ar" or args.step != "device":
                raise
            # a device step that refuses AR (its step graphs or plans missing): AR runs on the host
            # step, as generate runs it; the table's step path row says so
            engine.release()
            host = Engine(args.engine, backend=engine.backend, step="host", verify=False)
            runs[mode], traces[mode] = profile_generation(host, args, settings.replace(mode=mode), args.trace_steps)
            host.release()
    profiler = engine.backend.profiler
    if profiler is not None:  # each mode's traced steps get the engine events made within them
        events = profiler.collect(engine.backend)
        for trace in traces.values():
            trace["engine"] = in_window(events, trace)
    main, ar = runs[settings.mode], runs["ar"]
    out = {"runner": name, "device": args.device or runner(name).device,
           "step": main["step"], "runs": runs,
           "step_in_ar_steps": round(main["ms_per_step"] / ar["ms_per_step"], 3),
           "speed_up": round(main["tokens_per_second"] / ar["tokens_per_second"], 3),
           "latency": verify_curve(engine, args, main["nodes"]),
           "peak_memory_bytes": peak_memory(), "_trace": traces}
    engine.release()
    return out


def profile_generation(engine, args, settings, trace_steps):
    """One mode's per-step figures, from a generation after an untimed one of the same call."""
    call = dict(settings=settings, seed=args.seed, tree=args.tree, **condition_of(engine, args))
    engine.generate(**call)
    probe = engine.backend
    recorder = probe.inner
    records, marks = [], []  # per step: its record, then (events counted, time) when it ended

    def observe(record):
        records.append(record)
        marks.append((len(recorder.events), time.perf_counter()))
        probe.mark_step(f"step {len(marks) + 1}" if len(marks) <= trace_steps else None)
        if probe.profiler is not None:
            probe.profiler.step(len(marks), trace_steps)

    probe.spans.clear()
    if probe.profiler is not None:
        probe.profiler.begin()
    probe.mark_step("step 1")
    try:
        s = engine.generate(observer=observe, **call).stats
    finally:
        probe.mark_step(None)
        if probe.profiler is not None:
            probe.profiler.end()
    steps = max(s["steps"], 1)
    prefill = s["phase_seconds"]["prefill"]
    step_seconds = s["seconds"] - prefill
    engine_seconds = s["engine_seconds"] - min(prefill, s["engine_seconds"])
    # crossings from the end of the first step (setup and prefill excluded) to the last step
    counted = recorder.totals(marks[0][0]) if len(marks) > 1 else dict(to_device=0, to_host=0, sync=0, launch=0)
    later = max(len(marks) - 1, 1)
    tree = records[0].tree
    per_step = lambda seconds: round(1000 * seconds / steps, 4)  # noqa: E731 - ms per step
    return {
        "mode": s["mode"], "tree": s["tree"], "tree_source": s["tree_source"], "nodes": tree.num_nodes,
        "depth": tree.depth, "step": s["step"], "steps": s["steps"], "steps_per_image": s["steps_per_image"],
        "seconds": s["seconds"], "tokens_per_second": s["tokens_per_second"],
        "ms_per_step": per_step(step_seconds),
        "phase_ms_per_step": {k: per_step(s["phase_seconds"][k]) for k in PHASES},
        "engine_ms_per_step": per_step(engine_seconds),
        "host_ms_per_step": per_step(max(step_seconds - engine_seconds, 0.0)),
        "engine_calls_per_step": s["engine_calls_per_step"],
        "host_launches_per_step": round(counted["launch"] / later, 3),
        "syncs_per_step": round(counted["sync"] / later, 3),
        "bytes_to_device_per_step_per_image": round(counted["to_device"] / later / args.images),
        "bytes_to_host_per_step_per_image": round(counted["to_host"] / later / args.images),
        "mean_accepted_length": s["mean_accepted_length"],
        "acceptance_per_depth": acceptance_per_depth(records, tree.depth),
    }, trace_of(probe.spans, marks, trace_steps)


def acceptance_per_depth(records, depth):
    """[d = 1..depth]: the fraction of (step, running image) pairs that accepted >= d drafts."""
    accepted = np.concatenate([r.accepted[r.active] for r in records]) if records else np.zeros(0)
    if not accepted.size:
        return [0.0] * depth
    return [round(float(np.mean(accepted >= d)), 4) for d in range(1, depth + 1)]


def trace_of(spans, marks, trace_steps):
    """The engine call spans and step spans of steps 2..trace_steps + 1 (the first step's end is
    the first mark the observer left), in microseconds from that mark."""
    ends = [t for _, t in marks[: trace_steps + 1]]
    if len(ends) < 2:
        return {"steps": [], "calls": []}
    t0 = ends[0]
    us = lambda t: round(1e6 * (t - t0), 1)  # noqa: E731
    steps = [[f"step {i + 1}", us(a), us(b)] for i, (a, b) in enumerate(zip(ends, ends[1:]))]
    calls = [[name, us(a), us(b)] for name, a, b in spans if t0 <= a < ends[-1]]
    return {"steps": steps, "calls": calls, "window": (t0, ends[-1])}


def lengths(nodes):
    """T = 1, 2, 4, ... below the tree's node count, and the node count."""
    out = [1 << i for i in range(nodes.bit_length()) if 1 << i < nodes]
    return out + [nodes]


def verify_curve(engine, args, nodes):
    """L(T) of the verification call over --images images at the generation's mid-point context."""
    engine.release()  # one plan at a time: the generation's goes before the timing plans
    prefix = engine.condition.prefix(args.cfg_scale > 1, **default_condition(engine.manifest, args.images))
    context = prefix.tokens + engine.manifest.image.tokens // 2
    rng = np.random.default_rng(0)
    ms = {}
    for T in lengths(nodes):
        plan = plan_for(engine, verify_tree(T), args.images, args.cfg_scale, context)
        ms[T] = 1000 * time_call(engine, plan, "verify", args.repeats, rng)
        release(engine, plan)
    return {"context": int(context), "images": args.images,
            "verify_ms": {str(T): round(v, 4) for T, v in ms.items()},
            "relative_to_one_token": {str(T): round(v / ms[1], 3) for T, v in ms.items()}}


# ---------------------------------------------------------------------------------------------
# Outputs


def table(report):
    """The terminal table: one column per runner and mode."""
    cols = [(r, r["runs"][m]) for r in report["runners"] for m in r["runs"]]
    rows = [("", [f"{r['runner']} {g['mode']}" for r, g in cols]),
            ("tree (nodes, depth), source", [f"{g['tree']} ({g['nodes']}, {g['depth']}), {g['tree_source']}"
                                             for _, g in cols]),
            ("step path", [g["step"] for _, g in cols]),
            ("ms per step", [f"{g['ms_per_step']:.3f}" for _, g in cols])]
    rows += [(f"  {p}", [f"{g['phase_ms_per_step'][p]:.3f}" for _, g in cols]) for p in PHASES]
    rows += [("  engine", [f"{g['engine_ms_per_step']:.3f}" for _, g in cols]),
             ("  host", [f"{g['host_ms_per_step']:.3f}" for _, g in cols]),
             ("engine calls per step", [f"{g['engine_calls_per_step']:.2f}" for _, g in cols]),
             ("host launches per step", [f"{g['host_launches_per_step']:.2f}" for _, g in cols]),
             ("bytes/step/image to device", [str(g["bytes_to_device_per_step_per_image"]) for _, g in cols]),
             ("bytes/step/image to host", [str(g["bytes_to_host_per_step_per_image"]) for _, g in cols]),
             ("steps per image", [f"{g['steps_per_image']:.1f}" for _, g in cols]),
             ("mean accepted length", [f"{g['mean_accepted_length']:.3f}" for _, g in cols]),
             ("acceptance >= d drafts", [" ".join(f"{a:.2f}" for a in g["acceptance_per_depth"]) or "-"
                                         for _, g in cols]),
             ("tokens/s", [f"{g['tokens_per_second']:.1f}" for _, g in cols]),
             ("step in AR steps", [f"{r['step_in_ar_steps']:.2f}" if g["mode"] != "ar" else "1"
                                   for r, g in cols]),
             ("speed-up over ar", [f"{r['speed_up']:.2f}x" if g["mode"] != "ar" else "1" for r, g in cols])]
    width = max(len(label) for label, _ in rows)
    col = max(len(v) for _, values in rows for v in values) + 2
    lines = [f"profile {report['engine']}: {report['images']} images, mode {report['settings']['mode']}, "
             f"{report['threads']} thread(s)"]
    lines += [label.ljust(width) + "".join(v.rjust(col) for v in values) for label, values in rows]
    for r in report["runners"]:
        L = r["latency"]
        curve = ", ".join(f"T={T}: {ms:.3f} ms ({rel}x)" for (T, ms), rel in
                          zip(L["verify_ms"].items(), L["relative_to_one_token"].values()))
        lines.append(f"L(T) {r['runner']} verify at context {L['context']}: {curve}")
    lines.append(f"peak memory: {report['peak_memory_bytes'] / 2**20:.0f} MiB (the process's peak resident "
                 f"memory, all runners)")
    return "\n".join(lines)


def write_outputs(stage, report, traces):
    try:
        write_file(os.path.join(stage, "profile.json"), (json.dumps(report, indent=2) + "\n").encode())
        write_file(os.path.join(stage, "trace.json"), json.dumps(chrome_trace(report, traces)).encode())
        try:
            plot(report, os.path.join(stage, "profile.png"))
        except ImportError:
            print("profile.png skipped: matplotlib is missing (pip install -e '.[export]')")
    except OSError as e:
        raise LanternError(f"cannot write the outputs ({e.strerror}); free space and run again") from None


def chrome_trace(report, traces):
    """Chrome trace event format: a process per runner and mode, thread 1 its steps, thread 2 its
    engine calls (complete "X" events, microseconds)."""
    events, pid = [], 0
    for r, per_mode in zip(report["runners"], traces):
        for mode, trace in per_mode.items():
            pid += 1
            events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"{r['runner']} {mode}"}})
            for tid, what in ((1, "steps"), (2, "engine calls")):
                events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": what}})
            for tid, key in ((1, "steps"), (2, "calls")):
                events += [{"name": name, "cat": key, "ph": "X", "pid": pid, "tid": tid, "ts": a,
                            "dur": round(b - a, 1)} for name, a, b in trace[key]]
            rows = {}  # the engine profiler's rows, threads 3, 4, ...
            for e in trace.get("engine", []):
                row = e.pop("row")
                if row not in rows:
                    rows[row] = 3 + len(rows)
                    events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": rows[row],
                                   "args": {"name": row}})
                events.append(dict(e, ph="X", pid=pid, tid=rows[row]))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in report["runners"]:
        L = r["latency"]
        left.plot([int(T) for T in L["verify_ms"]], list(L["verify_ms"].values()), marker="o", label=r["runner"])
        depths = r["runs"][report["settings"]["mode"]]["acceptance_per_depth"]
        right.plot(range(1, len(depths) + 1), depths, marker="o", label=r["runner"])
        right.set_xticks(range(1, len(depths) + 1))
    left.set_xlabel("tokens verified in one call (T)")
    left.set_ylabel("ms")
    left.set_title("verification latency L(T)", fontsize=9)
    right.set_xlabel("depth d")
    right.set_ylabel("fraction of steps accepting >= d drafts")
    right.set_ylim(0, 1)
    right.set_title("acceptance per depth", fontsize=9)
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
