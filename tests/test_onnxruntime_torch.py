"""The onnxruntime-torch backend: the engine's ONNX graphs run by ONNX Runtime as the torch
backend's modules (runtime/backends/onnxruntime_torch.py), so ONNX Runtime gets the whole step on
its device (drafting, acceptance, commits as torch ops on the memory the sessions read and
write). Against the plain ONNX Runtime backend's host step, token for token: greedy over the
modes, sampling, CFG on and off with an interval, batch 1 and 3, c2i, t2i and a forced-token
engine; through a backend that records every host crossing, a device step on the real ONNX
Runtime graphs that moves a few integers per image and nothing that grows with the vocabulary,
the cache or the tree."""
import json
import sys

import numpy as np
import pytest
import torch

from lantern.export.torch_backend import open_onnxruntime_torch_backend
from lantern.runtime.backends import open_backend
from lantern.runtime.backends.onnxruntime_torch import OnnxRuntimeModule
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.manifest import read_manifest
from lantern.tools.crossings import RecordingBackend
from lantern.tools.run_cli import main as run_main
from engines import captions

torch.set_grad_enabled(False)


@pytest.fixture(scope="module")
def c2i(c2i_engine):
    """The plain ONNX Runtime engine (the reference), and a host and a device engine on one
    onnxruntime-torch backend (cases with the same tree and batch reuse the plan and its step)."""
    backend = open_onnxruntime_torch_backend(c2i_engine, threads=2)
    return (Engine(c2i_engine, threads=2), Engine(c2i_engine, backend=backend, step="host"),
            Engine(c2i_engine, backend=backend, step="device"))


CASES = [dict(mode="ar", greedy=True, cfg_scale=4.0, n=3),
         dict(mode="exact", greedy=True, cfg_scale=4.0, cfg_interval=5, n=3),
         dict(mode="lantern", greedy=True, cfg_scale=1.0, delta=0.2, k=8, n=1),
         dict(mode="lantern++", greedy=True, cfg_scale=4.0, lam=3.0, k=8, n=3),
         dict(mode="exact", greedy=False, cfg_scale=3.0, top_k=20, seed=[3, 4, 5], n=3),
         dict(mode="lantern++", greedy=False, cfg_scale=1.0, temperature=0.9, top_p=0.9, lam=3.0, k=8, seed=2, n=1)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['mode']}-{'greedy' if c['greedy'] else 'sampling'}")
def test_both_steps_give_the_onnxruntime_tokens(c2i, case):
    reference, host_engine, device_engine = c2i
    kw = dict(case)
    kw["classes"] = list(range(1, kw.pop("n") + 1))
    want = reference.generate(**kw)
    host, device = host_engine.generate(**kw), device_engine.generate(**kw)
    assert (host.stats["step"], device.stats["step"], device.stats["backend"]) == ("host", "device",
                                                                                    "onnxruntime-torch")
    np.testing.assert_array_equal(host.tokens, want.tokens)
    np.testing.assert_array_equal(device.tokens, want.tokens)
    for key in ("steps_per_image", "mean_accepted_length", "accepted_histogram"):
        assert device.stats[key] == want.stats[key], key
    if kw["mode"] == "lantern++" and kw["greedy"]:
        assert device.stats["mean_accepted_drafts"] > 0  # relaxed acceptance really ran
        alone = device_engine.generate(**{**kw, "classes": [2]})  # batch invariance
        np.testing.assert_array_equal(alone.tokens[0], device.tokens[1])


def test_text_conditioned_and_forced_token_engines(t2i_engine, chameleon_engines):
    caption, mask = captions(2)
    lumina = chameleon_engines["lumina_mgpt"]
    for directory, kw in [(t2i_engine, dict(caption=caption, caption_mask=mask, cfg_scale=3.0)),
                          (lumina, dict(prompt=["a red cat", "a dog on a mat"], grid=(4, 4), cfg_scale=3.0))]:
        backend = open_onnxruntime_torch_backend(directory, threads=2)
        for extra in (dict(greedy=True), dict(greedy=False, top_k=50, seed=[5, 9])):
            args = dict(mode="lantern++", lam=4.0, k=8, **kw, **extra)
            want = Engine(directory, threads=2).generate(**args)
            device = Engine(directory, backend=backend, step="device").generate(**args)
            np.testing.assert_array_equal(device.body, want.body, err_msg=f"{directory} {extra}")
            assert device.stats["mean_accepted_drafts"] > 0


def test_the_device_step_moves_a_few_integers_per_image(c2i_engine):
    """Per step on the real ONNX Runtime graphs: one read of the report (accepted, depth + 1
    tokens, invalid; int64 per image) and its one synchronisation, nothing written up, one launch
    per call of the step (engine calls and phases); the host step reads the whole verification
    logits every step."""
    backend = RecordingBackend(open_onnxruntime_torch_backend(c2i_engine, threads=2))
    kw = dict(mode="lantern++", lam=3.0, k=8, greedy=True, cfg_scale=4.0, classes=[1, 2, 3])
    engine = Engine(c2i_engine, backend=backend, step="device")
    device = engine.generate(**kw)
    events = backend.events[backend.start:]
    depth, vocab, nodes = engine.tree.depth, engine.manifest.vocabulary.size, engine.tree.num_nodes
    assert {kind for kind, _ in events} == {"to_host", "sync", "launch"}
    reads = [size for kind, size in events if kind == "to_host"]
    assert reads == [3 * (depth + 3) * 8] * len(reads) and len(reads) >= device.stats["steps"]
    calls = (depth + 1) + (depth + 2)  # draft0..draft{D-1}, verify; begin, level1..level{D}, accept
    assert [kind for kind, _ in events] == (["launch"] * calls + ["to_host", "sync"]) * len(reads)

    start = len(backend.events)
    host = Engine(c2i_engine, backend=backend, step="host").generate(**kw)
    host_reads = [size for kind, size in backend.events[start:] if kind == "to_host"]
    assert max(host_reads) >= 6 * nodes * vocab * 4  # [rows, nodes, vocabulary] float32
    np.testing.assert_array_equal(device.tokens, host.tokens)


def test_a_binding_is_made_once_per_call_and_outputs_stay_put(c2i):
    """The device step's calls keep their IOBindings and output tensors from generation to
    generation of a plan (the calls chain through buffers that stay where the next call reads
    them); the host loop's prefill feeds fresh tensors (CPU: its numpy buffers wrapped per call),
    so it binds anew; a strided input is made dense; a tensor at a reused address is another call."""
    _, _, device_engine = c2i
    backend = device_engine.backend
    kw = dict(mode="lantern++", lam=3.0, k=8, greedy=True, cfg_scale=4.0)
    device_engine.generate(classes=[1, 2], **kw)
    kept = {name: dict(module.bindings) for name, module in backend.modules.items()}
    device_engine.generate(classes=[3, 4], **kw)  # the same plan and step: the same tensors
    tree = device_engine.tree
    for name, calls in (("drafter", tree.depth), ("target", 2)):  # draft0 .. draft{D-1}; prefill, verify
        now = backend.modules[name].bindings
        assert len(now) == len(kept[name]) == calls
        still = [entry for b, entry in now.items() if entry is kept[name].get(b)]
        if name == "target":  # verify kept (its input_ids: the step's own tensor), the prefill bound anew
            assert len(still) == 1 and still[0].args[0]().shape[1] == tree.num_nodes
        else:
            assert len(still) == calls
    image = device_engine.manifest.image
    codes = torch.randint(0, device_engine.manifest.vocabulary.codes, (1, image.grid_height, image.grid_width))
    dense = backend.modules["vq_decoder"](codes)[0].clone()
    strided = codes.transpose(1, 2).contiguous().transpose(1, 2)  # the same codes, not dense
    assert not strided.is_contiguous()
    strided = backend.modules["vq_decoder"](strided)[0]
    np.testing.assert_array_equal(strided.numpy(), dense.numpy())
    # another tensor at the same address (a temporary freed and its memory reused) is another
    # call: its outputs are its own, and the first call's stay as they were
    decoder, other = backend.modules["vq_decoder"], torch.flip(codes, dims=(2,))
    first = decoder(codes)[0]
    want_first, want_other = first.clone(), decoder(other.clone())[0].clone()
    same_memory = codes.view_as(codes)
    same_memory.copy_(other)
    second = decoder(same_memory)[0]
    assert second is not first
    np.testing.assert_array_equal(first.numpy(), want_first.numpy())
    np.testing.assert_array_equal(second.numpy(), want_other.numpy())


def test_refusals_and_the_command_line(c2i_engine, tmp_path, capsys, monkeypatch):
    manifest = read_manifest(c2i_engine)
    with pytest.raises(LanternError, match="unknown device 'tpu'"):
        open_onnxruntime_torch_backend(c2i_engine, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(LanternError, match="this PyTorch has no CUDA device"):
            open_onnxruntime_torch_backend(c2i_engine, device="cuda")
    bare = open_backend("onnxruntime-torch", c2i_engine, manifest, threads=2)  # the registry: no acceptance
    assert isinstance(bare.modules["target"], OnnxRuntimeModule) and bare.default_step == "host"
    with pytest.raises(LanternError, match="without the step.s modules.*open_onnxruntime_torch_backend"):
        Engine(c2i_engine, backend=bare, step="device").generate(mode="exact", greedy=True, classes=[1])
    with monkeypatch.context() as patch:  # torch (lantern.export) missing: one line, no traceback
        patch.setitem(sys.modules, "lantern.export.torch_backend", None)
        assert run_main(["generate", c2i_engine, "--backend", "onnxruntime-torch", "--classes", "1",
                         "--out", str(tmp_path / "none")]) == 2
        err = capsys.readouterr().err
        assert "--backend onnxruntime-torch needs PyTorch" in err and "Traceback" not in err
        assert not (tmp_path / "none").exists()
    out = tmp_path / "run"
    assert run_main(["generate", c2i_engine, "--backend", "onnxruntime-torch", "--step", "device", "--mode", "lantern++",
                     "--lam", "3", "--k", "8", "--greedy", "--classes", "1,2", "--cfg-scale", "4", "--threads", "2",
                     "--out", str(out)]) == 0
    assert "device step" in capsys.readouterr().out
    stats = json.loads((out / "stats.json").read_text())
    assert (stats["step"], stats["backend"]) == ("device", "onnxruntime-torch")
    want = Engine(c2i_engine, threads=2).generate(mode="lantern++", lam=3.0, k=8, greedy=True, cfg_scale=4.0,
                                                  classes=[1, 2])
    np.testing.assert_array_equal(np.load(out / "tokens.npy"), want.tokens)


def test_gpu_checks_section_logic_on_the_cpu(c2i_engine):
    """gpu_check's onnxruntime-torch-cuda section is step_timing over this backend: on the CPU
    both step paths run and give the same greedy steps."""
    from lantern.tools.bench.device_step import step_timing

    backend = open_onnxruntime_torch_backend(c2i_engine, threads=2)
    data = step_timing(c2i_engine, modes=("ar", "lantern++"), batches=(1,), warmup=False, backend=backend)
    assert (data["backend"], data["device"], data["cuda_graphs"]) == ("onnxruntime-torch", "cpu", False)
    runs = {(r["step"], r["mode"]): r for r in data["runs"]}
    assert set(runs) == {(p, m) for p in ("host", "device") for m in ("ar", "lantern++")}
    assert runs["host", "lantern++"]["steps"] == runs["device", "lantern++"]["steps"]
    assert runs["device", "lantern++"]["step_in_ar_steps"] > 0
