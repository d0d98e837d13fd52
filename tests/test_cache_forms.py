"""The cache forms of the graphs (lantern.export.cache_forms): eager torch, ONNX Runtime and a numpy
reference agree; ONNX Runtime updates a bound cache in place; TensorRT-RTX builds them."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from lantern.export import cache_forms as ff
from lantern.runtime.errors import LanternError

B, H, HKV, T, P, HD = 2, 4, 2, 3, 12, 16  # grouped-query heads; TensorRT fuses head dims >= 16
WRITE = np.array([5, 2])  # per-row committed lengths: this step's tokens go to slots WRITE[b]..
STEP_INPUTS = ["q", "k", "v", "cache_k", "cache_v", "write_index", "mask"]
STEP_OUTPUTS = ["out", "present_k", "present_v"]
# Batch and new tokens stay dynamic; the cache capacity P must be static for TensorRT.
STEP_DIMS = [{0: "B", 2: "T"}] * 3 + [{0: "B"}] * 3 + [{0: "B", 2: "T"}]
TOLERANCE = {"fp32": 1e-5, "fp16": 4e-3}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _mask():
    """Row b sees its committed slots (but not slot 0 in row 1) and, causally, the T slots it
    writes; the rest of the cache is masked."""
    mask = np.zeros((B, 1, T, P), dtype=bool)
    for b in range(B):
        mask[b, :, :, :WRITE[b]] = True
        mask[b, :, :, WRITE[b]:WRITE[b] + T] = np.tril(np.ones((T, T), dtype=bool))
    mask[1, :, :, 0] = False
    return mask


def _step_inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, T, HD), (B, HKV, T, HD), (B, HKV, T, HD), (B, HKV, P, HD), (B, HKV, P, HD)]
    floats = [torch.randn(*s, generator=g).to(DTYPES[dtype]) for s in shapes]
    return (*floats, torch.from_numpy(WRITE), torch.from_numpy(_mask()))


def _reference(q, k, v, cache_k, cache_v, write_index, mask):
    """numpy float64: write k/v at the rows' slots, then masked softmax attention with each
    query head reading KV head h // (H / HKV)."""
    q, k, v, ck, cv = (np.asarray(t, dtype=np.float64) for t in (q, k, v, cache_k, cache_v))
    ck, cv = ck.copy(), cv.copy()
    for b, w in enumerate(write_index):
        ck[b, :, w:w + T], cv[b, :, w:w + T] = k[b], v[b]
    kv_head = np.arange(H) // (H // HKV)
    scores = q @ ck[:, kv_head].transpose(0, 1, 3, 2) / np.sqrt(HD)
    scores = np.where(mask, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return probs @ cv[:, kv_head], ck, cv


@pytest.fixture(scope="module")
def step_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache-forms")
    return {dtype: ff.export(ff.AttentionStep(), _step_inputs(dtype), str(root / f"step_{dtype}.onnx"), STEP_INPUTS,
                             STEP_OUTPUTS, STEP_DIMS) for dtype in ("fp32", "fp16", "bf16")}


def _numpy(t):
    return t.float().numpy() if isinstance(t, torch.Tensor) and t.is_floating_point() else np.asarray(t)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_eager_inplace_form_matches_reference_and_plain_form(dtype):
    inputs = _step_inputs(dtype)
    out, cache_k, cache_v = ff.AttentionStep()(*inputs)
    want_out, want_k, want_v = _reference(*(_numpy(t) for t in inputs))
    assert np.array_equal(_numpy(cache_k), want_k) and np.array_equal(_numpy(cache_v), want_v)
    assert np.abs(_numpy(out) - want_out).max() < TOLERANCE[dtype]
    # The engines' current form on the same data: past = the first 5 slots (each row masks what
    # it has not committed), new = this step's tokens, attended causally.
    q, k, v, ck, cv, _, _ = inputs
    past = int(WRITE.max())
    plain_mask = np.zeros((B, 1, T, past + T), dtype=bool)
    for b, w in enumerate(WRITE):
        plain_mask[b, :, :, :w] = _mask()[b, :, :, :w]
        plain_mask[b, :, :, past:] = np.tril(np.ones((T, T), dtype=bool))
    plain, _, _ = ff.PlainAttentionStep()(q, k, v, ck[:, :, :past].contiguous(), cv[:, :, :past].contiguous(),
                                          torch.from_numpy(plain_mask))
    assert np.abs(_numpy(plain) - _numpy(out)).max() < TOLERANCE[dtype]


def test_export_emits_the_single_fused_ops(step_files):
    model = onnx.load(step_files["fp16"])
    assert [n.op_type for n in model.graph.node] == ["TensorScatter", "TensorScatter", "Attention"]
    assert {o.domain: o.version for o in model.opset_import}[""] == 24
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims["cache_k"] == ["B", HKV, P, HD] and dims["mask"] == ["B", 1, "T", P]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_onnxruntime_runs_the_cache_forms(step_files, dtype):
    inputs = [t.numpy() for t in _step_inputs(dtype)]
    session = ort.InferenceSession(step_files[dtype], providers=["CPUExecutionProvider"])
    out, cache_k, cache_v = session.run(None, dict(zip(STEP_INPUTS, inputs)))
    want_out, want_k, want_v = _reference(*inputs)
    assert np.array_equal(cache_k, want_k) and np.array_equal(cache_v, want_v)
    assert np.abs(out.astype(np.float64) - want_out).max() < TOLERANCE[dtype]
    eager, _, _ = ff.AttentionStep()(*_step_inputs(dtype))
    assert np.abs(out.astype(np.float32) - _numpy(eager)).max() < TOLERANCE[dtype]


def test_onnxruntime_updates_a_bound_cache_in_place(step_files, capfd):
    """Binding one OrtValue as TensorScatter's input and output makes ONNX Runtime write into
    it (without it, it copies the cache and says so on stderr)."""
    inputs = [t.numpy() for t in _step_inputs("fp32")]
    feeds = dict(zip(STEP_INPUTS, inputs))
    session = ort.InferenceSession(step_files["fp32"], providers=["CPUExecutionProvider"])
    buffers = {"cache_k": feeds["cache_k"].copy(), "cache_v": feeds["cache_v"].copy()}
    binding = session.io_binding()
    for name in ("q", "k", "v", "write_index", "mask"):
        binding.bind_cpu_input(name, feeds[name])
    for cache, present in (("cache_k", "present_k"), ("cache_v", "present_v")):
        value = ort.OrtValue.ortvalue_from_numpy(buffers[cache])  # shares the numpy buffer
        binding.bind_ortvalue_input(cache, value)
        binding.bind_ortvalue_output(present, value)
    binding.bind_output("out")
    session.run_with_iobinding(binding)
    _, want_k, want_v = _reference(*inputs)
    assert np.array_equal(buffers["cache_k"], want_k) and np.array_equal(buffers["cache_v"], want_v)
    assert "in-place optimization not activated" not in capfd.readouterr().err

    session.run(None, feeds)  # unbound: ONNX Runtime copies, and the inputs stay as they were
    assert "in-place optimization not activated" in capfd.readouterr().err
    assert np.array_equal(feeds["cache_k"], inputs[3])


LAYERS, ACCEPT = 2, 3
CACHE_NAMES = [f"cache_{kind}_{i}" for kind in ("keys", "values") for i in range(LAYERS)]
SRC = np.array([[7, 9, 10], [3, 3, 3]])  # row 0: nodes at slots 7, 9, 10 go to 6..8 (overlap); row 1: padding
DST = np.array([6, 3])


def _commit_reference(caches):
    out = [c.copy() for c in caches]
    for c in out:
        for b in range(B):
            c[b, :, DST[b]:DST[b] + ACCEPT] = c[b][:, SRC[b]].copy()
    return out


@pytest.fixture(scope="module")
def commit_file(tmp_path_factory):
    caches = [torch.randn(B, HKV, P, HD, dtype=torch.float16) for _ in CACHE_NAMES]
    path = str(tmp_path_factory.mktemp("commit") / "commit.onnx")
    return ff.export(ff.CommitGraph(), (torch.from_numpy(SRC), torch.from_numpy(DST), *caches), path,
                     ["src_slots", "write_index"] + CACHE_NAMES, [f"{n}_out" for n in CACHE_NAMES],
                     [{0: "B", 1: "A"}, {0: "B"}] + [{0: "B"}] * len(CACHE_NAMES))


def test_commit_graph_moves_accepted_entries_in_place(commit_file):
    rng = np.random.default_rng(3)
    caches = [rng.standard_normal((B, HKV, P, HD)).astype(np.float16) for _ in CACHE_NAMES]
    want = _commit_reference(caches)
    eager = ff.CommitGraph()(torch.from_numpy(SRC), torch.from_numpy(DST), *(torch.from_numpy(c) for c in caches))
    assert all(np.array_equal(e.numpy(), w) for e, w in zip(eager, want))

    session = ort.InferenceSession(commit_file, providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    binding.bind_cpu_input("src_slots", SRC)
    binding.bind_cpu_input("write_index", DST)
    buffers = [c.copy() for c in caches]
    for name, buffer in zip(CACHE_NAMES, buffers):
        value = ort.OrtValue.ortvalue_from_numpy(buffer)
        binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(f"{name}_out", value)
    session.run_with_iobinding(binding)
    assert all(np.array_equal(b, w) for b, w in zip(buffers, want))
    assert [n.op_type for n in onnx.load(commit_file).graph.node].count("TensorScatter") == len(CACHE_NAMES)


# ---------------------------------------------------------------------------------------------
# TensorRT-RTX (builds without a GPU)


def _step_profile():
    from lantern.export.tensorrt_build import exact_profile

    return [exact_profile({"q": (B, H, T, HD), "k": (B, HKV, T, HD), "v": (B, HKV, T, HD), "cache_k": (B, HKV, P, HD),
                           "cache_v": (B, HKV, P, HD), "write_index": (B,), "mask": (B, 1, T, P)})]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("cc", ["SM89", "SM120"])
def test_tensorrt_rtx_builds_the_cache_forms(step_files, dtype, cc):
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'lantern[tensorrt-rtx]')")
    from lantern.export.tensorrt_build import build_plan

    plan, record = build_plan(step_files[dtype], _step_profile(), flavor="tensorrt-rtx", compute_capabilities=[cc])
    assert record["fused_layers"] == {"attention": 1, "kv_cache_update": 2}
    assert len(plan) > 0


def test_tensorrt_rtx_fp32_attention_needs_decomposable(step_files):
    """TensorRT-RTX has no fused fp32 attention kernel; marked decomposable it builds."""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'lantern[tensorrt-rtx]')")
    from lantern.export.tensorrt_build import build_plan

    with pytest.raises(LanternError, match="not supported by a dedicated kernel") as err:
        build_plan(step_files["fp32"], _step_profile(), flavor="tensorrt-rtx", compute_capabilities=["SM89"])
    assert "\n" not in str(err.value)
    _, record = build_plan(step_files["fp32"], _step_profile(), flavor="tensorrt-rtx", compute_capabilities=["SM89"],
                           decomposable_attention=True)
    assert record["builder"]["decomposable_attention"] is True


def test_tensorrt_rtx_needs_a_static_cache_length(tmp_path):
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'lantern[tensorrt-rtx]')")
    from lantern.export.tensorrt_build import build_plan

    dynamic_p = [{0: "B", 2: "T"}] * 3 + [{0: "B", 2: "P"}] * 2 + [{0: "B"}, {0: "B", 2: "T", 3: "P"}]
    path = ff.export(ff.AttentionStep(), _step_inputs("fp16"), str(tmp_path / "dynamic_p.onnx"), STEP_INPUTS,
                     STEP_OUTPUTS, dynamic_p)
    with pytest.raises(LanternError, match="must have a static sequence length dimension"):
        build_plan(path, _step_profile(), flavor="tensorrt-rtx", compute_capabilities=["SM89"])


@pytest.mark.parametrize("cc", ["SM89", "SM120"])
def test_tensorrt_rtx_builds_the_commit_graph(commit_file, cc):
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'lantern[tensorrt-rtx]')")
    from lantern.export.tensorrt_build import build_plan, exact_profile

    shapes = {"src_slots": (B, ACCEPT), "write_index": (B,), **{n: (B, HKV, P, HD) for n in CACHE_NAMES}}
    _, record = build_plan(commit_file, [exact_profile(shapes)], flavor="tensorrt-rtx", compute_capabilities=[cc])
    assert record["fused_layers"]["kv_cache_update"] == len(CACHE_NAMES)
