"""`lantern-run quality ENGINE`: what relaxation costs in image quality, next to what it gains.

For every method it generates the same requested classes with the same seeds, then reports
  accuracy   the classifier agrees with the requested class (class consistency),
  frechet    Fréchet distance between the method's and `ar`'s samples in the classifier's
             feature space (`ar` against `ar` with other seeds is the noise floor),
  speed      mean accepted length and wall time against `ar` in the same run,
in report.json and report.md with a speed-versus-quality plot, written to its own directory
(--out, default ./quality-ENGINE_NAME) which appears when the sweep is complete. Sampling with
CFG, as images are generated in practice. The classifier is the demo's
(tools/train_classifier.py) unless --classifier.

The methods are ar, exact and lantern++ at the demo's k 20, λ 5 by default (a few minutes at
--per-class 20 on two CPU cores); --lams, --ks and --deltas widen the sweep, each speculative
method taking about as long as exact. Before the sweep it states its size and the time it
expects, measured on one batch of ar and one of exact. Images go through the engine in batches
of --batch (a 26-node tree over hundreds of CFG rows at once is several times slower per image
on a CPU); batch i of every method uses the same seed.
"""
import json
import os
import sys
import time

import numpy as np

from lantern.runtime.errors import LanternError

# What the report directory holds: --force replaces only a directory with nothing else in it.
REPORT_FILES = ("report.json", "report.md", "*.png")


def _floats(text):
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def add_parser(sub):
    p = sub.add_parser("quality", help="speed vs quality sweep (class accuracy, Fréchet distance against ar)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("engine", help="engine directory with a drafter, neighbour table and VQ decoder")
    p.add_argument("--classifier", help="classifier .safetensors (default: the demo model's)")
    p.add_argument("--per-class", type=int, default=20, help="images per class and method (default 20)")
    p.add_argument("--lams", type=_floats, default=[5.0],
                   help="lantern++ λ values (default 5, the demo's; a wider sweep: 1,1.5,2,3,5)")
    p.add_argument("--ks", type=_ints, default=[20], help="lantern++ / lantern neighbour counts k (default 20)")
    p.add_argument("--deltas", type=_floats, default=[], help="lantern δ values (default none; e.g. 0.1,0.3)")
    p.add_argument("--cfg", type=float, default=3.0)
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


def frechet_distance(a, b):
    """Fréchet distance between Gaussians fitted to feature sets a [n, d] and b [m, d]:
    |mu_a - mu_b|^2 + tr(Sa + Sb - 2 (Sa^1/2 Sb Sa^1/2)^1/2), numpy only (symmetric square roots)."""
    mu_a, mu_b = a.mean(0), b.mean(0)
    sa, sb = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    w, v = np.linalg.eigh(sa)
    root_a = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    middle = np.linalg.eigvalsh(root_a @ sb @ root_a)
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(sa) + np.trace(sb) - 2 * np.sqrt(np.clip(middle, 0, None)).sum())


def project(features, reference, dims):
    """Features on the reference set's top principal directions: with a few hundred samples a
    128-dim covariance is mostly estimation noise, and the Fréchet distance with it."""
    mean = reference.mean(0)
    _, _, vt = np.linalg.svd(reference - mean, full_matrices=False)
    return (features - mean) @ vt[:dims].T


def methods(lams, ks, deltas):
    out = [("ar", dict(mode="ar")), ("exact", dict(mode="exact"))]
    for k in ks:
        out += [(f"lantern++ k={k} lam={lam:g}", dict(mode="lantern++", k=k, lam=lam)) for lam in lams]
    out += [(f"lantern k={max(ks)} delta={d:g}", dict(mode="lantern", k=max(ks), delta=d)) for d in deltas]
    return out


def _check_args(args):
    for name in ("per_class", "batch", "threads", "feature_dims"):
        value = getattr(args, name)
        if value < 1:
            raise LanternError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not args.ks:
        raise LanternError("--ks needs at least one k")


def batch_seed(seed, role, index):
    """An independent seed for batch `index` of a role (0: the methods, 1: ar's noise floor)."""
    return int(np.random.SeedSequence([seed, role, index]).generate_state(1)[0])


def run(args):
    from lantern.runtime.outdir import OutputDirectory, only_files

    _check_args(args)
    out_dir = args.out or f"quality-{os.path.basename(os.path.abspath(args.engine))}"
    # Checked and locked before any work; the report appears only when the sweep is complete.
    with OutputDirectory(out_dir, args.force, only_files(REPORT_FILES, "lantern-run quality"),
                         kind="report directory") as stage:
        summary = sweep(args, stage)
    print(f"report: {os.path.join(out_dir, 'report.md')} ({_duration(summary['seconds'])}; expected "
          f"{_duration(summary['expected_seconds'])})")
    return 0


def sweep(args, out_dir):
    """Run every method, judge the images, write the report files into out_dir; returns the summary."""
    import torch

    from lantern.runtime.generator import Engine
    from lantern.runtime.png import image_grid, write_png
    from lantern.tools.train_classifier import load_classifier

    engine = Engine(args.engine, threads=args.threads)
    m = engine.manifest
    if m.condition.kind != "class" or "vq_decoder" not in m.graphs or "lantern++" not in m.modes:
        raise LanternError(f"{args.engine}: the quality harness needs a class-conditional engine with a drafter "
                           f"and a VQ decoder")
    from lantern.export import demo

    path = args.classifier or os.path.join(demo.DEMO_DIR, "classifier.safetensors")
    classifier = load_classifier(path)
    n_classes = m.condition.num_classes
    classes = np.repeat(np.arange(n_classes), args.per_class)
    batches = [slice(i, i + args.batch) for i in range(0, len(classes), args.batch)]
    torch.set_num_threads(args.threads)
    plan = methods(args.lams, args.ks, args.deltas)
    common = dict(cfg_scale=args.cfg, temperature=args.temperature, top_k=args.top_k)

    def generate(kw, role):
        """All images of one method, batch by batch: tokens, engine seconds, per-image stats."""
        tokens, seconds, accepted, steps = [], 0.0, 0.0, 0.0
        for i, b in enumerate(batches):
            t = time.perf_counter()
            r = engine.generate(classes=classes[b].tolist(), seed=batch_seed(args.seed, role, i), **common, **kw)
            seconds += time.perf_counter() - t
            tokens.append(r.tokens)
            accepted += r.stats["mean_accepted_length"] * len(r.tokens)
            steps += r.stats["steps_per_image"] * len(r.tokens)
            bar.update(len(r.tokens))
        n = len(classes)
        return np.concatenate(tokens), seconds, {"mean_accepted_length": accepted / n, "steps_per_image": steps / n}

    def judge(tokens):
        images = engine.decode(tokens)
        x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1
        with torch.no_grad():
            logits, feats = classifier(x), classifier.features(x)
        return images, (logits.argmax(-1).numpy() == classes).mean(), feats.numpy().astype(np.float64)

    # Size and expected time: one batch of ar and one of exact, scaled to the sweep.
    engine.generate(mode="exact", classes=classes[:2].tolist(), **common)  # warm up the sessions
    probe = classes[batches[0]].tolist()
    cost = {}
    for mode in ("ar", "exact"):
        t = time.perf_counter()
        r = engine.generate(classes=probe, mode=mode, seed=args.seed, **common)
        decoded = time.perf_counter()
        engine.decode(r.tokens)
        scale = len(classes) / len(probe)
        cost[mode] = {"generate": (decoded - t) * scale, "decode": (time.perf_counter() - decoded) * scale}
    expected = sum(cost["ar" if kw["mode"] == "ar" else "exact"]["generate"] + cost["ar"]["decode"]
                   for _, kw in plan) + cost["ar"]["generate"] + cost["ar"]["decode"]
    total_images = len(classes) * (len(plan) + 1)
    print(f"quality: {len(plan)} methods ({', '.join(name for name, _ in plan)}) x {len(classes)} images "
          f"({args.per_class} per class x {n_classes} classes) + ar's noise floor = {total_images} images in "
          f"batches of {args.batch}; expect about {_duration(expected)} (measured on one batch of ar and of exact)",
          flush=True)

    bar = _progress(total_images, not args.no_progress)
    start = time.perf_counter()
    rows, reference = [], None
    for name, kw in plan:
        bar.set_description(name)
        tokens, seconds, stats = generate(kw, 0)
        images, accuracy, feats = judge(tokens)
        if name == "ar":
            reference = (feats, seconds)
            floor, _, _ = generate(kw, 1)
            feats = judge(floor)[2]  # the ar row: ar against ar with other seeds
        rows.append({"method": name, **kw, "accuracy": float(accuracy),
                     "frechet_vs_ar": frechet_distance(project(reference[0], reference[0], args.feature_dims),
                                                       project(feats, reference[0], args.feature_dims)),
                     "mean_accepted_length": stats["mean_accepted_length"],
                     "steps_per_image": stats["steps_per_image"], "seconds": seconds,
                     "speedup": reference[1] / seconds})
        write_png(os.path.join(out_dir, _file(name) + ".png"),
                  image_grid(images[:: args.per_class // 2 or 1], ncols=n_classes))
        r = rows[-1]
        bar.write(f"{name:28s} accuracy {r['accuracy']:.3f}  frechet {r['frechet_vs_ar']:8.3f}  "
                  f"accepted {r['mean_accepted_length']:.2f}  speedup {r['speedup']:.2f}x")
    bar.close()
    summary = {"engine": os.path.abspath(args.engine), "classifier": path, "images_per_method": len(classes),
               "settings": {k: v for k, v in vars(args).items() if k != "func"},
               "frechet_noise_floor": "the 'ar' row: ar (seed) against ar (other seeds)",
               "frechet_space": f"classifier features on the top {args.feature_dims} principal directions of ar's",
               "expected_seconds": expected, "seconds": time.perf_counter() - start, "results": rows}
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(summary, f, indent=2)
    _plot(out_dir, rows)
    _markdown(out_dir, summary)
    return summary


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


def _plot(out_dir, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "accuracy", "class accuracy"), (axes[1], "frechet_vs_ar", "Fréchet distance to ar")):
        for r in rows:
            family = r["method"].split(" ")[0]
            color = {"ar": "black", "exact": "tab:green", "lantern++": "tab:orange", "lantern": "tab:blue"}[family]
            ax.scatter(r["mean_accepted_length"], r[key], color=color)
            ax.annotate(r["method"].replace("lantern++ ", "").replace("lantern ", ""), (r["mean_accepted_length"], r[key]),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("mean accepted length (tokens per target step)")
        ax.set_ylabel(label)
    axes[0].set_title("speed vs class consistency")
    axes[1].set_title("speed vs distribution shift (lower is better)")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "speed_vs_quality.png"), dpi=100)
    plt.close(fig)


def _markdown(out_dir, summary):
    lines = ["# lantern quality report", "", f"Engine `{summary['engine']}`, {summary['images_per_method']} images per "
             f"method; Fréchet distance in the classifier's feature space against `ar` (the `ar` row: `ar` against "
             f"`ar` with another seed, the noise floor).", "",
             "| method | accuracy | Fréchet vs ar | mean accepted length | steps/image | speedup |", "|---|---|---|---|---|---|"]
    for r in summary["results"]:
        lines.append(f"| {r['method']} | {r['accuracy']:.3f} | {r['frechet_vs_ar']:.3f} | "
                     f"{r['mean_accepted_length']:.2f} | {r['steps_per_image']:.1f} | {r['speedup']:.2f}x |")
    lines += ["", "![speed vs quality](speed_vs_quality.png)", ""]
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write("\n".join(lines))
