"""`lantern-run quality ENGINE`: what relaxation and quantization cost in image quality, next to
what they gain, so a user picks a point on the speed/quality curve.

For every scheme (the engine as given, plus the weight-only quantized copies --schemes names:
int8 and int4 by default, made from the engine in a temporary directory in a second or two) and
every method (ar, exact and lantern++ at the demo's k 20, λ 5 by default) it generates the same
requested classes with the same seeds (sampling with CFG, as images are generated in practice),
then reports (the drafter's rows draft with the engine's exported tree in every scheme)
  accuracy   the classifier agrees with the requested class (class consistency),
  frechet    Fréchet distance between the row's samples and the engine's own `ar` samples (the
             reference: fp32 `ar`) in the classifier's feature space; the reference `ar` against
             `ar` with other seeds is the noise floor,
  greedy     greedy token agreement with the reference: one greedy image per class per row,
             compared position by position with the reference's greedy `ar` tokens (free
             running: after a first difference the rest of the image usually differs too), and
             per scheme the teacher-forced agreement: on the reference's own greedy `ar` inputs,
             how often the scheme's target picks the same greedy token,
  speed      mean accepted length, target calls per image after prefill (steps/image) and wall
             time against the reference `ar` in the same run,
in report.json and report.md with a speed-versus-quality plot, written to its own directory
(--out, default ./quality-ENGINE_NAME) which appears when the sweep is complete. The classifier is
the demo's (tools/train/classifier.py) unless --classifier.

Drafter-free rows: --proposers tree,jacobi adds, next to the drafter tree's rows, the same
methods with the Jacobi window (lantern.runtime.jacobi; --window slots, --init drafts): "jacobi
exact", "jacobi lantern++ k=.. lam=..", and grouped speculative decoding (mode gsd, lossy) per
proposer, "gsd k=.. (tree)" and "gsd k=.. (jacobi)" at --taus (default 1 where jacobi is asked
for, none otherwise). --proposers jacobi alone needs no drafter: an engine with a neighbor table
and a VQ decoder serves it. A jacobi row takes about half as long as the tree's exact (demo,
batch 32, CPU).

The default (3 schemes x 3 methods, 6 images per class) takes about 3 min on two CPU cores;
--schemes none compares methods on the engine alone (a third of that, or --per-class 20 for
tighter numbers); --lams, --ks and --deltas widen the sweep, each speculative method taking about
as long as exact. Before the sweep it states its size and the time it expects, measured on one
batch of ar and one of each proposer's exact. Images go through the engine in batches of --batch (a 26-node tree
over hundreds of CFG rows at once is several times slower per image on a CPU); batch i of every
row uses the same seed.
"""
import dataclasses
import json
import os
import sys
import tempfile
import time

import numpy as np

from lantern.export.quantize import greedy_agreement, quantize_engine, QuantizeOptions
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import DECODE_CHUNK, Engine
from lantern.runtime.jacobi import DEFAULT_WINDOW, INITS, JacobiWindow
from lantern.runtime.manifest import quantization_scheme
from lantern.runtime.memory import available_memory
from lantern.runtime.outdir import only_files, OutputDirectory
from lantern.runtime.plan import decode_bytes
from lantern.runtime.png import image_grid, write_png
from lantern.runtime.settings import GenerationSettings, PROPOSERS, RELAXED
from lantern.tools import quality_report
from lantern.tools.quality_judge import classify, frechet_distance, load_judge, project

# What the report directory holds: --force replaces only a directory with nothing else in it.
REPORT_FILES = ("report.json", "report.md", "*.png")
QUANTIZED = ("int8", "int4")  # lantern.export.quantize.SCHEMES (not imported: the parser stays light)


def _floats(text):
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def _schemes(text):
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in ("none",) + QUANTIZED]
    if bad:
        import argparse

        raise argparse.ArgumentTypeError(f"unknown scheme(s) {', '.join(bad)}; valid: none, {', '.join(QUANTIZED)}")
    return [x for x in names if x != "none"]


def _proposers(text):
    names = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [x for x in names if x not in PROPOSERS]
    if bad or not names:
        import argparse

        raise argparse.ArgumentTypeError(f"unknown proposer(s) {', '.join(bad) or '(none given)'}; valid: "
                                         f"{', '.join(PROPOSERS)}")
    return names


def add_parser(sub):
    p = sub.add_parser("quality", help="speed vs quality sweep over quantization schemes and decoding methods "
                                       "(class accuracy, Fréchet distance and greedy agreement against fp32 ar)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("engine", help="engine directory with a neighbor table and VQ decoder (and a drafter for the "
                                  "tree rows)")
    p.add_argument("--classifier", help="classifier .safetensors (default: the demo model's)")
    p.add_argument("--schemes", type=_schemes, default=list(QUANTIZED),
                   help="quantized copies of the engine to compare with it (default int8,int4; 'none': the engine "
                        "alone)")
    p.add_argument("--per-class", type=int, default=6, help="images per class and row (default 6)")
    p.add_argument("--lams", type=_floats, default=[5.0],
                   help="lantern++ λ values (default 5, the demo's; a wider sweep: 1,1.5,2,3,5)")
    p.add_argument("--ks", type=_ints, default=[20], help="lantern++ / lantern neighbor counts k (default 20)")
    p.add_argument("--deltas", type=_floats, default=[], help="lantern δ values (default none; e.g. 0.1,0.3)")
    p.add_argument("--proposers", type=_proposers, default=["tree"],
                   help="who drafts the speculative rows: tree (the drafter's exported tree, the default), jacobi "
                        "(the drafter-free window), or tree,jacobi (both, each with its rows)")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help=f"jacobi rows: slots per verification (default {DEFAULT_WINDOW}, generate's)")
    p.add_argument("--init", choices=INITS, default="random", help="jacobi rows: fresh drafts (default random)")
    p.add_argument("--taus", type=_floats, default=None,
                   help="gsd rows' τ, one row per proposer, k (--ks) and τ (default: 1 when --proposers names "
                        "jacobi, else no gsd rows; '' for none)")
    p.add_argument("--cfg-scale", type=float, default=3.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--feature-dims", type=int, default=16,
                   help="principal directions of the ar features the Fréchet distance uses (default 16)")
    p.add_argument("--batch", type=int, default=32, help="images per engine call (default 32)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", help="report directory (default: ./quality-ENGINE_NAME)")
    p.add_argument("--force", action="store_true", help="replace --out if it holds an earlier quality report")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def methods(lams, ks, deltas, base=GenerationSettings(), proposers=("tree",), taus=(), window=DEFAULT_WINDOW,
            init="random"):
    """(row name, GenerationSettings) of every decoding method of the sweep: `base` (the shared
    sampling and CFG settings) in each mode with its relaxations, for each proposer: the tree's
    rows keep their plain names, the jacobi window's are prefixed "jacobi "; gsd rows (one per
    k and τ) name their proposer in brackets."""
    def with_(**changes):
        return dataclasses.replace(base, **changes)

    out = [("ar", with_(mode="ar", proposer="tree"))]
    for proposer in proposers:
        draft = {"proposer": "tree"} if proposer == "tree" else {"proposer": proposer, "window": window, "init": init}
        name = "" if proposer == "tree" else f"{proposer} "
        out.append((f"{name}exact", with_(mode="exact", **draft)))
        for k in ks:
            out += [(f"{name}lantern++ k={k} lam={lam:g}", with_(mode="lantern++", k=k, lam=lam, **draft))
                    for lam in lams]
        out += [(f"{name}lantern k={max(ks)} delta={d:g}", with_(mode="lantern", k=max(ks), delta=d, **draft))
                for d in deltas]
        out += [(f"gsd k={k}{'' if tau == 1 else f' tau={tau:g}'} ({proposer})", with_(mode="gsd", k=k, tau=tau,
                                                                                       **draft))
                for k in ks for tau in taus]
    return out


def sweep_methods(args):
    """methods() for the command line's options."""
    return methods(args.lams, args.ks, args.deltas, sweep_settings(args), args.proposers, gsd_taus(args),
                   args.window, args.init)


def gsd_taus(args):
    """--taus, or its default: one gsd row per k at τ 1 where the jacobi rows are asked for."""
    if args.taus is not None:
        return args.taus
    return [1.0] if "jacobi" in args.proposers else []


def row_tree(engine, settings):
    """The tree a row passes to generate: the engine's exported one for the drafter tree's
    speculative rows (not a tuned one), None for ar and the jacobi window (it has its own)."""
    return engine.tree if settings.mode != "ar" and settings.proposer == "tree" else None


def sweep_settings(args):
    """The settings every row shares, from the command line (one line on bad values)."""
    return GenerationSettings(cfg_scale=args.cfg_scale, temperature=args.temperature, top_k=args.top_k)


def _check_args(args):
    for name in ("per_class", "batch", "threads", "feature_dims"):
        value = getattr(args, name)
        if value < 1:
            raise LanternError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not args.ks:
        raise LanternError("--ks needs at least one k")
    sweep_methods(args)  # every row's settings, checked before any work


def batch_seed(seed, role, index):
    """An independent seed for batch `index` of a role (0: the methods, 1: ar's noise floor)."""
    return int(np.random.SeedSequence([seed, role, index]).generate_state(1)[0])


def run(args):
    _check_args(args)
    out_dir = args.out or f"quality-{os.path.basename(os.path.abspath(args.engine))}"
    # Checked and locked before any work; the report appears only when the sweep is complete.
    with OutputDirectory(out_dir, args.force, only_files(REPORT_FILES, "lantern-run quality"),
                         kind="report directory") as stage:
        summary = sweep(args, stage)
    print(f"report: {os.path.join(out_dir, 'report.md')} ({_duration(summary['seconds'])}; expected "
          f"{_duration(summary['expected_seconds'])})")
    return 0


def _engines(args, work):
    """{scheme label: Engine}: the engine as given first (the reference), then its quantized copies."""

    reference = Engine(args.engine, threads=args.threads)
    check_engine(reference, args)
    m = reference.manifest
    label = quantization_scheme(m)
    label = m.dtype if label == "none" else label
    if args.schemes and label != "fp32":
        raise LanternError(f"{args.engine} is {label}; the scheme comparison quantizes an fp32 engine (give the fp32 "
                           f"engine, or --schemes none to judge this one alone)")
    check_memory(reference, args)
    engines = {label: reference}
    if args.schemes:

        for scheme in args.schemes:
            out = os.path.join(work, scheme)
            quantize_engine(args.engine, out, QuantizeOptions(scheme))
            engines[scheme] = Engine(out, threads=args.threads)
    return engines


def check_engine(engine, args):
    """One line on an engine the requested rows cannot run on: class-conditional with a VQ
    decoder always, a drafter for the tree's rows, a neighbor table for the relaxed ones."""
    m, rows = engine.manifest, sweep_methods(args)
    missing = [what for what, lacking in (
        ("class conditioning", m.condition.kind != "class"),
        ("a VQ decoder", "vq_decoder" not in m.graphs),
        ("a drafter (for the tree rows; --proposers jacobi needs none)",
         any(s.mode != "ar" and s.proposer == "tree" for _, s in rows) and "exact" not in m.modes),
        ("a neighbor table (for the relaxed rows)", any(s.mode in RELAXED for _, s in rows) and m.neighbors is None),
    ) if lacking]
    if missing:
        raise LanternError(f"{args.engine}: the quality harness needs a class-conditional engine with a VQ decoder; "
                           f"this one lacks {', '.join(missing)}")


def widest_trees(engine, args):
    """(tree, drafter) of the step plans the sweep's rows run: the exported tree, the jacobi
    window's chain."""
    trees = [(engine.tree, True)] if "tree" in args.proposers else []
    if "jacobi" in args.proposers:  # the target alone: no drafter call in its plan
        trees.append((JacobiWindow(args.window, args.init, engine.manifest).tree, False))
    return trees


def check_memory(engine, args):
    """Refuse, in one line and before anything is quantized or allocated, a sweep this machine
    cannot hold: its widest step plans (the exported tree, the jacobi window, over --batch images
    or over the greedy rows' one image per class) as generate refuses one, and a row's images decoded at once."""
    n_classes = engine.manifest.condition.num_classes
    row = n_classes * args.per_class
    widest = max(min(args.batch, row), n_classes)
    prefix = engine.condition.prefix(args.cfg_scale > 1, classes=np.arange(widest) % n_classes)
    for tree, drafter in widest_trees(engine, args):
        engine.check_memory(tree, prefix, drafter=drafter)
    need, limit = decode_bytes(engine.manifest, row, DECODE_CHUNK), available_memory()
    if limit is not None and need > 0.8 * limit:  # Engine.decode's margin
        raise LanternError(f"a row of {row} images ({args.per_class} per class) needs about {need / 2**30:.2f} GiB "
                           f"decoded, more than this machine can give ({limit / 2**30:.2f} GiB available); "
                           f"use a smaller --per-class")


def sweep(args, out_dir):
    """Run every scheme x method, judge the images, write the report files into out_dir; returns
    the summary."""
    with tempfile.TemporaryDirectory(prefix="lantern-quality-") as work:
        return _sweep(args, out_dir, work)


def _sweep(args, out_dir, work):
    import torch

    engines = _engines(args, work)
    reference_scheme, reference = next(iter(engines.items()))
    m = reference.manifest
    classifier, path = load_judge(args.classifier)
    n_classes = m.condition.num_classes
    classes = np.repeat(np.arange(n_classes), args.per_class)
    batches = [slice(i, i + args.batch) for i in range(0, len(classes), args.batch)]
    greedy_classes = np.arange(n_classes)  # one greedy image per class and row
    torch.set_num_threads(args.threads)
    # Every scheme drafts with the engine's exported tree (not a tree `lantern-run tune` chose for
    # one engine's latency), so rows differ only in the scheme and the method.
    base = sweep_settings(args)
    plan = [(name, settings, row_tree(reference, settings)) for name, settings in sweep_methods(args)]

    def generate(engine, settings, tree, role):
        """All images of one row, batch by batch: tokens, engine seconds, per-image stats."""
        tokens, seconds, accepted, steps = [], 0.0, 0.0, 0.0
        for i, b in enumerate(batches):
            t = time.perf_counter()
            r = engine.generate(classes=classes[b].tolist(), seed=batch_seed(args.seed, role, i), settings=settings,
                                tree=tree)
            seconds += time.perf_counter() - t
            tokens.append(r.tokens)
            accepted += r.stats["mean_accepted_length"] * len(r.tokens)
            steps += r.stats["steps_per_image"] * len(r.tokens)
            bar.update(len(r.tokens))
        n = len(classes)
        return np.concatenate(tokens), seconds, {"mean_accepted_length": accepted / n, "steps_per_image": steps / n}

    def greedy(engine, settings, tree):
        r = engine.generate(classes=greedy_classes.tolist(), settings=dataclasses.replace(settings, greedy=True),
                            tree=tree)
        bar.update(len(greedy_classes))
        return r.tokens

    def judge(tokens):
        images = reference.decode(tokens)
        predicted, feats = classify(classifier, images)
        return images, (predicted == classes).mean(), feats

    # Size and expected time: one batch of ar and one of exact per proposer on the reference,
    # scaled to the sweep (a quantized engine costs about what the reference does on a CPU:
    # 0.9-1.3x measured; a relaxed row about what its proposer's exact does).
    probe = classes[batches[0]].tolist()
    probes = {"ar": dataclasses.replace(base, mode="ar")}
    probes.update({name: settings for name, settings, _ in plan if settings.mode == "exact"})
    for settings in probes.values():  # warm up
        reference.generate(classes=classes[:2].tolist(), settings=settings, tree=row_tree(reference, settings))
    cost = {}
    for name, settings in probes.items():
        t = time.perf_counter()
        r = reference.generate(classes=probe, settings=settings, seed=args.seed, tree=row_tree(reference, settings))
        decoded = time.perf_counter()
        reference.decode(r.tokens)
        per_image = (decoded - t) / len(probe)
        cost[name] = {"generate": per_image, "decode": (time.perf_counter() - decoded) / len(probe)}
    exact_of = {s.proposer: name for name, s in probes.items() if s.mode == "exact"}
    per_row = sum(cost["ar" if settings.mode == "ar" else exact_of[settings.proposer]]["generate"]
                  for _, settings, _ in plan)
    expected = len(engines) * (per_row * (len(classes) + len(greedy_classes)) + len(plan) * len(classes)
                               * cost["ar"]["decode"]) + len(classes) * sum(cost["ar"].values())
    total_images = (len(classes) + len(greedy_classes)) * len(plan) * len(engines) + len(classes) + len(greedy_classes)
    print(f"quality: {len(engines)} scheme{'s' if len(engines) > 1 else ''} ({', '.join(engines)}) x {len(plan)} methods "
          f"({', '.join(name for name, _, _ in plan)}) x {len(classes)} sampled images ({args.per_class} per class x "
          f"{n_classes} classes) + {len(greedy_classes)} greedy ones + ar's noise floor = {total_images} images in "
          f"batches of {args.batch}; expect about {_duration(expected)} (measured on one batch of ar and of "
          f"{' and '.join(exact_of.values())})",
          flush=True)

    bar = _progress(total_images, not args.no_progress)
    start = time.perf_counter()
    rows, reference_feats, reference_seconds = [], None, None
    bar.set_description(f"{reference_scheme} greedy ar")
    forced, greedy_ar = greedy_agreement(reference, engines, greedy_classes.tolist(), args.cfg_scale)
    bar.update(len(greedy_classes))
    for scheme, engine in engines.items():
        for name, settings, tree in plan:
            bar.set_description(f"{scheme} {name}")
            tokens, seconds, stats = generate(engine, settings, tree, 0)
            images, accuracy, feats = judge(tokens)
            if reference_feats is None:  # the reference ar: its own features, its noise floor
                reference_feats, reference_seconds = feats, seconds
                floor, _, _ = generate(engine, settings, tree, 1)
                feats = judge(floor)[2]  # the reference row: ar against ar with other seeds
            agreement = float((greedy(engine, settings, tree) == greedy_ar).mean())
            rows.append({"scheme": scheme, "method": name, "mode": settings.mode, "settings": settings.canonical(),
                         "proposer": "ar" if settings.mode == "ar" else settings.proposer,
                         "tree": None if tree is None else tree.name, "accuracy": float(accuracy),
                         "frechet_vs_ar": frechet_distance(project(reference_feats, reference_feats, args.feature_dims),
                                                           project(feats, reference_feats, args.feature_dims)),
                         "greedy_agreement": agreement, "teacher_forced_agreement": forced[scheme],
                         "mean_accepted_length": stats["mean_accepted_length"],
                         "steps_per_image": stats["steps_per_image"], "seconds": seconds,
                         "speedup": reference_seconds / seconds})
            write_png(os.path.join(out_dir, _file(f"{scheme} {name}") + ".png"),
                      image_grid(images[:: args.per_class // 2 or 1], ncols=n_classes))
            r = rows[-1]
            bar.write(f"{scheme:5s} {name:28s} accuracy {r['accuracy']:.3f}  frechet {r['frechet_vs_ar']:8.3f}  "
                      f"greedy agreement {r['greedy_agreement']:.3f}  accepted {r['mean_accepted_length']:.2f}  "
                      f"steps {r['steps_per_image']:.1f}  speedup {r['speedup']:.2f}x")
        engine.release()  # one scheme's step plan at a time: what check_memory measured
    bar.close()
    summary = {"engine": os.path.abspath(args.engine), "classifier": path, "images_per_row": len(classes),
               "greedy_images_per_row": len(greedy_classes), "reference": f"{reference_scheme} ar",
               "schemes": {scheme: _scheme_record(e) for scheme, e in engines.items()},
               "settings": {k: v for k, v in vars(args).items() if k != "func"},
               "frechet_noise_floor": f"the {reference_scheme} ar row: ar (seed) against ar (other seeds)",
               "frechet_space": f"classifier features on the top {args.feature_dims} principal directions of the "
                                f"reference ar's",
               "greedy_agreement": f"free-running greedy tokens equal to {reference_scheme} greedy ar's, position by "
                                   f"position; teacher-forced: the scheme's greedy target token on the reference's "
                                   f"own greedy ar inputs",
               "expected_seconds": expected, "seconds": time.perf_counter() - start, "results": rows}
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(summary, f, indent=2)
    quality_report.plot(out_dir, rows)
    quality_report.markdown(out_dir, summary)
    return summary


def _scheme_record(engine):
    """How a row's engine was made: its dtype and its graphs' quantization records."""
    import dataclasses

    m = engine.manifest
    return {"dtype": m.dtype, "quantization": {name: dataclasses.asdict(g.quantization) for name, g in m.graphs.items()
                                               if g.quantization is not None}}


def _duration(seconds):
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


class _NoBar:
    def set_description(self, _):
        pass

    def update(self, n=1):
        pass

    def write(self, line):
        print(line, flush=True)

    def close(self):
        pass


def _progress(total, enabled):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="img", file=sys.stderr, dynamic_ncols=True)


def _file(name):
    return name.replace("+", "p").replace(" ", "_").replace("=", "")
