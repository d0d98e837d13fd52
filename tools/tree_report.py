"""Reports for the tree search: acceptance table, latency curve, chosen tree against presets, plots,
and the what-if planning aid.

  python -m lantern.tools.tree_report --latency LAT.json --acceptance ACC.json
         [--budget 64] [--depth 6] [--candidates 10] [--out tree.json] [--report report.json]
         [--plots DIR]

The what-if run prices trees under a latency model given as a file (published or assumed figures,
e.g. verification flat up to 64 tokens and a drafter call costing a fraction of a verification)
and an acceptance table (counts from a calibration, or vectors given outright). It is a planning
aid: everything it prints is a prediction of the model, nothing is measured.

Latency file (milliseconds; sizes are tokens per call):
  {"verify_ms": {"1": 20, "64": 21, "128": 38}, "draft_fraction": 0.05, "host_ms": 0.3}
  or "draft_ms": {"1": 1.0, "64": 1.1} instead of draft_fraction; optional "draft_host_ms" (loop
  work per drafter call), "ar_ms", "note".
Acceptance file: AcceptanceCounts.to_json() ({"accepted": [[..]], "trials": [[..]]}, one row per
depth, one column per rank), or {"p": [[..], ..]} (per-depth vectors) or {"p": [..]} (one vector
for every depth), or a `lantern-run tune` report.json (its calibration counts).
"""
import argparse
import json
import os
import sys

import numpy as np

from lantern.runtime.errors import LanternError, cli_main
from lantern.runtime.tree import build_tree
from lantern.tools.acceptance_stats import (DEFAULT_PRIOR_STRENGTH, AcceptanceCounts, acceptance_vectors,
                                            check_vectors, expected_accept_length)
from lantern.tools.latency_model import LatencyModel
from lantern.tools.tree_search import ar_candidate, price, search, tree_json

PRESETS = ("mc_sim_7b_63", "naive_extend_57", "chain-2", "chain-3", "chain-4", "chain-5", "chain-6",
           "kary-2-2", "kary-2-3", "kary-3-2", "kary-4-2")
PLANNING_LABEL = ("PLANNING AID: predictions of the given latency model and acceptance table; "
                  "nothing here was measured.")


def compare_presets(p, latency, candidates, presets=PRESETS, generation=None):
    """Each preset priced under the same model, or the reason it cannot run: a node with more
    children than the drafter's candidates, or a call size outside the latency model."""
    rows = []
    for name in presets:
        tree = build_tree(name)
        if max(tree.widths) > candidates:
            rows.append({"name": name, "nodes": tree.num_nodes, "depth": tree.depth,
                         "skipped": f"needs {max(tree.widths)} drafter candidates, the drafter has {candidates}"})
        elif not latency.covers(tree):
            rows.append({"name": name, "nodes": tree.num_nodes, "depth": tree.depth,
                         "skipped": "call sizes outside the latency model"})
        else:
            rows.append({k: v for k, v in price(tree, p, latency, generation=generation).to_json().items()
                         if k != "paths"})
    return rows


def build_report(result, p, latency, candidates, counts=None, presets=PRESETS, planning=False, calibration=None,
                 generation=None):
    """A JSON-ready report: the chosen tree (with its paths), AR, the presets under the same model,
    the acceptance vectors (and counts when measured), the latency points and the search curve.
    With `calibration` (the tree all the counts were recorded on), also the model's in-sample
    check: that tree's predicted accepted drafts under p beside the measured mean."""
    report = {
        "planning_aid": bool(planning),
        "chosen": result.best.to_json(),
        "chosen_tree": tree_json(result.best),
        "ar": ar_candidate(latency, generation).to_json(),
        "presets": compare_presets(p, latency, candidates, presets, generation),
        "acceptance_vectors": np.round(p, 6).tolist(),
        "latency_model": latency.to_json(),
        "search": result.to_json(),
    }
    if counts is not None:
        report["acceptance_counts"] = counts.to_json()
        report["measured_mean_accept_length"] = counts.mean_accept_length()
    if calibration is not None and counts is not None:
        tree = build_tree(calibration)
        report["calibration_check"] = {
            "tree": tree.name, "nodes": tree.num_nodes, "depth": tree.depth,
            "predicted_accepted": expected_accept_length(tree, p), "measured_accepted": counts.mean_accept_length()}
    if planning:
        report["label"] = PLANNING_LABEL
    return report


def acceptance_table(p, counts=None):
    """Depth x rank: p (observations). Observations come from the counts when given."""
    depth, width = p.shape
    lines = ["depth | " + " | ".join(f"rank {r:>2}" + (" (obs)" if counts is not None else "") for r in range(width))]
    for d in range(depth):
        cells = []
        for r in range(width):
            cell = f"{p[d, r]:.3f}"
            if counts is not None:
                cell += f" ({int(counts.trials[d, r])})"
            cells.append(cell.rjust(len(f"rank {r:>2}" + (" (obs)" if counts is not None else ""))))
        lines.append(f"{d + 1:>5} | " + " | ".join(cells))
    return "\n".join(lines)


def latency_table(latency, sizes=None):
    """T, verification ms, drafter ms at width T, host ms, and verification / AR step."""
    sizes = sizes or sorted({1, 2, 4, 8, 16, 32, 64, 128, 256} | {latency.verify.max_x})
    ar = latency.ar_step_ms()
    lines = ["    T | verify ms | drafter ms | host ms | verify / AR"]
    for T in sizes:
        if not latency.verify.covers(T):
            continue
        draft = latency.drafter_ms(T) if (latency.draft is None or latency.draft.covers(T)) else float("nan")
        lines.append(f"{T:>5} | {latency.verify(T):>9.3f} | {draft:>10.3f} | {latency.host_step_ms(T):>7.3f} | "
                     f"{latency.verify(T) / ar:>11.2f}")
    return "\n".join(lines)


def format_report(report):
    """The report as text: chosen tree, AR and presets under the same model."""
    lines = []
    if report["planning_aid"]:
        lines.append(PLANNING_LABEL)
    c = report["chosen"]
    verb = "would pick" if report["planning_aid"] else "picked"
    lines.append(f"the search {verb}: {c['name']} ({c['nodes']} nodes incl. root, depth {c['depth']})")
    lines.append(f"  predicted step compression (tokens per step): {c['tokens_per_step']:.3f}")
    if c.get("images", 1) > 1:
        lines.append(f"  over a call of {c['images']} images, which ends with its slowest: "
                     f"{c['generation_tokens_per_step']:.3f} tokens per step each")
    lines.append(f"  predicted step time: {c['step_ms']:.3f} ms (AR step {report['ar']['step_ms']:.3f} ms)")
    lines.append(f"  predicted speedup over AR: {c['speedup_vs_ar']:.3f}x")
    if "calibration_check" in report:
        cc = report["calibration_check"]
        lines.append(f"  calibration tree {cc['tree']} ({cc['nodes']} nodes): accepted drafts per step "
                     f"predicted {cc['predicted_accepted']:.3f}, measured {cc['measured_accepted']:.3f}")
    lines.append("same model, other trees (tokens/step, step ms, speedup):")
    for row in [report["ar"]] + report["presets"]:
        if "skipped" in row:
            lines.append(f"  {row['name']:<18} {row['nodes']:>4} nodes  skipped: {row['skipped']}")
        else:
            lines.append(f"  {row['name']:<18} {row['nodes']:>4} nodes  {row['tokens_per_step']:.3f}  "
                         f"{row['step_ms']:>9.3f}  {row['speedup_vs_ar']:.3f}x")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Plots


def plot_acceptance(p, path, counts=None, title="positional acceptance"):
    """Heat map of p[depth, rank], each cell annotated with p and its observation count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depth, width = p.shape
    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * width, 1.0 + 0.55 * depth))
    im = ax.imshow(p, cmap="viridis", vmin=0.0, vmax=max(float(p.max()), 1e-9), aspect="auto")
    for d in range(depth):
        for r in range(width):
            text = f"{p[d, r]:.2f}" + (f"\n{int(counts.trials[d, r])}" if counts is not None else "")
            ax.text(r, d, text, ha="center", va="center", fontsize=7,
                    color="white" if p[d, r] < 0.6 * p.max() else "black")
    ax.set_xticks(range(width))
    ax.set_yticks(range(depth), [str(d + 1) for d in range(depth)])
    ax.set_xlabel("child rank")
    ax.set_ylabel("depth")
    ax.set_title(title + (" (cells: p, observations)" if counts is not None else ""), fontsize=9)
    fig.colorbar(im, ax=ax, label="P(on accepted path | parent is)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_latency(latency, result, path, title="latency model and predicted speedup"):
    """Left: verification and drafter latency against tokens per call, measured points marked,
    the chosen tree's verification size marked. Right: the best predicted speedup per tree size,
    the chosen tree marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    T = np.arange(1, latency.verify.max_x + 1)
    left.plot(T, [latency.verify(t) for t in T], label="verification (target, T tokens)")
    left.plot(latency.verify.x, latency.verify.y, "o", ms=3, color="C0")
    draft_max = latency.verify.max_x if latency.draft is None else latency.draft.max_x
    W = np.arange(1, draft_max + 1)
    left.plot(W, [latency.drafter_ms(w) for w in W], label="drafter call (width T)")
    left.axhline(latency.ar_step_ms(), color="gray", ls=":", label="AR step")
    best = result.best
    if best.nodes > 1:
        left.axvline(best.nodes, color="C3", ls="--", label=f"chosen tree: {best.nodes} tokens")
    left.set_xlabel("tokens per call")
    left.set_ylabel("ms")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    per_n = result.best_per_budget()
    right.plot(list(per_n), [c.speedup for c in per_n.values()], marker=".", ms=3)
    right.plot([best.nodes], [best.speedup], "o", color="C3", label=f"chosen: {best.name}, {best.speedup:.2f}x")
    right.axhline(1.0, color="gray", ls=":")
    right.set_xlabel("tree size (tokens per verification)")
    right.set_ylabel("predicted speedup over AR")
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# What-if


def load_acceptance(data, depth, prior_strength=DEFAULT_PRIOR_STRENGTH):
    """(p [depth, width], counts or None) from an acceptance JSON dict or file (module docstring)."""
    if isinstance(data, (str, os.PathLike)):
        try:
            with open(data, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise LanternError(f"cannot read acceptance file {os.fspath(data)}: {e}") from None
    if not isinstance(data, dict):
        raise LanternError("acceptance: expected a JSON object with 'accepted' and 'trials', or 'p'")
    if isinstance(data.get("calibration"), dict) and "counts" in data["calibration"]:
        data = data["calibration"]["counts"]  # a `lantern-run tune` report: its measured counts
    if "p" in data:
        p = check_vectors(data["p"])
        if np.ndim(data["p"]) == 1:
            p = np.repeat(p, depth, axis=0)  # one vector for every depth, as in Sequoia
        return p, None
    if "accepted" in data and "trials" in data:
        counts = AcceptanceCounts.from_json(data)
        width = counts.extent()[1]
        if width == 0:
            raise LanternError("acceptance counts are empty (no trials)")
        return acceptance_vectors(counts, depth=depth, width=width, prior_strength=prior_strength), counts
    raise LanternError("acceptance: expected 'accepted' and 'trials' (counts) or 'p' (vectors)")


def tune(p, latency, max_nodes, max_depth, candidates, counts=None, presets=PRESETS, planning=False,
         calibration=None):
    """search + build_report in one call: returns (SearchResult, report dict)."""
    result = search(p, latency, max_nodes, max_depth, candidates)
    return result, build_report(result, p, latency, candidates, counts, presets, planning, calibration)


def write_outputs(report, result, p, latency, counts=None, tree_path=None, report_path=None, plots=None):
    """The chosen tree as choices JSON (nothing written for AR), the report JSON, the two plots."""
    if tree_path and report["chosen_tree"] is not None:
        _write_json(tree_path, report["chosen_tree"])
    if report_path:
        _write_json(report_path, report)
    if plots:
        os.makedirs(plots, exist_ok=True)
        plot_acceptance(p, os.path.join(plots, "acceptance.png"), counts)
        plot_latency(latency, result, os.path.join(plots, "latency.png"),
                     title=("PLANNING AID (predicted, not measured): " if report["planning_aid"] else "")
                     + "latency model and predicted speedup")


def _write_json(path, data):
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)  # never a half-written file


def add_parser(sub, name="whatif"):
    p = sub.add_parser(name, help="planning aid: the tree a latency model and an acceptance table would pick")
    _arguments(p)
    return p


def _arguments(p):
    p.add_argument("--latency", required=True, help="latency model JSON (see module docstring)")
    p.add_argument("--acceptance", required=True, help="acceptance counts or vectors JSON")
    p.add_argument("--budget", type=int, default=64, help="largest tree, root included (default 64)")
    p.add_argument("--depth", type=int, default=6, help="depth limit (default 6)")
    p.add_argument("--candidates", type=int, default=10, help="drafter top-K: most children per node (default 10)")
    p.add_argument("--prior-strength", type=float, default=DEFAULT_PRIOR_STRENGTH,
                   help="pooling of sparse cells, in pseudo-observations (default 10)")
    p.add_argument("--out", help="write the chosen tree here (choices JSON for --tree)")
    p.add_argument("--report", help="write the report JSON here")
    p.add_argument("--plots", help="write acceptance.png and latency.png into this directory")
    p.set_defaults(func=run_whatif)


def run_whatif(args):
    latency = LatencyModel.from_json(args.latency)
    p, counts = load_acceptance(args.acceptance, args.depth, args.prior_strength)
    result, report = tune(p, latency, args.budget, args.depth, args.candidates, counts, planning=True)
    print(format_report(report))
    print("\nacceptance vectors" + (" (observations)" if counts is not None else "") + ":")
    print(acceptance_table(p, counts))
    print("\nlatency model:")
    print(latency_table(latency))
    write_outputs(report, result, p, latency, counts, args.out, args.report, args.plots)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m lantern.tools.tree_report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _arguments(parser)
    return cli_main(parser, argv, "tree_report")


if __name__ == "__main__":
    sys.exit(main())
