"""TensorRT backend: the plans `lantern-export trt` built, run on an NVIDIA GPU (full TensorRT or
TensorRT for RTX; no torch).

Opening: the manifest's plan builds (`Manifest.tensorrt`) are matched against what is here — the
installed flavor and its exact version, the GPU's compute capability — and a plan built for
another GPU or TensorRT version is refused with the `lantern-export trt` line that rebuilds it.

Device memory and streams go through NVIDIA's `cuda-python` bindings (`cuda.bindings.runtime`,
the `cuda-bindings` package): the CUDA runtime API as it is, with stream capture and CUDA graphs,
2D/3D copies and pinned host memory, statically linked (no libcudart lookup), 8 MB, and it imports
without a GPU. Polygraphy's `polygraphy.cuda` (ctypes over libcudart) has no stream capture or
graph calls and needs a libcudart.so on the path, so it would have needed those added by hand.

One stream; every call, copy and commit is queued on it in order. bind(plan) gives every call
regime a profile of its own (`assign_profiles`: `lantern-export trt` builds one per regime of a
step plan, equal shapes included) and so its own execution context (a context holds one profile,
and a profile one context at a time), device buffers for the plan's host feeds (ids, positions,
masks, settings) with pinned staging buffers beside them, device buffers for every output, and
the tensor addresses, set once. All contexts share one scratch allocation (TensorRT's activation
memory, USER_MANAGED): calls never overlap on the one stream. run(call) copies the host feeds into
their pinned staging buffers (host memcpy) and launches the regime's CUDA graph: the staging ->
device copies and `execute_async_v3`, captured after the regime's first, eager run (TensorRT
wants one enqueue before capture; TensorRT-RTX compiles its shape-specialized kernels then). A
graph stands for its context's state at capture: a context given other shapes or addresses (an
unbound call such as a `check` case in the same profile) drops the graph and captures again.
With cuda_graphs=False the same copies and enqueue are issued one by one.

On the device, without kernels of our own:
  gather  one device-to-device copy per run of consecutive (row, column) pairs; the loop's
          gathers are B x W hidden vectors, so a few to a few dozen small copies per drafter call.
  commit  one cudaMemcpy3DAsync per run of consecutive slots and per cache (keys, values): a
          [layers x heads x slots x head_dim] box moves between the new-K/V output and the cache
          in one call (pitches: a slot row; slices: a layer), so a step's commit is 2 to
          2 x (depth + 1) x rows copy calls and never leaves the GPU.
  numpy   a device-to-host copy and a stream synchronize (logits, top-K).
The price of copies over kernels is API calls: a few microseconds each on the host. In-place
engines (--attention fused) commit with their commit graph instead, one launch, and their
present_* outputs are bound to the past_* cache buffers they update (untested on a GPU so far).
"""
import ctypes
import importlib
import os

import numpy as np

from lantern.runtime.errors import LanternError
from lantern.runtime.contracts import graph_io

FLAVOR_MODULES = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx"}
_INSTALL = {"tensorrt": "pip install 'lantern[tensorrt]'", "tensorrt-rtx": "pip install 'lantern[tensorrt-rtx]'"}
_TRT_DTYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT64": "int64", "INT32": "int32",
               "BOOL": "bool", "INT8": "int8", "UINT8": "uint8"}
_ENGINE_FLOATS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


# ---------------------------------------------------------------------------------------------
# Which plans run here (pure: tested without a GPU)


def installed_versions():
    """{flavor: version} of the TensorRT flavors whose module imports here."""
    found = {}
    for flavor, module in FLAVOR_MODULES.items():
        try:
            found[flavor] = importlib.import_module(module).__version__
        except ImportError:
            pass
    return found


def rebuild_command(directory, flavor, compute_capability, batches=None, trees=None, cfg=None):
    """The `lantern-export trt` line that builds plans for this GPU (and these calls)."""
    cc = compute_capability[2:] if flavor == "tensorrt-rtx" and compute_capability else "current"
    line = f"lantern-export trt {directory} --flavor {flavor} --compute-capability {cc}"
    if batches:
        line += " --batch " + " ".join(map(str, batches))
    if trees:
        line += " --tree " + " ".join(trees)
    if cfg is not None and len(cfg) == 1:
        line += " --cfg" if cfg[0] else " --no-cfg"
    return line + " --force"


def select_plans(manifest, directory, gpu, installed, flavor=None, key=None):
    """(key, TensorRTPlans) of the first plan build that runs here: the flavor installed at the
    version that built it, built for this GPU's compute capability (gpu: "SM89"). Else a
    LanternError that says why each build does not run and how to rebuild."""
    builds = dict(manifest.tensorrt or {})
    if key is not None:
        if key not in builds:
            raise LanternError(f"{directory} has no plans/{key} (it has: {', '.join(builds) or 'none'})")
        builds = {key: builds[key]}
    if flavor is not None:
        if flavor not in FLAVOR_MODULES:
            raise LanternError(f"unknown TensorRT flavor {flavor!r}; valid: {', '.join(FLAVOR_MODULES)}")
        builds = {k: b for k, b in builds.items() if b.flavor == flavor}
    wanted = flavor or (next(iter(installed)) if installed else "tensorrt-rtx")
    if not builds:
        raise LanternError(f"{directory} has no TensorRT plans{f' for {flavor}' if flavor else ''}; build them with "
                           f"`{rebuild_command(directory, wanted, gpu)}`")
    reasons = []
    for k, b in builds.items():
        if b.flavor not in installed:
            reasons.append(f"plans/{k} need {b.flavor} {b.version}, which is not installed ({_INSTALL[b.flavor]})")
        elif installed[b.flavor] != b.version:
            reasons.append(f"plans/{k} were built by {b.flavor} {b.version}; this is {installed[b.flavor]}")
        elif gpu not in b.compute_capabilities:
            reasons.append(f"plans/{k} were built for {', '.join(b.compute_capabilities)}; this GPU is {gpu}")
        else:
            return k, b
    b = next(iter(builds.values()))
    rebuild = b.flavor if b.flavor in installed else wanted
    if rebuild == "tensorrt-rtx" and gpu not in rtx_targets():
        rebuild = "tensorrt"  # TensorRT for RTX does not target this GPU (Hopper, datacenter Blackwell)
    raise LanternError(f"{directory}: no TensorRT plans run here: {'; '.join(reasons)}; rebuild them with "
                       f"`{rebuild_command(directory, rebuild, gpu, b.batches, b.trees or None, b.cfg)}`")


def rtx_targets():
    """The compute capabilities TensorRT for RTX can build for: its own list where it is
    installed, else those of version 1.7."""
    try:
        trt = importlib.import_module("tensorrt_rtx")
        return {name for name in trt.ComputeCapability.__members__ if name.startswith("SM")}
    except ImportError:
        return {"SM75", "SM80", "SM86", "SM89", "SM120", "SM121"}


def find_profile(plan_file, shapes, taken=()):
    """Index of the first profile of a plan that covers a call's input shapes and is not taken
    (by another call of the same step plan), or None."""
    for index, profile in enumerate(plan_file.profiles):
        if index not in taken and profile.covers(shapes):
            return index
    return None


def assign_profiles(directory, key, entry, plan, gpu):
    """{regime: profile index} for every call of a StepPlan, each call a profile of its own
    (TensorRT lets one execution context hold a profile at a time, and every regime gets its own
    context and CUDA graph); a LanternError with the rebuild line for a call none covers."""
    taken, out = {}, {}
    for regime, call in plan.calls.items():
        if call.graph not in entry.plans:
            raise LanternError(f"plans/{key} have no {call.graph} plan; rebuild them with "
                               f"`{rebuild_command(directory, entry.flavor, gpu)}`")
        shapes = call_shapes(call)
        index = find_profile(entry.plans[call.graph], shapes, taken.setdefault(call.graph, set()))
        if index is None:
            raise uncovered_call(directory, key, entry, call.graph, regime, shapes, gpu, plan)
        taken[call.graph].add(index)
        out[regime] = index
    return out


def call_shapes(call):
    """{input: shape} of a call's feeds, host arrays or device buffers."""
    return {name: tuple(buf.shape if isinstance(buf, DeviceArray) else np.shape(buf)) for name, buf in call.feeds.items()}


def uncovered_call(directory, key, entry, graph, regime, shapes, gpu, plan=None):
    """The LanternError for a call no profile covers: what the plans serve, what the call needs, and
    the rebuild line (with the plan's tree and batch added when the call comes from a StepPlan)."""
    served = sorted({label for p in entry.plans[graph].profiles for label in p.serves})
    what = ", ".join(f"{n} {list(s)}" for n, s in shapes.items()  # one cache input stands for all layers
                     if n in entry.plans[graph].profiles[0].shapes and (not n.startswith("past_") or n == "past_keys_0"))
    batches, trees, cfg = list(entry.batches), list(entry.trees), entry.cfg
    needs = ""
    if plan is not None:
        batches = sorted(set(batches) | {plan.images})
        if plan.tree.depth and plan.tree.name not in trees:
            trees.append(plan.tree.name)
        if plan.prefix.cfg not in cfg:
            cfg = None
        needs = (f" (tree {plan.tree.name}, {plan.images} image(s), {'with' if plan.prefix.cfg else 'without'} "
                 f"CFG)")
    return LanternError(f"the {graph} call {regime}{needs} with {what} is not covered by plans/{key} (built for "
                        f"{'; '.join(served)}); rebuild them with "
                        f"`{rebuild_command(directory, entry.flavor, gpu, batches, trees or None, cfg)}`")


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


# ---------------------------------------------------------------------------------------------
# The backend


class _HostFeed:
    """A feed the loop writes on the host, its pinned staging copy and its device buffer."""

    def __init__(self, host, staging, pinned, device):
        self.host, self.staging, self.pinned, self.device = host, staging, pinned, device

    def stage(self):
        self.staging[...] = _host_values(self.host, self.device.dtype)


class _Bound:
    """One call prepared to run: its context (graph, profile), input shapes, host feeds, tensor
    addresses and, once captured, its CUDA graph."""

    def __init__(self, call, context_key, shapes, host, addresses):
        self.call, self.context_key, self.shapes = call, context_key, shapes
        self.host = host  # [_HostFeed]
        self.addresses = addresses  # tensor name -> device address
        self.runs = 0
        self.graph = None
        self.done = None  # event recorded after the last launch: staging is reused after it


class TensorRTBackend(CudaArrays):
    name = "tensorrt"

    def __init__(self, directory, manifest, threads=None, device="cuda", flavor=None, plans=None, cuda_graphs=True):
        """threads: unused (the GPU runs the graphs). device: cuda or cuda:N. flavor / plans:
        pick a flavor or a plans/KEY build (default: the first build that runs here).
        cuda_graphs: capture each bound call regime in a CUDA graph (default) or enqueue it."""
        self.directory, self.manifest = directory, manifest
        if not manifest.tensorrt:
            raise LanternError(f"{directory} has no TensorRT plans; build them with `lantern-export trt {directory}` "
                               f"(--compute-capability current on the GPU machine, or named GPUs with TensorRT-RTX)")
        super().__init__(device, manifest.dtype)
        self.gpu = self.cuda.compute_capability()
        self.key, self.plans = select_plans(manifest, directory, self.gpu, installed_versions(), flavor, plans)
        self.trt = trt = importlib.import_module(FLAVOR_MODULES[self.plans.flavor])
        self.cuda_graphs = bool(cuda_graphs)
        self.logger = error_logger(trt)
        self.runtime = trt.Runtime(self.logger)
        self.engines = {}
        for graph, plan_file in self.plans.plans.items():
            self.engines[graph] = self._deserialize(graph, plan_file)
        scratch = max(e.device_memory_size_v2 for e in self.engines.values())
        self.scratch = self.cuda.malloc(scratch)
        self.scratch_bytes = scratch
        self.contexts = {}  # (graph, profile) -> execution context
        self.owner = {}  # (graph, profile) -> the _Bound whose addresses the context holds
        self._bound = {}  # id(call) -> _Bound

    # -- opening ---------------------------------------------------------------------------------
    def _deserialize(self, graph, plan_file):
        path = os.path.join(self.directory, plan_file.file)
        self.logger.clear()
        with open(path, "rb") as f:
            engine = self.runtime.deserialize_cuda_engine(f.read())
        if engine is None:
            raise LanternError(f"{path}: {self.plans.flavor} cannot load the plan ({self.logger.first_error()}); "
                               f"rebuild it with `{rebuild_command(self.directory, self.plans.flavor, self.gpu)}`")
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = {n for n in names if engine.get_tensor_mode(n) == self.trt.TensorIOMode.INPUT}
        entry = self.manifest.graphs[graph]
        if inputs != set(entry.inputs) or set(names) - inputs != set(entry.outputs) \
                or engine.num_optimization_profiles != len(plan_file.profiles):
            raise LanternError(f"{path}: the plan's inputs, outputs or profiles differ from the manifest's; rebuild it "
                               f"with `{rebuild_command(self.directory, self.plans.flavor, self.gpu)}`")
        return engine

    def _context(self, graph, profile):
        key = (graph, profile)
        if key not in self.contexts:
            engine, trt = self.engines[graph], self.trt
            self.logger.clear()
            user_managed = trt.ExecutionContextAllocationStrategy.USER_MANAGED  # the shared scratch below
            if hasattr(engine, "create_runtime_config"):
                config = engine.create_runtime_config()
                config.set_execution_context_allocation_strategy(user_managed)
                if hasattr(config, "dynamic_shapes_kernel_specialization_strategy"):
                    # TensorRT-RTX: compile the shape-specialized kernels at the first run, so the
                    # CUDA graph captured after it holds them rather than the generic fallbacks
                    config.dynamic_shapes_kernel_specialization_strategy = \
                        trt.DynamicShapesKernelSpecializationStrategy.EAGER
                context = engine.create_execution_context(config)
            else:
                context = engine.create_execution_context(user_managed)
            if context is None:
                raise LanternError(f"{graph}: TensorRT cannot create an execution context ({self.logger.first_error()})")
            context.set_device_memory(self.scratch.ptr, self.scratch_bytes)
            if not context.set_optimization_profile_async(profile, self.cuda.handle):
                raise LanternError(f"{graph}: TensorRT cannot select profile {profile} ({self.logger.first_error()})")
            self.contexts[key] = context
        return self.contexts[key]

    def _tensor_dtype(self, graph, name):
        trt_dtype = self.engines[graph].get_tensor_dtype(name)
        return _TRT_DTYPES.get(trt_dtype.name, trt_dtype.name.lower())

    # -- binding ---------------------------------------------------------------------------------
    def _prepare(self, call, profile):
        """A _Bound for a call in a profile: its context with the input shapes set, device buffers
        for its host feeds (pinned staging beside them) and for its outputs, every tensor address."""
        shapes = call_shapes(call)
        context = self._context(call.graph, profile)
        self._forget_context((call.graph, profile))  # its shapes and addresses change here
        host, addresses = [], {}
        self.logger.clear()
        for name, buf in call.feeds.items():
            dtype = self._tensor_dtype(call.graph, name)
            if isinstance(buf, DeviceArray):
                if buf.dtype != dtype:
                    raise LanternError(f"{call.graph} input {name}: a {buf.dtype} device buffer for a {dtype} tensor")
                addresses[name] = buf.ptr
            else:
                device = self._empty(shapes[name], dtype)
                host.append(_HostFeed(buf, *self._pinned(shapes[name], dtype), device))
                addresses[name] = device.ptr
            if not context.set_input_shape(name, shapes[name]):
                raise LanternError(f"{call.graph} input {name}: TensorRT refuses shape {list(shapes[name])} "
                                   f"({self.logger.first_error()})")
        outputs = {}
        entry = self.manifest.graphs[call.graph]
        aliases = graph_io(entry.contract, max(entry.layers, 1))["aliases"]
        for name in entry.outputs:
            shape = tuple(context.get_tensor_shape(name))
            if name in aliases:  # IKVCacheUpdateLayer writes into its cache input: one buffer
                feed = call.feeds[aliases[name]]
                outputs[name] = feed if isinstance(feed, DeviceArray) else next(f.device for f in host if f.host is feed)
                addresses[name] = addresses[aliases[name]]
                continue
            want = call.output_shapes.get(name)
            if want is not None and tuple(want) != shape:
                raise LanternError(f"{call.graph} output {name}: the plan gives {list(shape)}, the step plan expects "
                                   f"{list(want)}; rebuild the plans")
            outputs[name] = self._empty(shape, self._tensor_dtype(call.graph, name))
            addresses[name] = outputs[name].ptr
        return _Bound(call, (call.graph, profile), shapes, host, addresses), outputs

    def _set_addresses(self, bound):
        """Give the call's context this call's shapes and addresses, unless it holds them already."""
        context = self.contexts[bound.context_key]
        if self.owner.get(bound.context_key) is not bound:
            for name, shape in bound.shapes.items():
                context.set_input_shape(name, shape)
            for name, ptr in bound.addresses.items():
                context.set_tensor_address(name, ptr)
            self.owner[bound.context_key] = bound
        return context

    def _forget_context(self, key):
        """A context is about to get other shapes or addresses: the call that held it loses its
        CUDA graph (a graph stands for its context's state at capture) and is captured again."""
        bound = self.owner.pop(key, None)
        if bound is not None and bound.graph is not None:
            self.synchronize()  # no launch of the graph may be in flight when it goes
            bound.graph, bound.runs = None, 0

    def bind(self, plan):
        profiles = assign_profiles(self.directory, self.key, self.plans, plan, self.gpu)
        for regime, call in plan.calls.items():
            bound, call.outputs = self._prepare(call, profiles[regime])
            self._bound[id(call)] = bound

    def release(self, plan):
        """Forget a plan's bindings and graphs (the engine keeps one plan at a time)."""
        self.synchronize()
        for call in plan.calls.values():
            bound = self._bound.pop(id(call), None)
            if bound is not None and self.owner.get(bound.context_key) is bound:
                self._forget_context(bound.context_key)

    # -- running ---------------------------------------------------------------------------------
    def _enqueue(self, bound):
        """The staging -> device copies and the TensorRT enqueue of a bound call, on the stream."""
        self.logger.clear()
        for feed in bound.host:
            self.cuda.memcpy(feed.device.ptr, feed.staging.ctypes.data, feed.device.nbytes, "cudaMemcpyHostToDevice")
        return self.contexts[bound.context_key].execute_async_v3(self.cuda.handle)

    def run(self, call):
        bound = self._bound.get(id(call))
        if bound is None or bound.call is not call:
            return self._run_once(call)
        if bound.done is not None:  # the staging buffers are free once the last launch finished
            self.cuda.call(self.cuda.rt.cudaEventSynchronize, bound.done)
        for feed in bound.host:
            feed.stage()
        if bound.graph is not None:
            bound.graph.launch()
        else:
            self._set_addresses(bound)
            if not self._enqueue(bound):
                raise LanternError(f"{call.graph} call {call.regime}: TensorRT's enqueue failed "
                                   f"({self.logger.first_error()})")
            if self.cuda_graphs and bound.runs == 0 and self._capturable(bound):
                self.synchronize()  # first run eager (TensorRT's lazy setup), then capture for the next ones
                bound.graph = self.cuda.capture(lambda: self._enqueue(bound))
        if bound.done is None:
            bound.done = self.cuda.event()
        self.cuda.call(self.cuda.rt.cudaEventRecord, bound.done, self.cuda.stream)
        bound.runs += 1
        return call.outputs

    def _capturable(self, bound):
        check = getattr(self.contexts[bound.context_key], "is_stream_capturable", None)  # where the version has it
        return check is None or check(self.cuda.handle)

    def _run_once(self, call):
        """A call that was not bound (check cases, the VQ decoder): buffers made for it, freed
        with its outputs; it runs in the first profile that covers it."""
        shapes = call_shapes(call)
        if call.graph not in self.plans.plans:
            raise LanternError(f"plans/{self.key} have no {call.graph} plan; rebuild them with "
                               f"`{rebuild_command(self.directory, self.plans.flavor, self.gpu)}`")
        profile = find_profile(self.plans.plans[call.graph], shapes)
        if profile is None:
            raise uncovered_call(self.directory, self.key, self.plans, call.graph, call.regime, shapes, self.gpu)
        bound, outputs = self._prepare(call, profile)
        for feed in bound.host:
            feed.stage()
        self._set_addresses(bound)
        if not self._enqueue(bound):
            raise LanternError(f"{call.graph} call {call.regime}: TensorRT's enqueue failed ({self.logger.first_error()})")
        self.synchronize()  # the staging buffers go with `bound`
        self.owner.pop(bound.context_key, None)
        return outputs

    # -- for `lantern-export check` --------------------------------------------------------------
    def call_shapes(self, graph):
        """[(case name, {input: shape})]: the shapes this backend serves for a graph, one case per
        profile (its min and max too when it spans), for check's cases."""
        plan_file = self.plans.plans.get(graph)
        if plan_file is None:
            return []
        cases = []
        for index, profile in enumerate(plan_file.profiles):
            name = profile.serves[0] if profile.serves else f"profile{index}"
            points = ["opt"] + [k for k in ("min", "max") if any(r[k] != r["opt"] for r in profile.shapes.values())]
            for point in points:
                cases.append((name if point == "opt" else f"{name} {point}",
                              {n: tuple(r[point]) for n, r in profile.shapes.items()}))
        return cases


def _device_index(device):
    text = str(device)
    if text == "cuda":
        return 0
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise LanternError(f"the tensorrt backend runs on an NVIDIA GPU: device must be cuda or cuda:N, got {device!r}")


def error_logger(trt):
    """A TensorRT logger that keeps errors (TensorRT reports failures only there) and prints nothing.
    The builder (lantern.export.tensorrt_build) uses it too."""

    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors = []

        def log(self, severity, msg):
            if severity <= trt.ILogger.Severity.ERROR:
                self.errors.append(" ".join(str(msg).split()))

        def clear(self):
            self.errors.clear()
            return self

        def first_error(self):
            """The first error since the last clear()."""
            return self.errors[0] if self.errors else "no error message from TensorRT"

    return Logger()

