"""Engine backends behind one small protocol (Polygraphy's split: a loader per backend, one runner).

A backend runs the graphs of an engine directory by name and owns the arrays that live on its
device (KV caches, hidden states), so the decoding loop never copies a whole cache and never
knows which backend runs. The registry below (RUNNERS) is the one place runner names are spelled:
the rest of lantern asks it (`runner(name)`, `names(...)`); `open_backend(name, ...)` opens one.
"""
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

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

    def device_step_refusal(self, plan, sampler, proposer=None):
        """Why the device step cannot run a generation of this plan and sampler, or None.
        proposer: given for the proposers other than the drafter tree that device_step_proposers
        names (a jacobi window: its graphs depend on its slots and init)."""

    def device_step(self, decoding):
        """The device step for one generation (runtime.generator; only where the refusal is None)."""


def _onnxruntime(directory, manifest, **options):
    from lantern.runtime.backends.onnxruntime import OnnxRuntimeBackend

    return OnnxRuntimeBackend(directory, manifest, **options)


def _torch(directory, manifest, modules=None, **options):
    if modules is None:
        raise LanternError(f"the {TORCH.name} backend runs the graphs as torch modules, which lantern.export rebuilds "
                           f"from the engine's source checkpoints: use `lantern-run` (it does that) or "
                           f"lantern.export.torch_backend.open_torch_backend(engine_dir)")
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


@dataclass(frozen=True)
class Runner:
    """A runner as the rest of lantern sees it: the name users pick (--backend), how the runtime
    opens it, and the facts other modules would otherwise read from the name."""

    name: str
    open: Callable  # (directory, manifest, **options) -> Backend
    device: str  # where it runs unless told ("cpu" or "cuda"): also the clock `tune` times it on
    plans: bool  # runs the engine's TensorRT plans: every call (every tree it runs) needs a covering profile
    export: bool  # built from torch modules lantern.export makes (the graphs' modules, or the device step's
    #               acceptance modules): `lantern-run` opens it through lantern.export.torch_backend
    onnx: bool  # runs the ONNX graphs on ONNX Runtime
    cuda_graphs_option: bool  # takes cuda_graphs=False (--no-cuda-graphs); the torch-based ones capture always on CUDA
    install: str  # what it needs installed besides lantern

    @property
    def reference(self):
        """The torch modules rebuilt from the source checkpoints: what `check` compares against."""
        return self.export and not self.plans and not self.onnx

    @property
    def row_views(self):
        """Its buffers' rows slice into views it copies into (numpy, torch): what moving one image's
        state between plans needs (lantern.runtime.continuous). The tensorrt runner's own CUDA
        arrays do not slice so."""
        return not (self.plans and not self.export)

    @property
    def hybrid(self):
        """Another runner's graphs or plans as the torch backend's modules (the whole step in torch)."""
        return self.export and not self.reference


_TORCH_INSTALL = "pip install torch==2.13.0 -e '.[export]'"
ONNXRUNTIME = Runner("onnxruntime", _onnxruntime, device="cpu", plans=False, export=False, onnx=True,
                     cuda_graphs_option=False, install="pip install 'lantern[cpu]' (or [gpu] for CUDA)")
TENSORRT = Runner("tensorrt", _tensorrt, device="cuda", plans=True, export=False, onnx=False, cuda_graphs_option=True,
                  install="pip install 'lantern[tensorrt]' (or [tensorrt-rtx])")
TORCH = Runner("torch", _torch, device="cpu", plans=False, export=True, onnx=False, cuda_graphs_option=False,
               install=_TORCH_INSTALL)
TENSORRT_TORCH = Runner("tensorrt-torch", _tensorrt_torch, device="cuda", plans=True, export=True, onnx=False,
                        cuda_graphs_option=False, install=f"{_TORCH_INSTALL} (a CUDA build) and {TENSORRT.install}")
ONNXRUNTIME_TORCH = Runner("onnxruntime-torch", _onnxruntime_torch, device="cpu", plans=False, export=True, onnx=True,
                           cuda_graphs_option=False, install=_TORCH_INSTALL)

RUNNERS = {r.name: r for r in (ONNXRUNTIME, TENSORRT, TORCH, TENSORRT_TORCH, ONNXRUNTIME_TORCH)}
DEFAULT = ONNXRUNTIME.name  # torch-free, on every machine


def runner(name):
    """The registry's record of a runner name (one line naming the valid ones for another)."""
    if name not in RUNNERS:
        raise LanternError(f"unknown backend {name!r}; valid: {', '.join(RUNNERS)}")
    return RUNNERS[name]


def runs_plans(name):
    """Whether the runner called `name` runs TensorRT plans (False for a name outside the registry:
    a wrapper or stand-in backend)."""
    return name in RUNNERS and RUNNERS[name].plans


def names(**facts):
    """The runner names whose records have these values, in registry order: names(export=True)."""
    return [r.name for r in RUNNERS.values() if all(getattr(r, k) == v for k, v in facts.items())]


def spoken(items):
    """'a', 'a and b', 'a, b and c': registry names in help text."""
    items = list(items)
    return " and ".join(items) if len(items) < 3 else f"{', '.join(items[:-1])} and {items[-1]}"


def open_backend(name, directory, manifest, **options):
    return runner(name).open(directory, manifest, **options)
