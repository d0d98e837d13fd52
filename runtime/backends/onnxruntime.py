"""ONNX Runtime backend: one InferenceSession per graph.

Two ways to run a call: plain `session.run(feeds)` (outputs are fresh arrays every call), or,
for calls of a bound StepPlan, IOBinding: each call's feed buffers are bound once as OrtValues
that share their memory, and its outputs go into buffers preallocated once, so a step allocates
nothing that grows with the cache or the vocabulary. On the CPU provider numpy buffers are bound
in place. The CUDA provider runs the same code on the same host buffers: ORT copies a host input
to the device when it is bound (not at each run), so there every run binds its inputs again, and
each call copies its feeds, caches included, up and its outputs back (onnxruntime-torch keeps
them on the device instead: lantern.runtime.backends.onnxruntime_torch).

In-place graphs (contracts with `aliases`: present_keys_i is past_keys_i updated): a bound call
binds the cache's one OrtValue as both input and output, so TensorScatter writes into the cache
(ONNX Runtime copies the whole cache first when the two differ, and says so on stderr); an
unbound call gets the updated cache back as an output and copies it into the input's buffer.

profile_prefix (lantern-run profile --engine-trace): ONNX Runtime's own profiler on for every
session from its creation (it can only be turned on there), each writing its Chrome-trace JSON
under PROFILE_PREFIX_<graph>_<time>.json once end_profiling() is called.
"""
import os

import numpy as np

from lantern.runtime.backends import ONNXRUNTIME
from lantern.runtime.contracts import graph_io
from lantern.runtime.errors import LanternError
from lantern.runtime.graph_step import GraphStep, phase_files, step_graphs_refusal

_NUMPY_DTYPES = {"fp32": np.float32, "fp16": np.float16}
_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
              "tensor(bool)": np.bool_, "tensor(double)": np.float64}


class OnnxRuntimeBackend:
    name = ONNXRUNTIME.name
    key = None  # runs the ONNX graphs (or their modules), no compiled plans
    # the step graphs where the engine has them for a generation's tree (lantern-export accept), else
    # the host step (Engine's _step_path gives way to it when the default device step refuses)
    default_step = "device"
    device_step_proposers = ("tree", "jacobi")  # a jacobi window where the engine has its graphs (accept --window)

    def __init__(self, directory, manifest, threads=None, device="cpu", io_binding=True, profile_prefix=None):
        try:
            import onnxruntime as ort
        except ImportError:
            raise LanternError("onnxruntime is not installed: pip install 'lantern[cpu]' (or [gpu])") from None
        if manifest.dtype not in _NUMPY_DTYPES:
            raise LanternError("ONNX Runtime's CPU kernels do not run bf16 graphs; export fp32/fp16 or use TensorRT")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise LanternError(f"threads must be a positive integer, got {threads!r}")
        self.ort = ort
        self.float_dtype = _NUMPY_DTYPES[manifest.dtype]
        self.io_binding = io_binding
        providers = ["CPUExecutionProvider"]
        if device == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise LanternError("the CUDA execution provider is not available (install onnxruntime-gpu)")
            providers.insert(0, "CUDAExecutionProvider")
        elif device != "cpu":
            raise LanternError(f"unknown device {device!r}; valid: cpu, cuda")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or os.cpu_count() or 1
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Each graph has its own session and thread pool, and the decoding loop alternates between
        # them: idle threads spinning after a drafter call would steal the cores the target needs.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.enable_profiling = profile_prefix is not None
        self.profile_prefix = profile_prefix
        self.sessions = {}
        for graph, entry in manifest.graphs.items():
            path = os.path.join(directory, entry.file)
            self._name_profile(options, graph)
            try:
                self.sessions[graph] = ort.InferenceSession(path, options, providers=providers)
            except Exception as e:  # ORT raises its own exception types
                raise LanternError(f"{path}: ONNX Runtime cannot load it ({str(e).splitlines()[0]}); "
                                   f"re-export the engine") from None
            if device == "cuda" and self.sessions[graph].get_providers()[0] != "CUDAExecutionProvider":
                # listed as available, but its libraries (CUDA, cuDNN) did not load: ORT fell back
                raise LanternError(f"ONNX Runtime could not start its CUDA provider for {path} (a CUDA or cuDNN "
                                   f"library it needs is missing or of another version; its warnings above say "
                                   f"which)")
        self.outputs = {g: [o.name for o in s.get_outputs()] for g, s in self.sessions.items()}
        self.aliases = {g: graph_io(e.contract, max(e.layers, 1))["aliases"] for g, e in manifest.graphs.items()}
        self._bound = {}  # id(call) -> (call, IOBinding)
        self._steps = {}  # id(plan) -> its GraphStep, reused (refilled) by the plan's next generations
        self._values = {}  # id(call) -> {input or output name: its bound OrtValue}
        self.directory, self.manifest, self.options, self.providers = directory, manifest, options, providers
        self.device = device

    def zeros(self, shape):
        return np.zeros(shape, dtype=self.float_dtype)

    def bind(self, plan):
        if self.io_binding:
            self.bind_calls(plan.calls.values())

    def bind_calls(self, calls):
        """Bind each call's feeds, and its outputs: to call.outputs' buffers where it names them
        (a step graph writing into the next call's feeds), else to buffers made here."""
        for call in calls:
            session = self.sessions[call.graph]
            binding = session.io_binding()
            values = {}
            for name, buffer in call.feeds.items():
                values[name] = self.ort.OrtValue.ortvalue_from_numpy(buffer)  # shares the buffer
                binding.bind_ortvalue_input(name, values[name])
            given, call.outputs = call.outputs or {}, {}
            self._values[id(call)] = values  # the bound OrtValues: a later graph may read them in place
            aliases = self.aliases[call.graph]
            for out in session.get_outputs():
                if out.name in aliases:  # updated in place: the input's own buffer
                    binding.bind_ortvalue_output(out.name, values[aliases[out.name]])
                    call.outputs[out.name] = call.feeds[aliases[out.name]]
                    continue
                buffer = given.get(out.name)
                if buffer is None:
                    buffer = np.zeros(call.output_shapes[out.name], dtype=_ORT_TYPES[out.type])
                values[out.name] = self.ort.OrtValue.ortvalue_from_numpy(buffer)
                binding.bind_ortvalue_output(out.name, values[out.name])
                call.outputs[out.name] = buffer
            self._bound[id(call)] = (call, binding)

    def run(self, call):
        bound = self._bound.get(id(call))
        if bound is not None and bound[0] is call:
            if self.device == "cuda":  # ORT copies a host input to the device when it is bound, not per run
                for name, value in self._values[id(call)].items():
                    if name in call.feeds:
                        bound[1].bind_ortvalue_input(name, value)
                bound[1].synchronize_inputs()  # the copies it queued, done before the run reads them
            self.sessions[call.graph].run_with_iobinding(bound[1])
            return call.outputs
        out = dict(zip(self.outputs[call.graph], self.sessions[call.graph].run(None, call.feeds)))
        for output, source in self.aliases[call.graph].items():
            np.copyto(call.feeds[source], out[output])
            out[output] = call.feeds[source]
        return out

    def release(self, plan):
        """Forget a plan's bindings (the engine keeps one plan at a time)."""
        for call in plan.calls.values():
            self._bound.pop(id(call), None)
            self._values.pop(id(call), None)
        self._drop_step(plan)

    def _drop_step(self, plan):
        """Forget the plan's GraphStep and the bindings of its phase calls (the engine calls are
        the plan's own, which a new GraphStep binds again)."""
        step = self._steps.pop(id(plan), None)
        own = {id(c) for c in plan.calls.values()}
        for call in [c for calls in step.calls for c in calls] if step is not None else ():
            if id(call) not in own:
                self._bound.pop(id(call), None)
                self._values.pop(id(call), None)

    # -- the device step: the engine's step graphs --------------------------------------------
    def device_step_refusal(self, plan, sampler, proposer=None):
        """Why this backend's device step (the whole step on the engine's step graphs for the
        plan's tree, or for the jacobi proposer's window and init; IOBinding) cannot run a
        generation of this plan, sampler and proposer (None: the drafter tree), or None."""
        if not self.io_binding:
            return "it needs IOBinding (io_binding=False)"
        return step_graphs_refusal(self.manifest, self.directory, plan, sampler,
                                   proposer if _window(proposer) else None)[1]

    def device_step(self, decoding):
        """The generation's whole step on the engine's step graphs of its tree or jacobi window (greedy or
        sampling; lantern.runtime.graph_step): engine calls and phases bound once, the host reads
        back a few integers per image."""
        step = self._steps.get(id(decoding.plan))
        if step is not None and step.serves(decoding):
            step.load(decoding)  # the plan's next generation: the same buffers and bindings, refilled
            return step
        self._drop_step(decoding.plan)  # another key on this plan: the old step's bindings go with it
        p = decoding.proposer
        entry = self.manifest.window_graphs_for(p.window, p.init) if _window(p) else \
            self.manifest.step_graphs_for(decoding.plan.tree)
        graphs = self.open_graphs(phase_files(entry, decoding.sampler, decoding.view.size))  # a session costs its load
        step = self._steps[id(decoding.plan)] = GraphStep(decoding.backend, decoding, graphs)
        return step

    def open_graphs(self, files):
        """{name: label} of more graphs (a tree's step graphs) at files {name: path in the engine
        directory}, each loaded once; run as calls of graph=label."""
        labels = {}
        for name, rel in files.items():
            label = f"file:{rel}"
            if label not in self.sessions:
                path = os.path.join(self.directory, rel)
                self._name_profile(self.options, _session_name(label).replace("/", "_"))
                try:
                    session = self.ort.InferenceSession(path, self.options, providers=self.providers)
                except Exception as e:
                    raise LanternError(f"{path}: ONNX Runtime cannot load it ({str(e).splitlines()[0]}); run "
                                       f"`lantern-export accept {self.directory} --force`") from None
                self.sessions[label] = session
                self.outputs[label] = [o.name for o in session.get_outputs()]
                self.aliases[label] = {}
            labels[name] = label
        return labels

    def graph_inputs(self, label):
        return [(i.name, _ORT_TYPES[i.type]) for i in self.sessions[label].get_inputs()]

    def graph_outputs(self, label):
        return [(o.name, _ORT_TYPES[o.type]) for o in self.sessions[label].get_outputs()]

    def device_call(self, call, shared):
        """The plan's call itself: bound (bind), its feeds and outputs are the buffers the step's
        phases write and read."""
        return call

    def run_all(self, calls):
        for call in calls:
            self.run(call)

    def array(self, host):
        """A buffer of the backend's holding a copy of a host array (the CPU provider's are host arrays)."""
        return np.array(host)

    def fill(self, array, values):
        np.copyto(array, values)

    def read(self, array, width):
        """The first `width` columns of a buffer, on the host."""
        return array[:, :width].copy()

    def _name_profile(self, options, name):
        if self.profile_prefix is not None:  # one file per session (sessions made in one millisecond share a time)
            options.profile_file_prefix = f"{self.profile_prefix}_{name}"

    def end_profiling(self):
        """{session name: (its profiler's start, ns since the epoch; its JSON file)}; profiling ends."""
        return {_session_name(label): (s.get_profiling_start_time_ns(), s.end_profiling())
                for label, s in self.sessions.items()}

    def call_shapes(self, graph):
        return None  # any shape runs

    def numpy(self, array):
        return array

    def gather(self, src, rows, cols, out):
        flat = src.reshape(-1, *src.shape[2:])
        np.take(flat, (np.asarray(rows) * src.shape[1] + np.asarray(cols)).reshape(-1), axis=0,
                out=out.reshape(-1, *src.shape[2:]))

    def copy(self, src, out):
        np.copyto(out, src)

    def commit(self, cache, new, rows, src, dst):
        cache[:, rows, :, dst] = new[:, rows, :, src]

    def synchronize(self):
        """run() returns host arrays, so nothing is ever left in flight."""

    def fill_rows(self, array, rows, values):
        """array[rows] = values in place (a continuous batch's joiner into a running step's buffers)."""
        array[rows] = values


def _window(proposer):
    """Whether a generation's proposer is a jacobi window (its graphs: Manifest.window_graphs)."""
    return proposer is not None and proposer.name == "jacobi"


def _session_name(label):
    """A session's name in profiles: its graph's ('target'), or a step graph's folder and file stem
    ('mc_sim_7b_63-523717d6/greedy.level1': every tree has a greedy.begin)."""
    if not label.startswith("file:"):
        return label
    folder, file = os.path.split(label[len("file:"):])
    return f"{os.path.basename(folder)}/{os.path.splitext(file)[0]}"
