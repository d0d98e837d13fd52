"""Device memory, streams and CUDA graphs for the GPU backends, through NVIDIA's `cuda-python`
bindings (`cuda.bindings.runtime`): address arithmetic for gathers and cache commits (pure,
tested on the host), the CUDA runtime wrapper, device arrays and `CudaArrays`, the part of a
backend that owns them.
"""
import ctypes

import numpy as np

from lantern.runtime.errors import LanternError

_ENGINE_FLOATS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

# ---------------------------------------------------------------------------------------------
# Device memory (pure address arithmetic first: tested on the host)


def gather_runs(src_shape, rows, cols, out_rows, out_cols):
    """out[i, j] = src[rows[i, j], cols[i, j]] as copies of whole vectors: [(src index, out
    index, count)] in units of one vector (src and out flattened over their first two dims),
    consecutive pairs merged."""
    src = (np.asarray(rows) * src_shape[1] + np.asarray(cols)).reshape(-1)
    dst = (np.arange(out_rows)[:, None] * out_cols + np.arange(out_cols)[None, :]).reshape(-1)
    return _runs(src, dst)


def commit_runs(cache_shape, new_shape, rows, src, dst):
    """cache[:, rows, :, dst] = new[:, rows, :, src] as 3D copies: [(row, src slot, dst slot,
    count)] with consecutive slots of one row merged; each moves a [layers, heads, count,
    head_dim] box (see copy3d_params)."""
    rows, src, dst = (np.asarray(a, dtype=np.int64).reshape(-1) for a in np.broadcast_arrays(rows, src, dst))
    if len(rows) and (src.max() >= new_shape[3] or dst.max() >= cache_shape[3] or rows.max() >= cache_shape[1]):
        raise IndexError("commit indices out of range")
    out = []
    for i in range(len(rows)):
        if out and out[-1][0] == rows[i] and out[-1][1] + out[-1][3] == src[i] and out[-1][2] + out[-1][3] == dst[i]:
            out[-1][3] += 1
        else:
            out.append([int(rows[i]), int(src[i]), int(dst[i]), 1])
    return [tuple(r) for r in out]


def copy3d_params(cache_shape, new_shape, itemsize, row, src, dst, count):
    """One commit run as a 3D copy from new [L, B, H, T, hd] to cache [L, B, H, P, hd]:
    {"src", "dst": (byte offset, pitch, rows per slice)} and the box (width bytes, height, depth).
    A pitch is one head's row of slots (T or P slots of hd elements); a slice (one layer) is
    B * H such rows; the box is `count` slots wide, H heads high and L layers deep."""
    layers, _, heads, capacity, hd = cache_shape
    slot = hd * itemsize

    def side(shape, slot_index):
        _, batch, _, slots, _ = shape
        return ((row * heads * slots + slot_index) * slot, slots * slot, batch * heads)

    return {"src": side(new_shape, src), "dst": side(cache_shape, dst), "box": (count * slot, heads, layers)}


def _runs(src, dst):
    out = []
    for s, d in zip(src.tolist(), dst.tolist()):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += 1
        else:
            out.append([s, d, 1])
    return [tuple(r) for r in out]


def to_bfloat16(x):
    """float array -> bfloat16 bits (uint16), rounded to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bfloat16(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _storage(dtype):
    """The numpy type that holds a tensor's bytes (bfloat16 as uint16)."""
    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)


def _host_values(array, dtype):
    """A host array as the bytes of a device tensor of `dtype`."""
    if dtype == "bfloat16":
        return to_bfloat16(array)
    return np.ascontiguousarray(array, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# The CUDA runtime


class _Cuda:
    """The few CUDA runtime calls the backend makes, each checked: a failure is one LanternError."""

    def __init__(self, device, stream=True):
        try:
            from cuda.bindings import runtime
        except ImportError:
            raise LanternError("the tensorrt backend needs NVIDIA's CUDA Python bindings: "
                               "pip install 'lantern[tensorrt]' (or [tensorrt-rtx])") from None
        self.rt = rt = runtime
        count = self.call(rt.cudaGetDeviceCount, what="no CUDA GPU is visible (the tensorrt backend runs on NVIDIA "
                                                       "GPUs)")
        if not 0 <= device < count:
            raise LanternError(f"device cuda:{device}: this machine has {count} CUDA GPU(s)")
        self.device = device
        self.call(rt.cudaSetDevice, device)
        if stream:
            self.stream = self.call(rt.cudaStreamCreateWithFlags, rt.cudaStreamNonBlocking)
            self.handle = int(self.stream)

    def call(self, fn, *args, what=None):
        err, *values = fn(*args)
        if err != self.rt.cudaError_t.cudaSuccess:
            name = self.rt.cudaGetErrorName(err)[1].decode()
            raise LanternError(f"{what or 'CUDA ' + fn.__name__ + ' failed'}: {name}")
        return values[0] if len(values) == 1 else (tuple(values) or None)

    def compute_capability(self):
        attr = self.rt.cudaDeviceAttr
        major = self.call(self.rt.cudaDeviceGetAttribute, attr.cudaDevAttrComputeCapabilityMajor, self.device)
        minor = self.call(self.rt.cudaDeviceGetAttribute, attr.cudaDevAttrComputeCapabilityMinor, self.device)
        return f"SM{major}{minor}"

    def malloc(self, nbytes):
        return _Allocation(self, self.call(self.rt.cudaMalloc, max(int(nbytes), 1)), pinned=False)

    def malloc_host(self, nbytes):
        return _Allocation(self, self.call(self.rt.cudaMallocHost, max(int(nbytes), 1)), pinned=True)

    def memcpy(self, dst, src, nbytes, kind):
        if nbytes:
            self.call(self.rt.cudaMemcpyAsync, dst, src, nbytes, getattr(self.rt.cudaMemcpyKind, kind), self.stream)

    def memset(self, ptr, nbytes):
        self.call(self.rt.cudaMemsetAsync, ptr, 0, nbytes, self.stream)

    def copy3d(self, src, dst, box):
        """Device-to-device copy of a box (width bytes, height rows, depth slices) between
        pitched buffers given as (address, pitch, rows per slice)."""
        rt = self.rt
        p = rt.cudaMemcpy3DParms()
        p.srcPtr = rt.make_cudaPitchedPtr(src[0], src[1], src[1], src[2])
        p.dstPtr = rt.make_cudaPitchedPtr(dst[0], dst[1], dst[1], dst[2])
        p.extent = rt.make_cudaExtent(*box)
        p.kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        self.call(rt.cudaMemcpy3DAsync, p, self.stream)

    def synchronize(self):
        self.call(self.rt.cudaStreamSynchronize, self.stream)

    def event(self):
        return self.call(self.rt.cudaEventCreateWithFlags, self.rt.cudaEventDisableTiming)

    def capture(self, enqueue):
        """A CUDA graph of what enqueue() queues on the stream, instantiated; None when the work
        cannot be captured (the regime then runs eagerly)."""
        rt = self.rt
        self.call(rt.cudaStreamBeginCapture, self.stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal)
        try:
            ok = enqueue()
        finally:
            err, graph = rt.cudaStreamEndCapture(self.stream)
        if not ok or err != rt.cudaError_t.cudaSuccess:
            rt.cudaGetLastError()  # clear the capture error
            return None
        try:
            return _Graph(self, self.call(rt.cudaGraphInstantiate, graph, 0))
        finally:
            rt.cudaGraphDestroy(graph)


class _Allocation:
    def __init__(self, cuda, ptr, pinned):
        self.cuda, self.ptr, self.pinned = cuda, int(ptr), pinned

    def __del__(self):
        try:
            (self.cuda.rt.cudaFreeHost if self.pinned else self.cuda.rt.cudaFree)(self.ptr)
        except Exception:  # interpreter shutdown
            pass


class _Graph:
    def __init__(self, cuda, exec_):
        self.cuda, self.exec = cuda, exec_

    def launch(self):
        self.cuda.call(self.cuda.rt.cudaGraphLaunch, self.exec, self.cuda.stream)

    def __del__(self):
        try:
            self.cuda.rt.cudaGraphExecDestroy(self.exec)
        except Exception:
            pass


def gpu_compute_capability(device=0):
    """The compute capability of a visible GPU as 'SM89', or None (no GPU, no driver, or no
    CUDA bindings installed)."""
    try:
        return _Cuda(device, stream=False).compute_capability()
    except LanternError:
        return None


class DeviceArray:
    """A tensor in device memory: shape, dtype ('float32', 'float16', 'bfloat16', 'int64',
    'bool'), the address. Indexing the first axis with an int gives a view (the cache's layers);
    any other index gives a host view resolved by the backend's numpy()."""

    def __init__(self, allocation, ptr, shape, dtype):
        self.allocation, self.ptr, self.shape, self.dtype = allocation, int(ptr), tuple(shape), dtype

    @property
    def itemsize(self):
        return _storage(self.dtype).itemsize

    @property
    def nbytes(self):
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
            i = int(index) + (self.shape[0] if index < 0 else 0)
            if not 0 <= i < self.shape[0]:
                raise IndexError(f"index {index} out of range for {self.shape[0]}")
            step = self.nbytes // self.shape[0]
            return DeviceArray(self.allocation, self.ptr + i * step, self.shape[1:], self.dtype)
        return _HostView(self, index)

    def __repr__(self):
        return f"DeviceArray({list(self.shape)}, {self.dtype}, 0x{self.ptr:x})"


class _HostView:
    """device_array[index] for an index that is not a plain layer: read through numpy()."""

    def __init__(self, base, index):
        self.base, self.index = base, index

    def __getitem__(self, index):
        return _HostView(self, index)


class CudaArrays:
    """The array half of the Backend protocol on one CUDA stream: device buffers of the engine's
    dtype (zeros), reading them back (numpy), and the loop's in-place moves (copy, gather,
    commit), all queued in order on the stream. TensorRTBackend runs plans on top of it."""

    def __init__(self, device, engine_dtype):
        self.cuda = _Cuda(_device_index(device))
        self.engine_dtype = _ENGINE_FLOATS[engine_dtype]
        # bf16 has no numpy type: host copies of bf16 buffers come back as float32
        self.float_dtype = {"fp32": np.float32, "fp16": np.float16, "bf16": np.float32}[engine_dtype]

    def _empty(self, shape, dtype):
        array = DeviceArray(None, 0, shape, dtype)
        array.allocation = self.cuda.malloc(array.nbytes)
        array.ptr = array.allocation.ptr
        return array

    def zeros(self, shape):
        array = self._empty(shape, self.engine_dtype)
        self.cuda.memset(array.ptr, array.nbytes)
        return array

    def _pinned(self, shape, dtype):
        """(a numpy array in page-locked host memory, its allocation): staging the device copies
        can be captured in a CUDA graph from (pageable memory cannot)."""
        storage = _storage(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * storage.itemsize
        allocation = self.cuda.malloc_host(nbytes)
        raw = (ctypes.c_byte * max(nbytes, 1)).from_address(allocation.ptr)
        view = np.frombuffer(raw, dtype=np.uint8, count=nbytes).view(storage).reshape(shape)
        return view, allocation

    def synchronize(self):
        self.cuda.synchronize()

    def numpy(self, array):
        if isinstance(array, _HostView):
            return self.numpy(array.base)[array.index]
        if not isinstance(array, DeviceArray):
            return np.asarray(array)
        host = np.empty(array.shape, dtype=_storage(array.dtype))
        self.cuda.memcpy(host.ctypes.data, array.ptr, array.nbytes, "cudaMemcpyDeviceToHost")
        self.synchronize()
        return from_bfloat16(host) if array.dtype == "bfloat16" else host

    def copy(self, src, out):
        if not isinstance(out, DeviceArray):
            np.copyto(out, self.numpy(src))
            return
        if isinstance(src, DeviceArray):
            if (src.shape, src.dtype) != (out.shape, out.dtype):
                raise ValueError(f"copy {src} -> {out}: shapes or dtypes differ")
            if src.ptr != out.ptr:
                self.cuda.memcpy(out.ptr, src.ptr, out.nbytes, "cudaMemcpyDeviceToDevice")
            return
        host = _host_values(np.broadcast_to(self.numpy(src), out.shape), out.dtype)
        self.cuda.memcpy(out.ptr, host.ctypes.data, out.nbytes, "cudaMemcpyHostToDevice")
        self.synchronize()  # `host` is a temporary

    def gather(self, src, rows, cols, out):
        rows, cols = np.broadcast_arrays(rows, cols)
        if not (isinstance(src, DeviceArray) and isinstance(out, DeviceArray)):
            host = self.numpy(src)[rows, cols]
            self.copy(host, out)
            return
        vector = int(np.prod(src.shape[2:], dtype=np.int64)) * src.itemsize
        if out.shape[:2] != rows.shape or out.shape[2:] != src.shape[2:] or src.dtype != out.dtype:
            raise ValueError(f"gather {src} -> {out} with indices {list(rows.shape)}: shapes do not fit")
        for s, d, n in gather_runs(src.shape, rows, cols, out.shape[0], out.shape[1]):
            self.cuda.memcpy(out.ptr + d * vector, src.ptr + s * vector, n * vector, "cudaMemcpyDeviceToDevice")

    def commit(self, cache, new, rows, src, dst):
        if not (isinstance(cache, DeviceArray) and isinstance(new, DeviceArray)):
            raise ValueError("commit moves device buffers (the KV cache and a call's new K/V)")
        if new.dtype != cache.dtype or new.shape[:3] + new.shape[4:] != cache.shape[:3] + cache.shape[4:]:
            raise ValueError(f"commit {new} -> {cache}: shapes or dtypes do not fit")
        for run in commit_runs(cache.shape, new.shape, rows, src, dst):
            p = copy3d_params(cache.shape, new.shape, cache.itemsize, *run)
            self.cuda.copy3d((new.ptr + p["src"][0],) + p["src"][1:], (cache.ptr + p["dst"][0],) + p["dst"][1:],
                             p["box"])


def _device_index(device):
    text = str(device)
    if text == "cuda":
        return 0
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise LanternError(f"the tensorrt backend runs on an NVIDIA GPU: device must be cuda or cuda:N, got {device!r}")
