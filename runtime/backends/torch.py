"""PyTorch backend: the graphs as torch modules (the very modules that were exported, rebuilt by
lantern.export from the engine's source checkpoints), on the CPU or a GPU. The reference for
`check`, and the GPU path measurable where PyTorch has CUDA. lantern.runtime never imports
lantern.export: the modules are handed in."""
import numpy as np

from lantern.runtime.errors import LanternError
from lantern.runtime.manifest import graph_io

_TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class TorchBackend:
    name = "torch"

    def __init__(self, modules, manifest, threads=None, device="cpu"):
        """modules: {graph name: torch module}, inputs and outputs in the order of the graph's contract."""
        try:
            import torch
        except ImportError:
            raise LanternError("the torch backend needs PyTorch (pip install 'lantern[export]')") from None
        self.torch = torch
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
                raise LanternError(f"threads must be a positive integer, got {threads!r}")
            torch.set_num_threads(threads)
        if device == "cuda" and not torch.cuda.is_available():
            raise LanternError("device cuda: this PyTorch has no CUDA device")
        self.device = torch.device(device)
        self.dtype = getattr(torch, _TORCH_DTYPES[manifest.dtype])
        # bf16 has no numpy type: host copies of bf16 tensors come back as float32
        self.float_dtype = {"fp32": np.float32, "fp16": np.float16, "bf16": np.float32}[manifest.dtype]
        self.modules = {name: module.to(self.device).eval() for name, module in modules.items()}
        self.inputs, self.outputs, self.floats = {}, {}, {}
        for name, graph in manifest.graphs.items():
            if name not in self.modules:
                continue
            io = graph_io(graph.contract, max(graph.layers, 1))
            self.inputs[name] = list(io["inputs"])
            self.outputs[name] = list(io["outputs"])
            self.floats[name] = {k for k, (kind, _) in io["inputs"].items() if kind == "float"}

    def _tensor(self, x, is_float):
        if not isinstance(x, self.torch.Tensor):
            x = self.torch.from_numpy(np.ascontiguousarray(x)).to(self.device)
        return x.to(self.dtype) if is_float else x

    def zeros(self, shape):
        return self.torch.zeros(shape, dtype=self.dtype, device=self.device)

    def bind(self, plan):
        """Nothing to prepare: feeds are wrapped per call (zero-copy on the CPU)."""

    def run(self, call):
        floats = self.floats[call.graph]
        args = [self._tensor(call.feeds[name], name in floats) for name in self.inputs[call.graph]]
        with self.torch.inference_mode():
            out = self.modules[call.graph](*args)
        out = out if isinstance(out, tuple) else (out,)
        return dict(zip(self.outputs[call.graph], out))

    def numpy(self, array):
        if isinstance(array, np.ndarray):
            return array
        return array.detach().float().cpu().numpy() if array.is_floating_point() else array.cpu().numpy()

    def _index(self, values):
        return self.torch.as_tensor(np.array(values), device=self.device)

    def gather(self, src, rows, cols, out):
        out.copy_(src[self._index(rows), self._index(cols)])

    def copy(self, src, out):
        out.copy_(self._tensor(src, True))

    def commit(self, cache, new, rows, src, dst):
        cache[:, self._index(rows), :, self._index(dst)] = new[:, self._index(rows), :, self._index(src)]

    def synchronize(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()
