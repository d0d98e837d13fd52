"""Polygraphy as the independent TensorRT check (lantern.export.polygraphy_check): its loaders
build the same plan bytes as lantern's builder (TensorRT-RTX, on the CPU), its Comparator with
check's tolerance rule passes equal graphs and fails a perturbed one (ONNX Runtime runners, on
the CPU), and `check --against polygraphy-trt` says in one line that it needs a GPU here.

Polygraphy picks TensorRT or TensorRT-RTX once per process (POLYGRAPHY_USE_TENSORRT_RTX, read at
import), so the builds run in subprocesses of their own."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("polygraphy", reason="polygraphy is not installed (pip install 'lantern[polygraphy]')")

from lantern.export import cli  # noqa: E402
from lantern.export.check_cases import check_cases  # noqa: E402
from lantern.export.check_compare import TOLERANCES  # noqa: E402
from lantern.export.check import ToleranceCompare  # noqa: E402
from lantern.export.polygraphy_check import backend_runner, compare_runners  # noqa: E402
from lantern.runtime.backends import open_backend  # noqa: E402
from lantern.runtime.backends.cuda import gpu_compute_capability  # noqa: E402
from lantern.runtime.manifest import read_manifest  # noqa: E402

HAS_GPU = gpu_compute_capability() is not None

# One build per fresh process. TensorRT-RTX 1.7 does not build a graph with several inputs to the
# same bytes twice (between processes too, with the heap layout): two builds of the target by one
# builder differ in ~2000 bytes, and now and then in their byte histogram too (seen once in CI),
# never in size. Graphs with one input and one output (condition, VQ decoder) build to the same
# bytes every time, so they carry the byte-identity check; the target is held to its size.
_BUILD = """
import hashlib, json, os, sys
from lantern.export import tensorrt_build as tb, trt_export
from lantern.runtime.manifest import read_manifest
from lantern.runtime.tree import build_tree
directory, graph, builder, tf32 = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
m = read_manifest(directory)
calls = trt_export.call_shapes(m, (1,), (True,), [build_tree(m.tree)])
profiles = [p for _, p in trt_export.graph_profiles(m, graph, calls[graph])]
onnx_path = os.path.join(directory, graph + ".onnx")
if builder == "lantern":
    plan, _ = tb.build_plan(onnx_path, profiles, flavor="tensorrt-rtx", compute_capabilities=["SM89"], tf32=tf32)
else:
    from lantern.export.polygraphy_check import polygraphy_plan
    plan = polygraphy_plan(onnx_path, profiles, flavor="tensorrt-rtx", compute_capabilities=["SM89"], tf32=tf32)
print(json.dumps({"bytes": len(plan), "sha256": hashlib.sha256(plan).hexdigest(), "profiles": len(profiles)}))
"""


def _build(directory, graph, builder, tf32=False):
    env = dict(os.environ, POLYGRAPHY_USE_TENSORRT_RTX="1")
    done = subprocess.run([sys.executable, "-c", _BUILD, str(directory), graph, builder, "1" if tf32 else "0"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_polygraphy_loaders_build_the_same_plan_bytes(c2i_engine):
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'lantern[tensorrt-rtx]')")
    for graph in ("condition", "vq_decoder"):
        ours, theirs = _build(c2i_engine, graph, "lantern"), _build(c2i_engine, graph, "polygraphy")
        assert ours["bytes"] > 0 and theirs == ours, graph
    # the comparison sees the settings: the same Polygraphy build with TF32 on is another plan
    assert _build(c2i_engine, "vq_decoder", "polygraphy", tf32=True)["sha256"] != ours["sha256"]
    # the target (8 inputs, 4 outputs, 3 profiles): the same size (see _BUILD on why not the bytes)
    ours, theirs = _build(c2i_engine, "target", "lantern"), _build(c2i_engine, "target", "polygraphy")
    assert ours["profiles"] == 3  # prefill, AR step and tree verification (CFG, batch 1)
    assert theirs["bytes"] == ours["bytes"] > 0


def _perturbed_target(engine, out):
    """A copy of the engine's target.onnx with its final norm's weight scaled by 1.01."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(os.path.join(engine, "target.onnx"))
    weight = next(t for t in model.graph.initializer if t.name.endswith("norm.weight") and "layers" not in t.name)
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * np.float32(1.01), weight.name))
    onnx.save(model, str(out))
    return str(out)


def test_comparator_with_check_rule_passes_equal_graphs_and_fails_a_perturbed_one(c2i_engine, tmp_path):
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    manifest = read_manifest(c2i_engine)
    cases = check_cases("target", manifest, np.random.default_rng(0))
    feeds = [f for _, f in cases]
    atol, rtol = TOLERANCES[manifest.dtype]
    lantern_ort = backend_runner(open_backend("onnxruntime", c2i_engine, manifest, threads=1), "target", manifest,
                                 "lantern-onnxruntime")
    plain = OnnxrtRunner(SessionFromOnnx(os.path.join(c2i_engine, "target.onnx")), name="polygraphy-onnxrt")
    bad = OnnxrtRunner(SessionFromOnnx(_perturbed_target(c2i_engine, tmp_path / "target.onnx")), name="perturbed")

    same = ToleranceCompare("target", atol, rtol, [n for n, _ in cases])
    assert compare_runners([lantern_ort, plain], feeds, same) is True
    assert len(same.rows) == len(cases) * len(manifest.graphs["target"].outputs)
    assert all(r["ok"] for r in same.rows)

    perturbed = ToleranceCompare("target", atol, rtol, [n for n, _ in cases])
    assert compare_runners([lantern_ort, bad], feeds, perturbed) is False
    failed = {(r["case"].split(":")[0], r["output"]) for r in perturbed.rows if not r["ok"]}
    # the norm feeds the head and the drafter's hidden state, never the cache's new K/V
    assert {(c, o) for c, _ in cases for o in ("logits", "hidden")} <= failed
    assert not any(o.startswith("new_") for _, o in failed)
    row = next(r for r in perturbed.rows if r["output"] == "logits")
    assert row["max_abs"] > row["bound"] and "lantern-onnxruntime vs perturbed" in row["case"]


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present: the GPU test below runs the check instead")
def test_check_against_polygraphy_without_gpu_is_one_line(c2i_engine, capsys):
    assert cli.main(["check", str(c2i_engine), "--against", "polygraphy-trt", "--no-verify-hashes"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs an NVIDIA GPU" in err, err


@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU: Polygraphy's TrtRunner deserializes the plans")
def test_check_against_polygraphy_on_gpu(c2i_engine, tmp_path):
    from lantern.export.tensorrt_build import available_flavors

    if not available_flavors():
        pytest.skip("no TensorRT flavor is installed")
    engine = shutil.copytree(c2i_engine, tmp_path / "engine")
    flavor = "tensorrt" if "tensorrt" in available_flavors() else "tensorrt-rtx"
    # a process uses one flavor with Polygraphy: a subprocess keeps the test session clean
    code = ("import json, sys; from lantern.export import cli; from lantern.export.check import "
            "check_engine_polygraphy as c; assert cli.main(['trt', sys.argv[1], '--flavor', sys.argv[2], "
            "'--compute-capability', 'current', '--batch', '1']) == 0; r = c(sys.argv[1]); "
            "print(json.dumps({'ok': r['ok'], 'rows': len(r['results']), 'failures': r['failures'][:3]}))")
    done = subprocess.run([sys.executable, "-c", code, str(engine), flavor], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["rows"] > 0 and report["ok"], report["failures"]


def test_inspect_engine_prints_polygraphys_view_of_each_graph(c2i_engine, capsys):
    """`lantern-export inspect ENGINE`: the manifest's listing; --graphs: each graph as Polygraphy's
    `inspect model` prints it (symbolic shapes, node counts; --layers every node), on the CPU."""
    import onnx

    assert cli.main(["inspect", str(c2i_engine)]) == 0
    listing = capsys.readouterr().out
    assert "graph        target: target.onnx (fp32), 8 inputs, 4 outputs" in listing
    assert "modes ar, exact, lantern, lantern++" in listing
    assert cli.main(["inspect", str(c2i_engine), "--graphs"]) == 0
    printed = capsys.readouterr().out
    sections = dict(part.split("\n", 1) for part in printed.split("==== graph ")[1:])
    manifest = read_manifest(c2i_engine)
    assert list(sections) == [f"{g} ({e.file})" for g, e in manifest.graphs.items()]
    for name, entry in manifest.graphs.items():
        text = sections[f"{name} ({entry.file})"]
        graph = onnx.load(os.path.join(c2i_engine, entry.file), load_external_data=False).graph
        assert f"---- {len(graph.node)} Node(s) ----" in text and f"---- {len(entry.inputs)} Graph Input(s)" in text
    assert "attention_mask [dtype=bool, shape=('B', 1, 'T', 'P+T')]" in sections["target (target.onnx)"]
    assert cli.main(["inspect", str(c2i_engine), "--graphs", "--layers"]) == 0
    layers = capsys.readouterr().out
    condition = onnx.load(os.path.join(c2i_engine, "condition.onnx")).graph
    assert all(f"| {n.name} [Op: {n.op_type}]" in layers for n in condition.node)
    assert cli.main(["inspect", str(c2i_engine), "--plans"]) == 2  # no plans built here
    assert "has no TensorRT plans" in capsys.readouterr().err


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU message; a GPU is present")
def test_inspect_plans_without_gpu_is_one_line(tmp_path):
    from lantern.export.polygraphy_check import plan_summary
    from lantern.runtime.errors import LanternError

    with pytest.raises(LanternError) as err:
        plan_summary(tmp_path / "target.plan", "tensorrt-rtx")
    assert "\n" not in str(err.value) and "needs an NVIDIA GPU" in str(err.value)
