"""trace.json's sources for `lantern-run profile`: our own timing of the engine calls
(TracedBackend), NVTX ranges on CUDA (Nsight Systems shows the phases) and, with --engine-trace,
the engine's own profiler (ONNX Runtime's, or torch.profiler for the torch-based runners) whose
events of the traced steps are merged into trace.json beside ours.

Times here are time.perf_counter() seconds until trace_of makes them microseconds from the end
of a generation's first step. ONNX Runtime's events are microseconds from its profiler's start,
which the session reports in ns since the epoch (time.time_ns's clock); torch.profiler's are
aligned by a record_function mark made at a known perf_counter time.
"""
import contextlib
import json
import os
import shutil
import tempfile
import time
import weakref

from lantern.runtime.backends import ONNXRUNTIME, runner
from lantern.runtime.errors import LanternError


class TracedBackend:
    """A backend whose engine calls are timed as the loop makes them: each run() (through the
    synchronize that follows it, where the work of an asynchronous device ends), each call of a
    device step's run_all (its phases too; a step replayed as one CUDA graph is one "step" span).
    spans: [regime, start, end] (perf_counter).
    ranges: None, or an NVTX-like recorder (range_push(name), range_pop()) given a range per call
    and, through mark_step, per step."""

    def __init__(self, inner, ranges=None, profiler=None):
        self.inner, self.ranges, self.profiler = inner, ranges, profiler
        self.spans = []
        self._open = None  # the last run()'s span until the synchronize after it
        self._step_open = False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, call):
        with self.range(call.regime):
            start = time.perf_counter()
            out = self.inner.run(call)
            self._open = [call.regime, start, time.perf_counter()]
        self.spans.append(self._open)
        return out

    def run_all(self, calls):
        """A device step's calls (its phases and engine calls), each timed and ranged by regime;
        where the runner replays the step as one CUDA graph, the step is one span ("step")."""
        if getattr(self.inner, "cuda_graphs", False):
            with self.range("step"):
                start = time.perf_counter()
                self.inner.run_all(calls)
                self.inner.synchronize()
            self.spans.append(["step", start, time.perf_counter()])
            return
        for call in calls:
            with self.range(call.regime):
                start = time.perf_counter()
                self.inner.run_all([call])
            self.spans.append([call.regime, start, time.perf_counter()])

    def synchronize(self):
        out = self.inner.synchronize()
        if self._open is not None:
            self._open[2] = time.perf_counter()
            self._open = None
        return out

    @contextlib.contextmanager
    def range(self, name):
        if self.ranges is None:
            yield
            return
        self.ranges.range_push(name)
        try:
            yield
        finally:
            self.ranges.range_pop()

    def mark_step(self, name=None):
        """Ends the open step's range and opens the range of step `name` (None: none)."""
        if self.ranges is None:
            return
        if self._step_open:
            self.ranges.range_pop()
        self._step_open = name is not None
        if name is not None:
            self.ranges.range_push(name)


def nvtx_ranges(device):
    """torch.cuda.nvtx where the runner runs on CUDA and torch with CUDA is importable; else None
    (no ranges: the CPU path is unchanged)."""
    if device != "cuda":
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.nvtx if torch.cuda.is_available() else None


# ---------------------------------------------------------------------------------------------
# --engine-trace


def engine_profiler(name, device):
    """The engine profiler of runner `name`, or one line saying which runners have one."""
    if name == ONNXRUNTIME.name:
        return OrtProfiler()
    if runner(name).export:
        return TorchProfiler(device)
    raise LanternError(f"--engine-trace: runner {name!r} has no engine profiler here (onnxruntime: ONNX Runtime's; "
                       f"the torch-based runners: torch.profiler)")


class OrtProfiler:
    """ONNX Runtime's profiler: on in every session from its creation (the only place it can be
    turned on) to the runner's end, so it also slows the untimed and the timed generations; the
    traced steps' events are picked by time."""

    label = "ONNX Runtime"

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="lantern-ort-profile-")
        weakref.finalize(self, shutil.rmtree, self.dir, True)  # also when the profile stops early
        self.backend_options = {"profile_prefix": os.path.join(self.dir, "ort")}

    def begin(self):
        pass

    def step(self, steps_done, trace_steps):
        pass

    def end(self):
        pass

    def collect(self, backend):
        """[(row, event with ts in perf_counter seconds)] of every session; the files go."""
        offset = time.time_ns() - time.perf_counter_ns()
        out = []
        try:
            for session, (start_ns, path) in backend.end_profiling().items():
                with open(path) as f:
                    events = json.load(f)
                for e in events:
                    if e.get("ph") == "X":
                        out.append((f"{self.label} {session}",
                                    dict(e, ts=(start_ns + 1000 * e["ts"] - offset) / 1e9)))
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
        return out


class TorchProfiler:
    """torch.profiler from the traced generation's start to the end of its traced steps (its
    rows: the profiler's own threads and, on CUDA, streams)."""

    label = "torch.profiler"
    backend_options = {}
    MARK = "lantern: trace clock"

    def __init__(self, device):
        import torch

        self.torch = torch
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof, self.events = None, []

    def begin(self):
        self.prof = self.torch.profiler.profile(activities=self.activities)
        self.prof.__enter__()
        with self.torch.profiler.record_function(self.MARK):
            self.mark = time.perf_counter()

    def step(self, steps_done, trace_steps):
        if steps_done > trace_steps:  # the first step and the traced ones: done
            self.end()

    def end(self):
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        with tempfile.TemporaryDirectory(prefix="lantern-torch-profile-") as tmp:
            path = os.path.join(tmp, "trace.json")
            self.prof.export_chrome_trace(path)
            with open(path) as f:
                events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
        self.prof = None
        (mark,) = [e for e in events if e["name"] == self.MARK]
        shift = self.mark - mark["ts"] / 1e6
        self.events += [(f"{self.label} {e.get('tid')}", dict(e, ts=e["ts"] / 1e6 + shift))
                        for e in events if e is not mark]

    def collect(self, backend):
        out, self.events = self.events, []
        return out


def in_window(events, trace):
    """The engine events that start within a trace's traced steps, as Chrome trace events on rows
    named by their source (ts, dur in microseconds from the trace's start)."""
    if "window" not in trace:
        return []
    t0, t1 = trace["window"]
    out = []
    for row, e in events:
        if t0 <= e["ts"] < t1:
            out.append({"row": row, "name": str(e["name"]), "cat": str(e.get("cat", "")),
                        "ts": round(1e6 * (e["ts"] - t0), 1), "dur": round(float(e.get("dur", 0)), 1),
                        "args": e.get("args", {})})
    return out
