"""Engine backends behind one small protocol (Polygraphy's split: a loader per backend, one runner).

A backend runs the graphs of an engine directory by name and owns the arrays that live on its
device (KV caches, hidden states), so the decoding loop never copies a whole cache and never
knows which backend runs. `open_backend(name, ...)` picks one from the registry.
"""
from typing import Optional, Protocol

from lantern.runtime.errors import LanternError


class Backend(Protocol):
    name: str
    float_dtype: object  # the engine's float dtype as numpy understands it
    key: Optional[str]  # the compiled plans it runs (a Manifest.tensorrt key); None: the ONNX graphs

    def zeros(self, shape):
        """A float buffer of the engine dtype on the backend's device."""

    def bind(self, plan):
        """Prepare every call of a StepPlan once (bind its feed buffers, preallocate outputs).
        Optional work: run() must also accept calls that were never bound."""

    def run(self, call):
        """Run call.graph on call.feeds -> {output name: array} (the call's bound outputs when
        it was bound; valid until the same call runs again). An output the graph's contract
        aliases to an input (in-place graphs: present_keys_i -> past_keys_i) is that input's
        buffer, updated: bound to it, or copied back into it."""

    def numpy(self, array):
        """A host numpy array of the values."""

    def gather(self, src, rows, cols, out):
        """out[i, j] = src[rows[i, j], cols[i, j]] in place (hidden states between calls)."""

    def copy(self, src, out):
        """out[...] = src in place."""

    def commit(self, cache, new, rows, src, dst):
        """cache[:, rows, :, dst] = new[:, rows, :, src] (KV entries the loop keeps)."""

    def synchronize(self):
        """Wait for queued device work (timers read after it)."""

    def release(self, plan):
        """Forget what bind(plan) prepared (the engine keeps one plan at a time)."""

    def call_shapes(self, graph):
        """[(case name, {input: shape})]: the only shapes this backend runs a graph at (compiled
        profiles), for check's cases; None where any shape runs."""

    default_step: str  # "host" or "device": the step path Engine(step=None) takes

    def device_step_refusal(self, plan, sampler):
        """Why the device step cannot run a generation of this plan and sampler, or None."""

    def device_step(self, decoding):
        """The device step for one generation (runtime.generator; only where the refusal is None)."""


def _onnxruntime(directory, manifest, **options):
    from lantern.runtime.backends.onnxruntime import OnnxRuntimeBackend

    return OnnxRuntimeBackend(directory, manifest, **options)


def _torch(directory, manifest, modules=None, **options):
    if modules is None:
        raise LanternError("the torch backend runs the graphs as torch modules, which lantern.export rebuilds from "
                           "the engine's source checkpoints: use `lantern-run` (it does that) or "
                           "lantern.export.torch_backend.open_torch_backend(engine_dir)")
    from lantern.runtime.backends.torch import TorchBackend

    return TorchBackend(modules, manifest, **options)


def _tensorrt(directory, manifest, **options):
    from lantern.runtime.backends.tensorrt import TensorRTBackend

    return TensorRTBackend(directory, manifest, **options)


def _tensorrt_torch(directory, manifest, **options):
    from lantern.runtime.backends.tensorrt_torch import TensorRTTorchBackend

    return TensorRTTorchBackend(directory, manifest, **options)


def _onnxruntime_torch(directory, manifest, **options):
    from lantern.runtime.backends.onnxruntime_torch import OnnxRuntimeTorchBackend

    return OnnxRuntimeTorchBackend(directory, manifest, **options)


BACKENDS = {"onnxruntime": _onnxruntime, "tensorrt": _tensorrt, "torch": _torch, "tensorrt-torch": _tensorrt_torch,
            "onnxruntime-torch": _onnxruntime_torch}


def open_backend(name, directory, manifest, **options):
    if name not in BACKENDS:
        raise LanternError(f"unknown backend {name!r}; valid: {', '.join(BACKENDS)}")
    return BACKENDS[name](directory, manifest, **options)
