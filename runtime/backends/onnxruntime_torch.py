"""ONNX Runtime sessions inside the torch backend: each graph's session a callable over torch
tensors, bound by IOBinding to the tensors' own memory (no copy either way), so TorchBackend runs
it where it runs a graph's module. What this gives ONNX Runtime is the device step that its own
backend lacks (OnnxRuntimeBackend runs only acceptance as a graph; drafting, masks and commits
are the host's there): lantern.runtime.backends.torch_step's drafting, acceptance and commits as
torch ops on the tensors the sessions read and write, so a step's only crossing is its report, a
few integers per image, and the calls chain through buffers that stay where the next call reads
them (the issue's "IOBinding so outputs stay where the next call reads them").

A module binds per binding (input shapes, dtypes and addresses): the IOBinding and its output
tensors (ONNX Runtime's allocations at its first run, as torch tensors through dlpack) are made
once and reused while the same tensors come back (every call of a step plan), so outputs are
valid until a call with the same inputs runs again (the loops read a call's
outputs before that). In-place outputs (contracts with `aliases`) are bound to the cache input
they update: TensorScatter writes into the cache. On CUDA (onnxruntime-gpu beside PyTorch with
CUDA) the sessions run on torch's current stream (the CUDA provider's user_compute_stream), so
torch's ops and the sessions' kernels stay in order; ONNX Runtime's own kernels and allocations
cannot be captured in a torch CUDA graph, so this backend never captures (cuda_graphs is off).
Not yet run on a GPU: nothing here has onnxruntime-gpu and a GPU together."""
import numpy as np

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
        self.bindings = {}  # binding -> (IOBinding, output tensors, the OrtValues that own them)

    def to(self, device):  # TorchBackend moves its modules; a session runs where it was opened
        return self

    def eval(self):
        return self

    def __call__(self, *args):
        args = [a.contiguous() for a in args]  # a copy only where a caller hands a strided view
        binding = tuple((tuple(a.shape), a.dtype, a.device, a.data_ptr()) for a in args)
        entry = self.bindings.get(binding)
        if entry is not None:
            self._run(entry[0])
            return entry[1]
        if len(self.bindings) >= BINDINGS_KEPT:
            self.bindings.clear()
        entry = self.bindings[binding] = self._bind_and_run(args)
        return entry[1]

    def _bind_and_run(self, args):
        """A new binding's first run: its inputs bound to the tensors, in-place outputs to the
        caches they update, the others to memory ONNX Runtime allocates at the shapes it finds;
        those outputs, as torch tensors over that memory (dlpack), are bound for every later run."""
        torch = self.torch
        binding = self.session.io_binding()
        for name, arg in zip(self.inputs, args):
            binding.bind_input(name, *_where(arg), _numpy_dtype(arg.dtype), tuple(arg.shape), arg.data_ptr())
        by_name = dict(zip(self.inputs, args))
        device_type, device_id = _where(args[0])
        for name in self.outputs:
            if name in self.aliases:  # written into its cache input: one buffer
                cache = by_name[self.aliases[name]]
                binding.bind_output(name, device_type, device_id, _numpy_dtype(cache.dtype), tuple(cache.shape),
                                    cache.data_ptr())
            else:
                binding.bind_output(name, device_type, device_id)
        self._run(binding)
        allocated = binding.get_outputs()  # kept with the binding: they own the outputs' memory
        outputs = []
        for name, value in zip(self.outputs, allocated):
            if name in self.aliases:
                outputs.append(by_name[self.aliases[name]])
                continue
            tensor = torch.from_dlpack(value)
            binding.bind_output(name, device_type, device_id, _numpy_dtype(tensor.dtype), tuple(tensor.shape),
                                tensor.data_ptr())
            outputs.append(tensor)
        return binding, tuple(outputs), allocated

    def _run(self, binding):
        try:
            self.session.run_with_iobinding(binding)
        except Exception as e:  # ORT raises its own exception types
            raise LanternError(f"{self.graph}: ONNX Runtime failed ({str(e).splitlines()[0]})") from None


def _numpy_dtype(dtype):
    return np.dtype(str(dtype).removeprefix("torch."))


def _where(tensor):
    return tensor.device.type, tensor.device.index or 0


class OnnxRuntimeTorchBackend(TorchBackend):
    """The torch backend with the engine's ONNX graphs, run by ONNX Runtime, as its modules
    (module docstring). acceptance: the device step's acceptance module factories
    (lantern.export.torch_backend.open_onnxruntime_torch_backend hands them in); without them
    only the host step runs. Quantized engines run too: ONNX Runtime runs their graphs. threads:
    ONNX Runtime's intra-op threads per session."""

    name = "onnxruntime-torch"

    def __init__(self, directory, manifest, threads=None, device="cpu", acceptance=None,
                 accept_precision="float64"):
        try:
            import torch
        except ImportError:
            raise LanternError("the onnxruntime-torch backend needs PyTorch (pip install 'lantern[export]')") from None
        if device not in ("cpu", "cuda"):
            raise LanternError(f"unknown device {device!r}; valid: cpu, cuda")
        if device == "cuda" and not torch.cuda.is_available():
            raise LanternError("device cuda: this PyTorch has no CUDA device")
        stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else None
        sessions = OnnxRuntimeBackend(directory, manifest, threads=threads, device=device, io_binding=False,
                                      cuda_stream=stream)
        if not hasattr(sessions.ort.OrtValue, "__dlpack__"):
            raise LanternError(f"onnxruntime {sessions.ort.__version__} cannot hand its outputs to torch (no "
                               f"DLPack); pip install -U onnxruntime (or onnxruntime-gpu)")
        modules = {}
        for graph, entry in manifest.graphs.items():
            io = graph_io(entry.contract, max(entry.layers, 1))
            modules[graph] = OnnxRuntimeModule(torch, sessions.sessions[graph], graph, list(io["inputs"]),
                                               list(io["outputs"]), io["aliases"])
        self.sessions = sessions
        # torch runs only the step's bookkeeping and acceptance here: on the CPU one thread, so its
        # pool does not contend with ONNX Runtime's (GPT-B, 2 cores: 6 ms less per step than 2)
        super().__init__(modules, manifest, threads=1 if device == "cpu" else None, device=device,
                         cuda_graphs=False, acceptance=acceptance, accept_precision=accept_precision)

    def release(self, plan):
        super().release(plan)
        for module in self.modules.values():
            module.bindings.clear()  # the plan's tensors are going, and with them their calls' outputs
