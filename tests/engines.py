"""Tiny engine directories exported through the real CLI from checkpoints in the real formats."""
import json
import os
import pathlib

import numpy as np
import torch

from lantern.export import checkpoints, cli, vq
from tiny import imitate_target, OLD_STD, PEAKED_STD, tiny_chameleon_target, tiny_drafter, tiny_target


def tiny_vq(vocab, seed=0):
    torch.manual_seed(seed)
    config = vq.VQConfig(codebook_size=vocab, codebook_embed_dim=8, z_channels=32, ch=32, num_res_blocks=1,
                         encoder_ch_mult=(1, 1, 2), decoder_ch_mult=(1, 1, 2))
    return vq.VQModel(config).eval()


def build_engine(root, model_type="c2i", tree="mc_sim_7b_63", drafter=True, with_vq=True, block_size=36,
                 vocab=64, extra=(), peaked=True, step_graphs=True):
    """Write a tiny target (+ drafter, VQ) to disk and export it. Returns the engine directory.
    c2i targets are written as LlamaGen .pt files with a config JSON, t2i targets in LANTERN's
    Hugging Face layout, so the session's engines go through both loaders. peaked=False: the
    near-uniform models before issue 30 (tests/tiny.py), which tests/data/regression_v1 was made on.
    step_graphs: add the step graphs of its default tree and AR (add_step_graphs)."""
    root = str(root)
    target = tiny_target(model_type, std=PEAKED_STD if peaked else OLD_STD, n_kv_head=2, block_size=block_size,
                         vocab_size=vocab)
    src = os.path.join(root, f"src-{model_type}")
    os.makedirs(src, exist_ok=True)
    out = os.path.join(root, f"engine-{model_type}")
    if model_type == "c2i":
        a = target.args
        config = os.path.join(src, "config.json")
        with open(config, "w") as f:
            json.dump({k: getattr(a, k) for k in ("dim", "n_layer", "n_head", "n_kv_head", "vocab_size", "num_classes",
                                                   "block_size", "multiple_of", "cls_token_num", "model_type")}, f)
        checkpoints.save_llamagen_pt(target, os.path.join(src, "c2i.pt"))
        argv = ["onnx", "--target", os.path.join(src, "c2i.pt"), "--config", config, "--out", out]
    else:
        checkpoints.save_hf_target(target, os.path.join(src, "target"))
        argv = ["onnx", "--target", os.path.join(src, "target"), "--out", out]
    if drafter:
        checkpoints.save_drafter(tiny_drafter(target, imitate=peaked), os.path.join(src, "drafter"))
        argv += ["--drafter", os.path.join(src, "drafter"), "--tree", tree, "--candidates", "16"]
    if with_vq:
        vq.save_vq(tiny_vq(vocab), os.path.join(src, "vq.pt"))
        argv += ["--vq", os.path.join(src, "vq.pt")]
    assert cli.main(argv + ["--no-progress"] + list(extra)) == 0
    if step_graphs:
        add_step_graphs(out)
    return out


def add_step_graphs(directory):
    """The step graphs of the engine's default tree and AR (`lantern-export accept`), as the
    demo has them: ONNX Runtime's default step runs them."""
    from lantern.export import accept_engine

    accept_engine.add_step_graphs(directory)


def export_like(engine, out, *extra):
    """The checkpoints `engine` was exported from, exported again through the CLI with the same
    tree, candidates and neighbors plus `extra` options (e.g. --attention inplace): an engine of
    the same weights in another form. Returns its directory."""
    assert cli.main(export_argv(engine, out, *extra)) == 0
    return str(out)


def export_argv(engine, out, *extra):
    """`lantern-export` arguments that export `engine`'s checkpoints again (see export_like)."""
    m = manifest(engine)
    src = m["sources"]
    argv = ["onnx", "--target", src["target"]["path"], "--out", str(out), "--no-progress"]
    if src["target"].get("options", {}).get("config_file"):
        argv += ["--config", src["target"]["options"]["config_file"]]
    if "drafter" in src:
        argv += ["--drafter", src["drafter"]["path"], "--tree", m["tree"]["name"], "--candidates", str(m["candidates"])]
    if "vq" in src:
        argv += ["--vq", src["vq"]["path"], "--neighbors-k", str(m["neighbors"]["k"])]
    return argv + list(extra)


def build_chameleon_engines(root, vocab=9400):
    """Tiny Anole (Hugging Face layout) and Lumina-mGPT (xllmx) engines with LANTERN drafters and
    a Meta-layout VQ-GAN (text tokenizer beside it), exported through the CLI: {family: directory}.
    The vocabulary keeps Chameleon's layout: image tokens 4..8195, then the prompts' special ids."""
    from lantern.export import chameleon as ch
    from lantern.export import chameleon_checkpoints as ck
    from lantern.export import chameleon_vq as cvq

    vq_model = cvq.init_random(cvq.ChameleonVQ(cvq.tiny_config()), seed=4).eval()
    cvq.save_vq(vq_model, root / "vq")
    ck.save_text_tokenizer(root / "vq" / "text_tokenizer.json", vocab_size=vocab)
    out = {}
    for family, save in (("anole", ck.save_hf_anole), ("lumina_mgpt", ck.save_xllmx_lumina)):
        config = ck.tiny_config(family=family, num_key_value_heads=2, vocab_size=vocab)
        target = tiny_chameleon_target(config, seed=0)
        drafter = imitate_target(ch.init_random(ch.ChameleonDrafter(ck.tiny_drafter_config(config)), seed=1).eval(),
                                 target)
        if family == "lumina_mgpt":
            target, drafter = ck.tie_qk_norm_rows(target), ck.tie_qk_norm_rows(drafter)
        save(target, root / family)
        ck.save_drafter(drafter, root / f"{family}_drafter")
        argv = ["onnx", "--target", str(root / family), "--drafter", str(root / f"{family}_drafter"),
                "--vq", str(root / "vq"), "--tree", "mc_sim_7b_63", "--candidates", "16", "--neighbors-k", "16",
                "--out", str(root / f"engine-{family}"), "--no-progress"]
        assert cli.main(argv) == 0
        out[family] = str(root / f"engine-{family}")
    return out


def captions(n, cls=6, dim=24, seed=1):
    rng = np.random.default_rng(seed)
    mask = np.ones((n, cls), dtype=bool)
    for i in range(n):
        mask[i, : i % 3] = False  # left padding
    return rng.normal(size=(n, cls, dim)).astype(np.float32), mask


def manifest(directory):
    with open(os.path.join(directory, "manifest.json")) as f:
        return json.load(f)


def edit_manifest(directory, change):
    """Rewrite an engine's manifest.json through change(data) (hashes not updated: what a hand or
    an attacker would do)."""
    data = manifest(directory)
    change(data)
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump(data, f)


def strike_drafter(directory):
    """Make an engine copy AR-only in place: its drafter, tree, neighbors and VQ decoder struck
    from the manifest and their files removed (the engine an AR-only export gives, without an
    export)."""
    directory = pathlib.Path(directory)
    m = manifest(directory)
    for key in ("drafter", "drafter_config", "tree", "candidates", "neighbors", "vq"):
        m[key] = None
    del m["graphs"]["drafter"], m["graphs"]["vq_decoder"]
    for name in [n for n in m["files"] if n.split(".")[0] in ("drafter", "vq_decoder", "neighbors")]:
        del m["files"][name]
        os.remove(directory / name)
    steps = m.get("step_graphs", {})
    for tree in [t for t, e in steps.items() if e["tree"]["paths"]]:  # AR's step graphs stay
        for name in {*steps[tree]["greedy"].values(), *steps[tree]["sampling"].values()}:
            del m["files"][name]
            os.remove(directory / name)
        del steps[tree]
    m["modes"], m["image"]["pixels"] = ["ar"], None
    m["sources"] = {"target": m["sources"]["target"]}
    (directory / "manifest.json").write_text(json.dumps(m))
    return directory


# ops that read a device value on the host (item, a bool of a tensor, equal), whose output shape
# depends on the data (nonzero, masked_select, unique), or that make a tensor of Python data
# (lift_fresh: torch.tensor(...), an index list x[:, [0, 2]], which on CUDA is a copy up from
# pageable memory): on CUDA each is a synchronisation, and inside stream capture an error, so a
# step that calls one cannot be one CUDA graph
HOST_READING_OPS = {"aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::nonzero",
                    "aten::masked_select", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
                    "aten::lift_fresh", "aten::lift_fresh_copy"}


def host_reads(fn):
    """{op: count} of HOST_READING_OPS that fn() dispatches (torch's dispatcher sees every op,
    on any device: the CPU shows what CUDA capture would refuse), and of the Tensor methods
    that hand a tensor to the host (numpy, tolist, cpu)."""
    import collections

    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    to_host = {torch.Tensor.numpy: "Tensor.numpy", torch.Tensor.tolist: "Tensor.tolist", torch.Tensor.cpu: "Tensor.cpu"}

    class Methods(TorchFunctionMode):
        def __init__(self, seen):
            super().__init__()
            self.seen = seen

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in to_host:
                self.seen[to_host[func]] += 1
            return func(*args, **(kwargs or {}))

    class Probe(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name in HOST_READING_OPS:
                self.seen[func._schema.name] += 1
            return func(*args, **(kwargs or {}))

    with torch.inference_mode(), Probe() as probe, Methods(probe.seen):
        fn()
    return dict(probe.seen)


class CpuGraph:
    """A CUDA graph's semantics on the CPU, for the device step's tests: construction records
    the ops fn() dispatches and then undoes their writes (capture runs nothing on the GPU),
    replay() runs the recorded ops again on the same tensors, writing each result where the
    recorded one lives (a graph's memory is fixed at capture), with every Python value baked in
    as it was at capture. A step that reads anything from Python state per step, or allocates
    what the next step reads anew, replays wrong here as it would on a GPU."""

    def __init__(self, fn):
        from torch.utils._python_dispatch import TorchDispatchMode

        ops, saved = [], []

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                for index, argument in enumerate(func._schema.arguments):
                    if argument.alias_info is not None and argument.alias_info.is_write:
                        target = args[index] if index < len(args) else kwargs.get(argument.name)
                        if isinstance(target, torch.Tensor):
                            saved.append((target, target.clone()))
                out = func(*args, **kwargs)
                ops.append((func, args, kwargs, out))
                return out

        with torch.inference_mode():
            with Record():
                fn()
            for tensor, before in reversed(saved):
                tensor.copy_(before)
        self.ops = ops

    @staticmethod
    def _assign(recorded, new):
        if isinstance(recorded, torch.Tensor):
            if recorded.data_ptr() != new.data_ptr():  # else the same view of the same memory, made again
                recorded.copy_(new)
        elif isinstance(recorded, (tuple, list)):
            for r, n in zip(recorded, new):
                CpuGraph._assign(r, n)

    def replay(self):
        with torch.inference_mode():
            for func, args, kwargs, recorded in self.ops:
                self._assign(recorded, func(*args, **kwargs))


def capture_steps_on_cpu(monkeypatch):
    """Every CPU torch backend made from here on runs its device step as on CUDA with
    cuda_graphs: TorchBackend.run_all runs a step's call list eagerly once, then captures it
    (_capture_step) as a CpuGraph of `for call in calls: backend.run(call)`, replayed from then
    on; an op in it that stream capture refuses (host_reads) fails the test. Each backend counts its runs in `step_runs`: {(id(calls), "eager" or "replay"): n}."""
    import collections

    from lantern.runtime.backends.torch import TorchBackend

    init, run_all = TorchBackend.__init__, TorchBackend.run_all

    def capturing(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.cuda_graphs = True
        self.step_runs = collections.Counter()

    def counting(self, calls):
        entry = self._step_graphs.get(id(calls))
        self.step_runs[id(calls), "replay" if entry is not None and entry[1] is not None else "eager"] += 1
        return run_all(self, calls)

    def capture(self, calls):
        def step():
            for call in calls:
                self.run(call)
        made = []
        refused = host_reads(lambda: made.append(CpuGraph(step)))  # what stream capture would refuse
        assert refused == {}, f"CUDA graph capture of the step would fail on {refused}"
        return made[0]

    monkeypatch.setattr(TorchBackend, "__init__", capturing)
    monkeypatch.setattr(TorchBackend, "run_all", counting)
    monkeypatch.setattr(TorchBackend, "_capture_step", capture)


def assert_captured_once(backend, step):
    """Both of the step's call lists (even and odd steps) ran eagerly exactly once, were
    captured as a CpuGraph, and replayed after that."""
    for calls in step.calls:
        assert isinstance(backend._step_graphs[id(calls)][1], CpuGraph)
        assert backend.step_runs[id(calls), "eager"] == 1
        assert backend.step_runs[id(calls), "replay"] >= 1


def run_one_step(step):
    """One step's calls run eagerly (on the CPU backend), for the probes above: the ops a step
    dispatches, whatever its images' state (after a generation all are done: the ops still run)."""
    for call in step.calls[step.steps_run % 2]:
        step.backend.run(call)


def tensors_made_without_a_device(fn):
    """{(factory, file:line)} of the tensors fn() makes with no device given (torch.arange(n),
    torch.tensor(...)): on the CPU they work, on CUDA they land on the CPU beside device tensors."""
    import traceback

    from torch.overrides import TorchFunctionMode

    factories = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.tensor, torch.as_tensor,
                 torch.eye, torch.linspace, torch.scalar_tensor}
    found = set()

    class Probe(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in factories and kwargs.get("device") is None \
                    and not (func is torch.as_tensor and isinstance(args[0], torch.Tensor)):
                frame = traceback.extract_stack()[-2]
                found.add((func.__name__, f"{os.path.basename(frame.filename)}:{frame.lineno}"))
            return func(*args, **kwargs)

    with Probe():
        fn()
    return found


def flip_a_bit(path, at):
    """Damage a file in place: the lowest bit of its byte `at` flipped (integrity must notice)."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))
