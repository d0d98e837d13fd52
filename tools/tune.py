"""`lantern-run tune`: the static draft tree that is fastest on this machine, for given generation
settings, measured on the engine itself. `lantern-run whatif` runs the same search on a
latency model from a file (a planning aid; see lantern.tools.tree_report).

  lantern-run tune ENGINE [--mode --lam --delta --k --greedy --temperature --top-k --top-p --cfg-scale
                           --cfg-interval --seed --backend --threads] [--classes 3,7 | --caption F.npy]
                          [--budget 64] [--depth 6] [--images 16] [--batch 8] [--out DIR] [--dry-run]

1. Calibration. `--images` generations (calls of `--batch` images) with a wide, deep calibration
   tree (tree_search.calibration_tree: every rank the search may use, down to `--depth`), the
   given settings, on the given classes or captions (default: classes spread over the model's
   range; a caption engine without --caption gets blank, all-zero caption features, and the
   report says so). The loop's StepRecords go to AcceptanceCounts; the report lists how many
   observations back each cell of the acceptance table.
2. Latency model, per batch size (1 and --batch), on the engine's backend (tools/tune_measure.py):
   - verification of T tokens and drafter calls of width w, timed through real step plans at a
     mid-generation cache length (lantern.tools.latency), on a grid of sizes up to the largest
     the search may pick (every size up to 8, then steps of about 25 %), interpolated between;
     the fastest of --repeats runs per size (other processes only ever slow a call down);
   - the loop's own time, measured as it pays: whole generations of a few small trees (and of
     AR) with the same settings; per loop step, the time of the draft/verify/accept/commit
     phases over the steps run, the fastest of a few generations. What the engine-call curves
     do not explain (host work, and calls slower in the loop than alone: the graphs evict each
     other's weights from the caches) is fitted, by non-negative least squares, as a + b * nodes
     per step plus c per drafter call (a small tree's step can spend most of its time
     there). The AR step is the AR generation's measured step. The report
     lists each tree's measured and modelled step.
3. Search (tree_search.search: Sequoia's DP per depth limit, priced with the model, AR as a
   candidate) per batch size, ranked by a whole call's tokens per second (a batched call ends
   with its slowest image). The chosen tree is then run too and the fit redone with it, until
   the choice is a tree whose step was measured (or AR). The report compares the chosen tree
   with AR and the presets under the same model.
4. Output, unless --dry-run: the chosen trees as choices JSON (`--tree` reads them) and the
   report (report.json, report.md, plots) under ENGINE/tuned/, then the manifest's
   `tuned_trees` entry for these settings, written last (tools/tune_record.py's `install`).
   `generate` then uses the tuned tree for these settings on this backend unless a tree is
   given. --out DIR writes a copy of the report and trees there as well.

`--also-jacobi` (an engine with a drafter) then measures the chosen tree against the jacobi
windows and AR, whole, and records a window where one is faster (between proposers).
`--proposer jacobi` tunes the drafter-free window instead (tools/tune_window.py: AR and each of
`--windows` measured whole, the fastest recorded per batch for the settings with the window left
open; generate --proposer jacobi without --window runs it).

"The settings it was tuned for" (GenerationSettings.canonical): mode; lam (lantern++) or delta
(lantern) and k; greedy, or sampling with its temperature, top-k and top-p; the CFG scale (off
below 1) and interval. These change the acceptance table or the rows each call carries. The batch
changes only latency: one tree per batch size tuned, and generate takes the tuned batch nearest
its image count. The backend is recorded and must match; the thread count and the machine are
recorded in the entry, not matched (re-run tune after moving an engine to other hardware).

Compiled plans: where the engine records TensorRT plans (`Manifest.tensorrt`), `plans_coverage`
(tools/plan_coverage.py) checks whether a tree's calls (StepPlan.shapes()) each get a profile of
the plans, as the tensorrt backend assigns them. Tuning on the tensorrt backend keeps the search
within its plans (AR and the trees they were built for); tuning on another backend reports a
chosen tree the plans do not cover as needing `lantern-export trt` again. The runtime uses an
entry only on the backend it was measured on, so a tree tuned elsewhere never runs on plans
built for another tree, and `lantern-export trt` builds profiles for the trees tuned on the
tensorrt backend besides the engine's own, so a rebuild keeps covering them.
"""
import argparse
import os
import time

import numpy as np

from lantern.runtime import enginedir
from lantern.runtime.backends import runs_plans
from lantern.runtime.cli import _classes, _load_npy, add_generation_options, generation_settings, open_engine
from lantern.runtime.errors import LanternError
from lantern.runtime.tree import build_tree, MAX_WIDTH, root_only
from lantern.tools import tree_report, tune_record, tune_window
from lantern.tools.latency import default_condition
from lantern.tools.plan_coverage import coverage_note, plans_coverage
from lantern.tools.acceptance_stats import acceptance_vectors, AcceptanceCounts
from lantern.tools.tree_search import calibration_tree, search
from lantern.tools.tune_measure import (call_latency, check_memory, clock_of, fit_latency, fit_table, fit_trees,
                                        loop_step_ms, machine, StepTimer)

DEFAULT_BUDGET = 64
DEFAULT_DEPTH = 6
DEFAULT_IMAGES = 16
CALIBRATION_WIDTH = 8  # ranks observed per opened node; the DP rarely goes past rank 4 on image tokens
GUESS = [[0.45, 0.15, 0.08, 0.05, 0.03, 0.02, 0.015, 0.01]]  # shapes the calibration tree only


# ---------------------------------------------------------------------------------------------
# Inputs


def _ints(text):
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers, e.g. 2,4,8; got {text!r}") from None


def tuning_settings(engine, settings):
    """The GenerationSettings a tree is tuned for on this engine (mode checked, k resolved as
    generate resolves it, so its key is the one generate looks up)."""
    if settings.mode == "ar":
        raise LanternError("mode 'ar' drafts nothing, so there is no tree to tune; pick exact, lantern or lantern++")
    if settings.proposer == "jacobi":
        if settings.window is not None:
            raise LanternError(f"tune picks the jacobi window (--windows lists the candidates); drop --window "
                               f"{settings.window}")
        return settings.resolve(engine.manifest, engine.directory)
    if settings.mode not in engine.manifest.modes:
        raise LanternError(f"tune records trees for the engine's modes ({', '.join(engine.manifest.modes)}), not "
                           f"{settings.mode!r}")
    return settings.resolve(engine.manifest, engine.directory)


DEFAULT_PROMPTS = ("a photo of a cat", "a red car on a city street", "a bowl of fruit on a wooden table",
                   "a mountain lake at sunset", "a portrait of an old man", "a lighthouse on a cliff by the sea",
                   "a bicycle leaning against a brick wall", "a plate of pasta with basil")


def conditions(engine, images, classes=None, caption=None, caption_mask=None, prompt=None, prompt_ids=None):
    """(one generate() condition dict per image, a note on what was used). Given classes,
    caption rows or prompts are cycled to `images`. Defaults: classes spread over the model's
    range; blank (zero) caption features for a caption engine; a few everyday prompts for a
    prompt engine with a text tokenizer (one without needs --prompt-ids)."""
    c = engine.manifest.condition
    given = {"--classes": classes, "--caption": caption, "--prompt": prompt, "--prompt-ids": prompt_ids}
    takes = {"class": ("--classes",), "caption": ("--caption",), "prompt": ("--prompt", "--prompt-ids")}[c.kind]
    wrong = [name for name, value in given.items() if value is not None and name not in takes]
    if wrong:
        raise LanternError(f"this is a {c.kind}-conditional engine: give {' or '.join(takes)}, not {wrong[0]}")
    if c.kind == "class":
        if classes is None:
            classes = [(i * c.num_classes) // min(images, c.num_classes) % c.num_classes for i in range(images)]
        picked = [int(classes[i % len(classes)]) for i in range(images)]
        note = f"classes {sorted(set(picked))}" + ("" if given["--classes"] else " (default: spread over the classes)")
        return [{"classes": [cl]} for cl in picked], note
    if c.kind == "prompt":
        if prompt_ids is not None:
            rows = np.asarray(prompt_ids)
            rows = rows[None] if rows.ndim == 1 else rows
            return ([{"prompt_ids": rows[i % len(rows)]} for i in range(images)],
                    f"{len(rows)} prompt(s) as ids, cycled to {images} images")
        if prompt is None and c.tokenizer is None:
            raise LanternError("this engine has no text tokenizer: give calibration prompts as --prompt-ids")
        texts = list(prompt) if prompt is not None else list(DEFAULT_PROMPTS)
        note = f"{len(texts)} prompt(s)" + (" (default: everyday scenes)" if prompt is None else "")
        return [{"prompt": texts[i % len(texts)]} for i in range(images)], note + f", cycled to {images} images"
    if caption is None:
        blank = default_condition(engine.manifest, 1)["caption"][0]
        note = ("blank (all-zero) caption features: no --caption was given, so acceptance is measured on an "
                "empty prompt; pass real T5 caption features for statistics that match real prompts")
        return [{"caption": blank} for _ in range(images)], note
    caption = np.asarray(caption, dtype=np.float32)
    if caption.ndim == 2:
        caption = caption[None]
    mask = None if caption_mask is None else np.asarray(caption_mask).reshape(len(caption), -1)
    out = [{"caption": caption[i % len(caption)], **({} if mask is None else {"caption_mask": mask[i % len(mask)]})}
           for i in range(images)]
    return out, f"{len(caption)} caption row(s) from --caption, cycled to {images} images"


def batched(conds, size):
    """generate() condition arguments for consecutive calls of `size` images."""
    out = []
    for start in range(0, len(conds), size):
        chunk = conds[start: start + size]
        if "classes" in chunk[0]:
            out.append({"classes": [c["classes"][0] for c in chunk]})
        elif "prompt" in chunk[0]:
            out.append({"prompt": [c["prompt"] for c in chunk]})
        elif "prompt_ids" in chunk[0]:
            out.append({"prompt_ids": np.stack([c["prompt_ids"] for c in chunk])})
        else:
            call = {"caption": np.stack([c["caption"] for c in chunk])}
            if "caption_mask" in chunk[0]:
                call["caption_mask"] = np.stack([c["caption_mask"] for c in chunk])
            out.append(call)
    return out


def repeat_to(conds, images):
    return [conds[i % len(conds)] for i in range(images)]

def calibrate(engine, settings, tree, conds, batch, seed=0, clock="wall"):
    """AcceptanceCounts from generations of `conds` in calls of `batch` images with `tree`, and
    per call (images, ms per loop step, steps)."""
    counts, runs = AcceptanceCounts(), []
    for i, call in enumerate(batched(conds, batch)):
        timer = StepTimer(clock, counts)
        g = engine.generate(**call, settings=settings, seed=seed + i, tree=tree, observer=timer)
        runs.append({"images": g.stats["images"], "step_ms": timer.step_ms, "steps": len(timer.times) + 1})
    return counts, runs


# ---------------------------------------------------------------------------------------------
# The whole run


def tune(engine, settings, conds, *, budget=DEFAULT_BUDGET, depth=DEFAULT_DEPTH, batches=(1,), calibration_batch=None,
         width=None, repeats=5, loop_runs=3, rounds=3, seed=0, note="", threads=None, clock="wall", log=print):
    """Calibrate, measure and search for the GenerationSettings `settings` on
    the conditions `conds`. Returns (report dict, {batch: chosen Tree}; root_only() for AR).
    clock: "wall", or "cpu" (this process's CPU time: steady on a shared machine, and equal to
    wall time only for a single-threaded CPU backend; see tune_measure.default_clock)."""
    m = engine.manifest
    K = m.candidates
    settings = tuning_settings(engine, settings)
    for name, value, low, high in (("budget", budget, 2, 4096), ("depth", depth, 1, 16)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise LanternError(f"--{name} must be an integer in {low}..{high}, got {value!r}")
    width = min(CALIBRATION_WIDTH, K) if width is None else width
    if not 1 <= width <= K:
        raise LanternError(f"calibration width must be 1..{K} (the drafter's candidates), got {width}")
    nodes = max(budget, 1 + depth * width)
    calib = build_tree(calibration_tree(GUESS, nodes, depth, width), name=f"calibration-{nodes}-d{depth}-w{width}")
    calibration_batch = calibration_batch or max(batches)
    check_memory(engine, settings, calib, budget, depth, sorted({calibration_batch, *batches}))
    t0 = time.perf_counter()
    counts, calib_runs = calibrate(engine, settings, calib, conds, calibration_batch, seed, clock)
    p = acceptance_vectors(counts, depth=depth, width=min(K, max(width, counts.extent()[1])))
    log(f"[1/3] calibration: {len(conds)} images in calls of {calibration_batch}, tree {calib.name} "
        f"({calib.num_nodes} nodes, depth {calib.depth}, {width} ranks per opened node): {counts.steps} image-steps, "
        f"{time.perf_counter() - t0:.1f} s")
    log("acceptance p[depth, rank] (observations):")
    log(tree_report.acceptance_table(p, counts))

    cfg = settings.cfg
    per_batch, chosen = {}, {}
    on_plans = runs_plans(engine.backend.name)  # its calls must fall in the plans' profiles
    for images in batches:
        t0 = time.perf_counter()
        generation = (m.image.tokens - 1, images)  # the first token comes from the prefill
        verify_ms, draft_ms = call_latency(engine, settings, images, budget, depth, repeats, seed, clock)
        call = batched(repeat_to(conds, images), images)[0]
        # warm the sessions on loop-sized calls; the loop measurements below run on this step path
        step = engine.generate(**call, settings=settings, seed=seed, tree="chain-1").stats["step"]
        trees = fit_trees(K, budget, depth, calib)
        full = [r["step_ms"] for r in calib_runs if r["images"] == images]  # the calibration's own steps
        run = [t for t in trees if not (full and t == calib)]
        ms = loop_step_ms(engine, call, settings, [root_only()] + run, loop_runs, seed, clock)
        ar_ms = ms[root_only().paths]
        measured = [(t, float(min(full)), "calibration") if full and t == calib else (t, ms[t.paths], "generation")
                    for t in trees]

        def allowed(tree):  # tuning on TensorRT plans: only trees the backend's plans cover
            coverage = plans_coverage(m, engine.condition, tree, images, cfg)
            missing = coverage.get(engine.backend.key, ["every call"])
            return coverage_note({engine.backend.key: missing}) if missing else None

        # The chosen tree is measured too and the host terms refitted with it, until the search
        # settles on a tree whose step was measured (or AR): the choice rests on a measurement.
        for _ in range(rounds):
            latency, fit, host = fit_latency(verify_ms, draft_ms, ar_ms, measured)
            # ranks past the calibration's width have p = 0 and are never picked; a tree has <= MAX_WIDTH
            result = search(p, latency, budget, depth, min(K, MAX_WIDTH), allowed=allowed if on_plans else None,
                            generation=generation)
            best = result.best
            tree = root_only() if best.nodes == 1 else build_tree(best.paths, name=best.name)
            if tree.depth == 0 or any(t.paths == tree.paths for t, _, _ in measured):
                break
            # measured in turns with AR again: AR's step is the fastest of all its runs
            ms = loop_step_ms(engine, call, settings, [root_only(), tree], loop_runs, seed, clock)
            ar_ms = min(ar_ms, ms[root_only().paths])
            measured.append((tree, ms[tree.paths], "chosen"))
        report = tree_report.build_report(result, p, latency, min(K, MAX_WIDTH), counts, calibration=calib,
                                          generation=generation)
        coverage = plans_coverage(m, engine.condition, tree, images, cfg)
        report.update(images=images, step=step, host_fit=host, fit=fit, plans=coverage_note(coverage),
                      plans_cover=None if coverage is None else {k: not v for k, v in coverage.items()})
        per_batch[images], chosen[images] = report, tree
        log(f"[2/3] latency for {images} image(s) per call: verification T 1..{latency.verify.max_x}, drafter widths "
            f"1..{latency.draft.max_x}, {len(fit)} loop measurements on the {step} step; "
            f"{time.perf_counter() - t0:.1f} s")
        log(fit_table(fit, host))
        log(f"[3/3] search for {images} image(s) per call (budget {budget}, depth {depth}, {K} candidates):")
        log(tree_report.format_report(report))
        log(f"  compiled plans: {report['plans']}")
    report = {"key": settings.key, "settings": settings.canonical(), "engine": os.path.abspath(engine.directory),
              "backend": engine.backend.name, "threads": threads, "clock": clock, "machine": machine(),
              "conditions": note,
              "calibration": {"tree": calib.to_json(), "nodes": calib.num_nodes, "depth": calib.depth, "width": width,
                              "images": len(conds), "batch": calibration_batch, "runs": calib_runs,
                              "counts": counts.to_json()},
              "acceptance_vectors": np.round(p, 6).tolist(), "budget": budget, "depth": depth, "candidates": K,
              "batches": {str(n): r for n, r in per_batch.items()}}
    return report, chosen


# ---------------------------------------------------------------------------------------------
# The command


def add_parser(sub, backend_loaders=None):
    """backend_loaders: as lantern.runtime.cli.add_parser's (lantern-run adds torch)."""

    loaders = dict(backend_loaders or {})

    p = sub.add_parser("tune", help="measure acceptance and latency on this machine and pick the fastest draft tree "
                                    "for the given settings (writes it into the engine directory)")
    p.add_argument("engine", help="engine directory")
    add_generation_options(p, tree=False)
    p.add_argument("--classes", type=_classes, help="calibration class labels (default: spread over the classes)")
    p.add_argument("--caption", help="calibration T5 caption features .npy [N, tokens, dim] (default: blank captions)")
    p.add_argument("--caption-mask", help=".npy [N, tokens] of 0/1 for --caption")
    p.add_argument("--prompt", action="append", help="calibration prompt (Chameleon engines); repeat for several")
    p.add_argument("--prompt-ids", help=".npy [L] or [N, L] of calibration prompts' token ids (Chameleon engines)")
    p.add_argument("--budget", type=int, default=DEFAULT_BUDGET,
                   help=f"largest tree, root included (default {DEFAULT_BUDGET})")
    p.add_argument("--depth", type=int, default=DEFAULT_DEPTH, help=f"depth limit (default {DEFAULT_DEPTH})")
    p.add_argument("--images", type=int, default=DEFAULT_IMAGES,
                   help=f"calibration images (default {DEFAULT_IMAGES})")
    p.add_argument("--batch", type=int, default=1,
                   help="images per generate call to tune for, besides 1 (default 1); calibration runs at it")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per engine call size (default 5)")
    p.add_argument("--clock", choices=("auto", "wall", "cpu"), default="auto",
                   help="time on the wall clock or this process's CPU time (auto: cpu for --threads 1 on the "
                        "CPU, where it equals wall time and ignores other processes on the cores; else wall)")
    p.add_argument("--windows", type=_ints, default=list(tune_window.WINDOWS),
                   help="--proposer jacobi: the windows to measure (default "
                        f"{','.join(map(str, tune_window.WINDOWS))}); AR is always a candidate")
    p.add_argument("--also-jacobi", action="store_true",
                   help="an engine with a drafter: also measure the jacobi proposer's --windows against the chosen "
                        "tree, whole, and record a window where one is faster (generate then runs it for these "
                        "settings)")
    p.add_argument("--out", help="also write the report and trees into this directory")
    p.add_argument("--dry-run", action="store_true", help="report only: leave the engine directory untouched")
    p.set_defaults(func=run, backend_loaders=loaders)


def run(args):
    for name, value in (("--images", args.images), ("--batch", args.batch), ("--repeats", args.repeats)):
        if value < 1:
            raise LanternError(f"{name} must be >= 1, got {value}")
    if not isinstance(args.seed, int):
        raise LanternError("tune takes one integer --seed (its calls give image i seed + i)")
    engine = open_engine(args)
    settings = tuning_settings(engine, generation_settings(args))
    key = settings.key
    caption = _load_npy(args.caption, "caption features") if args.caption else None
    mask = _load_npy(args.caption_mask, "caption mask") if args.caption_mask else None
    prompt_ids = _load_npy(args.prompt_ids, "prompt ids") if args.prompt_ids else None
    conds, note = conditions(engine, args.images, args.classes, caption, mask, args.prompt, prompt_ids)
    if not args.dry_run:  # before minutes of measurements, not after them
        enginedir.check_writable(args.engine, "lantern-run tune")
    batches = sorted({1, args.batch})
    if settings.proposer == "jacobi":
        return _run_windows(args, engine, settings, conds, note, batches)
    clock = clock_of(args)
    print(f"tuning {key} on {args.engine} ({engine.backend.name}, {args.threads or os.cpu_count()} thread(s), "
          f"{clock} clock)")
    print(f"conditions: {note}")
    report, chosen = tune(engine, settings, conds, budget=args.budget, depth=args.depth, batches=batches,
                          calibration_batch=args.batch, repeats=args.repeats, seed=args.seed, note=note,
                          threads=args.threads or os.cpu_count(), clock=clock)
    if args.also_jacobi:  # between proposers: the chosen trees against the windows, measured whole
        print(f"between proposers: the chosen tree(s) against jacobi windows {', '.join(map(str, args.windows))} and "
              f"ar, whole generations in turns")
        calls = {images: batched(repeat_to(conds, max(images, len(conds) // images * images)), images)
                 for images in batches}
        measured, picks = tune_window.tune_windows(engine, settings, calls, args.windows, seed=args.seed, trees=chosen)
        for images, pick in picks.items():
            report["batches"][str(images)]["proposers"] = measured[images]
            if isinstance(pick, int):  # a jacobi window ran faster than the tree (and AR)
                chosen[images] = pick
    if args.out:
        try:
            tune_record.write_report(args.out, report)
            for images, tree in chosen.items():
                if getattr(tree, "depth", 0):
                    tune_record.write_json(os.path.join(args.out, f"tree-b{images}.json"), tree.to_json())
        except OSError as e:
            raise LanternError(f"{args.out}: cannot write the report ({e.strerror})") from None
    if args.dry_run:
        print("dry run: the engine directory was not changed")
        return 0
    entry = tune_record.install(args.engine, chosen, report)
    for t in entry.trees:
        what = f"{t.name} ({t.nodes} nodes, depth {t.depth}) in {t.file}" if t.file else \
            f"the jacobi proposer's window of {t.window} slots" if t.window else "AR (no drafting)"
        print(f"{t.images} image(s) per call: {what}")
    print(f"manifest: generate with these settings on {engine.backend.name} now uses the tuned tree "
          f"(unless --tree is given); report: {os.path.join(args.engine, entry.report)}")
    return 0


def _run_windows(args, engine, settings, conds, note, batches):
    """tune --proposer jacobi: the fastest window per batch, measured whole (tools.tune_window)."""
    print(f"tuning the jacobi window for {settings.key} on {args.engine} ({engine.backend.name}, "
          f"{args.threads or os.cpu_count()} thread(s)); windows {', '.join(map(str, args.windows))} and ar")
    print(f"conditions: {note}")
    calls = {images: batched(repeat_to(conds, max(images, len(conds) // images * images)), images)
             for images in batches}
    reports, chosen = tune_window.tune_windows(engine, settings, calls, args.windows, seed=args.seed)
    report = {"key": settings.key, "settings": settings.canonical(), "engine": os.path.abspath(engine.directory),
              "backend": engine.backend.name, "threads": args.threads or os.cpu_count(), "clock": "wall",
              "machine": machine(), "conditions": note, "windows": list(args.windows),
              "batches": {str(n): r for n, r in reports.items()}}
    if args.out:
        try:
            os.makedirs(args.out, exist_ok=True)
            tune_window.write_report(args.out, report)
        except OSError as e:
            raise LanternError(f"{args.out}: cannot write the report ({e.strerror})") from None
    if args.dry_run:
        print("dry run: the engine directory was not changed")
        return 0
    tune_record.install(args.engine, chosen, report, render=tune_window.write_report)
    print("tuned: " + "; ".join(f"{n} image(s) per call: {'AR' if w is None else f'window {w}'}"
                                for n, w in sorted(chosen.items())))
    print(f"generate --proposer jacobi uses it for these settings on {engine.backend.name} (--window picks another)")
    return 0
