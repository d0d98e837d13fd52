"""ONNX Runtime backend: one InferenceSession per graph. On the CPU EP numpy inputs are passed
without copies, so the preallocated KV caches (numpy arrays owned here) are read in place."""
import os

import numpy as np

from lantern.runtime.errors import LanternError

_NUMPY_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": None}


class OnnxRuntimeBackend:
    name = "onnxruntime"

    def __init__(self, directory, manifest, threads=None, device="cpu"):
        try:
            import onnxruntime as ort
        except ImportError:
            raise LanternError("onnxruntime is not installed: pip install 'lantern[cpu]' (or [gpu])") from None
        if manifest["dtype"] == "bf16":
            raise LanternError("ONNX Runtime's CPU kernels do not run bf16 graphs; export fp32/fp16 or use TensorRT")
        self.float_dtype = _NUMPY_DTYPES[manifest["dtype"]]
        providers = ["CPUExecutionProvider"]
        if device == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise LanternError("the CUDA execution provider is not available (install onnxruntime-gpu)")
            providers.insert(0, "CUDAExecutionProvider")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or os.cpu_count() or 1
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Each graph has its own session and thread pool, and the decoding loop alternates between
        # them: idle threads spinning after a drafter call would steal the cores the target needs.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.sessions = {}
        for graph, entry in manifest["graphs"].items():
            path = os.path.join(directory, entry["file"])
            try:
                self.sessions[graph] = ort.InferenceSession(path, options, providers=providers)
            except Exception as e:  # ORT raises its own exception types
                raise LanternError(f"{path}: ONNX Runtime cannot load it ({str(e).splitlines()[0]}); rebuild the engine") from None
        self.outputs = {g: [o.name for o in s.get_outputs()] for g, s in self.sessions.items()}

    def run(self, graph, feeds):
        return dict(zip(self.outputs[graph], self.sessions[graph].run(None, feeds)))

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype=dtype)

    def asarray(self, array):
        return np.ascontiguousarray(array)

    def numpy(self, array):
        return array

    def take(self, array, rows, cols):
        return np.ascontiguousarray(array[rows, cols])

    def commit(self, cache, new, rows, src, dst):
        cache[:, rows, :, dst] = new[:, rows, :, src]

    def synchronize(self):
        """run() returns host arrays, so nothing is ever left in flight."""
