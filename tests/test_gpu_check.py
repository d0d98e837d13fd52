"""The GPU runbook (python -m lantern.tools.gpu_check) on a machine without a GPU: it runs what
needs none (TensorRT-RTX plans built ahead of time for SM89), says what it skipped and why, and
a failing section is one line while the rest still runs."""
import json

import pytest

from lantern.tools import gpu_check


def test_a_failing_section_is_one_line_and_the_rest_runs(tmp_path):
    report = gpu_check.Report(str(tmp_path / "r.json"), budget_seconds=60)

    def broken():
        raise RuntimeError("first line\nsecond line")

    def skipped():
        raise gpu_check.Skip("not here")

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


@pytest.mark.skipif(gpu_check.cuda_visible() is not None, reason="a GPU is present: the runbook measures it instead")
def test_without_a_gpu_the_runbook_builds_rtx_plans_and_lists_what_it_skipped(c2i_engine, tmp_path, capsys):
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'lantern[tensorrt-rtx]')")
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main([str(c2i_engine), "--out", str(out), "--cpu-threads", "1", "--batches", "1"]) == 0
    data = json.loads(out.read_text())
    label = "engine-c2i"
    assert data["environment"]["gpu"] is None and data["environment"]["tensorrt_rtx"]
    for backend in ("torch-cuda-graphs", "torch-cuda-eager", "torch-cuda-step-graph", "torch-cuda-step-eager",
                    "onnxruntime-cuda"):
        assert data[f"{label}/{backend}"]["skipped"], backend
    rtx = data[f"{label}/tensorrt-rtx"]
    assert rtx["plans"] == "tensorrt-rtx-SM89" and set(rtx["plan_bytes"]) == {"condition", "target", "drafter",
                                                                              "vq_decoder"}
    assert all(size > 0 for size in rtx["plan_bytes"].values())
    assert rtx["run"].startswith("skipped: no NVIDIA GPU")
    assert f"{label}/tensorrt-rtx/run" in data["skipped"] and f"{label}/torch-cuda-graphs" in data["skipped"]
    assert not any("error" in v for v in data.values() if isinstance(v, dict))


def test_the_device_step_section_measures_both_paths_on_the_cpu(c2i_engine):
    """The section's logic where no GPU is: both step paths run, ratios come out per path."""
    data = gpu_check.device_step_section(c2i_engine, (1,), False, device="cpu", modes=("ar", "lantern++"),
                                         warmup=False, threads=2)
    assert data["cuda_graphs"] is False
    runs = {(r["step"], r["mode"]): r for r in data["runs"]}
    assert set(runs) == {(p, m) for p in ("host", "device") for m in ("ar", "lantern++")}
    assert runs["host", "lantern++"]["steps"] == runs["device", "lantern++"]["steps"]  # the same greedy tokens
    assert all(0 <= r["host_share"] <= 1 and r["ms_per_step"] > 0 for r in data["runs"])
    assert runs["device", "lantern++"]["step_in_ar_steps"] > 0
