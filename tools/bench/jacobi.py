"""Benchmark the drafter-free proposer (speculative Jacobi decoding) against AR and the drafter's
tree, in one run, and print ONE JSON object (progress lines go to stderr):

  step_compression  on --engine (CFG 3, temperature 1, every class x --per-class sampled images, the
                    same per-image seeds for every method): target calls per image after prefill
                    (steps_per_image), AR's over the method's (ratio_vs_ar), class accuracy and
                    Fréchet distance against AR's images, judged with the quality harness's own
                    classifier, features and distance (lantern.tools.quality_judge); the noise: AR
                    against AR with other seeds, as the harness computes its floor
  wall_clock        ONNX Runtime on the CPU with --threads, batch 1 and 8: ar, jacobi exact and
                    jacobi lantern++ (window 16, the step compression's, and 6, generate's default) per engine (--engine, and --gpt-b where present,
                    with fewer images sized from one measured AR image to stay within
                    --gpt-b-seconds): seconds per image, the speedup over AR, and the step's cost
                    in AR steps (seconds per batch step of the method / seconds per AR step; a
                    batch step runs until its slowest image is done, prefill included)
  window_sweep      windows 3, 4, 6, 8, 16 for jacobi exact and jacobi lantern++ on --engine: steps per
                    image over the step_compression images and wall clock at batch 1

Timed methods run on an Engine each (its own step plan) and are interleaved batch by batch, so a
slower stretch of a shared machine falls on every method alike.

    python -m lantern.tools.bench.jacobi [--engine engines/demo] [--per-class 4] [--threads 2] [--json out.json]
    python -m lantern.tools.bench.jacobi --quick   # a few images, batch 1 only, no GPT-B engine
"""
import argparse
import dataclasses
import json
import os
import platform
import sys
import time

import numpy as np

from lantern.runtime.generator import Engine
from lantern.runtime.jacobi import DEFAULT_WINDOW
from lantern.runtime.settings import GenerationSettings, RELAXED
from lantern.tools.quality import row_tree
from lantern.tools.quality_judge import classify, frechet_distance, load_judge, project

K, LAM = 20, 5.0  # the demo's lantern++
WINDOW = 16
WINDOWS = (3, 4, 6, 8, 16)
JUDGE_BATCH = 32  # images per generate call where only the tokens count (an image's tokens do not
#                   depend on the images beside it: lantern.runtime.streams)


def log(message):
    print(f"[bench.jacobi {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def image_seeds(seed, role, n):
    """One seed per image: role 0 the methods' images, role 1 AR's noise floor."""
    return [int(x) for x in np.random.SeedSequence([seed, role]).generate_state(n)]


def compression_methods(engine, base):
    """(name, settings) of part a that this engine serves: the tree rows need a drafter, the
    relaxed ones a neighbor table (k at most its width)."""
    m = engine.manifest
    k = K if m.neighbors is None else min(K, m.neighbors.k)
    small = [x for x in (3, 8) if x < k]
    jacobi = dict(proposer="jacobi", window=WINDOW)
    rows = [("ar", base.replace(mode="ar")),
            ("tree exact", base.replace(mode="exact")),
            (f"tree lantern++ k={k} lam={LAM:g}", base.replace(mode="lantern++", k=k, lam=LAM))]
    rows += [(f"jacobi exact {init}", base.replace(mode="exact", init=init, **jacobi))
             for init in ("random", "uniform", "spatial")]
    rows += [(f"jacobi lantern++ k={k} lam={lam:g}", base.replace(mode="lantern++", k=k, lam=lam, **jacobi))
             for lam in (LAM, 2.0)]
    rows += [(f"gsd jacobi k={x} tau=1", base.replace(mode="gsd", k=x, tau=1.0, **jacobi)) for x in small + [k]]
    rows += [(f"gsd jacobi k={k} tau=0.15", base.replace(mode="gsd", k=k, tau=0.15, **jacobi)),
             (f"gsd tree k={k} tau=1", base.replace(mode="gsd", k=k, tau=1.0))]
    return [(name, s) for name, s in rows
            if not (s.mode != "ar" and s.proposer == "tree" and "exact" not in m.modes)
            and not (s.mode in RELAXED and m.neighbors is None)]


def generate_all(engine, settings, classes, seeds):
    """Every image's tokens (batches of JUDGE_BATCH), steps per image and accepted length, seconds."""
    tokens, steps, accepted, seconds = [], 0.0, 0.0, 0.0
    for i in range(0, len(classes), JUDGE_BATCH):
        t = time.perf_counter()
        r = engine.generate(settings, classes=classes[i:i + JUDGE_BATCH], seed=seeds[i:i + JUDGE_BATCH],
                            tree=row_tree(engine, settings))
        seconds += time.perf_counter() - t
        tokens.append(r.tokens)
        steps += r.stats["steps_per_image"] * len(r.tokens)
        accepted += r.stats["mean_accepted_length"] * len(r.tokens)
    n = len(classes)
    return np.concatenate(tokens), steps / n, accepted / n, seconds


def step_compression(engine, classifier, classes, args, base):
    seeds = image_seeds(args.seed, 0, len(classes))
    labels = np.asarray(classes)

    def judge(tokens):
        predicted, feats = classify(classifier, engine.decode(tokens))
        return float((predicted == labels).mean()), feats

    rows, ar_feats, ar_steps = {}, None, None
    for name, settings in compression_methods(engine, base):
        tokens, steps, accepted, seconds = generate_all(engine, settings, classes, seeds)
        accuracy, feats = judge(tokens)
        if ar_feats is None:  # ar comes first: the reference of every distance, and its noise floor
            ar_feats, ar_steps = feats, steps
            floor_tokens = generate_all(engine, settings, classes, image_seeds(args.seed, 1, len(classes)))[0]
            floor_accuracy, floor_feats = judge(floor_tokens)
            noise = {"accuracy_ar": accuracy, "accuracy_ar_other_seeds": floor_accuracy,
                     "frechet_ar_vs_ar_other_seeds": distance(floor_feats, ar_feats, args.feature_dims)}
            log(f"noise floor: ar accuracy {accuracy:.3f}, other seeds {floor_accuracy:.3f}, "
                f"frechet {noise['frechet_ar_vs_ar_other_seeds']:.2f}")
        rows[name] = {"settings": settings.canonical(), "steps_per_image": steps, "ratio_vs_ar": ar_steps / steps,
                      "mean_accepted_length": accepted, "accuracy": accuracy,
                      "frechet_vs_ar": distance(feats, ar_feats, args.feature_dims),
                      "seconds_batch32": seconds}
        r = rows[name]
        log(f"{name:30s} steps/image {steps:5.1f}  ratio {r['ratio_vs_ar']:.2f}  accuracy {accuracy:.3f}  "
            f"frechet {r['frechet_vs_ar']:.2f}")
    return {"images": len(classes), "ar_steps_per_image": ar_steps, "noise": noise,
            "frechet_space": f"the quality harness's: classifier features on the top {args.feature_dims} principal "
                             f"directions of ar's", "methods": rows}


def distance(feats, reference, dims):
    return frechet_distance(project(reference, reference, dims), project(feats, reference, dims))


def open_engines(directory, named, threads):
    """An Engine per (name, settings), each warmed on one image (its sessions; a step plan for
    another batch size is a few buffers, made on the first timed call)."""
    engines = {name: Engine(directory, threads=threads) for name, _ in named}
    for name, settings in named:
        engines[name].generate(settings, classes=[0], seed=0)
    return engines


def timed(engines, named, classes, seeds, batch):
    """Wall clock of each (name, settings) on its own Engine, interleaved batch by batch:
    {name: seconds per image and per batch step, steps per image, speedup and step cost against
    the first (ar)}."""
    out = {name: {"seconds": 0.0, "batch_steps": 0, "steps": 0.0} for name, _ in named}
    for i in range(0, len(classes), batch):
        for name, settings in named:
            calls = []
            t = time.perf_counter()
            r = engines[name].generate(settings, classes=classes[i:i + batch], seed=seeds[i:i + batch],
                                       observer=calls.append)
            out[name]["seconds"] += time.perf_counter() - t
            out[name]["batch_steps"] += len(calls)
            out[name]["steps"] += r.stats["steps_per_image"] * len(r.tokens)
    n = len(classes)
    ar = out[named[0][0]]
    ar_step = ar["seconds"] / ar["batch_steps"]
    return {name: {"seconds_per_image": o["seconds"] / n, "steps_per_image": o["steps"] / n,
                   "batch_steps": o["batch_steps"], "seconds_per_step": o["seconds"] / o["batch_steps"],
                   "step_cost_in_ar_steps": o["seconds"] / o["batch_steps"] / ar_step,
                   "speedup_vs_ar": ar["seconds"] / o["seconds"]} for name, o in out.items()}


def wall_methods(base, k, window=WINDOW):
    jacobi = dict(proposer="jacobi", window=window)
    return [(f"jacobi exact W={window}", base.replace(mode="exact", **jacobi)),
            (f"jacobi lantern++ k={k} lam={LAM:g} W={window}", base.replace(mode="lantern++", k=k, lam=LAM, **jacobi))]


def cycle_classes(n_classes, n):
    return (np.arange(n) % n_classes).tolist()


def wall_clock(directory, images, batches, args, base):
    """Part b on one engine: ar first (the reference of speedups and step costs)."""
    probe = Engine(directory, threads=args.threads)
    m = probe.manifest
    k = min(K, m.neighbors.k) if m.neighbors is not None else None
    named = [("ar", base.replace(mode="ar"))] + [x for w in (WINDOW, DEFAULT_WINDOW) for x in wall_methods(base, k or K, w)
                                                   if k is not None or x[1].mode not in RELAXED]
    probe.release()
    out = {"engine": os.path.abspath(directory), "target": dataclasses.asdict(m.target),
           "batches": {}}
    engines = open_engines(directory, named, args.threads)
    for batch, n in zip(batches, images):
        classes = cycle_classes(m.condition.num_classes, n)
        rows = timed(engines, named, classes, image_seeds(args.seed, 2, n), batch)
        out["batches"][str(batch)] = {"images": n, "methods": rows}
        for name, r in rows.items():
            log(f"{os.path.basename(directory)} batch {batch}: {name:32s} {r['seconds_per_image'] * 1e3:8.1f} "
                f"ms/image  speedup {r['speedup_vs_ar']:.2f}  step cost {r['step_cost_in_ar_steps']:.2f} AR steps")
    for e in engines.values():
        e.release()
    return out


def gpt_b_plan(directory, args, base):
    """Images per batch size for the GPT-B engine, sized from one measured AR image so the part
    stays within --gpt-b-seconds (measured ratios on 2 cores: per image, batch 1 costs about
    4.5 AR images for the three methods, batch 8 about 3.4)."""
    e = Engine(directory, threads=args.threads)
    e.generate(base.replace(mode="ar"), classes=[0], seed=0)  # sessions warm
    t = time.perf_counter()
    e.generate(base.replace(mode="ar"), classes=[1], seed=1)
    one = time.perf_counter() - t
    e.release()
    budget = args.gpt_b_seconds - 6 * one  # the warm-ups (a jacobi image costs about 2 AR images)
    n1 = int(np.clip(0.45 * budget // (4.5 * one), 1, 8))
    eights = int(np.clip(0.45 * budget // (8 * 3.4 * one), 0, 2))
    log(f"{os.path.basename(directory)}: one AR image {one:.2f} s: batch 1 x {n1} images, batch 8 x {8 * eights}")
    batches, images = [1], [n1]
    if eights:
        batches.append(8)
        images.append(8 * eights)
    return one, batches, images


def window_sweep(directory, classes, args, base, images):
    """Part c: steps per image over part a's images and wall clock at batch 1, per window."""
    engine = Engine(directory, threads=args.threads)
    m = engine.manifest
    k = min(K, m.neighbors.k) if m.neighbors is not None else None
    seeds = image_seeds(args.seed, 0, len(classes))
    named = []
    for w in WINDOWS:
        named += [x for x in wall_methods(base, k or K, w) if k is not None or x[1].mode not in RELAXED]
    steps = {name: generate_all(engine, s, classes, seeds)[1] for name, s in named}
    engine.release()
    n_classes = m.condition.num_classes
    named = [("ar", base.replace(mode="ar"))] + named
    engines = open_engines(directory, named, args.threads)
    wall = timed(engines, named, cycle_classes(n_classes, images), image_seeds(args.seed, 2, images), 1)
    for e in engines.values():
        e.release()
    out = {"images_timed": images, "ar_batch1": wall.pop("ar"), "windows": {}}
    for name, s in named[1:]:
        row = dict(wall[name], steps_per_image=steps[name], steps_per_image_timed=wall[name]["steps_per_image"])
        out["windows"].setdefault(str(s.window), {})[name.rsplit(" W=", 1)[0]] = row
        log(f"window {s.window:2d} {name:32s} steps/image {steps[name]:5.1f}  batch 1 speedup "
            f"{row['speedup_vs_ar']:.2f}  step cost {row['step_cost_in_ar_steps']:.2f}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="engines/demo")
    p.add_argument("--gpt-b", default="engines/demo-gpt-b", help="the GPT-B-cost engine, timed where present")
    p.add_argument("--per-class", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--classifier", help="classifier .safetensors (default: the demo model's)")
    p.add_argument("--feature-dims", type=int, default=16)
    p.add_argument("--wall-images", type=int, default=48, help="images per batch size timed on --engine")
    p.add_argument("--gpt-b-seconds", type=float, default=200.0, help="the GPT-B part's budget")
    p.add_argument("--json", help="also write the JSON here")
    p.add_argument("--quick", action="store_true", help="3 classes x 1 image, batch 1 only, no GPT-B engine")
    args = p.parse_args(argv)
    start = time.perf_counter()
    import torch

    torch.set_num_threads(args.threads)
    base = GenerationSettings(cfg_scale=3.0, temperature=1.0)
    engine = Engine(args.engine, threads=args.threads)
    n_classes = engine.manifest.condition.num_classes
    classifier, classifier_path = load_judge(args.classifier)
    if args.quick:
        classes = list(range(min(3, n_classes)))
        wall_images, batches = 2, [1]
    else:
        classes = np.repeat(np.arange(n_classes), args.per_class).tolist()
        wall_images, batches = args.wall_images, [1, 8]
    log(f"step compression: {len(classes)} images per method on {args.engine}")
    compression = step_compression(engine, classifier, classes, args, base)
    engine.release()
    log("wall clock")
    wall = {os.path.basename(os.path.abspath(args.engine)):
            wall_clock(args.engine, [wall_images] * len(batches), batches, args, base)}
    if not args.quick and args.gpt_b and os.path.isdir(args.gpt_b):
        t = time.perf_counter()
        one, gb_batches, gb_images = gpt_b_plan(args.gpt_b, args, base)
        record = wall_clock(args.gpt_b, gb_images, gb_batches, args, base)
        record.update(ar_image_seconds_probe=one, seconds=time.perf_counter() - t)
        wall[os.path.basename(os.path.abspath(args.gpt_b))] = record
    log("window sweep")
    windows = window_sweep(args.engine, classes, args, base, wall_images)
    result = {"engine": os.path.abspath(args.engine), "classifier": classifier_path,
              "settings": {"cfg_scale": 3.0, "temperature": 1.0, "per_class": 1 if args.quick else args.per_class,
                           "classes": n_classes if not args.quick else len(classes), "seed": args.seed,
                           "threads": args.threads, "quick": args.quick, "window": WINDOW,
                           "backend": "onnxruntime cpu"},
              "step_compression": compression, "wall_clock": wall, "window_sweep": windows,
              "seconds": time.perf_counter() - start, "load_avg_1m": round(os.getloadavg()[0], 2),
              "cpu": platform.processor() or platform.machine()}
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
