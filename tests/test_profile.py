"""`lantern-run profile` on the tiny c2i engine: its figures agree with what they claim, its trace
opens as Chrome trace events, and what it cannot run is refused in one line before any work."""
import importlib.util
import json

import pytest

from lantern.runtime.manifest import read_manifest
from lantern.runtime.tree import build_tree


def test_profile_figures_agree_with_what_they_claim(c2i_engine, tmp_path, capsys):
    from lantern.tools import run_cli

    out = tmp_path / "profile"
    argv = ["profile", c2i_engine, "--images", "2", "--threads", "1", "--cfg-scale", "4", "--repeats", "1",
            "--out", str(out)]
    assert run_cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "speed-up over ar" in printed and "L(T)" in printed
    report = json.loads((out / "profile.json").read_text())
    tree = build_tree(read_manifest(c2i_engine).tree)  # the fixture's engine is not tuned: the exported tree runs
    (result,) = report["runners"]
    spec, ar = result["runs"]["lantern++"], result["runs"]["ar"]

    for run in (spec, ar):
        assert sum(run["phase_ms_per_step"].values()) <= run["ms_per_step"] + 1e-3
        assert run["engine_ms_per_step"] + run["host_ms_per_step"] == pytest.approx(run["ms_per_step"], abs=1e-3)
        assert run["steps"] > 1 and run["tokens_per_second"] > 0
    # the engine's default step, on its step graphs: one drafter call per depth, then the
    # verification (AR verifies the root alone), and the phases between them (begin, a level per
    # depth, accept) launched from the host too; the report comes back: D + 3 integers per image
    assert (spec["nodes"], spec["depth"]) == (tree.num_nodes, tree.depth)
    assert (spec["step"], ar["step"]) == ("device", "device")
    assert spec["engine_calls_per_step"] == tree.depth + 1 and ar["engine_calls_per_step"] == 1
    assert spec["host_launches_per_step"] == (tree.depth + 1) + (tree.depth + 2)
    assert ar["host_launches_per_step"] == 1 + 2
    assert spec["bytes_to_host_per_step_per_image"] == 8 * (tree.depth + 3 + 2 * tree.num_nodes)
    assert ar["bytes_to_host_per_step_per_image"] == 8 * (3 + 2)

    depths = spec["acceptance_per_depth"]
    assert len(depths) == tree.depth and ar["acceptance_per_depth"] == []
    assert all(0 <= d <= 1 for d in depths) and all(a >= b for a, b in zip(depths, depths[1:]))
    # tokens per step never exceed 1 + drafts accepted (the last step may emit fewer than it accepted)
    assert spec["mean_accepted_length"] <= 1 + sum(depths) + 1e-3
    assert ar["mean_accepted_length"] == 1.0
    assert result["speed_up"] == pytest.approx(spec["tokens_per_second"] / ar["tokens_per_second"], abs=1e-3)
    assert result["step_in_ar_steps"] == pytest.approx(spec["ms_per_step"] / ar["ms_per_step"], rel=1e-3)

    latency = result["latency"]
    assert list(latency["verify_ms"]) == ["1", "2", "4", "8", "16", str(tree.num_nodes)]
    assert all(ms > 0 for ms in latency["verify_ms"].values()) and latency["relative_to_one_token"]["1"] == 1.0
    assert report["peak_memory_bytes"] > 2**20

    trace = json.loads((out / "trace.json").read_text())
    calls = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "calls"]
    steps = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "steps"]
    names = {e["name"] for e in calls}
    assert {"verify", "draft0", f"draft{tree.depth - 1}"} <= names
    assert len(steps) == 2 * 3  # --trace-steps 3, for each mode
    for pid in {e["pid"] for e in steps}:
        end = max(e["ts"] + e["dur"] for e in steps if e["pid"] == pid)
        assert all(0 <= e["ts"] and e["ts"] + e["dur"] <= end + 1 for e in calls if e["pid"] == pid)
    if importlib.util.find_spec("matplotlib"):
        assert (out / "profile.png").stat().st_size > 0
    else:
        assert "profile.png skipped" in printed and not (out / "profile.png").exists()


@pytest.mark.parametrize("argv,says", [
    (["--runner", "onnxruntime,no-such-runner"], "unknown backend 'no-such-runner'"),
    (["--images", "100000"], "needs about"),
])
def test_profile_refuses_up_front_in_one_line(c2i_engine, tmp_path, monkeypatch, capsys, argv, says):
    from lantern.runtime import generator
    from lantern.tools import run_cli

    monkeypatch.setattr(generator, "available_memory", lambda: 2**30)  # this machine, as its readers say
    out = tmp_path / "profile"
    assert run_cli.main(["profile", c2i_engine, "--threads", "1", "--out", str(out)] + argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], lines
    assert captured.out == "" and list(tmp_path.iterdir()) == []


def test_profile_of_a_device_step_traces_its_phases(c2i_engine, tmp_path):
    """ONNX Runtime's device step: the step graphs' phases between the engine calls, each in the
    trace by name, for the tree and for AR; the host step, asked for, reads the logits back."""
    from lantern.tools import run_cli

    out = tmp_path / "profile"
    argv = ["profile", c2i_engine, "--images", "2", "--threads", "1", "--greedy", "--step", "device",
            "--repeats", "1", "--out", str(out)]
    assert run_cli.main(argv) == 0
    (result,) = json.loads((out / "profile.json").read_text())["runners"]
    spec, ar = result["runs"]["lantern++"], result["runs"]["ar"]
    depth = build_tree(read_manifest(c2i_engine).tree).depth
    assert (spec["step"], ar["step"]) == ("device", "device")
    assert spec["engine_calls_per_step"] == depth + 1 and ar["engine_calls_per_step"] == 1
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    for pid, want in ((1, ["begin"] + [x for d in range(depth) for x in (f"draft{d}", f"level{d + 1}")] +
                       ["verify", "accept"]), (2, ["begin", "verify", "accept"])):
        per_step = [e["name"] for e in events if e["ph"] == "X" and e["cat"] == "calls" and e["pid"] == pid]
        assert per_step[: len(want)] == want and len(per_step) == 3 * len(want)  # --trace-steps 3

    host = tmp_path / "host"
    argv[argv.index("device")] = "host"
    assert run_cli.main(argv[:-1] + [str(host)]) == 0
    (result,) = json.loads((host / "profile.json").read_text())["runners"]
    spec = result["runs"]["lantern++"]
    vocab = read_manifest(c2i_engine).vocabulary.size
    assert spec["step"] == "host" and spec["bytes_to_host_per_step_per_image"] > vocab * 4  # the logits


class RangeRecorder:
    """Records NVTX-style range_push/range_pop calls, as torch.cuda.nvtx receives them on CUDA."""

    def __init__(self):
        self.calls, self.depth = [], 0

    def range_push(self, name):
        self.calls.append(name)
        self.depth += 1

    def range_pop(self):
        assert self.depth > 0, "a range popped that was never pushed"
        self.calls.append(None)
        self.depth -= 1


def test_engine_trace_merges_onnxruntime_profiler_and_ranges_wrap_each_call(c2i_engine, tmp_path, monkeypatch):
    """--engine-trace on ONNX Runtime: its profiler's session and node events of the traced steps
    on rows of their own, inside our call spans; with an NVTX recorder (what CUDA gets) a range
    per step and per call, named by regime. On the CPU there is no recorder at all."""
    from lantern.tools import profile, profile_trace, run_cli

    assert profile_trace.nvtx_ranges("cpu") is None
    recorder = RangeRecorder()
    monkeypatch.setattr(profile, "nvtx_ranges", lambda device: recorder)
    out = tmp_path / "profile"
    argv = ["profile", c2i_engine, "--images", "2", "--threads", "1", "--repeats", "1", "--engine-trace",
            "--out", str(out)]
    assert run_cli.main(argv) == 0
    depth = build_tree(read_manifest(c2i_engine).tree).depth

    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert {e["ph"] for e in events} <= {"X", "M"}
    timed = [e for e in events if e["ph"] == "X"]
    assert all(isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0
               for e in timed)
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    phases = ["begin"] + [f"level{d}" for d in range(1, depth + 1)] + ["accept"]
    for pid, graphs in ((1, ["target", "drafter"] + phases), (2, ["target", "begin", "accept"])):  # lantern++, ar
        ours = [e for e in timed if e["pid"] == pid and e["cat"] == "calls"]
        ort = [e for e in timed if e["pid"] == pid and rows[pid, e["tid"]].startswith("ONNX Runtime")]
        # a session per engine graph and per step graph (named by its file: greedy.level1, ...)
        names = {rows[pid, e["tid"]][len("ONNX Runtime "):] for e in ort}
        assert {n.split(".")[-1] for n in names} == set(graphs)
        assert any(e["cat"] == "Node" and e["name"].endswith("_kernel_time") for e in ort)
        runs = [e for e in ort if e["name"] == "model_run"]
        assert len(runs) == len(ours)  # one session run per engine call of the traced steps
        # aligned: each session run lies within one of our call spans (0.5 ms of clock slack)
        for r in runs:
            assert any(c["ts"] - 500 <= r["ts"] and r["ts"] + r["dur"] <= c["ts"] + c["dur"] + 500 for c in ours)

    assert recorder.depth == 0
    pushed = [c for c in recorder.calls if c is not None]
    assert pushed.count("step 2") == 2 and "step 5" not in pushed  # --trace-steps 3, both modes
    # the lantern++ generation's second step: its range holds one range per engine call, in order
    start = recorder.calls.index("step 2")
    inside = recorder.calls[start + 1: recorder.calls.index("step 3", start) - 1]
    assert [c for c in inside if c is not None] == \
        ["begin"] + [x for d in range(depth) for x in (f"draft{d}", f"level{d + 1}")] + ["verify", "accept"]


def test_engine_trace_merges_torch_profiler_ops_of_the_traced_steps(c2i_engine, tmp_path):
    """The torch runner: torch.profiler's ops of the traced steps, on their own row, the matmuls
    of each engine call inside that call's span (aligned by the profiler's clock mark)."""
    pytest.importorskip("torch")
    from lantern.tools import profile_trace, run_cli

    out = tmp_path / "profile"
    argv = ["profile", c2i_engine, "--images", "2", "--threads", "1", "--repeats", "1", "--runner", "torch",
            "--engine-trace", "--out", str(out)]
    assert run_cli.main(argv) == 0
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    ops = [e for e in events if e["ph"] == "X" and rows[e["pid"], e["tid"]].startswith("torch.profiler")]
    calls = [e for e in events if e["ph"] == "X" and e["cat"] == "calls"]
    steps = [e for e in events if e["ph"] == "X" and e["cat"] == "steps"]
    assert {e["pid"] for e in ops} == {1, 2}  # lantern++ and ar
    assert profile_trace.TorchProfiler.MARK not in {e["name"] for e in ops}
    end = max(e["ts"] + e["dur"] for e in steps)
    assert all(0 <= e["ts"] <= end for e in ops)
    # the verification's matmuls fall inside our verify spans (with 0.5 ms of clock slack)
    verify = [c for c in calls if c["name"] == "verify"]
    matmuls = [e for e in ops if e["name"] == "aten::matmul"
               and any(c["pid"] == e["pid"] and c["ts"] - 500 <= e["ts"] < c["ts"] + c["dur"] for c in verify)]
    assert len(matmuls) >= len(verify)
