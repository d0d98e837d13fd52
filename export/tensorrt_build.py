"""ONNX graph -> TensorRT plan, for both TensorRT flavors.

`tensorrt` (full TensorRT, module `tensorrt`: datacenter GPUs, builds for the GPU it runs on) and
`tensorrt-rtx` (TensorRT for RTX, module `tensorrt_rtx`: RTX/workstation GPUs, builds ahead of
time for named compute capabilities, no GPU needed) share one API; the few places they differ
(compute capabilities, timing cache) are handled here and nowhere else.

Networks are strongly typed: precision comes from the ONNX graph's types (export fp16/bf16
graphs for fp16/bf16 plans); no precision flags are set. Optimization profiles are plain data:
a list of {input name: (min, opt, max)}, one profile per call regime (`exact_profile`) or one
spanning all regimes (`spanning_profile`). The engine graphs have no shape-tensor inputs (CFG is
data: the drafter's `cfg_pair`), so a profile only ever holds shapes; a graph with a shape
tensor is refused. `lantern-export trt` (lantern.export.trt_export) builds an engine
directory's plans with these functions.

Facts about TensorRT-RTX 1.7 measured on a CPU-only machine (see tests/test_tensorrt_build.py):
building needs no GPU; deserializing a plan does (so `plan_io` needs one, and `build_plan`'s
record carries the same I/O description read from the network and the profiles); the timing
cache is a no-op there ("Timing cache operations are no-ops in TensorRT-RTX").
"""
import hashlib
import importlib
import os
import re
import time

from lantern.runtime.backends.tensorrt import error_logger
from lantern.runtime.errors import LanternError

FLAVORS = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx"}
_INSTALL = {"tensorrt": "pip install 'lantern[tensorrt]' (full TensorRT, Linux x86-64/aarch64 with an NVIDIA driver)",
            "tensorrt-rtx": "pip install 'lantern[tensorrt-rtx]'"}
_DTYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT64": "int64", "INT32": "int32",
           "BOOL": "bool", "INT8": "int8", "UINT8": "uint8", "FP8": "float8", "INT4": "int4", "FP4": "float4"}


def load_tensorrt(flavor):
    """The TensorRT module of a flavor, or a LanternError that says how to install it."""
    if flavor not in FLAVORS:
        raise LanternError(f"unknown TensorRT flavor {flavor!r}; valid: {', '.join(FLAVORS)}")
    try:
        return importlib.import_module(FLAVORS[flavor])
    except ImportError as e:
        raise LanternError(f"{flavor} is not installed ({e}); {_INSTALL[flavor]}") from None


def available_flavors():
    """The flavors whose module imports here."""
    found = []
    for flavor, module in FLAVORS.items():
        try:
            importlib.import_module(module)
            found.append(flavor)
        except ImportError:
            pass
    return found


# ---------------------------------------------------------------------------------------------
# Profiles from call shapes


def exact_profile(shapes):
    """One call regime's shapes {input: shape} -> a profile with min = opt = max, so TensorRT
    specialises for exactly that call."""
    return {name: (tuple(s), tuple(s), tuple(s)) for name, s in shapes.items()}


def spanning_profile(regimes, opt=None):
    """One profile covering every regime in `regimes` (a list of {input: shape}): min and max
    elementwise over the regimes. TensorRT picks kernels at `opt` (a {input: shape}, e.g. the
    most frequent call: verification); default the elementwise max."""
    if not regimes:
        raise LanternError("spanning_profile needs at least one regime")
    names = list(regimes[0])
    for i, shapes in enumerate(regimes):
        if list(shapes) != names:
            raise LanternError(f"regime {i} has inputs {list(shapes)}, regime 0 has {names}")
    profile = {}
    for name in names:
        shapes = [tuple(r[name]) for r in regimes]
        if len({len(s) for s in shapes}) != 1:
            raise LanternError(f"input {name}: regimes disagree on its rank: {shapes}")
        lo = tuple(min(dims) for dims in zip(*shapes))
        hi = tuple(max(dims) for dims in zip(*shapes))
        profile[name] = (lo, tuple(opt[name]) if opt is not None else hi, hi)
    return profile


# ---------------------------------------------------------------------------------------------
# Building


def build_plan(onnx_path, profiles, *, flavor, compute_capabilities=None, timing_cache=None, workspace_bytes=None,
               decomposable_attention=False, tf32=False, progress=None):
    """Parse `onnx_path` (external data next to it is found) into a strongly typed network and
    build a serialized plan with one optimization profile per entry of `profiles`.

    compute_capabilities: tensorrt-rtx only: e.g. ["SM89", "SM120"] (also "89", "8.9", 120),
      or ["current"] for the GPU present; default TensorRT-RTX's own (Ampere and later).
      Full TensorRT builds for the GPU it runs on, so it takes None or ["current"].
    timing_cache: full TensorRT only: a file loaded if it exists and saved after the build.
    workspace_bytes: the workspace memory pool limit (default TensorRT's: the device memory).
    decomposable_attention: let fused attention layers (ONNX Attention -> IAttention) fall back
      to plain layers where TensorRT has no fused kernel (fp32 has none); off, such a graph
      fails to build, which says the fusion did not happen.
    tf32: let fp32 matrix products run in TF32 (TensorRT's default, on): off by default here, so
      an fp32 graph computes in fp32 as its types say and checks against ONNX Runtime at fp32
      tolerances; TF32 costs ~1e-3 relative error per product.
    progress: called as progress(phase, done, total) for the builder's top-level phases.

    Returns (plan bytes, record): the record holds flavor, TensorRT version, compute
    capabilities, profiles, builder settings, the network's I/O, build seconds, plan size and sha256.
    """
    trt = load_tensorrt(flavor)
    where = str(onnx_path)
    if not profiles:
        raise LanternError(f"{where}: no optimization profile given")
    logger = error_logger(trt)
    builder, network, parser = _parse(trt, where, logger)  # the parser owns the weights: keep it
    io = _network_io(trt, network)
    fused = _fused_layers(trt, network, decomposable_attention)

    config = builder.create_builder_config()
    if not tf32:
        config.clear_flag(trt.BuilderFlag.TF32)
    user_allocation = hasattr(trt.BuilderFlag, "REQUIRE_USER_ALLOCATION")
    if user_allocation:  # TensorRT-RTX: what makes an execution context stream-capturable (CUDA graphs)
        config.set_flag(trt.BuilderFlag.REQUIRE_USER_ALLOCATION)
    targets = _set_compute_capabilities(trt, config, flavor, compute_capabilities)
    if workspace_bytes is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_bytes))
    cache = _load_timing_cache(config, flavor, timing_cache)
    if progress is not None:
        monitor = _Progress(trt, progress)  # must outlive the build: TensorRT keeps a reference
        config.progress_monitor = monitor
    added = [_add_profile(builder, config, logger, io, profile, index, where) for index, profile in enumerate(profiles)]

    start = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - start
    if plan is None:
        hint = " (building for 'current' needs an NVIDIA GPU and driver)" if "current" in targets else ""
        raise LanternError(f"{where}: {flavor} could not build a plan for {', '.join(targets)}{hint}: "
                           f"{logger.first_error()}")
    plan = bytes(plan)
    if cache is not None:
        _save_timing_cache(config, timing_cache)

    record = {
        "flavor": flavor,
        "tensorrt_version": trt.__version__,
        "compute_capabilities": targets,
        "profiles": added,
        "builder": {
            "strongly_typed": True,
            "optimization_level": config.builder_optimization_level,
            "workspace_bytes": config.get_memory_pool_limit(trt.MemoryPoolType.WORKSPACE),
            "timing_cache": str(timing_cache) if timing_cache is not None else None,
            "decomposable_attention": bool(decomposable_attention),
            "tf32": config.get_flag(trt.BuilderFlag.TF32),
            "require_user_allocation": user_allocation,
        },
        "fused_layers": fused,
        "io": io,
        "build_seconds": round(seconds, 3),
        "plan_bytes": len(plan),
        "sha256": hashlib.sha256(plan).hexdigest(),
    }
    return plan, record


def network_io(onnx_path, *, flavor):
    """The I/O of the network TensorRT parses from `onnx_path` (no build, no GPU):
    {"inputs": {name: {"dtype", "shape", "shape_tensor"}}, "outputs": {...}}; dynamic dims are
    the ONNX dim names where TensorRT keeps them, else -1."""
    trt = load_tensorrt(flavor)
    _, network, _parser = _parse(trt, str(onnx_path), error_logger(trt))
    return _network_io(trt, network)


def plan_io(plan, *, flavor):
    """The I/O of a serialized plan read back from the engine: {"inputs": {name: {"dtype",
    "shape", "profiles": [[min, opt, max], ...]}}, "outputs": {name: {"dtype", "shape"}}}.
    Needs a GPU: TensorRT (RTX too) cannot deserialize a plan without one."""
    trt = load_tensorrt(flavor)
    logger = error_logger(trt)
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        raise LanternError(f"{flavor} could not read the plan (that needs an NVIDIA GPU and driver): "
                           f"{logger.first_error()}")
    out = {"inputs": {}, "outputs": {}}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        entry = {"dtype": _dtype(engine.get_tensor_dtype(name)), "shape": list(engine.get_tensor_shape(name))}
        if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
            entry["profiles"] = [[list(s) for s in engine.get_tensor_profile_shape(name, p)]
                                 for p in range(engine.num_optimization_profiles)]
            out["inputs"][name] = entry
        else:
            out["outputs"][name] = entry
    return out


# ---------------------------------------------------------------------------------------------
# Internals


def _Progress(trt, callback):
    class Progress(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.totals = {}

        def phase_start(self, phase, parent, steps):
            if parent is None:
                self.totals[phase] = steps
                callback(phase, 0, steps)

        def step_complete(self, phase, step):
            if phase in self.totals:
                callback(phase, step + 1, self.totals[phase])
            return True  # False would cancel the build

        def phase_finish(self, phase):
            if phase in self.totals:  # TensorRT may finish a phase before counting its last step
                callback(phase, self.totals[phase], self.totals[phase])

    return Progress()


def _parse(trt, where, logger):
    """ONNX file -> (builder, strongly typed network, parser), or a one-line LanternError."""
    if not os.path.isfile(where):
        raise LanternError(f"{where}: no such ONNX file")
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(where):
        raise LanternError(f"{where}: {_parser_error(parser, logger)}")
    return builder, network, parser


def _parser_error(parser, logger):
    """The parser's first error in one line, naming the ONNX node."""
    if parser.num_errors == 0:
        return f"TensorRT's ONNX parser failed: {logger.first_error()}"
    e = parser.get_error(0)
    desc = " ".join(e.desc().split())
    node = e.node_name() or (f"#{e.node()}" if e.node() >= 0 else "")
    where = f"node {node} ({e.node_operator()})" if node else "the graph"
    more = f" (+{parser.num_errors - 1} more)" if parser.num_errors > 1 else ""
    return f"TensorRT's ONNX parser rejects {where}: {desc}{more}"


def _dtype(trt_dtype):
    return _DTYPES.get(trt_dtype.name, trt_dtype.name.lower())


def _network_io(trt, network):
    def entry(t):
        dims = [t.get_dimension_name(i) or d if d < 0 else d for i, d in enumerate(t.shape)]
        return {"dtype": _dtype(t.dtype), "shape": dims, "shape_tensor": bool(t.is_shape_tensor)}

    return {"inputs": {network.get_input(i).name: entry(network.get_input(i)) for i in range(network.num_inputs)},
            "outputs": {network.get_output(i).name: entry(network.get_output(i)) for i in range(network.num_outputs)}}


def _fused_layers(trt, network, decomposable_attention):
    """Count the fused attention / KV-cache-update layers the parser made (so a caller can see
    whether a graph's forms were recognised) and mark attention decomposable if asked."""
    attention = kv_update = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.ATTENTION_INPUT:
            attention += 1
            if decomposable_attention:
                layer.__class__ = trt.IAttentionInputLayer  # the bindings return the base class
                layer.attention.decomposable = True
        elif layer.type == trt.LayerType.KV_CACHE_UPDATE:
            kv_update += 1
    return {"attention": attention, "kv_cache_update": kv_update}


_CC = re.compile(r"^(?:sm_?)?(?:(\d{1,2})\.(\d)|(\d{2,3}))$", re.IGNORECASE)


def normalise_compute_capability(cc):
    """'SM89', 'sm_89', '89', '8.9', 89 -> 'SM89'; 'current' stays."""
    text = str(cc).strip()
    if text.lower() == "current":
        return "current"
    m = _CC.match(text)
    if not m:
        raise LanternError(f"bad compute capability {cc!r}; write e.g. 89, 8.9, SM89 or current")
    return f"SM{m.group(3) or m.group(1) + m.group(2)}"


def _set_compute_capabilities(trt, config, flavor, requested):
    """Set the plan's target GPUs; returns their names as recorded."""
    targets = [normalise_compute_capability(c) for c in requested or []]
    if flavor == "tensorrt":
        if targets not in ([], ["current"]):
            raise LanternError(f"full TensorRT builds for the GPU it runs on; compute capabilities {targets} "
                               f"need --flavor tensorrt-rtx")
        return ["current"]
    if not targets:
        return ["default"]  # TensorRT-RTX's own set: Ampere and later (its docs: 8.0, 8.6, 8.9, 12.0)
    known = {name for name in trt.ComputeCapability.__members__ if name != "NONE"}
    names = ["CURRENT" if t == "current" else t for t in targets]
    unknown = [t for t, n in zip(targets, names) if n not in known]
    if unknown:
        valid = sorted(n for n in known if n != "CURRENT")
        raise LanternError(f"{flavor} {trt.__version__} cannot target {', '.join(unknown)}; "
                           f"it targets {', '.join(valid)} or current")
    config.num_compute_capabilities = len(names)
    for i, name in enumerate(names):
        config.set_compute_capability(trt.ComputeCapability.__members__[name], i)
    return targets


def _load_timing_cache(config, flavor, path):
    if path is None:
        return None
    if flavor != "tensorrt":
        raise LanternError("a timing cache applies to full TensorRT only; TensorRT-RTX has none (its timing-cache "
                           "calls are no-ops: it compiles kernels at run time, kept in its runtime cache)")
    data = b""
    if os.path.exists(path):
        with open(path, "rb") as f:
            data = f.read()
    cache = config.create_timing_cache(data)
    config.set_timing_cache(cache, False)  # False: refuse a cache from another GPU/version
    return cache


def _save_timing_cache(config, path):
    data = bytes(config.get_timing_cache().serialize())
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _normalised(profile):
    out = {}
    for name, triple in profile.items():
        if len(triple) != 3:
            raise LanternError(f"profile entry for {name} must be (min, opt, max), got {triple!r}")
        out[name] = tuple(tuple(int(d) for d in s) for s in triple)
    return out


def _add_profile(builder, config, logger, io, profile, index, where):
    """Check one profile against the network's inputs (clear messages instead of TensorRT's),
    add it to the config and return it as TensorRT holds it."""
    profile = _normalised(profile)
    inputs = io["inputs"]
    unknown = [n for n in profile if n not in inputs]
    if unknown:
        raise LanternError(f"{where}: profile {index} names {', '.join(unknown)}, not inputs of the graph "
                           f"(inputs: {', '.join(inputs)})")
    dynamic = [n for n, e in inputs.items() if e["shape_tensor"] or any(not isinstance(d, int) or d < 0 for d in e["shape"])]
    missing = [n for n in dynamic if n not in profile]
    if missing:
        raise LanternError(f"{where}: profile {index} gives no shapes for dynamic input(s) {', '.join(missing)}")
    tensors = [n for n, e in inputs.items() if e["shape_tensor"]]
    if tensors:
        raise LanternError(f"{where}: input(s) {', '.join(tensors)} are shape tensors (TensorRT needs their values "
                           f"at build time); lantern's graphs have none: re-export the engine with `lantern-export onnx`")
    p = builder.create_optimization_profile()
    for name, (mn, op, mx) in profile.items():
        entry = inputs[name]
        for label, shape in (("min", mn), ("opt", op), ("max", mx)):
            if len(shape) != len(entry["shape"]) or any(isinstance(d, int) and d >= 0 and d != s
                                                       for d, s in zip(entry["shape"], shape)):
                raise LanternError(f"{where}: profile {index}: {label} shape {list(shape)} of {name} does not fit "
                                   f"its graph shape {entry['shape']}")
        if not all(a <= b <= c for a, b, c in zip(mn, op, mx)):
            raise LanternError(f"{where}: profile {index}: {name} needs min <= opt <= max, got "
                               f"{list(mn)}, {list(op)}, {list(mx)}")
        p.set_shape(name, mn, op, mx)
    if config.add_optimization_profile(p) < 0:
        raise LanternError(f"{where}: TensorRT rejects profile {index}: {logger.first_error()}")
    # What TensorRT holds, read back from its profile object: {input: {"min", "opt", "max"}}.
    held = {}
    for name in profile:
        triple = p.get_shape(name)
        held[name] = {k: [int(d) for d in s] for k, s in zip(("min", "opt", "max"), triple)}
    return held
