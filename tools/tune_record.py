"""Recording what `lantern-run tune` chose: the report (report.json, report.md and the plots) and
`install`, which writes the tuned trees and the report into the engine directory and the manifest's
`tuned_trees` entry for the settings last, under the engine's lock, so a crash at any point leaves a
manifest that matches its files.
"""
import json
import os
import tempfile

import numpy as np

from lantern.runtime import enginedir
from lantern.runtime.errors import LanternError
from lantern.runtime.manifest import describe_files, read_manifest, TunedSettings, TunedTree
from lantern.runtime.outdir import write_file
from lantern.runtime.settings import GenerationSettings
from lantern.tools import tree_report
from lantern.tools.acceptance_stats import AcceptanceCounts
from lantern.tools.latency_model import LatencyModel
from lantern.tools.tree_search import Candidate, SearchResult
from lantern.tools.tune_measure import fit_table


def _json_bytes(data):
    return (json.dumps(data, indent=1) + "\n").encode()


def write_json(path, data):
    """A file outside any engine directory (--out), atomically."""
    write_file(path, _json_bytes(data))


def write_report(directory, report, chosen=None):
    """report.json, report.md and the plots into `directory` (made if needed), and with `chosen`
    ({batch: Tree}) each drafting tree as tree-b{batch}.json. Returns the names written."""
    os.makedirs(directory, exist_ok=True)
    write_json(os.path.join(directory, "report.json"), report)
    names = ["report.json", "report.md", "acceptance.png"]
    tree_report.plot_acceptance(np.array(report["acceptance_vectors"]), os.path.join(directory, "acceptance.png"),
                                _counts(report["calibration"]["counts"]),
                                title=f"positional acceptance, {report['key']}")
    for images, r in report["batches"].items():
        tree_report.plot_latency(LatencyModel.from_json(r["latency_model"]), _result_of(r),
                                 os.path.join(directory, f"latency-b{images}.png"),
                                 title=f"latency model ({images} image(s) per call) and predicted speedup")
        names.append(f"latency-b{images}.png")
    write_file(os.path.join(directory, "report.md"), markdown(report).encode())
    return names


def _result_of(r):
    """A SearchResult-like view of a batch report for plot_latency (best and best per budget)."""

    def cand(d):
        return Candidate(name=d["name"], paths=d.get("paths", []), nodes=d["nodes"], depth=d["depth"],
                         tokens_per_step=d["tokens_per_step"], step_ms=d["step_ms"], ar_ms=r["ar"]["step_ms"],
                         images=d["images"], generation_tokens_per_step=d["generation_tokens_per_step"])

    return SearchResult(best=cand(r["chosen"]), candidates=[cand(d) for d in r["search"]["best_per_budget"].values()],
                        skipped=[])


def markdown(report):
    lines = [f"# Tuned draft tree: `{report['key']}`", "",
             f"Engine `{report['engine']}`, backend {report['backend']} ({report['threads']} thread(s), timed on the "
             f"{report['clock']} clock), "
             f"{report['machine'].get('cpu') or report['machine']['platform']}; load average "
             f"{report['machine'].get('load_average')} (a shared machine makes timings noisy).", "",
             "Settings: " + ", ".join(f"{k}={v}" for k, v in report["settings"].items()) + ".",
             f"Conditions: {report['conditions']}.", "",
             f"Calibration tree: {report['calibration']['nodes']} nodes, depth {report['calibration']['depth']}, "
             f"{report['calibration']['width']} ranks per opened node; {report['calibration']['images']} images.", "",
             "## Acceptance (p, observations)", "", "```",
             tree_report.acceptance_table(np.array(report["acceptance_vectors"]),
                                          _counts(report["calibration"]["counts"])), "```", "",
             "![acceptance](acceptance.png)", ""]
    for images, r in report["batches"].items():
        latency = LatencyModel.from_json(r["latency_model"])
        lines += [f"## {images} image(s) per call", "", "```", tree_report.format_report(r), "",
                  fit_table(r["fit"], r["host_fit"]), "", tree_report.latency_table(latency), "```", "",
                  f"Compiled plans: {r['plans']}.", "", f"![latency](latency-b{images}.png)", ""]
    lines += ["Predictions come from the positional acceptance model and the measured latency model "
              "(lantern.tools.tree_search's docstring lists what is modelled and assumed).", ""]
    return "\n".join(lines)


def _counts(data):
    return AcceptanceCounts.from_json(data)


def install(directory, chosen, report, render=None):
    """Record the trees tuned for report["settings"] in the engine directory, under the engine's
    lock (lantern.runtime.enginedir) so concurrent tunes and plan builds each keep their entries:
    the manifest is re-read under the lock (chosen: {batch: Tree}, or {batch: window or None} from
    tools.tune_window, whose report `render` writes); (1) if an entry for these settings exists, the
    manifest is rewritten without it and its files (the engine falls back to its exported tree
    meanwhile); (2) the trees and the report are written, each file atomically under a unique
    temporary name; (3) the manifest is rewritten with the new entry and the new files' sizes and
    sha256, last. A crash at any point leaves a manifest that matches its files. Returns the entry."""
    key = report["key"]
    try:
        with tempfile.TemporaryDirectory(prefix="lantern-tune-") as scratch:
            # rendered outside the engine (matplotlib opens paths as given), copied in confined
            report_names = (render or write_report)(scratch, report)
            contents = {name: open(os.path.join(scratch, name), "rb").read() for name in report_names}
    except OSError as e:
        raise LanternError(f"cannot render the tune report in the temporary directory ({e.strerror or e}); free space "
                           f"(or raise the file-size limit) and run again; {directory} was left as it was") from None
    with enginedir.locked(directory, "lantern-run tune"):
        m = read_manifest(directory)
        old = m.tuned_trees.get(key)
        old_files = set()
        if old is not None:
            old_files = {t.file for t in old.trees if t.file} | _report_files(m, old)
            m = m.replace(tuned_trees={k: v for k, v in m.tuned_trees.items() if k != key},
                          files={k: v for k, v in m.files.items() if k not in old_files})
            m.write(directory)
        trees, names = [], []
        for images, tree in sorted(chosen.items()):
            if not hasattr(tree, "depth"):  # a jacobi window (or None: AR), measured whole
                batch = report["batches"][str(images)]
                trees.append(_tuned_window(images, tree, batch.get("proposers", batch)["chosen"]))
                continue
            predicted = {k: report["batches"][str(images)]["chosen"][k]
                         for k in ("tokens_per_step", "step_ms", "tokens_per_s", "speedup_vs_ar")}
            file = None
            if tree.depth:
                file = f"tuned/{key}.b{images}.json"
                enginedir.write_file(directory, file, _json_bytes(tree.to_json()))
                names.append(file)
            trees.append(TunedTree(images=images, file=file, name=tree.name if tree.depth else "ar",
                                   nodes=tree.num_nodes, depth=tree.depth, predicted=predicted))
        report_dir = f"tuned/{key}"
        for name, data in contents.items():
            enginedir.write_file(directory, f"{report_dir}/{name}", data)
            names.append(f"{report_dir}/{name}")
        measured = {"threads": report["threads"], "clock": report["clock"], "machine": report["machine"],
                    "step": {images: r.get("step") for images, r in report["batches"].items()}}
        entry = TunedSettings(settings=GenerationSettings.from_canonical(report["settings"]),
                              backend=report["backend"], trees=tuple(trees),
                              report=f"{report_dir}/report.json", measured=measured)
        files = {k: v for k, v in m.files.items() if k not in names}
        files.update(describe_files(directory, names))
        m = m.replace(tuned_trees={**m.tuned_trees, key: entry}, files=dict(sorted(files.items())))
        m.write(directory)
        for name in old_files - set(names):
            try:
                os.remove(enginedir.inside(directory, name))
            except (OSError, LanternError):
                pass
    return entry


def _tuned_window(images, window, row):
    measured = {k: row[k] for k in ("seconds_per_image", "steps_per_image", "speedup_vs_ar")}
    if window is None:
        return TunedTree(images=images, file=None, name="ar", nodes=1, depth=0, predicted=measured)
    return TunedTree(images=images, file=None, name=f"jacobi-{window}", nodes=window, depth=window - 1,
                     predicted=measured, window=window)


def _report_files(m, entry):
    """The files of an entry's report directory that the manifest lists."""
    if not entry.report:
        return set()
    folder = os.path.dirname(entry.report) + "/"
    return {name for name in m.files if name.startswith(folder)}
