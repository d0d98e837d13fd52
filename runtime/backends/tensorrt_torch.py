"""TensorRT plans inside the torch backend: each plan a callable over torch CUDA tensors,
enqueued on torch's current stream, so TorchBackend runs it where it runs a graph's module. The
host step gets torch's per-call CUDA graphs around the enqueues; the device step
(lantern.runtime.backends.torch_step: drafting, acceptance and commits as torch ops, with
lantern.export's acceptance modules) gets the whole step, TensorRT's enqueues included, as one
CUDA graph per plan: the TensorRT step capture that TensorRTBackend (cuda-bindings, no torch)
cannot make, since its step's bookkeeping runs on the host between calls.

A plan's context per distinct input shapes (the first profile of the plan that covers them; a
profile serves one context), its outputs preallocated per context and returned as those
tensors (valid until the next call with the same shapes: the loops read a call's outputs
before that), in-place outputs bound to the cache input they update. Input and output addresses
are set before every enqueue (host calls, cheap), so each captured graph holds the addresses of
its own call. TensorRT's lazy setup needs one enqueue outside capture: TorchBackend warms a call
up before capturing it, and the device step runs its first step eagerly.

Needs a CUDA GPU, PyTorch with CUDA and the TensorRT flavor that built the plans; not yet run on
one (no machine here has full TensorRT, and TensorRT for RTX runs plans only on a GPU)."""
import importlib
import os

from lantern.runtime.backends.tensorrt import error_logger
from lantern.runtime.backends.tensorrt_plans import (FLAVOR_MODULES, find_profile, installed_versions,
                                                     rebuild_command, select_plans)
from lantern.runtime.backends.torch import TorchBackend
from lantern.runtime.contracts import graph_io
from lantern.runtime.errors import LanternError

_TORCH_OF_TRT = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT64": "int64", "INT32": "int32",
                 "BOOL": "bool", "INT8": "int8", "UINT8": "uint8"}


class TensorRTModule:
    """One plan as a module of the graph's contract: (*inputs) -> outputs, in contract order."""

    def __init__(self, torch, trt, logger, engine, plan_file, graph, inputs, outputs, aliases, where):
        self.torch, self.trt, self.logger, self.engine = torch, trt, logger, engine
        self.plan_file, self.graph, self.where = plan_file, graph, where
        self.inputs, self.outputs, self.aliases = inputs, outputs, aliases
        self.contexts = {}  # input shapes -> (context, {output name: tensor})
        self.taken = set()  # profiles held by a context

    def to(self, device):  # TorchBackend moves its modules; a plan lives where it was loaded
        return self

    def eval(self):
        return self

    def _dtype(self, name):
        trt_dtype = self.engine.get_tensor_dtype(name)
        return getattr(self.torch, _TORCH_OF_TRT.get(trt_dtype.name, trt_dtype.name.lower()))

    def _context(self, key, args):
        torch, trt = self.torch, self.trt
        shapes = dict(zip(self.inputs, key))
        profile = find_profile(self.plan_file, shapes, self.taken)
        if profile is None:
            served = sorted({label for p in self.plan_file.profiles for label in p.serves})
            raise LanternError(f"{self.graph}: no profile of its plan covers "
                               f"{', '.join(f'{n} {list(s)}' for n, s in shapes.items() if not n.startswith('past_'))}"
                               f" (built for {'; '.join(served)}); {self.where}")
        self.logger.clear()
        if hasattr(self.engine, "create_runtime_config"):  # TensorRT-RTX: shape-specialized kernels at the first
            config = self.engine.create_runtime_config()  # run, so a graph captured after it holds them
            if hasattr(config, "dynamic_shapes_kernel_specialization_strategy"):
                config.dynamic_shapes_kernel_specialization_strategy = \
                    trt.DynamicShapesKernelSpecializationStrategy.EAGER
            context = self.engine.create_execution_context(config)
        else:
            context = self.engine.create_execution_context()
        if context is None:
            raise LanternError(f"{self.graph}: TensorRT cannot create an execution context ({self.logger.first_error()})")
        stream = torch.cuda.current_stream().cuda_stream
        if not context.set_optimization_profile_async(profile, stream):
            raise LanternError(f"{self.graph}: TensorRT cannot select profile {profile} ({self.logger.first_error()})")
        for name, arg in zip(self.inputs, args):
            if arg.dtype != self._dtype(name):
                raise LanternError(f"{self.graph} input {name}: a {arg.dtype} tensor for a {self._dtype(name)} input")
            if not context.set_input_shape(name, tuple(arg.shape)):
                raise LanternError(f"{self.graph} input {name}: TensorRT refuses shape {list(arg.shape)} "
                                   f"({self.logger.first_error()})")
        outputs = {}
        for name in self.outputs:
            if name in self.aliases:  # written into its cache input: one buffer
                outputs[name] = None
                continue
            outputs[name] = torch.empty(tuple(context.get_tensor_shape(name)), dtype=self._dtype(name),
                                        device="cuda")
        self.taken.add(profile)
        self.contexts[key] = context, outputs
        return context, outputs

    def __call__(self, *args):
        key = tuple(tuple(a.shape) for a in args)
        context, outputs = self.contexts.get(key) or self._context(key, args)
        by_name = dict(zip(self.inputs, args))
        for name, arg in by_name.items():
            if not arg.is_contiguous():
                raise LanternError(f"{self.graph} input {name}: TensorRT reads dense tensors; got a strided view")
            context.set_tensor_address(name, arg.data_ptr())
        result = []
        for name in self.outputs:
            tensor = by_name[self.aliases[name]] if name in self.aliases else outputs[name]
            context.set_tensor_address(name, tensor.data_ptr())
            result.append(tensor)
        self.logger.clear()
        if not context.execute_async_v3(self.torch.cuda.current_stream().cuda_stream):
            raise LanternError(f"{self.graph}: TensorRT's enqueue failed ({self.logger.first_error()})")
        return tuple(result)


class TensorRTTorchBackend(TorchBackend):
    """The torch backend with the engine's TensorRT plans as its modules (module docstring).
    acceptance: the device step's acceptance module factories (lantern.export.torch_backend.
    open_tensorrt_torch_backend hands them in); without them only the host step runs."""

    name = "tensorrt-torch"

    def __init__(self, directory, manifest, threads=None, device="cuda", flavor=None, plans=None, cuda_graphs=True,
                 acceptance=None, accept_precision="float64"):
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
        where = f"rebuild the plans with `{rebuild_command(directory, build.flavor, gpu)}`"
        modules = {}
        for graph, entry in manifest.graphs.items():
            plan_file = build.plans.get(graph)
            if plan_file is None:
                raise LanternError(f"plans/{key} have no {graph} plan; {where}")
            path = os.path.join(directory, plan_file.file)
            with open(path, "rb") as f:
                engine = runtime.deserialize_cuda_engine(f.read())
            if engine is None:
                raise LanternError(f"{path}: {build.flavor} cannot load the plan ({logger.first_error()}); {where}")
            io = graph_io(entry.contract, max(entry.layers, 1))
            names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
            if names != set(io["inputs"]) | set(io["outputs"]):
                raise LanternError(f"{path}: the plan's inputs and outputs differ from the graph's contract; {where}")
            modules[graph] = TensorRTModule(torch, trt, logger, engine, plan_file, graph, list(io["inputs"]),
                                            list(io["outputs"]), io["aliases"], where)
        self.runtime = runtime  # the plans' runtime outlives their engines
        super().__init__(modules, manifest, threads=threads, device="cuda", cuda_graphs=cuda_graphs,
                         acceptance=acceptance, accept_precision=accept_precision)
