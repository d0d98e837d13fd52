"""The runtime's torch backend over an engine: its graphs rebuilt as torch modules from the
engine's source checkpoints (lantern.export.onnx_export.load_graph_modules), and the step's
modules its device step runs (lantern.export.step_graphs). lantern.runtime never imports
lantern.export, so this is where the two meet."""
from lantern.export.step_export import step_phase_factory
from lantern.export.onnx_export import load_graph_modules
from lantern.runtime import manifest as engine_format
from lantern.runtime.backends import ONNXRUNTIME, ONNXRUNTIME_TORCH, TENSORRT_TORCH, TORCH
from lantern.runtime.backends.onnxruntime_torch import OnnxRuntimeTorchBackend
from lantern.runtime.backends.tensorrt_torch import TensorRTTorchBackend
from lantern.runtime.backends.torch import TorchBackend
from lantern.runtime.errors import LanternError
from lantern.runtime.manifest import read_manifest


def open_torch_backend(directory, threads=None, device="cpu", manifest=None, accept_precision="float64"):
    """The torch backend over an engine's graphs rebuilt from its source checkpoints, with the
    step's modules for its device step."""
    manifest = manifest or read_manifest(directory)
    if (scheme := engine_format.quantization_scheme(manifest)) != "none":  # it would serve fp32 numerics
        raise LanternError(f"{directory} has {scheme}-quantized graphs, which the torch backend cannot run (it runs the "
                           f"fp32 modules); use --backend {ONNXRUNTIME.name}, or the fp32 engine for the torch "
                           f"reference")
    modules = {name: module for name, (_, module) in load_graph_modules(manifest).items()}
    return TorchBackend(modules, manifest, threads=threads, device=device, step_phases=step_phase_factory(manifest),
                        accept_precision=accept_precision)


def open_tensorrt_torch_backend(directory, threads=None, device="cuda", flavor=None, plans=None, cuda_graphs=True,
                                manifest=None, accept_precision="float64"):
    """The engine's TensorRT plans as the torch backend's modules (lantern.runtime.backends.
    tensorrt_torch), with the step's modules for its device step: the whole step, TensorRT's
    enqueues included, one CUDA graph per plan."""
    manifest = manifest or read_manifest(directory)
    return TensorRTTorchBackend(directory, manifest, threads=threads, device=device, flavor=flavor, plans=plans,
                                cuda_graphs=cuda_graphs, step_phases=step_phase_factory(manifest), accept_precision=accept_precision)


def open_onnxruntime_torch_backend(directory, threads=None, device="cpu", manifest=None, accept_precision="float64"):
    """The engine's ONNX graphs, run by ONNX Runtime, as the torch backend's modules (lantern.
    runtime.backends.onnxruntime_torch), with the step's modules for its device step: the
    whole step on ONNX Runtime's device, the calls chained through buffers that stay there."""
    manifest = manifest or read_manifest(directory)
    return OnnxRuntimeTorchBackend(directory, manifest, threads=threads, device=device, step_phases=step_phase_factory(manifest),
                                   accept_precision=accept_precision)


# by backend name (lantern-run's --backend): each (directory, threads=, device=, ...) -> the backend
OPENERS = {TORCH.name: open_torch_backend, TENSORRT_TORCH.name: open_tensorrt_torch_backend,
           ONNXRUNTIME_TORCH.name: open_onnxruntime_torch_backend}
