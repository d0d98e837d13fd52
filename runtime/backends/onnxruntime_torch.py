"""ONNX Runtime sessions inside the torch backend: each graph's session a callable over torch
tensors, bound by IOBinding to the tensors' own memory (no copy either way), so TorchBackend runs
it where it runs a graph's module. The device step (lantern.runtime.graph_step over
lantern.export's step modules) runs drafting, acceptance and commits as torch ops on the tensors
the sessions read and write, so a step's only crossing is its report, a
few integers per image, and the calls chain through buffers that stay where the next call reads
them. On CUDA it also keeps the KV caches on the device, which OnnxRuntimeBackend copies up and
back every call there.

A module keeps one IOBinding per binding (the input tensors themselves, found by their
addresses; _Binding): its outputs (ONNX Runtime's allocations at its first run, as torch tensors
through DLPack) are reused while those tensors come back (every call of a step plan), so they are
valid until that call runs again, as the Backend protocol says; a call with other tensors gets
outputs of its own. In-place outputs (contracts with `aliases`) are bound to the cache input they
update: TensorScatter writes into the cache.

On CUDA (onnxruntime-gpu beside PyTorch with CUDA), ONNX Runtime runs on its own stream, which
cannot join torch's (nor its graphs: this backend never captures, cuda_graphs is off): each call
first waits for torch's queued work, and ONNX Runtime's run returns synchronised; inputs are
bound again every run (ORT copies an input it reads on another device at binding time). So the
device step moves a few integers per image across the bus but waits on the host once per call.
Not yet run on a GPU: nothing here has onnxruntime-gpu and a GPU together."""
import weakref

import numpy as np

from lantern.runtime.backends import ONNXRUNTIME_TORCH
from lantern.runtime.backends.onnxruntime import OnnxRuntimeBackend
from lantern.runtime.backends.torch import TorchBackend
from lantern.runtime.contracts import graph_io
from lantern.runtime.errors import LanternError

BINDINGS_KEPT = 32  # per graph: a plan's calls, the VQ decoder's chunks, check's cases


class OnnxRuntimeModule:
    """One graph's InferenceSession as a module of the graph's contract: (*inputs) -> outputs,
    in contract order (see the module docstring)."""

    def __init__(self, torch, session, graph, inputs, outputs, aliases):
        self.torch, self.session, self.graph = torch, session, graph
        self.inputs, self.outputs, self.aliases = inputs, outputs, aliases
        self.bindings = {}  # input addresses -> _Binding (of the tensors at them)

    def to(self, device):  # TorchBackend moves its modules; a session runs where it was opened
        return self

    def eval(self):
        return self

    def __call__(self, *args):
        args = [a.contiguous() for a in args]  # a copy only where a caller hands a strided view
        key = tuple(a.data_ptr() for a in args)  # finds the candidate; serves() checks it is these tensors
        entry = self.bindings.get(key)
        cuda = args[0].is_cuda
        if cuda:  # ONNX Runtime runs on its own stream: torch's queued writes to the inputs first
            self.torch.cuda.current_stream(args[0].device).synchronize()
        try:
            if entry is None or not entry.serves(args):
                if entry is None and len(self.bindings) >= BINDINGS_KEPT:
                    self.bindings.clear()
                entry = self.bindings[key] = _Binding(self, args)
                return entry.outputs
            if cuda:  # ORT copies an input it reads on another device when it is bound, not per run
                entry.bind_inputs(args)
            self.session.run_with_iobinding(entry.binding)
        except Exception as e:  # ORT raises its own exception types
            raise LanternError(f"{self.graph}: ONNX Runtime failed ({' '.join(str(e).split())[:500]})") from None
        return entry.outputs


class _Binding:
    """A binding's IOBinding, made at its first run: inputs bound to the tensors, in-place outputs
    to the caches they update, the others to memory ONNX Runtime allocates at the shapes it
    finds; those outputs, as torch tensors over that memory (DLPack), are bound for every later
    run. It serves the very tensors it was made for (weak references: an address freed and
    reused is another tensor, and another call, whose outputs must not be these)."""

    def __init__(self, module, args):
        torch, session = module.torch, module.session
        self.module, self.binding = module, session.io_binding()
        self.args = [weakref.ref(a) for a in args]
        self.bind_inputs(args)
        by_name = dict(zip(module.inputs, args))
        device_type, device_id = _where(args[0])
        binding = self.binding
        for name in module.outputs:
            if name in module.aliases:
                cache = by_name[module.aliases[name]]
                binding.bind_output(name, device_type, device_id, _numpy_dtype(cache.dtype), tuple(cache.shape),
                                    cache.data_ptr())
            else:
                binding.bind_output(name, device_type, device_id)
        session.run_with_iobinding(binding)
        self.allocated = binding.get_outputs()  # kept: they own the outputs' memory
        outputs = []
        for name, value in zip(module.outputs, self.allocated):
            if name in module.aliases:
                outputs.append(by_name[module.aliases[name]])
                continue
            tensor = torch.from_dlpack(value)
            binding.bind_output(name, device_type, device_id, _numpy_dtype(tensor.dtype), tuple(tensor.shape),
                                tensor.data_ptr())
            outputs.append(tensor)
        self.outputs = tuple(outputs)

    def serves(self, args):
        return all(ref() is arg for ref, arg in zip(self.args, args))

    def bind_inputs(self, args):
        for name, arg in zip(self.module.inputs, args):
            self.binding.bind_input(name, *_where(arg), _numpy_dtype(arg.dtype), tuple(arg.shape), arg.data_ptr())
        self.binding.synchronize_inputs()  # copies ORT queued (an input read on another device): done


def _numpy_dtype(dtype):
    return np.dtype(str(dtype).removeprefix("torch."))


def _where(tensor):
    return tensor.device.type, tensor.device.index or 0


class OnnxRuntimeTorchBackend(TorchBackend):
    """The torch backend with the engine's ONNX graphs, run by ONNX Runtime, as its modules
    (module docstring). step_phases: the device step's modules
    (lantern.export.torch_backend.open_onnxruntime_torch_backend hands them in); without them
    only the host step runs. Quantized engines run too: ONNX Runtime runs their graphs. threads:
    ONNX Runtime's intra-op threads per session, and torch's (process-wide, as TorchBackend
    sets them)."""

    name = ONNXRUNTIME_TORCH.name

    def __init__(self, directory, manifest, threads=None, device="cpu", step_phases=None,
                 accept_precision="float64"):
        try:
            import torch
        except ImportError:
            raise LanternError("the onnxruntime-torch backend needs PyTorch (pip install 'lantern[export]')") from None
        if device not in ("cpu", "cuda"):
            raise LanternError(f"unknown device {device!r}; valid: cpu, cuda")
        if device == "cuda" and not torch.cuda.is_available():
            raise LanternError("device cuda: this PyTorch has no CUDA device")
        sessions = OnnxRuntimeBackend(directory, manifest, threads=threads, device=device, io_binding=False)
        if not hasattr(sessions.ort.OrtValue, "__dlpack__"):
            raise LanternError(f"onnxruntime {sessions.ort.__version__} cannot hand its outputs to torch (no "
                               f"DLPack); pip install -U onnxruntime (or onnxruntime-gpu)")
        modules = {}
        for graph, entry in manifest.graphs.items():
            io = graph_io(entry.contract, max(entry.layers, 1))
            modules[graph] = OnnxRuntimeModule(torch, sessions.sessions[graph], graph, list(io["inputs"]),
                                               list(io["outputs"]), io["aliases"])
        self.sessions = sessions
        super().__init__(modules, manifest, threads=threads, device=device, cuda_graphs=False,
                         step_phases=step_phases, accept_precision=accept_precision)

    def release(self, plan):
        super().release(plan)
        for module in self.modules.values():
            module.bindings.clear()  # the plan's tensors are going, and with them their calls' outputs
