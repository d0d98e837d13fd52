"""Engine backends behind one small protocol (Polygraphy-style: a loader per backend, one runner).

A backend opens the graphs of an engine directory and runs them by name:
    run(graph, feeds: {input name: array}) -> {output name: array}
It also owns the arrays that stay in place between calls (the KV caches), so the decoding loop
never copies a whole cache and never knows which backend runs:
    zeros(shape, dtype) -> array          a buffer of the backend's kind
    asarray(np_array) -> array            host data in the backend's kind
    numpy(array) -> np.ndarray            back to the host
    take(array, rows, cols) -> array      array[rows, cols] (rows, cols: int arrays)
    commit(cache, new, rows, src, dst)    cache[:, rows, :, dst] = new[:, rows, :, src]
    synchronize()                         wait for queued device work (timers read after it)
    float_dtype                           the engine's float dtype as numpy understands it
"""
from lantern.runtime.errors import LanternError

BACKENDS = ("onnxruntime", "torch")


def open_backend(name, directory, manifest, **options):
    if name == "onnxruntime":
        from lantern.runtime.backends.onnxruntime import OnnxRuntimeBackend
        return OnnxRuntimeBackend(directory, manifest, **options)
    if name == "torch":
        from lantern.runtime.backends.torch import TorchBackend
        return TorchBackend.from_engine(directory, manifest, **options)
    if name == "tensorrt":
        raise LanternError("the tensorrt backend is not built yet; use onnxruntime or torch")
    raise LanternError(f"unknown backend {name!r}; valid: {', '.join(BACKENDS)}")
