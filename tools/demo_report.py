"""The demo's report (`lantern-export demo`, tools/demo.py): what the numbers say in words
(`reading`, the report's and the console's last paragraph), the console tables, the acceptance
plots and report.md, from the summary the demo's run collects.
"""
from lantern.runtime.backends import DEFAULT
import os

import numpy as np


def reading(summary):
    """What the numbers say, in words (the report's and the console's last paragraph)."""
    rows = {r["mode"]: r for r in summary["results"]}
    spec = rows.get("lantern++") or rows.get("exact")
    if spec is None:
        return ""
    images, nodes = summary["settings"]["images"], summary["tree"]["nodes"]
    cfg = summary["settings"].get("cfg_scale", 1.0) > 1
    on = summary.get("generated_on", {"device": "cpu"})
    if summary.get("embedding"):
        return _embedded_reading(summary)
    if on["device"] != "cpu":
        return (f"On {on['device']} ({on['backend']}, the {on['step']} step) a {spec['mode']} step costs "
                f"{spec['step_cost_vs_ar']:.2f} AR steps for {spec['mean_accepted_length']:.2f} tokens at the batch "
                f"({images} images{', CFG' if cfg else ''}) and {spec['step_cost_vs_ar_batch1']:.2f} AR steps at one "
                f"image: speculative decoding pays off where the accepted length is the larger "
                f"({spec['speedup_batch']:.2f}x and {spec['speedup_batch1']:.2f}x over AR here).")
    if spec["verify_cost_vs_ar"] is None or spec["verify_cost_vs_ar_batch1"] is None:
        # the device step (ONNX Runtime's step graphs) is timed whole: no verification share to read
        return (f"A speculative step pays off when its mean accepted length exceeds its cost in AR steps. On the "
                f"CPU ({on.get('backend', DEFAULT)}, the {on.get('step', 'device')} step) a {spec['mode']} step costs "
                f"{spec['step_cost_vs_ar']:.1f} AR steps for {spec['mean_accepted_length']:.2f} tokens at the batch "
                f"({images} images{', CFG' if cfg else ''}) and {spec['step_cost_vs_ar_batch1']:.1f} AR steps at one "
                f"image ({spec['speedup_batch']:.2f}x and {spec['speedup_batch1']:.2f}x over AR here); `lantern-run "
                f"generate --step host` times the step's phases, `lantern-run profile ENGINE` the latency curve.")
    return (
        f"A speculative step pays off when its mean accepted length exceeds its cost in AR steps. "
        f"At the batch ({images} images{', CFG' if cfg else ''}: {images * (2 if cfg else 1)} rows per call) a "
        f"{spec['mode']} step costs {spec['step_cost_vs_ar']:.1f} AR steps for {spec['mean_accepted_length']:.2f} "
        f"tokens; its verification of {nodes} tokens per row alone costs {spec['verify_cost_vs_ar']:.1f} one-token "
        f"target calls. At this size the CPU is computing, so a step costs about what its tokens cost: compute per "
        f"verified token. At one image the step costs {spec['step_cost_vs_ar_batch1']:.1f} AR steps, but its "
        f"verification of {nodes} tokens costs only {spec['verify_cost_vs_ar_batch1']:.1f} one-token calls: most of "
        f"a call's cost is fixed, and a step makes {spec['engine_calls_per_step_batch1']:.1f} engine calls (a drafter "
        f"call per depth, the verification) where an AR step makes {rows['ar']['engine_calls_per_step_batch1']:.1f} "
        f"(prefill included): call overhead. Neither cost is the method's: on a GPU a {nodes}-token verification "
        f"of a large model costs little more than one token and calls can be captured in CUDA graphs, so the step "
        f"compression (steps/image) is what carries over (measure a step's phases and the latency curve on "
        f"your machine with `lantern-run profile ENGINE`).")


def _embedded_reading(summary):
    """The reading of a run on the demo embedded in a larger shape: what each step costs and where
    speculation paid, from the rows."""
    shape, on = summary["embedding"]["shape"], summary["generated_on"]
    batch = summary["settings"].get("batch") or summary["settings"]["images"]
    spec = [r for r in summary["results"] if r["mode"] != "ar" and not r.get("same_run_as")]
    measured = [(r["speedup_batch1"], "1 image", r) for r in spec] + [(r["speedup_batch"], f"{batch} images", r)
                                                                        for r in spec]
    best = max(measured, default=None, key=lambda x: x[0])
    parts = [f"The demo embedded exactly in {shape}'s shapes decodes the demo's tokens at {shape}'s cost "
             f"({on['backend']}, {on['device']}, {summary['settings']['threads']} thread(s)). A speculative step pays "
             f"off when its accepted length exceeds its cost in AR steps:"]
    for r in spec:
        parts.append(f"{r['mode']} accepts {r['mean_accepted_length_batch1']:.2f} tokens per step for "
                     f"{r['step_cost_vs_ar_batch1']:.2f} AR steps at 1 image (tree {r['tree_batch1']}: "
                     f"{r['speedup_batch1']:.2f}x over ar) and {r['mean_accepted_length']:.2f} for "
                     f"{r['step_cost_vs_ar']:.2f} at {batch} images (tree {r['tree']}: {r['speedup_batch']:.2f}x);")
    if best is not None:
        parts.append(f"the best, measured beside ar in this run: {best[0]:.2f}x ({best[2]['mode']}, {best[1]}).")
    return " ".join(parts)


def print_table(rows):
    head = (f"{'mode':17s} {'tree':13s} {'steps/img':>9s} {'accepted':>9s} | batch: {'step cost':>9s} {'s':>7s} "
            f"{'speedup':>8s} | 1 image: {'step cost':>9s} {'s':>7s} {'speedup':>8s}")
    print(head)
    print("-" * len(head))
    for r in rows:
        tree = r["tree"] if r["tree"] == r["tree_batch1"] else f"{r['tree']}/{r['tree_batch1']}"
        print(f"{r['mode']:17s} {tree[:13]:13s} {r['steps_per_image']:9.1f} {r['mean_accepted_length']:9.2f} | "
              f"{r['step_cost_vs_ar']:14.1f}x {r['batch_seconds']:7.2f} {r['speedup_batch']:7.2f}x | "
              f"{r['step_cost_vs_ar_batch1']:16.1f}x {r['latency_batch1_seconds']:7.3f} {r['speedup_batch1']:7.2f}x"
              + (f"  (the same run as {r['same_run_as']})" if r.get("same_run_as") else ""))


def plots(report_dir, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    modes = [r["mode"] for r in rows]
    axes[0].bar(modes, [r["mean_accepted_length"] for r in rows], color=["#888", "#4a7", "#c63", "#36c", "#a5c", "#dc3"][: len(rows)])
    axes[0].tick_params(axis="x", labelrotation=30)
    axes[0].set_ylabel("tokens per target step")
    axes[0].set_title("mean accepted length")
    for r in rows:
        hist = np.asarray(r["accepted_histogram"], dtype=float)
        if hist.sum():
            axes[1].plot(np.arange(len(hist)), hist / hist.sum(), marker="o", label=r["mode"])
            rates = r["acceptance_per_depth"]
            axes[2].plot(np.arange(1, len(rates) + 1), rates, marker="o", label=r["mode"])
    axes[1].set_xlabel("draft tokens accepted in a step")
    axes[1].set_ylabel("share of steps")
    axes[1].set_title("accepted drafts per step (distribution)")
    axes[1].legend()
    axes[2].set_xticks(range(1, max((len(r["acceptance_per_depth"]) for r in rows), default=1) + 1))
    axes[2].set_xlabel("tree depth d")
    axes[2].set_ylabel("P(depth d accepted | depth d-1 accepted)")
    axes[2].set_ylim(0, 1)
    axes[2].set_title("acceptance rate per depth")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(report_dir, "acceptance.png"), dpi=100)
    plt.close(fig)


def markdown(report_dir, summary, class_names):
    rows = summary["results"]
    lines = ["# lantern demo report", "",
             f"Engine `{summary['engine']}`; settings: " + ", ".join(f"{k}={v}" for k, v in summary["settings"].items()
                                                                 if k not in ("model_dir", "out")) + ".",
             f"Check: {'passed' if summary['check']['ok'] else 'FAILED'} (worst absolute error "
             f"{summary['check']['worst_abs_error']:.2e}).", ""]
    if summary.get("embedding"):
        e = summary["embedding"]
        lines += [f"The demo model embedded exactly in {e['shape']}'s shapes (`lantern.export.embed`, built in "
                  f"{e['seconds']:.1f} s into `{e['checkpoints']}`): the demo's function at {e['shape']}'s cost.", ""]
    lines += [
             "Step cost: the seconds of one step of the mode over those of one `ar` step (the accepted length at "
             "which the mode breaks even), at the batch and at one image per call.", "",
             "| mode | tree (batch / 1 image) | steps/image | mean accepted length | batch: step cost vs ar | "
             "batch s | speedup | 1 image: step cost vs ar | 1-image s | speedup |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['tree']} / {r['tree_batch1']} | {r['steps_per_image']:.1f} | "
                     f"{r['mean_accepted_length']:.2f} | "
                     f"{r['step_cost_vs_ar']:.1f}x | {r['batch_seconds']:.2f} | {r['speedup_batch']:.2f}x | "
                     f"{r['step_cost_vs_ar_batch1']:.1f}x | {r['latency_batch1_seconds']:.3f} | "
                     f"{r['speedup_batch1']:.2f}x |")
    same = [f"`{r['mode']}` ran what `{r['same_run_as']}` ran (mode {r['ran']}, tree {r['tree']})"
            for r in rows if r.get("same_run_as")]
    if same:
        lines += ["", "Same runs: " + "; ".join(same) + " (the tuner chose that for these settings)."]
    lines += ["", summary["reading"], ""]
    tuned = summary.get("tuned")
    if tuned:
        cut = ", ".join(f"{k} {v}" for k, v in tuned["cut"].items())
        lines += [f"Tuned draft tree (`lantern-run tune`, settings `{tuned['key']}`), "
                  + tuned_line(tuned).split("\n")[0] + ". The `lantern++ tuned` row runs it: generate picks it "
                  f"for these settings by itself. Full tune report: "
                  f"`{os.path.relpath(tuned['report'], os.path.join(summary['engine'], 'report'))}`; "
                  f"the demo's tune run is cut short to save time ({cut}).", ""]
    lines += ["![acceptance](acceptance.png)", "",
              "Left: tokens per target step. Middle: how many draft tokens a step accepted (share of steps). "
              "Right: of the steps that accepted the draft at depth d-1, the share that accepted one at depth d.",
              "", f"Grids: {summary['settings']['per_class']} images per class, in class order "
              f"({', '.join(class_names)}), three classes per row.", ""]
    for r in rows:
        lines += [f"## {r['mode']}", "", f"![{r['mode']}]({r['image']})", ""]
    q = summary.get("quantized")
    if q is not None:
        lines += [f"## {q['scheme']} engine beside fp32", "", f"`{q['engine']}`: {q['why']}. {q['check_line']}. "
                  f"Teacher-forced greedy agreement with fp32: {q['teacher_forced_greedy_agreement']:.1%} of the "
                  f"tokens of {q['greedy_images']} greedy images. {q['reading']}. `lantern-run quality` compares the "
                  f"schemes' class accuracy and Fréchet distance.", "",
                  "| mode | mean accepted length | fp32 | batch s | fp32 s | speed vs fp32 |", "|---|---|---|---|---|---|"]
        for r in q["results"]:
            lines.append(f"| {r['mode']} | {r['mean_accepted_length']:.2f} | {r['mean_accepted_length_fp32']:.2f} | "
                         f"{r['batch_seconds']:.2f} | {r['batch_seconds_fp32']:.2f} | {r['speed_vs_fp32']:.2f}x |")
        for r in q["results"]:
            lines += ["", f"![{q['scheme']} {r['mode']}]({r['image']})"]
        lines.append("")
    with open(os.path.join(report_dir, "report.md"), "w") as f:
        f.write("\n".join(lines))


def tuned_line(tuned):
    parts = []
    for images, b in tuned["batches"].items():
        what = "AR (no drafting)" if b["nodes"] == 1 else f"{b['nodes']} nodes, depth {b['depth']}"
        preset = (f"; {b['preset']} predicted {b['preset_predicted_speedup']:.2f}x"
                  if b["preset_predicted_speedup"] is not None else "")
        parts.append(f"{images} image(s) per call: {what}, predicted {b['predicted_speedup']:.2f}x over AR{preset}")
    return (f"tuned for this machine ({tuned['seconds']:.0f} s): " + "; ".join(parts)
            + f"\ntune report: {tuned['report']}")


def print_quantized(quantized):
    print(f"\n{quantized['scheme']} engine beside fp32 ({quantized['why']}):")
    head = f"{'mode':10s} {'accepted':>9s} {'fp32':>6s} | {'batch s':>8s} {'fp32 s':>7s} {'speed vs fp32':>14s}"
    print(head)
    print("-" * len(head))
    for r in quantized["results"]:
        print(f"{r['mode']:10s} {r['mean_accepted_length']:9.2f} {r['mean_accepted_length_fp32']:6.2f} | "
              f"{r['batch_seconds']:8.2f} {r['batch_seconds_fp32']:7.2f} {r['speed_vs_fp32']:13.2f}x")
    print(f"teacher-forced greedy agreement with fp32: {quantized['teacher_forced_greedy_agreement']:.1%} of tokens "
          f"({quantized['greedy_images']} greedy images); {quantized['check_line']}. {quantized['reading']}.")
