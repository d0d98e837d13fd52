"""Deferred weights (lantern.export.streaming): a Chameleon target written tensor by tensor and
exported with its large tensors left on disk until each is written. The export must hold no
large tensor before it writes it, and write exactly the weights (and graph) an export of the
loaded model writes. Tiny Anole shapes: the 65,536 x 64 embedding and lm_head are the deferred
tensors (lm_head through the Transpose the optimizer would otherwise fold in memory)."""
import hashlib
import os

import onnx
import onnx.numpy_helper
import pytest
import torch

from lantern.export import chameleon, chameleon_checkpoints as ck
from lantern.export.graph_export import export_graph
from lantern.export.onnx_export import DTYPE_NAMES
from lantern.export.streaming import DEFER_ELEMENTS, DeferredWeights
from lantern.runtime.contracts import resolved_io
from lantern.runtime.errors import LanternError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("streamed") / "target"
    ck.save_random_target(ck.tiny_config(num_hidden_layers=1), path, seed=5)
    return path


def _export_target(model, path, dtype, deferred=None):
    c = model.config
    contract, module = chameleon.graph_modules(model)["target"]
    dims = {"L": c.num_hidden_layers, "H": c.num_key_value_heads, "hd": c.head_dim, "D": c.hidden_size,
            "V": c.vocab_size}
    export_graph(module, resolved_io(contract, dims, DTYPE_NAMES[dtype], layers=c.num_hidden_layers), str(path),
                 deferred=deferred)
    graph = onnx.load(str(path)).graph  # external data loaded from beside it
    weights = sorted((tuple(t.dims), t.data_type, hashlib.sha256(onnx.numpy_helper.to_array(t).tobytes()).hexdigest())
                     for t in graph.initializer)
    return sorted(n.op_type for n in graph.node), weights


@pytest.mark.parametrize("dtype", ["bf16"])  # bf16 goes through its uint16 bits; fp16/fp32 as numpy (every Chameleon engine test exports this way)
def test_deferred_export_writes_what_the_loaded_model_exports(checkpoint, tmp_path, dtype):
    deferred = DeferredWeights()
    lazy, _ = ck.load_target(checkpoint, defer=(deferred, getattr(torch, DTYPE_NAMES[dtype])))
    assert len(deferred) == 2  # embed_tokens and lm_head; the layer weights are below DEFER_ELEMENTS
    for p in lazy.parameters():
        if p.numel() >= DEFER_ELEMENTS:
            assert p.untyped_storage().nbytes() == p.element_size()  # a placeholder: one element in memory
    loaded, _ = ck.load_target(checkpoint)
    loaded.to(getattr(torch, DTYPE_NAMES[dtype]))
    streamed_ops, streamed = _export_target(lazy, tmp_path / "streamed.onnx", dtype, deferred)
    ops, weights = _export_target(loaded, tmp_path / "loaded.onnx", dtype)
    assert streamed_ops == ops
    assert streamed == weights
    head = loaded.lm_head.weight.detach()
    digest = hashlib.sha256(head.t().contiguous().view(torch.uint16).numpy().tobytes()).hexdigest()
    assert any(w[2] == digest for w in streamed)  # the transposed head, folded lazily


def test_a_placeholder_is_never_computed_with_and_loads_are_checked():
    deferred = DeferredWeights()
    p = deferred.placeholder((3, 4), torch.float16, lambda: torch.ones(3, 5))
    assert deferred.load_of(p) is not None and deferred.load_of(torch.zeros(3, 4)) is None
    with pytest.raises(RuntimeError, match="shape"):
        deferred.materialize(p)


def test_write_safetensors_matches_the_library_reader(tmp_path):
    from safetensors.torch import load_file

    shapes = {"b": (2, 3), "a": (5,), "empty": (0, 4)}
    values = {k: torch.randn(s) for k, s in shapes.items()}
    ck.write_safetensors(str(tmp_path / "x.safetensors"), shapes, torch.bfloat16, lambda i, k: values[k])
    back = load_file(str(tmp_path / "x.safetensors"))
    assert sorted(back) == sorted(shapes)
    for k in shapes:
        assert torch.equal(back[k], values[k].bfloat16())


def test_a_truncated_deferred_checkpoint_is_one_error_line(checkpoint, tmp_path):
    import shutil

    bad = tmp_path / "target"
    shutil.copytree(checkpoint, bad)
    weights = bad / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(LanternError, match="unreadable"):
        ck.load_target(bad, defer=(DeferredWeights(), torch.float16))


def test_an_export_the_disk_cannot_hold_is_refused_before_writing(checkpoint, tmp_path, monkeypatch):
    import shutil

    from lantern.export.onnx_export import export_engine

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))  # 1 MiB free
    with pytest.raises(LanternError, match=r"need about 0\.\d GiB of disk .* 0\.0 GiB is free"):
        export_engine(tmp_path / "engines" / "e", checkpoint, dtype="fp16")
    assert not (tmp_path / "engines").exists()
