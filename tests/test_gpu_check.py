"""The GPU runbook (python -m lantern.tools.gpu_check) on a machine without a GPU: it runs what
needs none (TensorRT-RTX plans built ahead of time for SM89), says what it skipped and why, and
a failing section is one line while the rest still runs."""
import json

import pytest

from lantern.runtime.manifest import read_manifest
from lantern.tools import gpu_check, gpu_sections


def test_a_failing_section_is_one_line_and_the_rest_runs(tmp_path):
    report = gpu_check.Report(str(tmp_path / "r.json"), budget_seconds=60)

    def broken():
        raise RuntimeError("first line\nsecond line")

    def skipped():
        raise gpu_sections.Skip("not here")

    report.section("a", broken)
    report.section("b", skipped)
    report.section("c", lambda: {"value": 1})
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["a"] == {"error": "RuntimeError: first line second line"}
    assert data["b"] == {"skipped": "not here"}
    assert data["c"]["value"] == 1 and "seconds" in data["c"]


def test_sections_past_the_budget_are_skipped(tmp_path):
    report = gpu_check.Report(None, budget_seconds=0)
    report.section("late", lambda: {"value": 1})
    assert report.data["late"] == {"skipped": "time budget spent (--budget-minutes)"}


@pytest.mark.skipif(gpu_sections.cuda_visible() is not None, reason="a GPU is present: the runbook measures it instead")
def test_without_a_gpu_the_runbook_builds_rtx_plans_and_lists_what_it_skipped(c2i_engine, tmp_path, capsys):
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'lantern[tensorrt-rtx]')")
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main([str(c2i_engine), "--out", str(out), "--cpu-threads", "1", "--batches", "1"]) == 0
    data = json.loads(out.read_text())
    label = "engine-c2i"
    assert data["environment"]["gpu"] is None and data["environment"]["tensorrt_rtx"]
    for backend in ("torch-cuda-graphs", "torch-cuda-eager", "torch-cuda-step-graph", "torch-cuda-step-eager",
                    "onnxruntime-cuda", "onnxruntime-torch-cuda", "tensorrt-rtx-graph-step"):
        assert data[f"{label}/{backend}"]["skipped"], backend
    rtx = data[f"{label}/tensorrt-rtx"]
    # the engine's graphs and the greedy step graphs' plans the device step runs (AR's and the tree's)
    steps = {g for g in rtx["plan_bytes"] if g.startswith("step/")}
    assert rtx["plans"] == "tensorrt-rtx-SM89" and set(rtx["plan_bytes"]) - steps == {
        "condition", "target", "drafter", "vq_decoder"}
    assert len(steps) == 9 and all(g.split("/")[-1].startswith("greedy.") for g in steps)
    assert all(size > 0 for size in rtx["plan_bytes"].values())
    assert rtx["run"].startswith("skipped: no NVIDIA GPU")
    assert f"{label}/tensorrt-rtx/run" in data["skipped"] and f"{label}/torch-cuda-graphs" in data["skipped"]
    assert not any("error" in v for v in data.values() if isinstance(v, dict))


def test_the_device_step_section_measures_both_paths_on_the_cpu(c2i_engine):
    """The section's logic where no GPU is: both step paths run, ratios come out per path."""
    data = gpu_sections.device_step_section(c2i_engine, (1,), False, device="cpu", modes=("ar", "lantern++"),
                                         warmup=False, threads=2)
    assert data["cuda_graphs"] is False
    runs = {(r["step"], r["mode"]): r for r in data["runs"]}
    assert set(runs) == {(p, m) for p in ("host", "device") for m in ("ar", "lantern++")}
    assert runs["host", "lantern++"]["steps"] == runs["device", "lantern++"]["steps"]  # the same greedy tokens
    assert all(0 <= r["host_share"] <= 1 and r["ms_per_step"] > 0 for r in data["runs"])
    assert runs["device", "lantern++"]["step_in_ar_steps"] > 0


def test_step_paths_table_on_the_cpu_backends(c2i_engine):
    """tools/bench/device_step.whole_step (gpu_check's step_paths for TensorRT, the bench's
    default table): host and device rows per backend, the same tokens on both paths (greedy),
    AR on ONNX Runtime's step graphs too, and the device path reading the outcome where the host
    path reads the logits."""
    from lantern.runtime.backends.onnxruntime import OnnxRuntimeBackend
    from lantern.tools.bench.device_step import whole_step

    manifest = read_manifest(c2i_engine)
    backends = {"ort": OnnxRuntimeBackend(c2i_engine, manifest, threads=2)}
    rows = whole_step(c2i_engine, modes=("ar", "lantern++"), batches=(1,), samplings=(False,), backends=backends)
    by = {(r["mode"], r["step"]): r for r in rows}
    assert set(by) == {(m, p) for m in ("ar", "lantern++") for p in ("host", "device")}
    assert by["ar", "host"]["tokens_sha1"] == by["ar", "device"]["tokens_sha1"]
    host, device = by["lantern++", "host"], by["lantern++", "device"]
    assert host["tokens_sha1"] == device["tokens_sha1"] and host["steps"] == device["steps"]
    logits_bytes = 2 * 26 * manifest.vocabulary.size * 4  # CFG's two rows, mc_sim_7b_63's 26 nodes, float32
    assert host["bytes_device_to_host_per_step"] >= logits_bytes  # the host path reads them every step
    # the device path reads the outcome where the host path reads the logits (both read the drafts' top-K)
    assert host["bytes_device_to_host_per_step"] - device["bytes_device_to_host_per_step"] > logits_bytes // 2
    assert all(r["backend"] == "ort" and r["ms_per_step"] > 0 for r in (host, device, by["ar", "host"]))


def test_only_runs_the_sections_named_and_cpu_is_a_dry_run(c2i_engine, tmp_path):
    """--only keeps a short GPU window on the goal measurement; --device cpu runs a section's
    code here (the dry run before a GPU window is spent)."""
    out = tmp_path / "gpu_check.json"
    rc = gpu_check.main([str(c2i_engine), "--device", "cpu", "--only", "torch-cpu-step-graph", "--batches", "1",
                         "--cpu-threads", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0 and set(data) == {"environment", "engine-c2i/torch-cpu-step-graph", "skipped"}
    assert data["environment"]["torch_device"] == "cpu" and data["skipped"] == {}
    section = data["engine-c2i/torch-cpu-step-graph"]
    assert section["device"] == "cpu" and section["cuda_graphs"] is False  # no CUDA graphs on a CPU
    assert {(r["step"], r["mode"]) for r in section["runs"]} == {
        (p, m) for p in ("host", "device") for m in ("ar", "exact", "lantern++")}
    kernels = section["kernels_per_step"]  # what the step's graph would replay, per mode
    assert set(kernels) == {"ar", "exact", "lantern++"} and kernels["exact"]["in_ar_steps"] > 1


def test_only_refuses_an_unknown_section_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--only", "torch-cuda-step-grpah"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "unknown section torch-cuda-step-grpah" in err[-1]
    assert "torch-cuda-step-graph" in err[-1]  # the names it knows


def test_throughput_measures_both_proposers(c2i_engine):
    """The runbook's throughput rows: the drafter's tree and the drafter-free jacobi window beside
    ar, each with its step cost in AR steps (the numbers a GPU window is for)."""
    from lantern.runtime.generator import Engine

    rows = gpu_sections.throughput(Engine(c2i_engine, threads=1), batches=(2,), repeats=1)["batch2"]
    assert set(rows) == {"ar", "exact", "lantern++", "jacobi exact", "jacobi lantern++"}
    assert rows["ar"]["step_cost_in_ar_steps"] == 1.0
    assert rows["jacobi exact"]["steps_per_image"] < rows["ar"]["steps_per_image"]
