"""ONNX export and `check`: tiny models written in the real checkpoint formats, exported through
the CLI/API, run on ONNX Runtime and compared with the PyTorch graph modules."""
import json
import os
import pathlib
import shutil

import numpy as np
import pytest
import torch

from tiny import causal_mask, positions, tiny_drafter, tiny_target

from lantern.export import checkpoints, cli
from lantern.export import onnx_export
from lantern.export.check import check_engine
from lantern.runtime.errors import LanternError
from lantern.runtime.contracts import graph_io
from lantern.runtime.manifest import Condition, describe_files, read_manifest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")


# ---------------------------------------------------------------------------------------------
# Checkpoints on disk (module scope: written once)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    c2i = tiny_target("c2i", seed=0)
    a = c2i.args
    config = root / "c2i.json"
    config.write_text(json.dumps({"dim": a.dim, "n_layer": a.n_layer, "n_head": a.n_head, "vocab_size": a.vocab_size,
                                  "num_classes": a.num_classes, "block_size": a.block_size,
                                  "multiple_of": a.multiple_of, "cls_token_num": 1, "model_type": "c2i"}))
    checkpoints.save_llamagen_pt(c2i, root / "c2i.pt")
    checkpoints.save_drafter(tiny_drafter(c2i, seed=1), root / "c2i_drafter")
    t2i = tiny_target("t2i", seed=2)
    checkpoints.save_hf_target(t2i, root / "t2i")
    checkpoints.save_drafter(tiny_drafter(t2i, seed=3), root / "t2i_drafter", fmt="safetensors")
    # A drafter that does not fit (other hidden size).
    other = tiny_target("c2i", dim=48, n_head=6)
    checkpoints.save_drafter(tiny_drafter(other), root / "wide_drafter")
    paths = {"root": root, "c2i": str(root / "c2i.pt"), "c2i_config": str(config),
             "c2i_drafter": str(root / "c2i_drafter"), "t2i": str(root / "t2i"),
             "t2i_drafter": str(root / "t2i_drafter"), "wide_drafter": str(root / "wide_drafter")}
    return paths


@pytest.fixture(scope="module")
def c2i(c2i_engine):
    """The session's c2i engine (tests/conftest.py: a LlamaGen .pt target with a config file, a
    .bin drafter, a VQ decoder, exported through the CLI) and its manifest."""
    return c2i_engine, read_manifest(c2i_engine)


def _export_cli(sources, out, *extra):
    return cli.main(["onnx", "--target", sources["c2i"], "--config", sources["c2i_config"], "--out", str(out),
                     "--no-progress", *extra])


# ---------------------------------------------------------------------------------------------
# Engines that pass


def test_c2i_engine_passes_check(c2i):
    out, manifest = c2i
    assert set(manifest.graphs) == {"condition", "target", "drafter", "vq_decoder"}
    assert manifest.modes == ("ar", "exact", "lantern", "lantern++")
    assert manifest.condition == Condition(kind="class", tokens=1, num_classes=10, null_class=10)
    assert (manifest.vocabulary.image_start, manifest.vocabulary.image_end) == (0, 64) and manifest.candidates == 16
    assert manifest.sources["target"]["format"] == "llamagen-pt"
    assert manifest.sources["drafter"]["format"] == "drafter"
    report = check_engine(out)
    assert report["ok"], report["failures"]
    ids = [r for r in report["results"] if r["output"] == "topk_ids"]
    assert ids and all(r["clear"] > 0 for r in ids)  # the id comparison is not vacuous
    cases = {(r["graph"], r["case"]) for r in report["results"]}
    assert {("target", "prefill"), ("target", "step"), ("target", "tree"), ("drafter", "tree"),
            ("drafter", "draft0")} <= cases


def test_vq_decoder_and_neighbors(c2i):
    out, manifest = c2i
    from lantern.export.neighbors import nearest_neighbors
    from lantern.export.vq import load_vq

    table = np.load(os.path.join(out, "neighbors.npy"))
    assert table.shape == (64, 63) and manifest.neighbors.k == 63
    vq, _ = load_vq(manifest.sources["vq"]["path"])
    np.testing.assert_array_equal(table, nearest_neighbors(vq.code_vectors().detach().numpy(), 63))
    assert manifest.graphs["vq_decoder"].dtype == "fp32"
    assert manifest.image.pixels == manifest.image.grid_width * manifest.vq["downsample"] == 24


def test_t2i_engine_via_cli_passes_check(t2i_engine, capsys):
    manifest = read_manifest(t2i_engine)
    assert manifest.condition.kind == "caption" and manifest.condition.tokens == 6
    assert manifest.graphs["condition"].contract == "condition_t2i"
    assert manifest.sources["target"]["format"] == "lantern-hf"
    assert cli.main(["check", t2i_engine]) == 0
    printed = capsys.readouterr().out
    assert "target     tree     logits" in printed and "check passed" in printed


def test_fp16_engine_passes_check_with_its_tolerance(fp16_engine):
    out = pathlib.Path(fp16_engine)
    manifest = read_manifest(out)
    assert manifest.dtype == "fp16" and set(manifest.graphs) == {"condition", "target", "drafter"}
    model = onnx.load(str(out / "target.onnx"))
    types = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.input) + list(model.graph.output)}
    assert types["cond_embeds"] == types["hidden"] == types["past_keys_0"] == onnx.TensorProto.FLOAT16
    assert types["logits"] == onnx.TensorProto.FLOAT  # 'float32' in the contract stays fp32
    # Weights stay fp16 (no fp32 copies), except the RoPE table, which is fp32 by design.
    sizes = {i.name: i.data_type for i in model.graph.initializer if len(i.dims) == 2 and min(i.dims) > 8}
    assert sizes and set(sizes.values()) == {onnx.TensorProto.FLOAT16}
    report = check_engine(out)
    assert (report["atol"], report["rtol"]) == (1e-3, 1e-2)
    assert report["ok"], report["failures"]
    worst = max(r["max_rel"] for r in report["results"] if "max_rel" in r)
    assert 0 < worst < 5e-3  # fp16 really differs from torch, and by far less than the bound


def test_bf16_ar_engine_checks_through_fp32_upcast(sources, tmp_path):
    out = tmp_path / "bf16"
    manifest = onnx_export.export_engine(out, sources["c2i"], target_options={"config_file": sources["c2i_config"]},
                                         dtype="bf16")
    # no drafter: an AR-only engine (test_generator's test_ar_only_engine runs one)
    assert manifest.modes == ("ar",) and set(manifest.graphs) == {"condition", "target"} and manifest.drafter is None
    model = onnx.load(str(out / "target.onnx"))
    assert {v.type.tensor_type.elem_type for v in model.graph.input if v.name == "past_keys_0"} == {onnx.TensorProto.BFLOAT16}
    report = check_engine(out)
    assert report["ok"], report["failures"]


# ---------------------------------------------------------------------------------------------
# Manifest and dynamic axes


def test_manifest_round_trips_and_names_the_contracts(c2i):
    out, manifest = c2i
    assert read_manifest(out, verify=True) == manifest
    for name, entry in manifest.graphs.items():
        spec = graph_io(entry.contract, 2 if entry.contract == "target" else 1)
        assert list(entry.inputs) == list(spec["inputs"]) and list(entry.outputs) == list(spec["outputs"])
        assert entry.file in manifest.files
        model = onnx.load(os.path.join(out, entry.file), load_external_data=False)
        assert [v.name for v in model.graph.input] == list(entry.inputs)
        io = {**entry.inputs, **entry.outputs}
        for value in list(model.graph.input) + list(model.graph.output):
            dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
            assert dims == list(io[value.name].shape)
    target = manifest.graphs["target"]
    assert target.inputs["attention_mask"].shape == ("B", 1, "T", "P+T")
    assert target.inputs["past_keys_1"].shape == ("B", 2, "P", 8)
    assert target.inputs["cond_embeds"].shape == ("B", 1, 32)
    assert "past_keys_2" not in target.inputs
    from lantern.runtime.tree import build_tree

    assert build_tree(manifest.tree) == build_tree(onnx_export.DEFAULT_TREE)
    assert manifest.tools["torch"] == torch.__version__
    digest = manifest.sources["target"]["sha256"]["c2i.pt"]
    assert len(digest) == 64


def test_dynamic_axes_at_several_batch_sizes_and_cache_lengths(c2i):
    out, manifest = c2i
    modules = onnx_export.load_graph_modules(manifest)
    target = modules["target"][1]
    session = ort.InferenceSession(os.path.join(out, "target.onnx"), providers=["CPUExecutionProvider"])
    a = target.target.args
    gen = torch.Generator().manual_seed(0)
    for batch, tokens, past in [(1, 1, 0), (1, 1, 9), (3, 4, 2), (5, 2, 12), (2, 17, 0)]:
        past_k = torch.randn(a.n_layer, batch, a.kv_heads, past, a.head_dim, generator=gen)
        past_v = torch.randn(past_k.shape, generator=gen)
        ids = torch.randint(0, a.vocab_size + 1, (batch, tokens), generator=gen)  # V: the condition token
        inputs = (ids, torch.randn(batch, 1, a.dim, generator=gen), positions(batch, past, tokens),
                  causal_mask(batch, tokens, past), *past_k, *past_v)
        got = session.run(None, {n: x.numpy() for n, x in zip(graph_io("target", a.n_layer)["inputs"], inputs)})
        with torch.no_grad():
            want = target(*inputs)
        for g, w in zip(got, want):
            assert g.shape == tuple(w.shape)
            np.testing.assert_allclose(g, w.numpy(), atol=1e-5, rtol=1e-4)

    # The drafter: CFG partners are an input value (cfg_pair), never a shape.
    drafter = modules["drafter"][1]
    session = ort.InferenceSession(os.path.join(out, "drafter.onnx"), providers=["CPUExecutionProvider"])
    for batch, tokens, past in [(1, 1, 0), (6, 2, 7), (4, 5, 1)]:
        past_k = torch.randn(batch, a.kv_heads, past, a.head_dim, generator=gen)
        pair = (torch.arange(batch) + batch // 2) % batch
        inputs = (torch.randn(batch, tokens, a.dim, generator=gen), torch.randint(0, a.vocab_size, (batch, tokens)),
                  positions(batch, past, tokens), causal_mask(batch, tokens, past), past_k,
                  torch.randn(past_k.shape, generator=gen), pair, torch.tensor([3.0]),
                  torch.tensor([1.0]), torch.tensor([0]), torch.tensor([1.0]))
        got = session.run(None, {name: x.numpy() for name, x in zip(graph_io("drafter")["inputs"], inputs)})
        with torch.no_grad():
            want = drafter(*inputs)
        assert got[3].shape == (batch, tokens, manifest.candidates)
        for g, w in zip(got, want):
            assert g.shape == tuple(w.shape)
            if g.dtype != np.int64:
                np.testing.assert_allclose(g, w.numpy(), atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# Failing checks


def _perturb_initializer(path):
    """Change one weight of the largest initializer in place; the file keeps its size."""
    from onnx import numpy_helper

    model = onnx.load(path)
    init = max(model.graph.initializer, key=lambda t: np.prod(t.dims))
    array = numpy_helper.to_array(init).copy()
    array.flat[: array.size // 4] += 0.05
    init.CopyFrom(numpy_helper.from_array(array, init.name))
    onnx.save(model, path)


def test_changed_graph_is_caught_by_hash_then_fails_numerically(c2i, tmp_path, capsys):
    out = tmp_path / "perturbed"
    shutil.copytree(c2i[0], out)
    before = os.path.getsize(out / "target.onnx")
    _perturb_initializer(str(out / "target.onnx"))
    assert os.path.getsize(out / "target.onnx") == before  # only the hash can tell

    # The changed file without a manifest update: refused before anything runs.
    with pytest.raises(LanternError, match="target.onnx does not match its sha256"):
        check_engine(out)
    assert cli.main(["check", str(out)]) == 2
    assert "sha256" in capsys.readouterr().err

    # Manifest updated to the new file: the numbers must now disagree.
    manifest = read_manifest(out, verify=False)
    manifest.replace(files={**manifest.files, **describe_files(out, ["target.onnx"])}).write(out)
    assert cli.main(["check", str(out)]) == 1
    printed = capsys.readouterr().out.splitlines()
    failed = [line.split()[0] for line in printed if line.endswith("FAIL") or " FAIL (" in line]
    assert failed and set(failed) == {"target"}  # only the perturbed graph
    assert printed[-1].startswith("check FAILED: ") and "target/" in printed[-1]


def test_truncated_file_is_caught_by_size(c2i, tmp_path):
    out = tmp_path / "truncated"
    shutil.copytree(c2i[0], out)
    with open(out / "drafter.onnx", "r+b") as f:
        f.truncate(100)
    with pytest.raises(LanternError, match="drafter.onnx has 100 bytes"):
        check_engine(out, verify=False)


def _no_graphs(monkeypatch):
    """Replace the ONNX export by graphs with no nodes, for tests about everything around it."""
    import onnx

    empty = onnx.helper.make_model(onnx.helper.make_graph([], "empty", [], [])).SerializeToString()

    def write(module, io_spec, path, opset=18, deferred=None, cache=None):
        with open(path, "wb") as f:
            f.write(empty)
        return [os.path.basename(path)]

    monkeypatch.setattr(onnx_export, "export_graph", write)


def test_changed_source_checkpoint_is_refused(sources, tmp_path, monkeypatch):
    target = tmp_path / "c2i.pt"
    shutil.copy(sources["c2i"], target)
    out = tmp_path / "engine"
    _no_graphs(monkeypatch)
    onnx_export.export_engine(out, target, target_options={"config_file": sources["c2i_config"]})
    checkpoints.save_llamagen_pt(tiny_target("c2i", seed=7), target)
    with pytest.raises(LanternError, match="changed since the export"):
        check_engine(out)


# ---------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, nothing written


def _leftovers(directory):
    return [name for name in os.listdir(directory) if name.startswith(".")]


@pytest.mark.parametrize("case", ["drafter_mismatch", "unknown_tree", "missing_target", "missing_drafter",
                                  "unknown_dtype", "tree_without_drafter", "narrow_candidates", "bad_opset"])
def test_bad_input_is_one_line_and_writes_nothing(sources, tmp_path, capsys, case):
    out = tmp_path / "engines" / "bad"
    extra = {
        "drafter_mismatch": ["--drafter", sources["wide_drafter"]],
        "unknown_tree": ["--drafter", sources["c2i_drafter"], "--tree", "no_such_tree"],
        "missing_target": [],
        "missing_drafter": ["--drafter", str(tmp_path / "nowhere")],
        "unknown_dtype": ["--dtype", "int8"],
        "tree_without_drafter": ["--tree", "chain"],
        "narrow_candidates": ["--drafter", sources["c2i_drafter"], "--candidates", "2"],
        "bad_opset": ["--opset", "11"],
    }[case]
    argv = ["onnx", "--target", sources["c2i"], "--config", sources["c2i_config"], "--out", str(out), "--no-progress"]
    if case == "missing_target":
        argv[2] = str(tmp_path / "missing.pt")
    assert cli.main(argv + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lantern-export: error: ")
    expected = {"drafter_mismatch": "does not fit the target", "unknown_tree": "unknown tree preset",
                "missing_target": "no such file", "missing_drafter": "a drafter is a directory",
                "unknown_dtype": "unknown dtype 'int8'", "tree_without_drafter": "--tree needs --drafter",
                "narrow_candidates": "narrower than tree", "bad_opset": "opset 11"}[case]
    assert expected in err[0]
    assert not out.exists()
    assert not out.parent.exists() or _leftovers(out.parent) == []


def test_failure_mid_export_leaves_nothing(sources, tmp_path, monkeypatch):
    out = tmp_path / "engines" / "half"
    real = onnx_export.export_graph

    def fail_on_target(module, io_spec, path, opset=onnx_export.DEFAULT_OPSET, deferred=None, cache=None):
        if path.endswith("target.onnx"):
            raise RuntimeError("exporter blew up")
        return real(module, io_spec, path, opset, deferred, cache)

    monkeypatch.setattr(onnx_export, "export_graph", fail_on_target)
    with pytest.raises(RuntimeError, match="blew up"):
        onnx_export.export_engine(out, sources["c2i"], target_options={"config_file": sources["c2i_config"]})
    assert not out.exists() and _leftovers(out.parent) == []


def test_existing_directory_needs_force(sources, tmp_path, capsys, monkeypatch):
    out = tmp_path / "engine"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    _no_graphs(monkeypatch)  # this is about the directory handling
    assert _export_cli(sources, out) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert (out / "manifest.json").read_text() == "{}"
    assert _export_cli(sources, out, "--force") == 0
    assert json.loads((out / "manifest.json").read_text())["schema"] == 2
    assert _leftovers(tmp_path) == []
    # --force never replaces a directory that is not an engine.
    other = tmp_path / "not_an_engine"
    other.mkdir()
    (other / "precious.txt").write_text("keep")
    assert _export_cli(sources, other, "--force") == 2
    assert "not an engine" in capsys.readouterr().err
    assert (other / "precious.txt").read_text() == "keep"


def test_ar_only_engine_says_so(sources, tmp_path, capsys, monkeypatch):
    _no_graphs(monkeypatch)
    assert _export_cli(sources, tmp_path / "ar") == 0
    assert "modes: ar only" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "ar" / "manifest.json").read_text())
    assert manifest["modes"] == ["ar"] and manifest["drafter"] is None and manifest["tree"] is None
    assert set(manifest["graphs"]) == {"condition", "target"}
