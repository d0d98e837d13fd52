"""Polygraphy (NVIDIA's inference debugging toolkit) as an independent check of lantern's TensorRT
path: `lantern-export check ENGINE --against polygraphy-trt`.

Polygraphy's `TrtRunner` is NVIDIA's own, separately written runner (set shapes, set addresses,
`execute_async_v3`, copy the outputs to the host, synchronise per call: a checker, not a runtime).
`check --against polygraphy-trt` runs, over `check`'s cases in every profile of every plan, three
runners through Polygraphy's `Comparator` on the same feeds: lantern's tensorrt backend, a
`TrtRunner` on the same plan bytes, and the `--backend` (default ONNX Runtime). The compare
function is `check`'s tolerance rule (max |a - b| <= atol + rtol * max |reference| per output;
the drafter's top-k ids at ranks clear of a near-tie), so a pass means what `check` means.

`polygraphy_plan` builds a plan with Polygraphy's loaders (`NetworkFromOnnxPath` ->
`CreateConfig` + `PostprocessConfig` -> `EngineBytesFromNetwork`), configured the way
lantern.export.tensorrt_build configures its builder; tests require identical bytes, so the two
builders stay in step. (TensorRT-RTX 1.7 writes a plan's I/O records in an order that differs
between the first and a later build in one process: compare first builds of fresh processes.)

Polygraphy picks its TensorRT module once, when it is first imported:
POLYGRAPHY_USE_TENSORRT_RTX=1 makes it `tensorrt_rtx`. `load_polygraphy` sets that variable for
the flavor asked for and refuses a process where Polygraphy was already imported for the other.
"""
import collections
import importlib
import os
import sys
import time

import numpy as np

from lantern.export.tensorrt_build import load_tensorrt, normalise_compute_capability
from lantern.runtime.backends.cuda import gpu_compute_capability
from lantern.runtime.errors import LanternError
from lantern.runtime.plan import Call

NAME = "polygraphy-trt"
_INSTALL = "pip install 'lantern[polygraphy]' (with 'lantern[tensorrt]' or 'lantern[tensorrt-rtx]')"


def load_polygraphy(flavor=None):
    """Import Polygraphy for a TensorRT flavor ("tensorrt", "tensorrt-rtx"; None: no TensorRT is
    used, any setting does). Returns the polygraphy module."""
    rtx = flavor == "tensorrt-rtx"
    if "polygraphy" not in sys.modules and flavor is not None:
        os.environ["POLYGRAPHY_USE_TENSORRT_RTX"] = "1" if rtx else "0"  # read once, at import
    try:
        polygraphy = importlib.import_module("polygraphy")
        config = importlib.import_module("polygraphy.config")
    except ImportError as e:
        raise LanternError(f"polygraphy is not installed ({e}); {_INSTALL}") from None
    if flavor is not None and config.USE_TENSORRT_RTX != rtx:
        raise LanternError(f"Polygraphy was imported in this process for {'tensorrt-rtx' if config.USE_TENSORRT_RTX else 'tensorrt'}"
                           f" and cannot switch to {flavor}; run the {flavor} check in a process of its own")
    return polygraphy


def _quiet():
    from polygraphy.logger import G_LOGGER

    return G_LOGGER.verbosity(G_LOGGER.ERROR)


# ---------------------------------------------------------------------------------------------
# Building a plan with Polygraphy's loaders


def polygraphy_plan(onnx_path, profiles, *, flavor, compute_capabilities=None, tf32=False):
    """Plan bytes built by Polygraphy's loaders for `profiles` ([{input: (min, opt, max)}]),
    with the settings lantern's builder uses: strongly typed, TF32 off unless asked,
    REQUIRE_USER_ALLOCATION where the flavor has it, TensorRT's default profiling verbosity, and
    (tensorrt-rtx) the compute capabilities, e.g. ["SM89"]."""

    load_polygraphy(flavor)
    trt = load_tensorrt(flavor)
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, NetworkFromOnnxPath, PostprocessConfig
    from polygraphy.backend.trt import Profile
    from polygraphy.exception import PolygraphyException

    targets = [normalise_compute_capability(c) for c in compute_capabilities or []]

    def configure(builder, network, config):
        # Polygraphy's CreateConfig sets its own profiling verbosity (DETAILED); lantern keeps TensorRT's
        config.profiling_verbosity = builder.create_builder_config().profiling_verbosity
        if tf32:
            config.set_flag(trt.BuilderFlag.TF32)
        else:
            config.clear_flag(trt.BuilderFlag.TF32)
        if hasattr(trt.BuilderFlag, "REQUIRE_USER_ALLOCATION"):
            config.set_flag(trt.BuilderFlag.REQUIRE_USER_ALLOCATION)
        if targets and flavor == "tensorrt-rtx":
            config.num_compute_capabilities = len(targets)
            for i, name in enumerate(targets):
                config.set_compute_capability(trt.ComputeCapability.__members__[name], i)

    pg_profiles = []
    for profile in profiles:
        p = Profile()
        for name, (lo, opt, hi) in profile.items():
            p.add(name, lo, opt, hi)
        pg_profiles.append(p)
    network = NetworkFromOnnxPath(os.fspath(onnx_path), strongly_typed=True)
    config = PostprocessConfig(CreateConfig(profiles=pg_profiles), configure)
    try:
        with _quiet():
            return bytes(EngineBytesFromNetwork(network, config=config)())
    except PolygraphyException as e:
        raise LanternError(f"{onnx_path}: Polygraphy could not build a plan: {' '.join(str(e).split())}") from None


# ---------------------------------------------------------------------------------------------
# Runners and the compare function


def backend_runner(backend, graph, manifest, name):
    """A Polygraphy runner (`BaseRunner`) that runs one graph of an engine on a lantern backend."""
    from polygraphy.backend.base import BaseRunner


    entry = manifest.graphs[graph]

    class LanternRunner(BaseRunner):
        def __init__(self):
            super().__init__(name=name)

        def get_input_metadata_impl(self):
            from polygraphy.common import TensorMetadata

            meta = TensorMetadata()
            for input_name, spec in entry.inputs.items():
                dtype = np.float32 if spec.dtype == "bfloat16" else np.dtype(spec.dtype)  # bf16 feeds come upcast
                meta.add(input_name, dtype, [d if isinstance(d, int) else None for d in spec.shape])
            return meta

        def infer_impl(self, feed_dict):
            start = time.perf_counter()
            feeds = {k: np.array(v, copy=True) for k, v in feed_dict.items()}  # in-place graphs update their caches
            out = backend.run(Call(graph, "polygraphy", feeds))
            result = collections.OrderedDict((k, backend.numpy(out[k])) for k in entry.outputs)
            self.inference_time = time.perf_counter() - start
            return result

    return LanternRunner()


def as_numpy(value):
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach"):  # a torch tensor (Polygraphy's TrtRunner returns them for torch feeds)
        value = value.detach().cpu()
        return (value.float() if str(value.dtype) == "torch.bfloat16" else value).numpy()
    return np.asarray(value)


def compare_runners(runners, feeds, compare, comparisons=None):
    """Run Polygraphy runners over the same feeds ([{input: array}]) with Polygraphy's
    Comparator and judge them with `compare` (default comparisons: each runner against the next).
    Returns True iff every comparison passed."""
    from polygraphy.comparator import Comparator
    from polygraphy.exception import PolygraphyException

    try:
        with _quiet():
            results = Comparator.run(runners, data_loader=feeds)
            return bool(Comparator.compare_accuracy(results, compare_func=compare, comparisons=comparisons))
    except PolygraphyException as e:
        raise LanternError(f"Polygraphy's Comparator failed: {' '.join(str(e).split())}") from None


# ---------------------------------------------------------------------------------------------
# check --against polygraphy-trt


def trt_feeds(feeds, engine):
    """A case's feeds as the plan takes them: bf16 tensors as torch bfloat16 (numpy has none)."""
    out = {}
    for name, value in feeds.items():
        if engine.get_tensor_dtype(name).name == "BF16":
            import torch

            value = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32)).to(torch.bfloat16).cuda()
        out[name] = value
    return out


# ---------------------------------------------------------------------------------------------
# lantern-export inspect ENGINE --graphs / --plans: Polygraphy's `inspect model` text


def graph_summary(onnx_path, layers=False):
    """Polygraphy's `inspect model` text of an ONNX graph: its inputs and outputs with their
    symbolic shapes, initializer and node counts, and with `layers` every node with its inputs,
    outputs and attributes. Reads the graph's structure only (external weights stay on disk), so
    it works on the CPU for graphs of any size."""
    load_polygraphy()
    import onnx
    from polygraphy.backend.onnx import util

    try:
        model = onnx.load(os.fspath(onnx_path), load_external_data=False)
    except FileNotFoundError:
        raise LanternError(f"no such ONNX file: {onnx_path}") from None
    except Exception as e:  # protobuf's DecodeError and friends: the file is not an ONNX model
        raise LanternError(f"{onnx_path} is not a readable ONNX model ({type(e).__name__})") from None
    with _quiet():
        return util.str_from_onnx(model, show_layers=layers, show_attrs=layers, show_weights=False)


def plan_summary(plan_path, flavor, layers=False):
    """Polygraphy's `inspect model` text of a TensorRT plan: its bindings per profile and, with
    `layers`, the layers TensorRT built. Needs an NVIDIA GPU: TensorRT (RTX too) cannot
    deserialize a plan without one."""
    if gpu_compute_capability() is None:
        raise LanternError(f"{plan_path}: reading a TensorRT plan's bindings and layers needs an NVIDIA GPU ({flavor} "
                           "cannot deserialize a plan without one); `lantern-export inspect ENGINE` lists what the "
                           "manifest records of each plan (profiles, sizes) on any machine")
    load_polygraphy(flavor)
    load_tensorrt(flavor)
    from polygraphy.backend.trt import EngineFromBytes, util
    from polygraphy.exception import PolygraphyException

    with open(plan_path, "rb") as f:
        plan = f.read()
    try:
        with _quiet():
            engine = EngineFromBytes(plan)()
            context = engine.create_execution_context()
            return util.str_from_engine(engine, context, show_layers=layers, show_attrs=layers)
    except PolygraphyException as e:
        raise LanternError(f"{plan_path}: Polygraphy could not read the plan: {' '.join(str(e).split())}") from None
