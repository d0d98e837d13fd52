"""PyTorch backend: the reference (the very modules that were exported) and GPU timing.

It rebuilds the graphs from the source checkpoints recorded in the manifest, through
lantern.export's loaders, so it needs torch and the export extra; caches live on `device`."""
import numpy as np

from lantern.runtime.errors import LanternError
from lantern.runtime.manifest import graph_io

_TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class TorchBackend:
    name = "torch"

    def __init__(self, graphs, dtype="fp32", threads=None, device="cpu"):
        """graphs: {graph name: (contract name, torch module)} as lantern.export.graphs makes them."""
        import torch

        self.torch = torch
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        self.dtype = getattr(torch, _TORCH_DTYPES[dtype])
        self.float_dtype = np.float16 if dtype == "fp16" else np.float32
        self.graphs = {name: module.to(self.device) for name, (_, module) in graphs.items()}
        contracts = {name: graph_io(contract, module.target.args.n_layer if contract == "target" else 1)
                     for name, (contract, module) in graphs.items()}
        self.inputs = {name: list(c["inputs"]) for name, c in contracts.items()}
        self.outputs = {name: list(c["outputs"]) for name, c in contracts.items()}
        self.kinds = {name: {k: v[0] for k, v in c["inputs"].items()} for name, c in contracts.items()}

    @classmethod
    def from_engine(cls, directory, manifest, threads=None, device="cpu"):
        """Rebuild the graphs from the source checkpoints the manifest records."""
        try:
            import torch  # noqa: F401
            from lantern.export.onnx_export import load_graph_modules
        except ImportError as e:
            raise LanternError(f"the torch backend needs torch and lantern's export extra ({e})") from None
        return cls(load_graph_modules(manifest), manifest["dtype"], threads=threads, device=device)

    def _tensor(self, x, kind=None):
        """numpy -> torch on the device; contract 'float' inputs take the engine dtype."""
        if not isinstance(x, self.torch.Tensor):
            x = self.torch.from_numpy(np.ascontiguousarray(x)).to(self.device)
        if kind == "float":
            return x.to(self.dtype)
        return x

    def run(self, graph, feeds):
        kinds = self.kinds[graph]
        args = [self._tensor(feeds[name], kinds[name]) for name in self.inputs[graph]]
        with self.torch.inference_mode():
            out = self.graphs[graph](*args)
        out = out if isinstance(out, tuple) else (out,)
        return dict(zip(self.outputs[graph], out))

    def zeros(self, shape, dtype):
        return self.torch.zeros(shape, dtype=self.dtype, device=self.device)

    def asarray(self, array):
        return self._tensor(array)

    def numpy(self, array):
        if isinstance(array, np.ndarray):
            return array
        return array.detach().float().cpu().numpy() if array.is_floating_point() else array.cpu().numpy()

    def take(self, array, rows, cols):
        return array[self.torch.as_tensor(np.array(rows), device=self.device), self.torch.as_tensor(np.array(cols), device=self.device)]

    def commit(self, cache, new, rows, src, dst):
        t = self.torch.as_tensor
        cache[:, t(rows, device=self.device), :, t(dst, device=self.device)] = \
            new[:, t(rows, device=self.device), :, t(src, device=self.device)]

    def synchronize(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()
