"""In-place engines, `lantern-export onnx --attention inplace`: static caches the graphs
update in place (TensorScatter), fused attention over them (ONNX Attention), the accepted path
committed by commit.onnx. Checked against the plain form of the same checkpoints (the session
fixtures, re-exported), on ONNX Runtime CPU, and built with TensorRT-RTX where it is installed."""
import json
import shutil

import numpy as np
import onnx
import pytest
import torch

from engines import export_argv, export_like, host_reads, manifest, run_one_step
from lantern.export import checkpoints, cli
from lantern.export.check import check_engine
from lantern.export.check_cases import check_cases
from lantern.export.check_compare import _compare_ids, TOLERANCES
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.contracts import graph_io
from lantern.runtime.manifest import read_manifest
from lantern.runtime.plan import Call, StepPlan
from lantern.runtime.tree import build_tree
from tiny import OLD_STD, tiny_drafter, tiny_target

torch.set_grad_enabled(False)
MODES = [dict(mode="ar"), dict(mode="exact"), dict(mode="lantern", delta=0.2, k=8),
         dict(mode="lantern++", lam=3.0, k=8)]


@pytest.fixture(scope="module")
def inplace_c2i(c2i_engine, tmp_path_factory):
    return export_like(c2i_engine, tmp_path_factory.mktemp("inplace") / "c2i", "--attention", "inplace")


@pytest.fixture(scope="module")
def inplace_anole(chameleon_engines, tmp_path_factory):
    # a prompt budget of 24 tokens keeps the tiny engine's static cache small
    return export_like(chameleon_engines["anole"], tmp_path_factory.mktemp("inplace") / "anole", "--attention", "inplace",
                       "--max-prompt-tokens", "24")


@pytest.fixture(scope="module")
def inplace_fp16(tmp_path_factory):
    """fp16, head_dim 16 (TensorRT has no fused attention kernel for head_dim 8), no VQ: ar and exact.
    init_random's near-uniform models (OLD_STD): the peaked ones' fp16 rounding through random
    std-0.3 layers exceeds check's fp16 tolerances, which this compares the forms at."""
    root = tmp_path_factory.mktemp("inplace-fp16")
    target = tiny_target("c2i", std=OLD_STD, dim=64, n_head=4, n_kv_head=2, block_size=36)
    checkpoints.save_hf_target(target, root / "target")
    checkpoints.save_drafter(tiny_drafter(target, imitate=False), root / "drafter")
    out = root / "engine"
    assert cli.main(["onnx", "--target", str(root / "target"), "--drafter", str(root / "drafter"), "--candidates", "8",
                     "--dtype", "fp16", "--attention", "inplace", "--out", str(out), "--no-progress"]) == 0
    return str(out)


def _inputs(kind, n=3):
    if kind == "c2i":
        return dict(classes=[1, 4, 7][:n])
    return dict(prompt=["a red cat", "a dog on a mat"], grid=(4, 4))  # two lengths: different padding


# ---------------------------------------------------------------------------------------------
# The export


def test_inplace_export_writes_the_forms_tensorrt_fuses(inplace_c2i):
    m = read_manifest(inplace_c2i)
    s = m.inplace_cache
    assert m.attention == "inplace" and m.opset == 24
    assert {n: g.contract for n, g in m.graphs.items() if n != "vq_decoder"} == {
        "condition": "condition_c2i", "target": "target_inplace", "drafter": "drafter_inplace", "commit": "commit"}
    # c2i: 1 condition token, a 6x6 grid, mc_sim_7b_63's 26 nodes
    assert (s.prefix, s.image_tokens, s.tree_nodes, s.target, s.drafter) == (1, 36, 26, 63, 62)
    target = m.graphs["target"]
    assert target.inputs["attention_mask"].shape == ("B", 1, "T", 63)
    assert target.inputs["past_keys_1"].shape[2] == target.outputs["present_keys_1"].shape[2] == 63
    assert list(target.inputs)[-1] == "write_index" and "new_keys" not in target.outputs
    assert m.graphs["drafter"].inputs["past_keys_0"].shape[2] == 62
    ops = {name: [n.op_type for n in onnx.load(f"{inplace_c2i}/{name}.onnx").graph.node]
           for name in ("target", "drafter", "commit")}
    layers = m.target.layers
    assert (ops["target"].count("TensorScatter"), ops["target"].count("Attention")) == (2 * layers, layers)
    assert (ops["drafter"].count("TensorScatter"), ops["drafter"].count("Attention")) == (2, 1)
    assert ops["commit"].count("TensorScatter") == ops["commit"].count("GatherElements") == 2 * layers


def _static_feeds(feeds, slots):
    """A plain call's feeds [mask over P cache slots + T new tokens] in the static layout: the
    caches padded with junk to `slots`, the block at slots P .. P + T - 1, write_index = P."""
    mask = feeds["attention_mask"]
    T = mask.shape[2]
    P = mask.shape[3] - T
    out = {k: v for k, v in feeds.items() if not k.startswith("past_") and k != "attention_mask"}
    static = np.zeros(mask.shape[:3] + (slots,), dtype=bool)
    static[..., :P + T] = mask
    out["attention_mask"] = static
    for name, cache in feeds.items():
        if name.startswith("past_"):
            padded = np.full(cache.shape[:2] + (slots,) + cache.shape[3:], 50.0, dtype=cache.dtype)
            padded[:, :, :P] = cache
            out[name] = padded
    out["write_index"] = np.full(mask.shape[0], P, dtype=np.int64)
    return out, P, T


def _plain_feeds(static):
    """The inverse of _static_feeds: a static-layout call as a plain call over the P slots
    before write_index (equal for every row here)."""
    P = int(static["write_index"][0])
    mask = static["attention_mask"]
    T = mask.shape[2]
    feeds = {k: v for k, v in static.items() if not k.startswith("past_") and k not in ("attention_mask", "write_index")}
    feeds["attention_mask"] = np.ascontiguousarray(mask[..., :P + T])
    feeds.update({k: np.ascontiguousarray(v[:, :, :P]) for k, v in static.items() if k.startswith("past_")})
    return feeds, P, T


def _compare_forms(plain_out, inplace_out, P, T, feeds, atol, rtol):
    """Fused outputs against plain ones: same logits, hidden states and top-K; the present caches
    hold the plain call's new K/V at P .. P + T - 1 and the old cache elsewhere."""
    worst = 0.0
    for name, want in plain_out.items():
        if name in ("new_keys", "new_values"):
            kind = "keys" if name == "new_keys" else "values"
            for layer in range(want.shape[0]):
                got = inplace_out[f"present_{kind}_{layer}"]
                before = feeds[f"past_{kind}_{layer}"]
                np.testing.assert_array_equal(got[:, :, :P], before[:, :, :P])
                np.testing.assert_array_equal(got[:, :, P + T:], before[:, :, P + T:])
                worst = max(worst, _within(got[:, :, P:P + T], want[layer], atol, rtol))
        elif name != "topk_ids":
            worst = max(worst, _within(inplace_out[name], want, atol, rtol))
    return worst


def _within(got, want, atol, rtol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = float(np.abs(got - want).max())
    assert err <= atol + rtol * float(np.abs(want).max()), (err, float(np.abs(want).max()))
    return err


@pytest.mark.parametrize("graph", ["target", "drafter"])
def test_inplace_graphs_match_plain_graphs_fp32(c2i_engine, inplace_c2i, graph):
    """The same calls (prefill, one token, a tree, draft0; junk in masked slots) through both
    forms on ONNX Runtime: fp32 tolerances (atol 1e-5, rtol 1e-4 of the output's scale)."""
    plain, inplace = Engine(c2i_engine, threads=2), Engine(inplace_c2i, threads=2)
    slots = inplace.manifest.graphs[graph].inputs["past_keys_0"].shape[2]
    atol, rtol = TOLERANCES["fp32"]
    for case, feeds in check_cases(graph, plain.manifest, np.random.default_rng(0)):
        static, P, T = _static_feeds(feeds, slots)
        want = plain.backend.run(Call(graph, case, feeds))
        got = inplace.backend.run(Call(graph, case, {k: v.copy() for k, v in static.items()}))
        _compare_forms(want, got, P, T, static, atol, rtol)
        if graph == "drafter":  # the top-K ids wherever the ranks are clear of a near-tie
            assert _compare_ids(got["topk_ids"], want["topk_ids"], got["topk_probs"], want["topk_probs"])["ok"]


def test_inplace_fp16_graphs_match_the_plain_form(inplace_fp16):
    """fp16 in-place graphs on ONNX Runtime against the plain torch modules of the same fp16
    weights run in fp32: within the fp16 tolerances of `check` (atol 1e-3, rtol 1e-2)."""
    from lantern.export.families import FAMILIES
    engine = Engine(inplace_fp16, threads=2)
    m = engine.manifest
    family, src = FAMILIES[m.family], m.sources
    models = family.load(src["target"]["path"], drafter=src["drafter"]["path"])
    family.cast(models, "fp16")
    plain = {g: (contract, module.float()) for g, (contract, module) in family.graphs(models, m.candidates).items()}
    atol, rtol = TOLERANCES["fp16"]
    worst = {}
    for graph in ("target", "drafter"):
        contract, module = plain[graph]
        io = graph_io(contract, m.graphs[graph].layers)
        for case, static in check_cases(graph, m, np.random.default_rng(1)):  # in the static layout
            feeds, P, T = _plain_feeds(static)
            got = engine.backend.run(Call(graph, case, {k: v.copy() for k, v in static.items()}))
            args = [torch.from_numpy(feeds[name]) for name in io["inputs"]]
            args = [a.float() if a.dtype == torch.float16 else a for a in args]
            want = {k: v.float().numpy() for k, v in zip(io["outputs"], module(*args))}
            worst[(graph, case)] = _compare_forms(want, got, P, T, static, atol, rtol)
    assert max(worst.values()) > 0  # fp16 rounding is there, and within the bound


# ---------------------------------------------------------------------------------------------
# Decoding


@pytest.mark.parametrize("kind", ["c2i", "anole"])
def test_inplace_engines_give_the_tokens_of_plain_engines(request, kind):
    """c2i: every mode, and sampling. Anole: prompts of two lengths left-padded into the static
    cache and forced tokens, with a drafting mode of each kind. A text-conditioned LlamaGen engine
    adds only its condition graph, which the in-place form leaves as it is (the suite's time: it
    is not re-exported here; its padded caption prefix is what Anole's padded prompts check)."""
    if kind == "anole":
        plain_dir, inplace_dir = request.getfixturevalue("chameleon_engines")["anole"], request.getfixturevalue("inplace_anole")
    else:
        plain_dir, inplace_dir = request.getfixturevalue("c2i_engine"), request.getfixturevalue("inplace_c2i")
    plain, inplace = Engine(plain_dir, threads=2), Engine(inplace_dir, threads=2)
    for options in MODES if kind == "c2i" else [MODES[1], MODES[3]]:
        kw = dict(greedy=True, cfg_scale=3.0, **options, **_inputs(kind))
        a, b = plain.generate(**kw), inplace.generate(**kw)
        np.testing.assert_array_equal(b.tokens, a.tokens, err_msg=str(options))
        assert a.stats["steps_per_image"] == b.stats["steps_per_image"]
    if kind == "c2i":  # sampling draws from logits that agree to ~1e-7: the same draws
        kw = dict(mode="lantern++", lam=3.0, k=8, cfg_scale=3.0, seed=7, **_inputs(kind))
        np.testing.assert_array_equal(inplace.generate(**kw).tokens, plain.generate(**kw).tokens)


def test_greedy_exact_equals_ar_on_a_inplace_fp16_engine(inplace_fp16):
    engine = Engine(inplace_fp16, threads=2)
    for cfg in (1.0, 3.0):
        ar = engine.generate(classes=[2, 5], mode="ar", greedy=True, cfg_scale=cfg)
        exact = engine.generate(classes=[2, 5], mode="exact", greedy=True, cfg_scale=cfg)
        np.testing.assert_array_equal(exact.tokens, ar.tokens)
        assert exact.stats["mean_accepted_drafts"] >= 0 and exact.stats["steps_per_image"] <= ar.stats["steps_per_image"]


def test_prompts_of_any_length_share_one_plan(inplace_anole):
    """A static cache holds every prompt left-padded to the budget: prefill has one shape, and
    the plan made for one prompt serves another of a different length."""
    engine = Engine(inplace_anole, threads=2)
    engine.generate(prompt_ids=[[30, 31, 32]], grid=(2, 2), greedy=True, mode="exact")
    plan = engine._plan
    assert plan.calls["prefill"].feeds["input_ids"].shape == (1, 24)
    engine.generate(prompt_ids=[[30, 31, 32, 33, 34, 35, 36, 37]], grid=(2, 2), greedy=True, mode="exact")
    assert engine._plan is plan
    for regime, (_, shapes) in plan.shapes().items():
        if "attention_mask" in shapes:
            want = engine.manifest.inplace_cache.target if regime in ("prefill", "verify") else \
                engine.manifest.inplace_cache.drafter
            assert shapes["attention_mask"][-1] == want, regime


def test_onnxruntime_updates_the_bound_caches_in_place(inplace_c2i, capfd):
    """Every bound in-place call writes into the plan's cache buffers: its present outputs are
    the caches themselves, and ONNX Runtime never falls back to copying a cache (it says so on
    stderr when it does)."""
    engine = Engine(inplace_c2i, threads=2)
    capfd.readouterr()
    engine.generate(classes=[1, 2], mode="lantern++", lam=3.0, k=8, greedy=True, cfg_scale=3.0)
    assert "in-place optimization not activated" not in capfd.readouterr().err
    plan = engine._plan
    keys = plan.target_cache.keys
    for regime in ("prefill", "verify", "commit"):
        assert plan.calls[regime].outputs["present_keys_1"] is plan.target_cache.feeds["past_keys_1"]
        assert np.shares_memory(plan.calls[regime].outputs["present_keys_1"], keys)
    # a verification writes its nodes at write_index .. + M - 1 of the very buffer
    verify = plan.calls["verify"]
    M = verify.tokens
    plan.target_cache.mask_into(verify)
    start = int(verify.feeds["write_index"][0])
    keys[:, :, :, start:start + M] = 0  # the last step's commit may have left these slots as the call writes them
    before = keys.copy()
    engine.backend.run(verify)
    changed = np.flatnonzero(np.any(keys[1, 0] != before[1, 0], axis=(0, 2)))
    assert changed.min() >= start and changed.max() < start + M and len(changed) > M // 2
    # the commit graph moves entries inside the same buffer: node slots -> contiguous slots
    commit, before = plan.calls["commit"], keys.copy()
    commit.feeds["write_index"][:] = start + 1
    commit.feeds["src_slots"][:] = start + np.array([3, 7, 9, 20, 24, 25])[:commit.tokens]
    engine.backend.run(commit)
    src = commit.feeds["src_slots"][0]
    np.testing.assert_array_equal(keys[:, 0, :, start + 1:start + 1 + len(src)], before[:, 0][:, :, src])
    np.testing.assert_array_equal(keys[:, 0, :, :start + 1], before[:, 0, :, :start + 1])
    assert "in-place optimization not activated" not in capfd.readouterr().err


def test_plain_session_runs_of_a_inplace_engine_copy_the_caches_back(inplace_c2i):
    """Without IOBinding the updated caches come back as outputs and are copied into the cache
    buffers: the same tokens, at the price of a whole-cache copy per call."""
    kw = dict(classes=[3], mode="exact", greedy=True, cfg_scale=3.0)
    bound = Engine(inplace_c2i, threads=2).generate(**kw)
    unbound = Engine(inplace_c2i, threads=2, io_binding=False).generate(**kw)
    np.testing.assert_array_equal(unbound.tokens, bound.tokens)


def test_check_compares_inplace_engines_with_their_torch_modules(inplace_c2i):
    report = check_engine(inplace_c2i)
    assert report["ok"], report["failures"]
    checked = {(r["graph"], r["output"]) for r in report["results"]}
    assert ("commit", "present_values_1") in checked and ("target", "present_keys_0") in checked


# ---------------------------------------------------------------------------------------------
# Budgets and refusals


def test_what_a_static_cache_cannot_hold_is_refused_in_one_line(inplace_c2i, inplace_anole):
    c2i = Engine(inplace_c2i, threads=1)
    with pytest.raises(LanternError, match=r"has \d+ nodes; this engine's static cache holds trees of at most 26"):
        c2i.generate(classes=[1], mode="exact", greedy=True, tree="naive_extend_57")
    c2i.generate(classes=[1], mode="exact", greedy=True, tree="chain")  # a smaller tree fits
    anole = Engine(inplace_anole, threads=1)
    with pytest.raises(LanternError, match="the prompt takes 28 tokens; .* at most 24 .*--max-prompt-tokens"):
        anole.generate(prompt_ids=[list(range(30, 55))], grid=(2, 2), mode="ar", greedy=True)


@pytest.mark.parametrize("extra, words", [
    (["--attention", "inplace", "--opset", "18"], "needs TensorScatter, opset 24"),
    (["--attention", "inplace", "--max-tree-nodes", "3"], "--max-tree-nodes must be an integer >= 26"),
    (["--max-tree-nodes", "40"], "need --attention inplace"),
    (["--attention", "inplace", "--max-prompt-tokens", "40"], "applies to prompt (Chameleon) engines"),
])
def test_bad_inplace_export_options_are_refused(c2i_engine, tmp_path, capsys, extra, words):
    assert cli.main(export_argv(c2i_engine, tmp_path / "out", *extra)) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, words", [
    (lambda m: m.pop("inplace_cache"), "inplace_cache is missing; graphs commit, drafter, target update"),
    (lambda m: m["inplace_cache"].update(target=64), "does not add up"),
    (lambda m: m["inplace_cache"].update(tree_nodes=27, target=64, drafter=63), "has 63 slots; the static cache gives it 64"),
    (lambda m: (m["graphs"].pop("commit"), m["files"].pop("commit.onnx")), "has no commit graph"),
])
def test_inconsistent_static_caches_are_refused(inplace_c2i, tmp_path, change, words):
    d = tmp_path / "engine"
    shutil.copytree(inplace_c2i, d)
    data = manifest(d)
    change(data)
    (d / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(LanternError) as e:
        read_manifest(d)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_an_engine_written_before_the_inplace_rename_reads_the_same(inplace_c2i, tmp_path):
    """Engines from before the cache form had one name record `static_cache` and build.attention
    'fused': they open as they did (the record read under its old key); both keys at once are
    one line saying to re-export."""
    d = tmp_path / "engine"
    shutil.copytree(inplace_c2i, d)
    data = manifest(d)
    old = {("static_cache" if k == "inplace_cache" else k): v for k, v in data.items()}
    old["build"] = {**data["build"], "attention": "fused"}
    (d / "manifest.json").write_text(json.dumps(old))
    before, now = read_manifest(d), read_manifest(inplace_c2i)
    assert before.inplace_cache == now.inplace_cache and before.attention == "inplace"
    assert before.replace(build=now.build) == now
    (d / "manifest.json").write_text(json.dumps({**old, "inplace_cache": data["inplace_cache"]}))
    with pytest.raises(LanternError) as e:
        read_manifest(d)
    assert "static_cache and inplace_cache are one field" in str(e.value) and "re-export" in str(e.value)


# ---------------------------------------------------------------------------------------------
# TensorRT-RTX (builds without a GPU)


@pytest.mark.parametrize("cc", ["SM89", "SM120"])
def test_tensorrt_rtx_builds_the_inplace_fp16_graphs(inplace_fp16, cc):
    """Target, drafter and commit plans with one exact profile per call regime of a CFG step
    plan; the parser maps every cache update and attention to TensorRT's fused layers."""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'lantern[tensorrt-rtx]')")
    from lantern.export.tensorrt_build import build_plan, exact_profile

    engine = Engine(inplace_fp16, threads=1)
    prefix = engine.condition.prefix(True, classes=[1, 2])
    settings = dict(cfg_scale=3.0, temperature=1.0, top_k=0, top_p=1.0)
    plan = StepPlan(engine.manifest, engine.backend, engine.tree, prefix, settings)
    layers = engine.manifest.target.layers
    want = {"target": {"attention": layers, "kv_cache_update": 2 * layers},
            "drafter": {"attention": 1, "kv_cache_update": 2},
            "commit": {"attention": 0, "kv_cache_update": 2 * layers}}
    for graph, fused in want.items():
        profiles = [exact_profile(shapes) for g, shapes in plan.shapes().values() if g == graph]
        blob, record = build_plan(f"{inplace_fp16}/{graph}.onnx", profiles, flavor="tensorrt-rtx",
                                  compute_capabilities=[cc])
        assert record["fused_layers"] == fused and len(blob) > 0
        assert record["io"]["inputs"]["past_keys_0"]["shape"][2] == \
            engine.manifest.graphs[graph].inputs["past_keys_0"].shape[2]
    assert build_tree(engine.manifest.tree).num_nodes == engine.manifest.inplace_cache.tree_nodes


def test_trt_command_builds_a_inplace_engines_plans_commit_included(inplace_fp16, tmp_path):
    """`lantern-export trt` lays out the in-place step plans (write_index, static caches, the
    commit regime) and builds every graph of the engine, commit.onnx included."""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'lantern[tensorrt-rtx]')")
    engine = shutil.copytree(inplace_fp16, tmp_path / "engine")
    assert cli.main(["trt", str(engine), "--flavor", "tensorrt-rtx", "--compute-capability", "89", "--batch", "2",
                     "--no-progress"]) == 0
    plans = read_manifest(engine).tensorrt["tensorrt-rtx-SM89"].plans
    assert set(plans) == {"condition", "target", "drafter", "commit"}
    depth = build_tree(read_manifest(engine).tree).depth
    commit = [p.shapes["src_slots"]["opt"] for p in plans["commit"].profiles]
    assert sorted(map(tuple, commit)) == [(2, depth + 1), (4, depth + 1)]  # without and with CFG rows


# ---------------------------------------------------------------------------------------------
# The torch backend's device step on an in-place engine (lantern.runtime.graph_step over
# lantern.export.step_graphs' modules, the in-place cache form of step_caches): write indices,
# masks and the commit graph's feeds as device ops; the host step is the specification.
# (Without the commit graph's move the lantern++ cases differ in ~15% of their tokens.)


@pytest.fixture(scope="module")
def inplace_torch(inplace_c2i):
    """One torch backend over the in-place engine, a host and a device engine on it: cases with
    the same tree and batch reuse the plan, and the device engine its step."""
    from lantern.export.torch_backend import open_torch_backend

    backend = open_torch_backend(inplace_c2i, threads=2)
    return backend, Engine(inplace_c2i, backend=backend, step="host"), Engine(inplace_c2i, backend=backend, step="device")


# every mode, CFG off and on, batch 1 and 3, greedy then sampling (same seeds); exact once (on
# the tiny model it accepts few drafts: many steps). The lantern case follows the exact one on
# the same plan and key, so its device step is the exact one's, refilled
DEVICE_CASES = [("exact", 4.0, 3, {"cfg_interval": 5}),
                ("lantern", 4.0, 3, {"delta": 0.2, "k": 8, "cfg_interval": 7}),
                ("lantern++", 1.0, 3, {"lam": 3.0, "k": 8}), ("lantern++", 4.0, 1, {"lam": 3.0, "k": 8}),
                ("lantern", 4.0, 3, dict(greedy=False, temperature=0.8, top_k=20, delta=0.2, k=8, cfg_interval=5)),
                ("lantern++", 1.0, 1, dict(greedy=False, temperature=1.0, top_p=0.95, lam=3.0, k=8)),
                ("ar", 1.0, 1, {})]


@pytest.mark.parametrize("mode, cfg, images, extra", DEVICE_CASES)
def test_inplace_device_step_equals_the_host_step(inplace_torch, mode, cfg, images, extra):
    backend, host_engine, device_engine = inplace_torch
    kw = dict(dict(mode=mode, greedy=True, cfg_scale=cfg, classes=list(range(1, images + 1)),
                   seed=[11 + 7 * i for i in range(images)]), **extra)
    reused = backend._steps.get(id(device_engine._plan))
    host, device = host_engine.generate(**kw), device_engine.generate(**kw)
    assert (host.stats["step"], device.stats["step"]) == ("host", "device")
    np.testing.assert_array_equal(device.tokens, host.tokens)
    for key in ("steps_per_image", "mean_accepted_length", "accepted_histogram"):
        assert device.stats[key] == host.stats[key], key
    if mode == "lantern" and kw["greedy"]:
        assert reused is not None and backend._steps[id(device_engine._plan)] is reused
    if mode in ("lantern", "lantern++"):  # drafts accepted: the commit graph moved paths
        assert device.stats["mean_accepted_drafts"] > 0


def test_inplace_device_step_moves_a_few_integers_per_image(inplace_torch, inplace_c2i):
    from lantern.tools.crossings import RecordingBackend

    backend = RecordingBackend(inplace_torch[0])
    engine = Engine(inplace_c2i, backend=backend, step="device")
    out = engine.generate(mode="lantern++", lam=3.0, k=8, greedy=True, cfg_scale=4.0, classes=[1, 2, 3])
    events = backend.events[backend.start:]
    report = 3 * (engine.tree.depth + 3) * 8  # per image: accepted, depth + 1 tokens, invalid (int64)
    step = backend._steps[id(engine._plan)]
    calls = len(step.calls[0])  # phases and engine calls, the commit graph's among them
    assert "commit" in [c.regime for c in step.calls[0]]
    # per step its calls launched (one CUDA graph on CUDA), the report read: nothing goes up
    assert events == ([("launch", 0)] * calls + [("to_host", report), ("sync", 0)]) * out.stats["steps"]
    # and within the step no op reads the device on the host (CUDA capture refuses those)
    assert host_reads(lambda: run_one_step(step)) == {}


def test_inplace_step_replayed_as_one_captured_graph(inplace_torch, inplace_c2i, monkeypatch):
    """The in-place step (write_index, the commit graph) as CUDA runs it once captured
    (engines.capture_steps_on_cpu: one eager run per call list, then a CpuGraph replayed): the
    host step's tokens, greedy and sampling, two generations."""
    from engines import assert_captured_once, capture_steps_on_cpu
    from lantern.export.torch_backend import open_torch_backend

    capture_steps_on_cpu(monkeypatch)
    _, host_engine, _ = inplace_torch
    device = Engine(inplace_c2i, backend=open_torch_backend(inplace_c2i, threads=2), step="device")
    for extra in (dict(greedy=True), dict(greedy=False, temperature=1.0, top_k=20, seed=[5, 6])):
        kw = dict(mode="lantern++", lam=3.0, k=8, cfg_scale=4.0, classes=[1, 2], **extra)
        want = host_engine.generate(**kw).tokens
        first, second = device.generate(**kw), device.generate(**kw)
        assert_captured_once(device.backend, device.backend._steps[id(device._plan)])
        np.testing.assert_array_equal(first.tokens, want, err_msg=str(extra))
        np.testing.assert_array_equal(second.tokens, want, err_msg=str(extra))


def test_inplace_device_step_refusals(inplace_torch, inplace_c2i):
    """The device step serves in-place plans, greedy and sampling; what it cannot serve is still
    refused in one line."""
    from lantern.runtime.backends.torch import TorchBackend
    from lantern.runtime.kvcache import InPlaceKVCache
    from lantern.runtime.sampling import Greedy, Sampling

    backend = inplace_torch[0]
    engine = Engine(inplace_c2i, backend=backend, step="device")
    settings = dict(cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0)
    plan = StepPlan(engine.manifest, backend, engine.tree, engine.condition.prefix(False, classes=[1]), settings)
    assert isinstance(plan.target_cache, InPlaceKVCache)
    assert backend.device_step_refusal(plan, Greedy()) is None
    assert backend.device_step_refusal(plan, Sampling(top_k=20)) is None
    bare = TorchBackend(backend.modules, read_manifest(inplace_c2i))  # opened without the step's modules
    with pytest.raises(LanternError, match="the device step cannot run this generation: .* opened without the "
                                           "step's modules") as e:
        Engine(inplace_c2i, backend=bare, step="device").generate(mode="exact", classes=[1])
    assert "\n" not in str(e.value)


def test_inplace_device_step_on_left_padded_prompts(inplace_anole):
    """Prompts of two lengths, left-padded to the static cache's prompt budget: the device step
    reads the padding's invisible slots and position offsets as the host step does."""
    from lantern.export.torch_backend import open_torch_backend

    backend = open_torch_backend(inplace_anole, threads=2)
    kw = dict(mode="lantern++", lam=4.0, k=8, greedy=True, prompt=["a red cat", "a dog on a mat"], grid=(4, 4),
              cfg_scale=3.0)
    host = Engine(inplace_anole, backend=backend, step="host").generate(**kw)
    device = Engine(inplace_anole, backend=backend, step="device").generate(**kw)
    assert device.stats["step"] == "device" and device.stats["mean_accepted_drafts"] > 0
    np.testing.assert_array_equal(device.body, host.body)


def test_inplace_engine_on_onnxruntime_torch(inplace_c2i, capfd):
    """ONNX Runtime's whole device step on an in-place engine (onnxruntime-torch: each cache's
    output bound to its input, so TensorScatter writes the cache where it is; the commit graph
    moves accepted paths): the plain ONNX Runtime host step's tokens, greedy and sampling, and
    no whole-cache copy (ONNX Runtime says so on stderr when it makes one): the verify call's
    present outputs are the cache tensors themselves."""
    from lantern.export.torch_backend import open_onnxruntime_torch_backend

    reference = Engine(inplace_c2i, threads=2)
    device = Engine(inplace_c2i, backend=open_onnxruntime_torch_backend(inplace_c2i, threads=2), step="device")
    for extra in (dict(greedy=True), dict(greedy=False, temperature=1.0, top_k=20, seed=[5, 6])):
        kw = dict(mode="lantern++", lam=3.0, k=8, cfg_scale=4.0, classes=[1, 2], **extra)
        want = reference.generate(**kw)
        capfd.readouterr()
        got = device.generate(**kw)
        assert "in-place optimization not activated" not in capfd.readouterr().err
        np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=str(extra))
        assert got.stats["step"] == "device" and got.stats["mean_accepted_drafts"] > 0
    backend, plan = device.backend, device._plan
    bindings = backend.modules["target"].bindings.values()  # prefill, and each step's verify
    assert len(bindings) >= 2 and all(dict(zip(backend.outputs["target"], entry.outputs))["present_keys_1"] is
                                      plan.target_cache.feeds["past_keys_1"] for entry in bindings)
