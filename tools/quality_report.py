"""The quality harness's report (lantern-run quality, tools/quality.py): the speed-versus-quality
plot (speed_vs_quality.png: accuracy, Fréchet distance and greedy agreement against the speedup)
and report.md's table, from the sweep's rows.
"""
import os


def plot(out_dir, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    markers = {}
    for ax, key, label in ((axes[0], "accuracy", "class accuracy"),
                           (axes[1], "frechet_vs_ar", "Fréchet distance to the reference ar"),
                           (axes[2], "greedy_agreement", "greedy token agreement with the reference ar")):
        for r in rows:
            family = r["method"].split(" ")[0]
            color = {"ar": "black", "exact": "tab:green", "lantern++": "tab:orange", "lantern": "tab:blue",
                     "jacobi": "tab:purple", "gsd": "tab:red"}[family]
            marker = markers.setdefault(r["scheme"], "os^Dv"[len(markers) % 5])
            ax.scatter(r["speedup"], r[key], color=color, marker=marker)
            short = r["method"].replace("lantern++ ", "").replace("lantern ", "").replace("jacobi ", "J ")
            ax.annotate(f"{r['scheme']} {short}", (r["speedup"], r[key]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        ax.set_xlabel("speedup over the reference ar (wall time, this machine)")
        ax.set_ylabel(label)
    axes[0].set_title("speed vs class consistency")
    axes[1].set_title("speed vs distribution shift (lower is better)")
    axes[2].set_title("speed vs greedy fidelity")
    handles = [plt.Line2D([], [], color="gray", marker=m, linestyle="", label=s) for s, m in markers.items()]
    axes[0].legend(handles=handles, fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "speed_vs_quality.png"), dpi=100)
    plt.close(fig)


def markdown(out_dir, summary):
    lines = ["# lantern quality report", "",
             f"Engine `{summary['engine']}`, schemes {', '.join(summary['schemes'])}; {summary['images_per_row']} "
             f"sampled images per row. Reference: `{summary['reference']}`. Fréchet distance in the classifier's "
             f"feature space against the reference's samples (the reference row: `ar` against `ar` with another "
             f"seed, the noise floor). Greedy agreement: {summary['greedy_images_per_row']} greedy images per row, "
             f"{summary['greedy_agreement']}.", "",
             "| scheme | method | accuracy | Fréchet vs ref ar | greedy agreement | teacher-forced | mean accepted "
             "length | steps/image | speedup |", "|---|---|---|---|---|---|---|---|---|"]
    for r in summary["results"]:
        lines.append(f"| {r['scheme']} | {r['method']} | {r['accuracy']:.3f} | {r['frechet_vs_ar']:.3f} | "
                     f"{r['greedy_agreement']:.3f} | {r['teacher_forced_agreement']:.3f} | "
                     f"{r['mean_accepted_length']:.2f} | {r['steps_per_image']:.1f} | {r['speedup']:.2f}x |")
    lines += ["", "![speed vs quality](speed_vs_quality.png)", ""]
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write("\n".join(lines))
