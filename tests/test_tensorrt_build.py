"""TensorRT plans from tiny engines' ONNX graphs (TensorRT-RTX builds ahead of time without a
GPU). What a plan holds can only be read back with a GPU; without one the build record's I/O
(read from TensorRT's parsed network) is checked against the manifest the exporter wrote."""
import os
import shutil

import pytest

pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'lantern[tensorrt-rtx]')")

from engines import build_engine, manifest  # noqa: E402
from lantern.export import tensorrt_build as tb  # noqa: E402
from lantern.runtime.errors import LanternError  # noqa: E402

FLAVOR = "tensorrt-rtx"
HAS_GPU = os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


@pytest.fixture(scope="module", params=["fp32", "fp16"])
def engine(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return build_engine(root, "c2i", with_vq=False, extra=["--dtype", request.param])


def _target_call(m, batch, tokens):
    """The target's input shapes for one call (v1 contract), from the manifest."""
    io = m["graphs"]["target"]["io"]
    dim = io["inputs_embeds"]["shape"][2]
    heads, head_dim = io["past_keys_0"]["shape"][1], io["past_keys_0"]["shape"][3]
    past = m["condition"]["cls_token_num"] + m["block_size"]
    shapes = {"inputs_embeds": (batch, tokens, dim), "position_ids": (batch, tokens),
              "attention_mask": (batch, 1, tokens, past + tokens)}
    shapes.update({n: (batch, heads, past, head_dim) for n in m["graphs"]["target"]["inputs"] if n.startswith("past_")})
    return shapes


def _drafter_call(m, images, tokens):
    io = m["graphs"]["drafter"]["io"]
    dim = io["target_hidden"]["shape"][2]
    heads, head_dim = io["past_keys_0"]["shape"][1], io["past_keys_0"]["shape"][3]
    past = m["block_size"] + m["tree"]["nodes"] - 1
    B = 2 * images
    return {"target_hidden": (B, tokens, dim), "input_ids": (B, tokens), "position_ids": (B, tokens),
            "attention_mask": (B, 1, tokens, past + tokens), "past_keys_0": (B, heads, past, head_dim),
            "past_values_0": (B, heads, past, head_dim), "cond_batch": (images,)}


_TRT_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "int64": "int64", "bool": "bool"}


def _assert_io_matches_manifest(record_io, graph_entry):
    """Names, order, dtypes and shapes TensorRT parsed == what the exporter recorded (dynamic
    dims: the same name on inputs; TensorRT leaves outputs' dynamic dims unnamed, -1)."""
    contract = graph_entry["io"]
    assert list(record_io["inputs"]) == graph_entry["inputs"]
    assert list(record_io["outputs"]) == graph_entry["outputs"]
    for kind in ("inputs", "outputs"):
        for name, got in record_io[kind].items():
            want = contract[name]
            assert got["dtype"] == _TRT_DTYPES[want["dtype"]], (name, got, want)
            assert len(got["shape"]) == len(want["shape"]), (name, got, want)
            for g, w in zip(got["shape"], want["shape"]):
                if isinstance(w, int):
                    assert g == w, (name, got, want)
                else:
                    assert g in (w, -1), (name, got, want)


@pytest.mark.parametrize("cc", ["SM89", "SM120"])
def test_target_plan_builds_with_one_profile_per_regime(engine, cc):
    m = manifest(engine)
    regimes = [_target_call(m, 2, 1), _target_call(m, 2, m["tree"]["nodes"])]
    plan, record = tb.build_plan(os.path.join(engine, "target.onnx"), [tb.exact_profile(r) for r in regimes],
                                 flavor=FLAVOR, compute_capabilities=[cc])
    assert len(plan) == record["plan_bytes"] > 0
    assert record["compute_capabilities"] == [cc]
    assert record["tensorrt_version"].startswith("1.")
    assert record["builder"]["strongly_typed"] is True
    _assert_io_matches_manifest(record["io"], m["graphs"]["target"])
    # The graph's float inputs keep the export dtype: strongly typed, no precision flags.
    assert record["io"]["inputs"]["inputs_embeds"]["dtype"] == {"fp32": "float32", "fp16": "float16"}[m["dtype"]]
    assert record["io"]["outputs"]["logits"]["dtype"] == "float32"
    # The profiles as TensorRT holds them: the fixture has 1 class token + 36 image tokens of
    # cache and a 26-node tree (mc_sim_7b_63).
    assert [p["attention_mask"] for p in record["profiles"]] == [
        {"min": [2, 1, 1, 38], "opt": [2, 1, 1, 38], "max": [2, 1, 1, 38]},
        {"min": [2, 1, 26, 63], "opt": [2, 1, 26, 63], "max": [2, 1, 26, 63]}]
    assert record["profiles"][1]["past_values_1"]["opt"] == [2, 2, 37, 8]


def test_network_io_needs_no_build(engine):
    m = manifest(engine)
    _assert_io_matches_manifest(tb.network_io(os.path.join(engine, "drafter.onnx"), flavor=FLAVOR),
                                m["graphs"]["drafter"])


def test_drafter_plan_builds_with_shape_tensor_values(engine):
    """The v1 drafter's cond_batch is a shape tensor: its profile entry holds values."""
    m = manifest(engine)
    regimes = [_drafter_call(m, 1, 6), _drafter_call(m, 1, 4)]
    plan, record = tb.build_plan(os.path.join(engine, "drafter.onnx"), [tb.spanning_profile(regimes)],
                                 flavor=FLAVOR, compute_capabilities=["SM89", "SM120"])
    assert record["io"]["inputs"]["cond_batch"]["shape_tensor"] is True
    assert record["profiles"][0]["cond_batch"] == {"min": [1], "opt": [1], "max": [1]}
    assert record["profiles"][0]["input_ids"] == {"min": [2, 4], "opt": [2, 6], "max": [2, 6]}
    _assert_io_matches_manifest(record["io"], m["graphs"]["drafter"])


def test_profile_helpers():
    a = {"x": (2, 1, 8), "m": (2, 1, 1, 9)}
    b = {"x": (4, 26, 8), "m": (4, 1, 26, 34)}
    assert tb.exact_profile(a) == {"x": ((2, 1, 8),) * 3, "m": ((2, 1, 1, 9),) * 3}
    assert tb.spanning_profile([a, b]) == {"x": ((2, 1, 8), (4, 26, 8), (4, 26, 8)),
                                           "m": ((2, 1, 1, 9), (4, 1, 26, 34), (4, 1, 26, 34))}
    assert tb.spanning_profile([a, b], opt=a)["x"] == ((2, 1, 8), (2, 1, 8), (4, 26, 8))
    with pytest.raises(LanternError, match="rank"):
        tb.spanning_profile([a, {"x": (2, 8), "m": (2, 1, 1, 9)}])


@pytest.mark.parametrize("text,want", [("89", "SM89"), ("8.9", "SM89"), ("sm_120", "SM120"), ("12.0", "SM120"),
                                       (75, "SM75"), ("current", "current")])
def test_compute_capability_spellings(text, want):
    assert tb.normalise_compute_capability(text) == want


def _one_line(err):
    text = str(err.value)
    assert "\n" not in text and text
    return text


def test_broken_onnx_is_one_line_error(engine, tmp_path):
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes((open(os.path.join(engine, "condition.onnx"), "rb").read())[:2000])
    with pytest.raises(LanternError) as err:
        tb.build_plan(truncated, [{}], flavor=FLAVOR, compute_capabilities=["SM89"])
    assert _one_line(err).startswith(f"{truncated}: TensorRT's ONNX parser rejects the graph")

    import onnx
    from onnx import helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu"),
                               helper.make_node("Mystery", ["y"], ["z"], name="strange_node", domain="example.org")],
                              "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [2, 3])])
    unknown = tmp_path / "unknown_op.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("example.org", 1)]),
              unknown)
    with pytest.raises(LanternError) as err:
        tb.build_plan(unknown, [{}], flavor=FLAVOR, compute_capabilities=["SM89"])
    assert "node strange_node (Mystery)" in _one_line(err)

    with pytest.raises(LanternError, match="no such ONNX file"):
        tb.build_plan(tmp_path / "absent.onnx", [{}], flavor=FLAVOR)
    with pytest.raises(LanternError, match="no such ONNX file"):
        tb.network_io(tmp_path / "absent.onnx", flavor=FLAVOR)


def test_bad_profiles_and_targets_are_one_line_errors(engine):
    m = manifest(engine)
    path = os.path.join(engine, "target.onnx")
    call = _target_call(m, 2, 3)
    cases = [
        ([{**tb.exact_profile(call), "bogus": ((1,), (1,), (1,))}], "bogus, not inputs of the graph"),
        ([{k: v for k, v in tb.exact_profile(call).items() if k != "position_ids"}], "no shapes for dynamic input(s) position_ids"),
        ([tb.exact_profile({**call, "inputs_embeds": (2, 3, 7)})], "does not fit its graph shape"),
        ([tb.spanning_profile([call, _target_call(m, 2, 1)], opt=_target_call(m, 2, 5))], "min <= opt <= max"),
        ([], "no optimization profile"),
    ]
    for profiles, message in cases:
        with pytest.raises(LanternError) as err:
            tb.build_plan(path, profiles, flavor=FLAVOR, compute_capabilities=["SM89"])
        assert message in _one_line(err)
    with pytest.raises(LanternError, match="cannot target SM90"):
        tb.build_plan(path, [tb.exact_profile(call)], flavor=FLAVOR, compute_capabilities=["90"])
    with pytest.raises(LanternError, match="timing cache applies to full TensorRT only"):
        tb.build_plan(path, [tb.exact_profile(call)], flavor=FLAVOR, compute_capabilities=["89"], timing_cache="x.cache")


def test_progress_reports_the_builder_phases(engine):
    seen = []
    tb.build_plan(os.path.join(engine, "condition.onnx"), [tb.exact_profile({"class_ids": (2,)})], flavor=FLAVOR,
                  compute_capabilities=["SM89"], progress=lambda phase, done, total: seen.append((phase, done, total)))
    assert seen and seen[0][1] == 0 and seen[-1][1] == seen[-1][2]


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU message; a GPU is present")
def test_reading_a_plan_without_gpu_says_so(engine):
    plan, _ = tb.build_plan(os.path.join(engine, "condition.onnx"), [tb.exact_profile({"class_ids": (2,)})],
                            flavor=FLAVOR, compute_capabilities=["SM89"])
    with pytest.raises(LanternError) as err:
        tb.plan_io(plan, flavor=FLAVOR)
    assert "needs an NVIDIA GPU" in _one_line(err)
    with pytest.raises(LanternError) as err:
        tb.build_plan(os.path.join(engine, "condition.onnx"), [tb.exact_profile({"class_ids": (2,)})],
                      flavor=FLAVOR, compute_capabilities=["current"])
    assert "building for 'current' needs an NVIDIA GPU" in _one_line(err)


@pytest.mark.skipif(not HAS_GPU, reason="reading a plan back needs an NVIDIA GPU (TensorRT cannot deserialize without one)")
def test_plan_io_reads_back_what_was_built(engine):
    m = manifest(engine)
    regimes = [_target_call(m, 2, 1), _target_call(m, 2, m["tree"]["nodes"])]
    plan, record = tb.build_plan(os.path.join(engine, "target.onnx"), [tb.exact_profile(r) for r in regimes],
                                 flavor=FLAVOR, compute_capabilities=["current"])
    io = tb.plan_io(plan, flavor=FLAVOR)
    assert list(io["inputs"]) == m["graphs"]["target"]["inputs"]
    for name, entry in io["inputs"].items():
        assert entry["dtype"] == record["io"]["inputs"][name]["dtype"]
        assert entry["profiles"] == [[list(r[name])] * 3 for r in regimes]
    assert {n: e["dtype"] for n, e in io["outputs"].items()} == {n: e["dtype"] for n, e in record["io"]["outputs"].items()}
