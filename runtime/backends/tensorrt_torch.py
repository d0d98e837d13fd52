"""TensorRT plans inside the torch backend: each plan a callable over torch CUDA tensors,
enqueued on torch's current stream, so TorchBackend runs it where it runs a graph's module. The
host step gets torch's per-call CUDA graphs around the enqueues; the device step
(lantern.runtime.graph_step over lantern.export's step modules: drafting, acceptance and commits
as torch ops) gets the whole step, TensorRT's enqueues included, as one CUDA graph per plan: the TensorRT step capture that TensorRTBackend (cuda-bindings, no torch)
cannot make, since its step's bookkeeping runs on the host between calls.

An execution context per binding (input shapes and addresses; TensorRTModule), its outputs
preallocated and returned as those tensors (valid until the same call runs again: the loops read
a call's outputs before that), in-place outputs bound to the cache input they update. Every
step path feeds a plan's calls from the same tensors (TorchBackend.bind's static inputs, which
the device step adopts), so the host step's per-call graphs and the device step's graph share
one context per call regime, each with the one profile `lantern-export trt` built for it.
TensorRT's lazy setup needs one enqueue outside capture: TorchBackend warms a call up before
capturing it, and the device step runs its first step eagerly. One activation scratch serves
every context (enqueues are in order on one stream), as in TensorRTBackend.

Needs a CUDA GPU, PyTorch with CUDA and the TensorRT flavor that built the plans; not yet run on
one (no machine here has full TensorRT, and TensorRT for RTX runs plans only on a GPU)."""
import importlib

from lantern.runtime.backends import TENSORRT_TORCH
from lantern.runtime.backends.tensorrt import TRT_DTYPES, error_logger, load_plan
from lantern.runtime.backends.tensorrt_plans import (FLAVOR_MODULES, find_profile, installed_versions,
                                                     rebuild_command, select_plans)
from lantern.runtime.backends.torch import TorchBackend
from lantern.runtime.contracts import graph_io
from lantern.runtime.errors import LanternError

class TensorRTModule:
    """One plan as a module of the graph's contract: (*inputs) -> outputs, in contract order.

    An execution context per binding (input shapes and addresses): a CUDA graph captured over a
    context holds the addresses it had then, so a context that has run inside a capture is never
    given others. A new binding takes a free profile that covers its shapes (the plans have one
    per call regime); with none free, a context that no capture used is rebound (unbound calls:
    the VQ decoder, check's cases); else a LanternError. release() forgets the contexts of a
    plan's tensors once its graphs are gone, which frees their profiles."""

    def __init__(self, torch, trt, logger, engine, plan_file, graph, inputs, outputs, aliases, scratch, where):
        self.torch, self.trt, self.logger, self.engine = torch, trt, logger, engine
        self.plan_file, self.graph, self.where, self.scratch = plan_file, graph, where, scratch
        self.inputs, self.outputs, self.aliases = inputs, outputs, aliases
        self.dtypes = {name: self._dtype(name) for name in inputs + outputs}
        self.contexts = {}  # binding -> _Context

    def to(self, device):  # TorchBackend moves its modules; a plan lives where it was loaded
        return self

    def eval(self):
        return self

    def _dtype(self, name):
        trt_dtype = self.engine.get_tensor_dtype(name)
        return getattr(self.torch, TRT_DTYPES.get(trt_dtype.name, trt_dtype.name.lower()))

    def _new_context(self, profile):
        trt = self.trt
        self.logger.clear()
        user_managed = trt.ExecutionContextAllocationStrategy.USER_MANAGED  # the backend's one scratch
        if hasattr(self.engine, "create_runtime_config"):  # TensorRT-RTX: shape-specialized kernels at the
            config = self.engine.create_runtime_config()  # first run, so a graph captured after it holds them
            config.set_execution_context_allocation_strategy(user_managed)
            if hasattr(config, "dynamic_shapes_kernel_specialization_strategy"):
                config.dynamic_shapes_kernel_specialization_strategy = \
                    trt.DynamicShapesKernelSpecializationStrategy.EAGER
            context = self.engine.create_execution_context(config)
        else:
            context = self.engine.create_execution_context(user_managed)
        if context is None:
            raise LanternError(f"{self.graph}: TensorRT cannot create an execution context ({self.logger.first_error()})")
        context.set_device_memory(self.scratch.data_ptr(), self.scratch.numel())
        if not context.set_optimization_profile_async(profile, self.torch.cuda.current_stream().cuda_stream):
            raise LanternError(f"{self.graph}: TensorRT cannot select profile {profile} ({self.logger.first_error()})")
        return _Context(context, profile)

    def _bind(self, binding, args):
        """The context for a new binding, its shapes and addresses set, its outputs allocated."""
        shapes = {name: tuple(a.shape) for name, a in zip(self.inputs, args)}
        for name, arg in zip(self.inputs, args):
            if arg.dtype != self.dtypes[name]:
                raise LanternError(f"{self.graph} input {name}: a {arg.dtype} tensor for a {self.dtypes[name]} input")
            if not arg.is_contiguous() or not arg.is_cuda:
                raise LanternError(f"{self.graph} input {name}: TensorRT reads dense CUDA tensors")
        held = {c.profile for c in self.contexts.values()}
        profile = find_profile(self.plan_file, shapes, held)
        if profile is not None:
            entry = self._new_context(profile)
        else:  # rebind a context no capture used, of a profile that covers these shapes
            old = next((b for b, c in self.contexts.items() if not c.captured
                        and self.plan_file.profiles[c.profile].covers(shapes)), None)
            if old is None:
                what = ", ".join(f"{n} {list(s)}" for n, s in shapes.items() if not n.startswith("past_"))
                raise LanternError(f"{self.graph}: every profile of its plan that covers {what} is held by a CUDA "
                                   f"graph of other tensors (open one tensorrt-torch backend per engine user, or "
                                   f"{self.where})")
            entry = self.contexts.pop(old)
        context = entry.context
        self.logger.clear()
        for name, arg in zip(self.inputs, args):
            if not context.set_input_shape(name, tuple(arg.shape)):
                raise LanternError(f"{self.graph} input {name}: TensorRT refuses shape {list(arg.shape)} "
                                   f"({self.logger.first_error()})")
            context.set_tensor_address(name, arg.data_ptr())
        entry.outputs = []
        by_name = dict(zip(self.inputs, args))
        for name in self.outputs:
            if name in self.aliases:  # written into its cache input: one buffer
                tensor = by_name[self.aliases[name]]
            else:
                tensor = self.torch.empty(tuple(context.get_tensor_shape(name)), dtype=self.dtypes[name],
                                          device=args[0].device)
            context.set_tensor_address(name, tensor.data_ptr())
            entry.outputs.append(tensor)
        self.contexts[binding] = entry
        return entry

    def __call__(self, *args):
        binding = tuple((tuple(a.shape), a.data_ptr()) for a in args)
        entry = self.contexts.get(binding) or self._bind(binding, args)
        torch = self.torch
        if torch.cuda.is_current_stream_capturing():
            entry.captured = True
        self.logger.clear()
        if not entry.context.execute_async_v3(torch.cuda.current_stream().cuda_stream):
            raise LanternError(f"{self.graph}: TensorRT's enqueue failed ({self.logger.first_error()})")
        return tuple(entry.outputs)

    def forget(self, addresses):
        """Drop the contexts bound to any of these input addresses (their graphs are gone)."""
        for binding in [b for b in self.contexts if any(ptr in addresses for _, ptr in b)]:
            del self.contexts[binding]


class _Context:
    def __init__(self, context, profile):
        self.context, self.profile = context, profile
        self.outputs = []
        self.captured = False  # a CUDA graph holds its addresses: never rebound


class TensorRTTorchBackend(TorchBackend):
    """The torch backend with the engine's TensorRT plans as its modules (module docstring).
    step_phases: the device step's modules (lantern.export.torch_backend.
    open_tensorrt_torch_backend hands them in); without them only the host step runs."""

    name = TENSORRT_TORCH.name

    def __init__(self, directory, manifest, threads=None, device="cuda", flavor=None, plans=None, cuda_graphs=True,
                 step_phases=None, accept_precision="float64"):
        try:
            import torch
        except ImportError:
            raise LanternError("the tensorrt-torch backend needs PyTorch with CUDA (pip install torch)") from None
        if not str(device).startswith("cuda") or not torch.cuda.is_available():
            raise LanternError("the tensorrt-torch backend runs TensorRT plans on an NVIDIA GPU: torch sees no CUDA "
                               "device here")
        if not manifest.tensorrt:
            raise LanternError(f"{directory} has no TensorRT plans; build them with `lantern-export trt {directory}`")
        major, minor = torch.cuda.get_device_capability()
        gpu = f"SM{major}{minor}"
        key, build = select_plans(manifest, directory, gpu, installed_versions(), flavor, plans)
        self.key, self.plans = key, build
        trt = importlib.import_module(FLAVOR_MODULES[build.flavor])
        logger = error_logger(trt)
        runtime = trt.Runtime(logger)
        rebuild = rebuild_command(directory, build.flavor, gpu)
        where = f"rebuild the plans with `{rebuild}`"
        engines = {}
        for graph, entry in manifest.graphs.items():
            plan_file = build.plans.get(graph)
            if plan_file is None:
                raise LanternError(f"plans/{key} have no {graph} plan; {where}")
            engine = load_plan(trt, runtime, logger, directory, build.flavor, plan_file, entry, rebuild)
            engines[graph] = engine, plan_file, graph_io(entry.contract, max(entry.layers, 1))
        # one activation scratch for every context: all enqueues are in order on one stream
        size = max(e.device_memory_size_v2 if hasattr(e, "device_memory_size_v2") else e.device_memory_size
                   for e, _, _ in engines.values())
        self.scratch = torch.empty(max(int(size), 1), dtype=torch.uint8, device="cuda")
        modules = {graph: TensorRTModule(torch, trt, logger, engine, plan_file, graph, list(io["inputs"]),
                                         list(io["outputs"]), io["aliases"], self.scratch, where)
                   for graph, (engine, plan_file, io) in engines.items()}
        self.runtime = runtime  # the plans' runtime outlives their engines
        super().__init__(modules, manifest, threads=threads, device="cuda", cuda_graphs=cuda_graphs,
                         step_phases=step_phases, accept_precision=accept_precision)

    def release(self, plan):
        """Forget the plan's bindings and graphs, then the contexts bound to its tensors (their
        profiles serve the next plan)."""
        tensors = [t for call in plan.calls.values() for t in
                   list(self.bound_inputs(call).values()) + list(call.feeds.values()) if isinstance(t, self.torch.Tensor)]
        step = self._steps.get(id(plan))
        if step is not None:
            tensors += [t for call in step.model_calls.values() for t in call.feeds.values()]
        super().release(plan)
        self.torch.cuda.synchronize()  # no replay of the plan's graphs is in flight when their contexts go
        addresses = {t.data_ptr() for t in tensors}
        for module in self.modules.values():
            module.forget(addresses)
