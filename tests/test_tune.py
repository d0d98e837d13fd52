"""`lantern-run tune` on real tiny engines: acceptance statistics against independent counts, the
latency fit, the manifest's tuned trees (parsing, atomic install, generate using them), the
compiled-plans hook, and the command's one-line errors."""
import json
import os
import shutil

import numpy as np
import pytest

from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.integrity import sha256_file as sha256
from lantern.runtime.manifest import PlanFile, PlanProfile, TensorRTPlans, read_manifest
from lantern.runtime.settings import GenerationSettings
from lantern.runtime.tree import build_tree, root_only
from lantern.tools import plan_coverage, tune, tune_measure, tune_record
from lantern.tools.run_cli import build_parser, main as run_main
from lantern.tools.acceptance_stats import AcceptanceCounts, count_accepted_paths
from lantern.tools.latency_model import LatencyModel

SETTINGS = dict(mode="lantern++", lam=3.0, k=8, cfg_scale=2.0)


@pytest.fixture(scope="module")
def tuned_report(c2i_engine):
    """One small tune run on the tiny c2i engine (batches 1 and 2), shared by the tests below."""
    engine = Engine(c2i_engine, threads=1)
    conds, note = tune.conditions(engine, 4)
    return tune.tune(engine, GenerationSettings(**SETTINGS), conds, budget=10, depth=3, batches=(1, 2), repeats=1, loop_runs=1, note=note,
                     threads=1, log=lambda *a: None)


def engine_copy(c2i_engine, tmp_path, name="copy"):
    d = tmp_path / name
    shutil.copytree(c2i_engine, d)
    return str(d)


# ---------------------------------------------------------------------------------------------
# Acceptance statistics from real generations


class PathRecorder:
    """A second observer: each active row's accepted node path, read off the record on its own."""

    def __init__(self):
        self.paths = []

    def __call__(self, record):
        for row in np.flatnonzero(record.active):
            on = np.flatnonzero(record.decisions[row] == 1)
            self.paths.append([0] + sorted(int(i) for i in on if i != 0))


def both(*observers):
    def observe(record):
        for o in observers:
            o(record)
    return observe


@pytest.mark.parametrize("greedy", [False, True])
def test_statistics_from_a_real_engine_match_independent_counts(c2i_engine, greedy):
    """kary-3-3 has every rank 0..2 below every node down to depth 3, so besides the path-walking
    count, the loop's own histogram of accepted lengths fixes every depth's totals: at depth d,
    sum over ranks of accepted = row-steps that accepted >= d drafts, of trials = 3 x row-steps
    that accepted >= d - 1."""
    engine = Engine(c2i_engine, threads=1)
    tree = build_tree("kary-3-3")
    counts, paths = AcceptanceCounts(), PathRecorder()
    hist = np.zeros(tree.depth + 1, dtype=np.int64)
    for seed, classes in enumerate(([1, 2, 3], [4, 5], [6])):
        g = engine.generate(classes=classes, **SETTINGS, greedy=greedy, tree=tree, seed=seed,
                            observer=both(counts, paths))
        hist += g.stats["accepted_histogram"]
    direct = count_accepted_paths(tree, paths.paths)
    assert np.array_equal(counts.trials, direct.trials) and np.array_equal(counts.accepted, direct.accepted)
    assert counts.steps == hist.sum() == len(paths.paths)
    assert counts.accepted_drafts == int((hist * np.arange(len(hist))).sum())
    at_least = hist[::-1].cumsum()[::-1]  # at_least[d]: row-steps that accepted >= d drafts
    for d in range(1, tree.depth + 1):
        assert counts.accepted[d - 1].sum() == at_least[d]
        assert counts.trials[d - 1].sum() == 3 * at_least[d - 1]
    assert counts.accepted.sum() > 0 and (counts.trials[:3, :3] > 0).all()  # not a vacuous run


def test_calibration_counts_and_observations(c2i_engine, tuned_report):
    report, _ = tuned_report
    cal = report["calibration"]
    tree = build_tree(cal["tree"])
    assert tree.depth == 3 and tree.max_width <= read_manifest(c2i_engine).candidates and tree.contiguous
    counts = AcceptanceCounts.from_json(cal["counts"])
    assert counts.trials[0, 0] == counts.steps > 0  # every row-step tries rank 0 at depth 1
    assert "(obs)" in tune_record.markdown(report) and str(int(counts.trials[0, 0])) in tune_record.markdown(report)
    p = np.array(report["acceptance_vectors"])
    assert p.shape[0] == 3 and (p.sum(1) <= 1 + 1e-9).all()


# ---------------------------------------------------------------------------------------------
# Latency model


def test_host_fit_recovers_known_terms():
    """Steps built from known curves plus host 0.5 + 0.02 T + 0.3 D are fitted back exactly."""
    verify, draft = {1: 1.0, 8: 2.0, 16: 5.0}, {1: 0.5, 8: 1.0, 16: 3.0}
    engine_only = LatencyModel(verify, draft)
    trees = [build_tree(s) for s in ("chain-1", "chain-3", "kary-2-2", "kary-3-2", [[0], [1], [2], [3]])]
    measured = [(t, engine_only.step_ms(t) + 0.5 + 0.02 * t.num_nodes + 0.3 * t.depth, "x") for t in trees]
    latency, fit, host = tune_measure.fit_latency(verify, draft, 1.7, measured)
    assert host["per_step_ms"] == pytest.approx(0.5) and host["per_node_ms"] == pytest.approx(0.02)
    assert host["per_drafter_call_ms"] == pytest.approx(0.3)
    assert all(abs(row["error"]) < 1e-9 for row in fit)
    assert latency.ar_step_ms() == 1.7
    # a negative residual never makes a negative host term
    _, _, host = tune_measure.fit_latency(verify, draft, 1.7, [(t, engine_only.step_ms(t) - 0.1, "x") for t in trees])
    assert min(host.values()) >= 0


def test_latency_sizes_cover_the_budget():
    assert tune_measure.latency_sizes(5) == [1, 2, 3, 4, 5]
    sizes = tune_measure.latency_sizes(64)
    assert sizes[:8] == list(range(1, 9)) and sizes[-1] == 64 and sizes == sorted(set(sizes))
    assert all(b <= max(a + 1, round(a * 1.25)) for a, b in zip(sizes[7:], sizes[8:]))


def test_tune_measures_a_latency_model_per_batch(c2i_engine, tuned_report):
    report, chosen = tuned_report
    assert set(report["batches"]) == {"1", "2"} and set(chosen) == {1, 2}
    K = read_manifest(c2i_engine).candidates
    for images, r in report["batches"].items():
        latency = LatencyModel.from_json(r["latency_model"])
        assert latency.verify.max_x == 10 and latency.verify.covers(1) and latency.draft.max_x == 9
        names = [row["tree"] for row in r["fit"]]
        assert "ar" in names and len(names) >= 4  # AR and three small trees at least
        assert all(row["measured_step_ms"] > 0 for row in r["fit"])
        tree = chosen[int(images)]
        assert tree.num_nodes == r["chosen"]["nodes"] <= 10 and tree.max_width <= K and tree.depth <= 3
        if tree.depth:  # the chosen tree's step was measured, not only modelled
            assert any(row["nodes"] == tree.num_nodes and row["depth"] == tree.depth for row in r["fit"])
        assert r["chosen"]["tokens_per_s"] >= r["ar"]["tokens_per_s"]
        assert r["plans"] == "no TensorRT plans recorded"
        assert "calibration_check" in r


# ---------------------------------------------------------------------------------------------
# Settings keys and the manifest


def test_settings_key_names_what_changes_acceptance():
    s = GenerationSettings("lantern++", k=20, lam=5, delta=0.3, greedy=False, cfg_scale=3.0)
    assert s.key == "lantern++_lam5_k20_t1-topk0-topp1_cfg3"
    assert "delta" not in s.canonical()  # another mode's parameter is not part of it
    g = GenerationSettings("lantern", k=8, delta=0.25, greedy=True, temperature=0.7, top_k=5, cfg_scale=0.5)
    assert g.key == "lantern_delta0.25_k8_greedy_nocfg"  # greedy ignores the filters; CFG off
    assert GenerationSettings("exact", cfg_scale=4, cfg_interval=100).key == "exact_t1-topk0-topp1_cfg4-first100"
    assert GenerationSettings("lantern++", k=20, lam=5.5).key != GenerationSettings("lantern++", k=20, lam=5).key
    for one in (s, g, GenerationSettings("exact", cfg_scale=4, cfg_interval=100)):  # the form the manifest keeps
        assert GenerationSettings.from_canonical(one.canonical()).canonical() == one.canonical()


def install_trees(engine_dir, report, chosen):
    return tune_record.install(engine_dir, chosen, report)


def test_install_and_generate_use_the_tuned_trees(c2i_engine, tuned_report, tmp_path):
    report, _ = tuned_report
    d = engine_copy(c2i_engine, tmp_path)
    before = read_manifest(d)
    # the trees are whatever the search picked; drafting ones are forced here so both paths run
    chosen = {1: build_tree("chain-2", name="tuned-3-d2"), 2: root_only()}
    entry = install_trees(d, report, chosen)
    m = read_manifest(d, verify=True)  # sizes and sha256 of every listed file, the new ones included
    key = report["key"]
    assert key == GenerationSettings("lantern++", k=8, lam=3.0, cfg_scale=2.0).key
    assert key == "lantern++_lam3_k8_t1-topk0-topp1_cfg2"
    assert m.tuned_trees[key] == entry and m.tree == before.tree
    assert entry.trees[0].file == f"tuned/{key}.b1.json" and entry.trees[1].file is None
    for name in [entry.trees[0].file, entry.report, f"tuned/{key}/report.md", f"tuned/{key}/latency-b2.png"]:
        assert m.files[name].sha256 == sha256(os.path.join(d, name))
    assert build_tree(os.path.join(d, entry.trees[0].file)).paths == chosen[1].paths  # what --tree reads

    engine = Engine(d, threads=1)
    one = engine.generate(classes=[1], **SETTINGS, seed=3)
    assert one.stats["tree"] == "tuned-3-d2"
    two = engine.generate(classes=[1, 2], **SETTINGS, seed=3)  # batch 2 was tuned to AR
    ar = engine.generate(classes=[1, 2], mode="ar", cfg_scale=2.0, seed=3)
    assert two.stats["tree"] == "ar" and np.array_equal(two.tokens, ar.tokens)
    three = engine.generate(classes=[1, 2, 3], **SETTINGS)  # nearest tuned batch: 2
    assert three.stats["tree"] == "ar"
    assert engine.generate(classes=[1], **SETTINGS, tree="chain-1").stats["tree"] == "chain-1"  # --tree wins
    assert engine.generate(classes=[1], **{**SETTINGS, "lam": 2.5}).stats["tree"] == before.tree["name"]
    assert engine.generate(classes=[1], **SETTINGS, greedy=True).stats["tree"] == before.tree["name"]
    # k left to its default resolves as tune resolves it: k 8 is not the default (min(100, table))
    assert engine.generate(classes=[1], **{**SETTINGS, "k": None}).stats["tree"] == before.tree["name"]
    settings = tune.tuning_settings(engine, GenerationSettings(**{**SETTINGS, "k": None}))
    assert settings.k == min(100, engine.neighbors.shape[1]) != 8
    install_trees(d, {**report, "key": settings.key, "settings": settings.canonical()}, {1: build_tree("chain-1", name="default-k"),
                                                                      2: root_only()})
    engine = Engine(d, threads=1)
    assert engine.generate(classes=[1], **{**SETTINGS, "k": None}).stats["tree"] == "default-k"
    assert engine.generate(classes=[1], **SETTINGS).stats["tree"] == "tuned-3-d2"  # the k 8 entry stays


def test_a_tuned_entry_is_used_only_on_its_backend(c2i_engine, tuned_report, tmp_path):
    report, _ = tuned_report
    d = engine_copy(c2i_engine, tmp_path)
    install_trees(d, {**report, "backend": "tensorrt"}, {1: build_tree("chain-2", name="tuned-3-d2"), 2: root_only()})
    engine = Engine(d, threads=1)
    assert engine.generate(classes=[1], **SETTINGS).stats["tree"] == read_manifest(d).tree["name"]


def test_retuning_replaces_the_entry_and_an_interruption_leaves_a_valid_engine(c2i_engine, tuned_report, tmp_path,
                                                                               monkeypatch):
    report, _ = tuned_report
    d = engine_copy(c2i_engine, tmp_path)
    key = report["key"]
    install_trees(d, report, {1: build_tree("chain-2", name="a"), 2: build_tree("chain-1", name="b")})
    assert os.path.exists(os.path.join(d, f"tuned/{key}.b2.json"))
    install_trees(d, report, {1: build_tree("kary-2-2", name="c"), 2: root_only()})
    m = read_manifest(d, verify=True)
    assert [t.name for t in m.tuned_trees[key].trees] == ["c", "ar"]
    assert not os.path.exists(os.path.join(d, f"tuned/{key}.b2.json"))  # the old batch-2 tree is gone
    assert f"tuned/{key}.b2.json" not in m.files

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(tune_record, "write_report", fail)  # the report is rendered before the engine is touched
    with pytest.raises(LanternError, match="disk full"):
        install_trees(d, report, {1: build_tree("chain-3", name="d"), 2: root_only()})
    assert [t.name for t in read_manifest(d, verify=True).tuned_trees[key].trees] == ["c", "ar"]
    monkeypatch.undo()
    written = []

    def full_at_the_report(directory, name, data):  # the disk fills up once the trees are written
        if name.endswith("report.json"):
            raise LanternError("no space left")
        written.append(name)
        return real_write(directory, name, data)

    real_write = tune_record.enginedir.write_file
    monkeypatch.setattr(tune_record.enginedir, "write_file", full_at_the_report)
    with pytest.raises(LanternError):
        install_trees(d, report, {1: build_tree("chain-3", name="d"), 2: root_only()})
    assert f"tuned/{key}.b1.json" in written
    m = read_manifest(d, verify=True)  # still opens, every listed file matches
    assert key not in m.tuned_trees  # the old entry was unlisted before anything was overwritten
    assert Engine(d, threads=1).generate(classes=[1], **SETTINGS).stats["tree"] == m.tree["name"]
    assert not [n for n in os.listdir(d) if n.endswith(".tmp") or n.startswith(".lantern-tmp")]


@pytest.mark.parametrize("change, words", [
    (lambda e, k: e.update(settings={**e["settings"], "lam": 4.0}), "make the key"),
    (lambda e, k: e["settings"].update(delta=0.1), "canonical form"),
    (lambda e, k: e["trees"]["1"].update(file="tuned/nope.json"), "which `files` does not list"),
    (lambda e, k: e["trees"]["1"].update(nodes=1), "null for AR"),
    (lambda e, k: e["trees"].update({"0": e["trees"]["1"]}), "positive integer"),
    (lambda e, k: e.update(extra=1), "unknown field"),
    (lambda e, k: e["settings"].update(mode="ar"), "mode"),
    (lambda e, k: e["trees"]["1"].update(window=3), "needs file null"),  # a window where a tree file is
])
def test_bad_tuned_entries_are_refused_in_one_line(c2i_engine, tuned_report, tmp_path, change, words):
    report, _ = tuned_report
    d = engine_copy(c2i_engine, tmp_path)
    install_trees(d, report, {1: build_tree("chain-2"), 2: root_only()})
    path = os.path.join(d, "manifest.json")
    data = json.loads(open(path).read())
    change(data["tuned_trees"][report["key"]], report["key"])
    open(path, "w").write(json.dumps(data))
    with pytest.raises(LanternError, match=words) as err:
        read_manifest(d)
    assert "\n" not in str(err.value) and "lantern-run tune" in str(err.value)


# ---------------------------------------------------------------------------------------------
# Compiled plans


def test_plans_coverage_of_a_tuned_tree(c2i_engine):
    engine = Engine(c2i_engine, threads=1)
    m = engine.manifest
    assert plan_coverage.plans_coverage(m, engine.condition, "chain-2", 2, True) is None
    # plans built with exact profiles for chain-2 at 2 images with CFG, recorded as `lantern-export trt` does
    shapes = plan_coverage.call_shapes(m, engine.condition, "chain-2", 2, True)
    profiles = {}
    for regime, (graph, inputs) in shapes.items():
        ranges = {name: {"min": list(s), "opt": list(s), "max": list(s)} for name, s in inputs.items()}
        profiles.setdefault(graph, []).append(PlanProfile(serves=(regime,), shapes=ranges))
    plans = TensorRTPlans(flavor="tensorrt-rtx", version="1.7", compute_capabilities=("SM89",),
                          plans={g: PlanFile(file=f"plans/x/{g}.plan", profiles=tuple(p)) for g, p in profiles.items()},
                          batches=(2,), cfg=(True,), trees=("chain-2",))
    with_plans = m.replace(tensorrt={"tensorrt-rtx-SM89": plans})
    assert plan_coverage.plans_coverage(with_plans, engine.condition, "chain-2", 2, True) == {"tensorrt-rtx-SM89": []}
    missing = plan_coverage.plans_coverage(with_plans, engine.condition, "kary-2-2", 2, True)["tensorrt-rtx-SM89"]
    assert "verify" in missing and "prefill" not in missing and "condition" not in missing
    assert "needs `lantern-export trt` again" in plan_coverage.coverage_note({"tensorrt-rtx-SM89": missing})
    assert plan_coverage.plans_coverage(with_plans, engine.condition, "chain-2", 1, True)["tensorrt-rtx-SM89"]  # other batch
    assert "within plans/tensorrt-rtx-SM89" in plan_coverage.coverage_note({"tensorrt-rtx-SM89": []})


@pytest.mark.parametrize("backend", ["tensorrt", "tensorrt-torch"])  # both run the engine's plans
def test_trt_export_builds_for_trees_tuned_on_plans(c2i_engine, tuned_report, tmp_path, backend):
    from lantern.export import trt_export

    report, _ = tuned_report
    d = engine_copy(c2i_engine, tmp_path)
    exported = read_manifest(d).tree["name"]
    install_trees(d, {**report, "backend": backend}, {1: build_tree("kary-2-2", name="k"), 2: root_only()})
    m = read_manifest(d)
    trees = trt_export._trees(m, [], d)
    assert [t.name for t in trees] == [exported, f"{report['key']}.b1"]
    assert trees[1].paths == build_tree("kary-2-2").paths
    assert [t.name for t in trt_export._trees(m, ["chain-3"], d)] == ["chain-3"]  # --tree given: only those
    d2 = engine_copy(c2i_engine, tmp_path, "copy2")
    install_trees(d2, report, {1: build_tree("kary-2-2", name="k"), 2: root_only()})  # tuned on onnxruntime
    assert [t.name for t in trt_export._trees(read_manifest(d2), [], d2)] == [exported]


# ---------------------------------------------------------------------------------------------
# The command


@pytest.mark.parametrize("argv, clock", [
    ([], "cpu"),  # ONNX Runtime on the CPU, one thread: its CPU time is its wall time
    (["--backend", "torch"], "cpu"),
    (["--backend", "onnxruntime-torch"], "cpu"),
    (["--backend", "tensorrt"], "wall"),  # CUDA work: the host's CPU time would miss it
    (["--backend", "tensorrt-torch"], "wall"),
    (["--backend", "torch", "--device", "cuda"], "wall"),
    (["--threads", "2"], "wall"),
    (["--backend", "tensorrt", "--clock", "cpu"], "cpu"),  # --clock wins
])
def test_auto_clock_follows_where_the_runner_runs(argv, clock):
    args = build_parser().parse_args(["tune", "ENGINE", "--threads", "1"] + argv)
    assert tune_measure.clock_of(args) == clock


def test_cli_dry_run_and_errors(c2i_engine, t2i_engine, tmp_path, capsys):
    d = engine_copy(c2i_engine, tmp_path)
    manifest = open(os.path.join(d, "manifest.json")).read()
    caption = tmp_path / "caption.npy"
    np.save(caption, np.zeros((1, 6, 24), dtype=np.float32))
    cases = [
        (["--mode", "ar"], "no tree to tune"),
        (["--budget", "1"], "--budget must be an integer in 2..4096"),
        (["--images", "0"], "--images must be >= 1"),
        (["--caption", str(caption)], "give --classes, not --caption"),
        (["--classes", "3,99"], "class labels must be in [0, 9]"),
        # more than the machine holds: refused from the estimate before calibration, not numpy's MemoryError
        (["--batch", "4000000"], "more than this machine can give"),
    ]
    for argv, message in cases:
        assert run_main(["tune", d, "--threads", "1"] + argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert open(os.path.join(d, "manifest.json")).read() == manifest and not os.path.exists(os.path.join(d, "tuned"))
    out = tmp_path / "report"
    # the dry run on the torch backend's device step: the loop steps are measured as they will run
    assert run_main(["tune", d, "--threads", "1", "--mode", "exact", "--greedy", "--budget", "4", "--depth", "2",
                     "--images", "2", "--repeats", "1", "--dry-run", "--out", str(out), "--backend", "torch",
                     "--step", "device"]) == 0
    text = capsys.readouterr().out
    assert "exact_greedy_nocfg" in text and "dry run" in text and "(obs)" in text and "on the device step" in text
    assert open(os.path.join(d, "manifest.json")).read() == manifest
    report = json.loads((out / "report.json").read_text())
    assert report["settings"] == {"mode": "exact", "sampling": "greedy", "cfg_scale": 1.0, "cfg_interval": -1}
    assert report["backend"] == "torch" and report["batches"]["1"]["step"] == "device"
    assert (out / "report.md").exists()
    assert run_main(["tune", t2i_engine, "--classes", "1"]) == 2
    assert "give --caption, not --classes" in capsys.readouterr().err
    # for real: the entry lands in the manifest and `generate` without --tree follows it
    assert run_main(["tune", d, "--threads", "1", "--mode", "exact", "--greedy", "--budget", "4", "--depth", "2",
                     "--images", "2", "--repeats", "1"]) == 0
    assert "now uses the tuned tree" in capsys.readouterr().out
    entry = read_manifest(d, verify=True).tuned_trees["exact_greedy_nocfg"]
    assert [t.images for t in entry.trees] == [1] and entry.measured["clock"] == "cpu"
    assert entry.measured["step"] == {"1": "host"}  # ONNX Runtime on the CPU: the host step, its default
    assert run_main(["generate", d, "--mode", "exact", "--greedy", "--classes", "1", "--threads", "1",
                     "--out", str(tmp_path / "gen")]) == 0
    stats = json.loads((tmp_path / "gen" / "stats.json").read_text())
    assert stats["tree"] == entry.trees[0].name


def test_caption_engine_without_captions_uses_blank_ones(t2i_engine):
    engine = Engine(t2i_engine, threads=1)
    conds, note = tune.conditions(engine, 3)
    assert "blank" in note and len(conds) == 3
    c = engine.manifest.condition
    assert all(x["caption"].shape == (c.tokens, c.caption_dim) and not x["caption"].any() for x in conds)
    counts, runs = tune.calibrate(engine, GenerationSettings(mode="exact", greedy=True), build_tree("kary-2-2"), conds, batch=2)
    assert [r["images"] for r in runs] == [2, 1] and counts.steps > 0


def test_whatif_is_a_lantern_run_subcommand_and_reads_tune_reports(tuned_report, tmp_path, capsys):
    lat = tmp_path / "lat.json"
    lat.write_text(json.dumps({"verify_ms": {"1": 10, "64": 10}, "draft_fraction": 0.1}))
    acc = tmp_path / "acc.json"
    acc.write_text(json.dumps({"p": [0.6, 0.15, 0.05]}))
    assert run_main(["whatif", "--latency", str(lat), "--acceptance", str(acc), "--depth", "4"]) == 0
    assert capsys.readouterr().out.startswith("PLANNING AID")
    report, _ = tuned_report
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert run_main(["whatif", "--latency", str(lat), "--acceptance", str(path), "--depth", "3",
                     "--report", str(tmp_path / "w.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PLANNING AID") and "(obs)" in out
    w = json.loads((tmp_path / "w.json").read_text())
    assert w["acceptance_counts"] == {k: v for k, v in report["calibration"]["counts"].items()}


# ---------------------------------------------------------------------------------------------
# The jacobi proposer's window


def test_tune_picks_a_jacobi_window_and_generate_follows_it(c2i_engine, tmp_path, capsys):
    """`tune --proposer jacobi` measures AR and each window whole, records the fastest per batch
    for the settings with the window left open, and `generate --proposer jacobi` without
    --window runs it and says so; --window always wins; tune refuses a given --window."""
    d = engine_copy(c2i_engine, tmp_path)
    argv = ["tune", d, "--threads", "1", "--proposer", "jacobi", "--mode", "exact", "--greedy", "--images", "2",
            "--windows", "2,4", "--repeats", "1"]
    assert run_main(argv + ["--window", "4"]) == 2
    assert "drop --window 4" in capsys.readouterr().err
    assert run_main(argv) == 0
    out = capsys.readouterr().out
    assert "jacobi-2" in out and "jacobi-4" in out and "ms/image" in out
    settings = GenerationSettings(mode="exact", greedy=True, proposer="jacobi")
    m = read_manifest(d, verify=True)
    entry = m.tuned_trees[settings.key]
    assert settings.key == "exact_greedy_nocfg_jacobi-random" and entry.settings == settings
    report = json.loads(open(os.path.join(d, entry.report)).read())
    rows = {r["candidate"]: r for r in report["batches"]["1"]["candidates"]}
    assert set(rows) == {"ar", "jacobi-2", "jacobi-4"} and rows["ar"]["steps_per_image"] == 35  # 36 tokens
    fastest = min(rows.values(), key=lambda r: r["seconds_per_image"])
    assert entry.trees[0].window == fastest["window"]  # the measured fastest, AR (None) included
    # a window recorded for these settings (whatever this machine found fastest) is what generate runs
    tune_record.install(d, {1: 4}, dict(report, batches={"1": dict(report["batches"]["1"], chosen=rows["jacobi-4"])}),
                 render=tune.tune_window.write_report)
    engine = Engine(d, threads=1)
    tuned = engine.generate(settings, classes=[1, 2])
    assert tuned.stats["window"] == 4 and tuned.stats["tree_source"] == "tuned"
    assert "a window of 4 slots" in tuned.stats["tree_reason"]
    given = engine.generate(settings.replace(window=2), classes=[1, 2])
    assert given.stats["window"] == 2 and given.stats["tree_source"] == "given"
    ar = engine.generate(mode="ar", greedy=True, classes=[1, 2])
    np.testing.assert_array_equal(tuned.tokens, ar.tokens)  # exact greedy: AR's tokens whichever window
    # another backend does not use it: the default window
    other = Engine(d, threads=1, backend="onnxruntime-torch").generate(settings, classes=[1])
    assert other.stats["tree_source"] == "default" and other.stats["window"] == 6


def test_tune_also_jacobi_chooses_between_proposers_and_generate_and_serving_follow(c2i_engine, tmp_path, capsys):
    """tune --also-jacobi measures the chosen tree against the jacobi windows whole; a window
    recorded under the drafter's settings makes generate (without --tree) run the jacobi proposer
    with it, --tree still wins, and the server pins it per settings key like a tree."""
    from lantern.tools.image_service import ImageService

    d = engine_copy(c2i_engine, tmp_path)
    assert run_main(["tune", d, "--threads", "1", "--mode", "exact", "--greedy", "--budget", "4", "--depth", "2",
                     "--images", "2", "--repeats", "1", "--also-jacobi", "--windows", "2,4"]) == 0
    out = capsys.readouterr().out
    assert "between proposers" in out and "jacobi-4" in out
    settings = GenerationSettings(mode="exact", greedy=True)
    entry = read_manifest(d, verify=True).tuned_trees[settings.key]
    report = json.loads(open(os.path.join(d, entry.report)).read())
    rows = {r["candidate"]: r for r in report["batches"]["1"]["proposers"]["candidates"]}
    assert {"ar", "jacobi-2", "jacobi-4"} <= set(rows)
    fastest = min(rows.values(), key=lambda r: r["seconds_per_image"])
    if fastest["window"] is not None:  # what this machine measured is what was recorded
        assert entry.trees[0].window == fastest["window"]
    # a window recorded for the drafter's settings: generate runs the jacobi proposer with it
    batch = dict(report["batches"]["1"], proposers=dict(report["batches"]["1"]["proposers"], chosen=rows["jacobi-4"]))
    tune_record.install(d, {1: 4}, dict(report, batches={"1": batch}))
    engine = Engine(d, threads=1)
    tuned = engine.generate(settings, classes=[1, 2])
    assert tuned.stats["proposer"] == "jacobi" and tuned.stats["window"] == 4 and tuned.stats["tree_source"] == "tuned"
    assert "window of 4 slots was fastest" in tuned.stats["tree_reason"]
    given = engine.generate(settings, classes=[1, 2], tree="chain-2")
    assert given.stats["proposer"] == "tree" and given.stats["tree"] == "chain-2"
    np.testing.assert_array_equal(tuned.tokens, engine.generate(mode="ar", greedy=True, classes=[1, 2]).tokens)
    # the server pins it: the request's settings carry the window, its images equal direct generation
    service = ImageService(Engine(d, threads=1), max_batch=2)
    request = service.parse(json.dumps({"classes": [3], "seed": 5, "settings": {"mode": "lantern++", "lam": 2, "k": 8,
                                                                                 "greedy": False}}).encode())
    assert request.settings.proposer == "tree"  # another key: nothing tuned for it
    request = service.parse(json.dumps({"classes": [3], "seed": 5, "settings": {"mode": "exact", "greedy": True}}).encode())
    assert (request.settings.proposer, request.settings.window) == ("jacobi", 4)
    served = service.run([request])[0]
    np.testing.assert_array_equal(served.tokens, engine.generate(request.settings, classes=[3], seed=5).tokens)
