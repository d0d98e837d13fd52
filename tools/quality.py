"""`lantern-run quality ENGINE`: what relaxation costs in image quality, next to what it gains.

For every method (ar, exact, lantern++ over a λ × k sweep, lantern over δ) it generates the same
requested classes with the same seeds, then reports
  accuracy   the classifier agrees with the requested class (class consistency),
  frechet    Fréchet distance between the method's and `ar`'s samples in the classifier's
             feature space (`ar` against `ar` with other seeds is the noise floor),
  speed      mean accepted length and wall time against `ar` in the same run,
in report.json and report.md with a speed-versus-quality plot. Sampling with CFG, as images are
generated in practice. The classifier is the demo's (tools/train_classifier.py) unless --classifier.
"""
import json
import os
import time

import numpy as np

from lantern.runtime.errors import LanternError


def _floats(text):
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def add_parser(sub):
    p = sub.add_parser("quality", help="speed vs quality sweep (class accuracy, Fréchet distance against ar)")
    p.add_argument("engine", help="engine directory with a drafter, neighbour table and VQ decoder")
    p.add_argument("--classifier", help="classifier .safetensors (default: the demo model's)")
    p.add_argument("--per-class", type=int, default=20, help="images per class and method (default 20)")
    p.add_argument("--lams", type=_floats, default=[1.0, 1.5, 2.0, 3.0, 5.0])
    p.add_argument("--ks", type=_ints, default=[5, 20])
    p.add_argument("--deltas", type=_floats, default=[0.1, 0.3])
    p.add_argument("--cfg", type=float, default=3.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--feature-dims", type=int, default=16,
                   help="principal directions of the ar features the Fréchet distance uses (default 16)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", help="report directory (default: ENGINE/quality)")
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


def run(args):
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
    out_dir = args.out or os.path.join(args.engine, "quality")
    os.makedirs(out_dir, exist_ok=True)
    torch.set_num_threads(args.threads)

    def judge(tokens):
        images = engine.decode(tokens)
        x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1
        with torch.no_grad():
            logits, feats = classifier(x), classifier.features(x)
        return images, (logits.argmax(-1).numpy() == classes).mean(), feats.numpy().astype(np.float64)

    common = dict(classes=classes.tolist(), cfg_scale=args.cfg, temperature=args.temperature, top_k=args.top_k)
    engine.generate(mode="exact", **{**common, "classes": common["classes"][:2]})  # warm up
    rows, reference = [], None
    for name, kw in methods(args.lams, args.ks, args.deltas):
        t = time.perf_counter()
        result = engine.generate(seed=args.seed, **common, **kw)
        seconds = time.perf_counter() - t
        images, accuracy, feats = judge(result.tokens)
        if name == "ar":
            reference = (feats, seconds)
            floor = engine.generate(seed=args.seed + 1, **common, mode="ar")
            feats = judge(floor.tokens)[2]  # the ar row: ar against ar with another seed
        rows.append({"method": name, **kw, "accuracy": float(accuracy),
                     "frechet_vs_ar": frechet_distance(project(reference[0], reference[0], args.feature_dims),
                                                       project(feats, reference[0], args.feature_dims)),
                     "mean_accepted_length": result.stats["mean_accepted_length"],
                     "steps_per_image": result.stats["steps_per_image"], "seconds": seconds,
                     "speedup": reference[1] / seconds})
        write_png(os.path.join(out_dir, _file(name) + ".png"), image_grid(images[:: args.per_class // 2 or 1], ncols=n_classes))
        r = rows[-1]
        print(f"{name:28s} accuracy {r['accuracy']:.3f}  frechet {r['frechet_vs_ar']:8.3f}  "
              f"accepted {r['mean_accepted_length']:.2f}  speedup {r['speedup']:.2f}x", flush=True)
    summary = {"engine": os.path.abspath(args.engine), "classifier": path, "images_per_method": len(classes),
               "settings": {k: v for k, v in vars(args).items() if k != "func"},
               "frechet_noise_floor": "the 'ar' row: ar (seed) against ar (seed + 1)",
               "frechet_space": f"classifier features on the top {args.feature_dims} principal directions of ar's", "results": rows}
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(summary, f, indent=2)
    _plot(out_dir, rows)
    _markdown(out_dir, summary)
    print(f"report: {os.path.join(out_dir, 'report.md')}")
    return 0


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
