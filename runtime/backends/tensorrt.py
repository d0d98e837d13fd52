"""TensorRT backend: the plans `lantern-export trt` built, run on an NVIDIA GPU (full TensorRT or
TensorRT for RTX; no torch). Which plans and profiles run is tensorrt_plans.py; device memory,
streams and CUDA graphs are cuda.py; this module binds step plans to them and runs calls; the
device step (GraphStep over the step graphs' plans) is tensorrt_step.py.

Opening: the manifest's plan builds (`Manifest.tensorrt`) are matched against what is here — the
installed flavor and its exact version, the GPU's compute capability — and a plan built for
another GPU or TensorRT version is refused with the `lantern-export trt` line that rebuilds it.

Device memory and streams go through NVIDIA's `cuda-python` bindings (`cuda.bindings.runtime`,
the `cuda-bindings` package): the CUDA runtime API as it is, with stream capture and CUDA graphs,
2D/3D copies and pinned host memory, statically linked (no libcudart lookup), 8 MB, and it imports
without a GPU. Polygraphy's `polygraphy.cuda` (ctypes over libcudart) has no stream capture or
graph calls and needs a libcudart.so on the path, so it would have needed those added by hand.

One stream; every call, copy and commit is queued on it in order. bind(plan) gives every call
regime a profile of its own (`assign_profiles`: `lantern-export trt` builds one per regime of a
step plan, equal shapes included) and so its own execution context (a context holds one profile,
and a profile one context at a time), device buffers for the plan's host feeds (ids, positions,
masks, settings) with pinned staging buffers beside them, device buffers for every output, and
the tensor addresses, set once. All contexts share one scratch allocation (TensorRT's activation
memory, USER_MANAGED): calls never overlap on the one stream. run(call) copies the host feeds into
their pinned staging buffers (host memcpy) and launches the regime's CUDA graph: the staging ->
device copies and `execute_async_v3`, captured after the regime's first, eager run (TensorRT
wants one enqueue before capture; TensorRT-RTX compiles its shape-specialized kernels then). A
graph stands for its context's state at capture: a context given other shapes or addresses (an
unbound call such as a `check` case in the same profile) drops the graph and captures again.
With cuda_graphs=False the same copies and enqueue are issued one by one.

On the device, without kernels of our own:
  gather  one device-to-device copy per run of consecutive (row, column) pairs; the loop's
          gathers are B x W hidden vectors, so a few to a few dozen small copies per drafter call.
  commit  one cudaMemcpy3DAsync per run of consecutive slots and per cache (keys, values): a
          [layers x heads x slots x head_dim] box moves between the new-K/V output and the cache
          in one call (pitches: a slot row; slices: a layer), so a step's commit is 2 to
          2 x (depth + 1) x rows copy calls and never leaves the GPU.
  numpy   a device-to-host copy and a stream synchronize (logits, top-K).
The price of copies over kernels is API calls: a few microseconds each on the host. In-place
engines (--attention inplace) commit with their commit graph instead, one launch, and their
present_* outputs are bound to the past_* cache buffers they update (untested on a GPU so far).
Device step (step="device"; the default stays the host step until a GPU measures both: tools/
gpu_check's tensorrt graph-step sections): the whole step on the plans of the engine's step graphs
(`lantern-export accept`, then `trt`) through lantern.runtime.graph_step, tensorrt_step.py.
"""
import importlib
import os

from lantern.runtime.backends import TENSORRT
from lantern.runtime.backends.cuda import CudaArrays, DeviceArray, _host_values
from lantern.runtime.backends.tensorrt_plans import (FLAVOR_MODULES, assign_profiles, call_shapes, find_profile,
                                                     installed_versions, rebuild_command, select_plans, uncovered_call)
from lantern.runtime.backends.tensorrt_step import TensorRTGraphStep
from lantern.runtime.contracts import graph_io
from lantern.runtime.errors import LanternError

TRT_DTYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT64": "int64", "INT32": "int32",
               "BOOL": "bool", "INT8": "int8", "UINT8": "uint8"}

# ---------------------------------------------------------------------------------------------
# The backend


class _HostFeed:
    """A feed the loop writes on the host, its pinned staging copy and its device buffer."""

    def __init__(self, host, staging, pinned, device):
        self.host, self.staging, self.pinned, self.device = host, staging, pinned, device

    def stage(self):
        self.staging[...] = _host_values(self.host, self.device.dtype)


class _Bound:
    """One call prepared to run: its context (graph, profile), input shapes, host feeds, tensor
    addresses and, once captured, its CUDA graph."""

    def __init__(self, call, context_key, shapes, host, addresses):
        self.call, self.context_key, self.shapes = call, context_key, shapes
        self.host = host  # [_HostFeed]
        self.addresses = addresses  # tensor name -> device address
        self.runs = 0
        self.graph = None
        self.done = None  # event recorded after the last launch: staging is reused after it


class TensorRTBackend(TensorRTGraphStep, CudaArrays):
    name = TENSORRT.name
    # the device step (the step graphs' plans, GraphStep) has not yet run on a GPU: no measurement
    # says it is faster than the host step, so a generation runs the host step unless it asks
    # (tools/gpu_check's tensorrt_graph_step section measures both)
    default_step = "host"

    def __init__(self, directory, manifest, threads=None, device="cuda", flavor=None, plans=None, cuda_graphs=True):
        """threads: unused (the GPU runs the graphs). device: cuda or cuda:N. flavor / plans:
        pick a flavor or a plans/KEY build (default: the first build that runs here).
        cuda_graphs: capture each bound call regime in a CUDA graph (default) or enqueue it."""
        self.directory, self.manifest = directory, manifest
        if not manifest.tensorrt:
            raise LanternError(f"{directory} has no TensorRT plans; build them with `lantern-export trt {directory}` "
                               f"(--compute-capability current on the GPU machine, or named GPUs with TensorRT-RTX)")
        super().__init__(device, manifest.dtype)
        self.gpu = self.cuda.compute_capability()
        self.key, self.plans = select_plans(manifest, directory, self.gpu, installed_versions(), flavor, plans)
        self.trt = trt = importlib.import_module(FLAVOR_MODULES[self.plans.flavor])
        self.cuda_graphs = bool(cuda_graphs)
        self.logger = error_logger(trt)
        self.runtime = trt.Runtime(self.logger)
        self.graph_entries = dict(manifest.graphs)
        self.engines = {}  # the engine's graphs' plans now; the step graphs' when a GraphStep opens them
        for graph, plan_file in self.plans.plans.items():
            if graph in self.graph_entries:
                self.engines[graph] = self._deserialize(graph, plan_file)
        self.scratch, self.scratch_bytes = None, 0
        self._grow_scratch(max(e.device_memory_size_v2 for e in self.engines.values()))
        self.contexts = {}  # (graph, profile) -> execution context
        self.owner = {}  # (graph, profile) -> the _Bound whose addresses the context holds
        self._bound = {}  # id(call) -> _Bound
        self._steps = {}  # id(plan) -> its GraphStep, reused (refilled) by the plan's next generations
        self._sequences = {}  # id(call list) -> _Sequence (the call list kept in it: ids are reused)

    # -- opening ---------------------------------------------------------------------------------
    def _deserialize(self, graph, plan_file):
        return load_plan(self.trt, self.runtime, self.logger, self.directory, self.plans.flavor, plan_file,
                         self.graph_entries.get(graph), rebuild_command(self.directory, self.plans.flavor, self.gpu))

    def _grow_scratch(self, nbytes):
        """One scratch allocation (TensorRT's activation memory) for every context, at least
        nbytes: a step plan opened later may need more; every context then moves to the new one
        (and captured graphs, which hold the old addresses, go)."""
        if nbytes <= self.scratch_bytes:
            return
        if self.scratch is not None:
            self.synchronize()
        self.scratch, self.scratch_bytes = self.cuda.malloc(nbytes), nbytes
        for context in getattr(self, "contexts", {}).values():
            context.set_device_memory(self.scratch.ptr, self.scratch_bytes)
        for bound in getattr(self, "_bound", {}).values():
            bound.graph, bound.runs = None, 0
        for sequence in getattr(self, "_sequences", {}).values():
            sequence.graph, sequence.runs = None, 0

    def _context(self, graph, profile):
        key = (graph, profile)
        if key not in self.contexts:
            engine, trt = self.engines[graph], self.trt
            self.logger.clear()
            user_managed = trt.ExecutionContextAllocationStrategy.USER_MANAGED  # the shared scratch below
            if hasattr(engine, "create_runtime_config"):
                config = engine.create_runtime_config()
                config.set_execution_context_allocation_strategy(user_managed)
                if hasattr(config, "dynamic_shapes_kernel_specialization_strategy"):
                    # TensorRT-RTX: compile the shape-specialized kernels at the first run, so the
                    # CUDA graph captured after it holds them rather than the generic fallbacks
                    config.dynamic_shapes_kernel_specialization_strategy = \
                        trt.DynamicShapesKernelSpecializationStrategy.EAGER
                context = engine.create_execution_context(config)
            else:
                context = engine.create_execution_context(user_managed)
            if context is None:
                raise LanternError(f"{graph}: TensorRT cannot create an execution context ({self.logger.first_error()})")
            context.set_device_memory(self.scratch.ptr, self.scratch_bytes)
            if not context.set_optimization_profile_async(profile, self.cuda.handle):
                raise LanternError(f"{graph}: TensorRT cannot select profile {profile} ({self.logger.first_error()})")
            self.contexts[key] = context
        return self.contexts[key]

    def _tensor_dtype(self, graph, name):
        trt_dtype = self.engines[graph].get_tensor_dtype(name)
        return TRT_DTYPES.get(trt_dtype.name, trt_dtype.name.lower())

    # -- binding ---------------------------------------------------------------------------------
    def _prepare(self, call, profile, given=None):
        """A _Bound for a call in a profile: its context with the input shapes set, device buffers
        for its host feeds (pinned staging beside them) and for its outputs (or the `given` device
        buffers: a step graph writing the next call's feeds), every tensor address."""
        shapes = call_shapes(call)
        context = self._context(call.graph, profile)
        self._forget_context((call.graph, profile))  # its shapes and addresses change here
        host, addresses = [], {}
        self.logger.clear()
        for name, buf in call.feeds.items():
            dtype = self._tensor_dtype(call.graph, name)
            if isinstance(buf, DeviceArray):
                if buf.dtype != dtype:
                    raise LanternError(f"{call.graph} input {name}: a {buf.dtype} device buffer for a {dtype} tensor")
                addresses[name] = buf.ptr
            else:
                device = self._empty(shapes[name], dtype)
                host.append(_HostFeed(buf, *self._pinned(shapes[name], dtype), device))
                addresses[name] = device.ptr
            if not context.set_input_shape(name, shapes[name]):
                raise LanternError(f"{call.graph} input {name}: TensorRT refuses shape {list(shapes[name])} "
                                   f"({self.logger.first_error()})")
        outputs, given = {}, given or {}
        entry = self.graph_entries.get(call.graph)  # None: a step graph (no aliases; the engine names its outputs)
        aliases = graph_io(entry.contract, max(entry.layers, 1))["aliases"] if entry is not None else {}
        for name, _ in (self.graph_outputs(call.graph) if entry is None else [(n, None) for n in entry.outputs]):
            shape = tuple(context.get_tensor_shape(name))
            if name in aliases:  # IKVCacheUpdateLayer writes into its cache input: one buffer
                feed = call.feeds[aliases[name]]
                outputs[name] = feed if isinstance(feed, DeviceArray) else next(f.device for f in host if f.host is feed)
                addresses[name] = addresses[aliases[name]]
                continue
            want = call.output_shapes.get(name)
            if want is not None and tuple(want) != shape:
                raise LanternError(f"{call.graph} output {name}: the plan gives {list(shape)}, the step plan expects "
                                   f"{list(want)}; rebuild the plans")
            dtype = self._tensor_dtype(call.graph, name)
            if name in given:
                if not isinstance(given[name], DeviceArray) or (given[name].shape, given[name].dtype) != (shape, dtype):
                    raise LanternError(f"{call.graph} output {name}: the plan gives {dtype} {list(shape)}, the step binds "
                                       f"{given[name]!r}; rebuild the plans")
                outputs[name] = given[name]
            else:
                outputs[name] = self._empty(shape, dtype)
            addresses[name] = outputs[name].ptr
        return _Bound(call, (call.graph, profile), shapes, host, addresses), outputs

    def _set_addresses(self, bound):
        """Give the call's context this call's shapes and addresses, unless it holds them already."""
        context = self.contexts[bound.context_key]
        if self.owner.get(bound.context_key) is not bound:
            self._forget_context(bound.context_key)  # another call's (a plan's call and its step's device call)
            for name, shape in bound.shapes.items():
                context.set_input_shape(name, shape)
            for name, ptr in bound.addresses.items():
                context.set_tensor_address(name, ptr)
            self.owner[bound.context_key] = bound
        return context

    def _forget_context(self, key):
        """A context is about to get other shapes or addresses: the call that held it loses its
        CUDA graph (a graph stands for its context's state at capture) and is captured again."""
        bound = self.owner.pop(key, None)
        if bound is not None and bound.graph is not None:
            self.synchronize()  # no launch of the graph may be in flight when it goes
            bound.graph, bound.runs = None, 0
        for sequence in self._sequences.values():  # a step graph holding the context's old addresses
            if key in sequence.keys and sequence.graph is not None:
                self.synchronize()
                sequence.graph, sequence.runs = None, 0

    def bind(self, plan):
        profiles = assign_profiles(self.directory, self.key, self.plans, plan, self.gpu)
        for regime, call in plan.calls.items():
            bound, call.outputs = self._prepare(call, profiles[regime])
            self._bound[id(call)] = bound

    def _unbind(self, call):
        bound = self._bound.pop(id(call), None)
        if bound is not None and self.owner.get(bound.context_key) is bound:
            self._forget_context(bound.context_key)

    def release(self, plan):
        """Forget a plan's bindings and graphs (the engine keeps one plan at a time)."""
        self.synchronize()
        step = self._steps.pop(id(plan), None)
        if step is not None:
            self._drop_step(step)
        for call in plan.calls.values():
            self._unbind(call)

    # -- running ---------------------------------------------------------------------------------
    def _enqueue(self, bound):
        """The staging -> device copies and the TensorRT enqueue of a bound call, on the stream."""
        self.logger.clear()
        for feed in bound.host:
            self.cuda.memcpy(feed.device.ptr, feed.staging.ctypes.data, feed.device.nbytes, "cudaMemcpyHostToDevice")
        return self.contexts[bound.context_key].execute_async_v3(self.cuda.handle)

    def run(self, call):
        bound = self._bound.get(id(call))
        if bound is None or bound.call is not call:
            return self._run_once(call)
        if bound.done is not None:  # the staging buffers are free once the last launch finished
            self.cuda.call(self.cuda.rt.cudaEventSynchronize, bound.done)
        for feed in bound.host:
            feed.stage()
        if bound.graph is not None:
            bound.graph.launch()
        else:
            self._set_addresses(bound)
            if not self._enqueue(bound):
                raise LanternError(f"{call.graph} call {call.regime}: TensorRT's enqueue failed "
                                   f"({self.logger.first_error()})")
            if self.cuda_graphs and bound.runs == 0 and self._capturable(bound):
                self.synchronize()  # first run eager (TensorRT's lazy setup), then capture for the next ones
                bound.graph = self.cuda.capture(lambda: self._enqueue(bound))
        if bound.done is None:
            bound.done = self.cuda.event()
        self.cuda.call(self.cuda.rt.cudaEventRecord, bound.done, self.cuda.stream)
        bound.runs += 1
        return call.outputs

    def _capturable(self, bound):
        check = getattr(self.contexts[bound.context_key], "is_stream_capturable", None)  # where the version has it
        return check is None or check(self.cuda.handle)

    def _run_once(self, call):
        """A call that was not bound (check cases, the VQ decoder): buffers made for it, freed
        with its outputs; it runs in the first profile that covers it."""
        shapes = call_shapes(call)
        if call.graph not in self.plans.plans:
            raise LanternError(f"plans/{self.key} have no {call.graph} plan; rebuild them with "
                               f"`{rebuild_command(self.directory, self.plans.flavor, self.gpu)}`")
        profile = find_profile(self.plans.plans[call.graph], shapes)
        if profile is None:
            raise uncovered_call(self.directory, self.key, self.plans, call.graph, call.regime, shapes, self.gpu)
        bound, outputs = self._prepare(call, profile)
        for feed in bound.host:
            feed.stage()
        self._set_addresses(bound)
        if not self._enqueue(bound):
            raise LanternError(f"{call.graph} call {call.regime}: TensorRT's enqueue failed ({self.logger.first_error()})")
        self.synchronize()  # the staging buffers go with `bound`
        self.owner.pop(bound.context_key, None)
        return outputs

    # -- for `lantern-export check` --------------------------------------------------------------
    def call_shapes(self, graph):
        """[(case name, {input: shape})]: the shapes this backend serves for a graph, one case per
        profile (its min and max too when it spans), for check's cases."""
        plan_file = self.plans.plans.get(graph)
        if plan_file is None:
            return []
        cases = []
        for index, profile in enumerate(plan_file.profiles):
            name = profile.serves[0] if profile.serves else f"profile{index}"
            points = ["opt"] + [k for k in ("min", "max") if any(r[k] != r["opt"] for r in profile.shapes.values())]
            for point in points:
                cases.append((name if point == "opt" else f"{name} {point}",
                              {n: tuple(r[point]) for n, r in profile.shapes.items()}))
        return cases


def load_plan(trt, runtime, logger, directory, flavor, plan_file, entry, rebuild):
    """A plan file deserialized and checked against its manifest entry (inputs, outputs, one
    optimization profile per recorded one; a step graph's plan has no entry: its profiles only);
    a LanternError with the rebuild line otherwise. TensorRTBackend and tensorrt-torch open their
    plans with it."""
    path = os.path.join(directory, plan_file.file)
    logger.clear()
    with open(path, "rb") as f:
        engine = runtime.deserialize_cuda_engine(f.read())
    if engine is None:
        raise LanternError(f"{path}: {flavor} cannot load the plan ({logger.first_error()}); rebuild it with "
                           f"`{rebuild}`")
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = {n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT}
    if (entry is not None and (inputs != set(entry.inputs) or set(names) - inputs != set(entry.outputs))) \
            or engine.num_optimization_profiles != len(plan_file.profiles):
        raise LanternError(f"{path}: the plan's inputs, outputs or profiles differ from the manifest's; rebuild it "
                           f"with `{rebuild}`")
    return engine


def error_logger(trt):
    """A TensorRT logger that keeps errors (TensorRT reports failures only there) and prints nothing.
    The builder (lantern.export.tensorrt_build) uses it too."""

    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors = []

        def log(self, severity, msg):
            if severity <= trt.ILogger.Severity.ERROR:
                self.errors.append(" ".join(str(msg).split()))

        def clear(self):
            self.errors.clear()
            return self

        def first_error(self):
            """The first error since the last clear()."""
            return self.errors[0] if self.errors else "no error message from TensorRT"

    return Logger()

