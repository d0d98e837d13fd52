"""PyTorch backend: the graphs as torch modules (the very modules that were exported, rebuilt by
lantern.export from the engine's source checkpoints), on the CPU or a GPU. The reference for
`check`, and the GPU path measurable where PyTorch has CUDA. lantern.runtime never imports
lantern.export: the modules are handed in.

On CUDA, bind(plan) gives every call of the plan static device inputs (ids, positions, masks,
sampling settings; caches, hidden states and condition embeddings already live on the device)
and, by default, captures each call regime in a CUDA graph: a step then costs a few small
host-to-device copies and one graph replay per engine call. cuda_graphs=False runs the modules
eagerly on the same static buffers, for comparison.

In-place graphs (contracts with `aliases`): the modules return the updated caches as new tensors
(eager TensorScatter is out of place), which run() copies into the cache buffers, a whole-cache
copy per call (the device step's calls too): this backend is the reference for in-place engines,
not their fast path.

Device step (lantern.runtime.graph_step): with the step's modules (open_torch_backend hands in
lantern.export.step_export.step_phase_factory: the very modules the step graphs are exported
from), `device_step(decoding)` runs a generation's whole step on the device, every proposer,
greedy or sampling, both cache forms; on CUDA the whole step (phases and engine calls) is
captured as one CUDA graph per plan and replayed (after one eager step). default_step is the
step path generate() takes when none is asked for: host on the CPU (measured faster there:
tools/bench/device_step.py), device on CUDA."""
import sys

import numpy as np

from lantern.runtime.backends import TORCH
from lantern.runtime.errors import LanternError
from lantern.runtime.contracts import graph_io
from lantern.runtime.graph_step import GraphStep, top_k_refusal
from lantern.runtime.plan import Call
from lantern.runtime.kvcache import InPlaceKVCache
from lantern.runtime.sampling import Greedy

_TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class TorchBackend:
    name = TORCH.name
    key = None  # runs the ONNX graphs (or their modules), no compiled plans
    device_step_proposers = ("tree", "jacobi")  # its device step runs the drafter tree and the jacobi window

    def __init__(self, modules, manifest, threads=None, device="cpu", cuda_graphs=True, step_phases=None,
                 accept_precision="float64"):
        """modules: {graph name: torch module}, inputs and outputs in the order of the graph's contract.
        step_phases: (tree, columns, kind, proposer, init, accept dtype) -> {phase: (module,
        inputs, outputs)}, the device step's modules (lantern.export.step_export.step_phase_factory).
        accept_precision: the device step's sampling acceptance in float64 (the host's decisions)
        or float32."""
        try:
            import torch
        except ImportError:
            raise LanternError("the torch backend needs PyTorch (pip install 'lantern[export]')") from None
        self.torch = torch
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
                raise LanternError(f"threads must be a positive integer, got {threads!r}")
            torch.set_num_threads(threads)
        if device not in ("cpu", "cuda"):
            raise LanternError(f"unknown device {device!r}; valid: cpu, cuda")
        if device == "cuda" and not torch.cuda.is_available():
            raise LanternError("device cuda: this PyTorch has no CUDA device")
        self.device = torch.device(device)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.dtype = getattr(torch, _TORCH_DTYPES[manifest.dtype])
        # bf16 has no numpy type: host copies of bf16 tensors come back as float32
        self.float_dtype = {"fp32": np.float32, "fp16": np.float16, "bf16": np.float32}[manifest.dtype]
        self.modules = {name: module.to(self.device).eval() for name, module in modules.items()}
        self.inputs, self.outputs, self.floats, self.aliases = {}, {}, {}, {}
        for name, graph in manifest.graphs.items():
            if name not in self.modules:
                continue
            io = graph_io(graph.contract, max(graph.layers, 1))
            self.inputs[name] = list(io["inputs"])
            self.outputs[name] = list(io["outputs"])
            self.floats[name] = {k for k, (kind, _) in io["inputs"].items() if kind == "float"}
            self.aliases[name] = io["aliases"]
        if accept_precision not in ("float64", "float32"):
            raise LanternError(f"accept_precision must be float64 or float32, got {accept_precision!r}")
        self.accept_precision = accept_precision
        self._bound = {}  # id(call) -> (call, static inputs, CUDA graph or None, graph outputs)
        self.step_phases = step_phases
        self.default_step = "device" if self.device.type == "cuda" and step_phases is not None else "host"
        self.manifest = manifest
        self._pinned = {}  # (shape, dtype) -> pinned host buffer for to_host on CUDA
        self._steps = {}  # id(plan) -> its GraphStep (buffers), reused by the plan's generations
        self.phase_modules = {}  # label -> a step phase's module (lantern.export.step_graphs), run as calls too
        self._phases = {}  # the step modules' key -> {phase: label}
        self._phase_io = {}  # label -> (inputs, outputs) as [(name, numpy dtype)]
        self._step_graphs = {}  # id(calls) -> [calls, CUDA graph or None] of a step's whole sequence

    def _tensor(self, x, is_float):
        if not isinstance(x, self.torch.Tensor):
            x = self.torch.from_numpy(np.ascontiguousarray(x)).to(self.device)
        return x.to(self.dtype) if is_float else x

    def zeros(self, shape):
        return self.torch.zeros(shape, dtype=self.dtype, device=self.device)

    def bind(self, plan):
        if self.device.type != "cuda":
            return  # on the CPU feeds are wrapped per call, without copies
        torch = self.torch
        pool = None  # the plan's graphs share one memory pool, which dies with them
        for call in plan.calls.values():
            floats = self.floats[call.graph]
            static = {}
            for name in self.inputs[call.graph]:
                buf = call.feeds[name]
                if isinstance(buf, torch.Tensor):
                    static[name] = buf  # caches, hidden states: already on the device, in place
                else:
                    static[name] = torch.empty(buf.shape, dtype=self.dtype if name in floats else
                                               getattr(torch, str(buf.dtype)), device=self.device)
            self._copy_feeds(call, static)
            graph, outputs = None, None
            if self.cuda_graphs:
                try:
                    graph, outputs = self._capture(call.graph, [static[n] for n in self.inputs[call.graph]], pool)
                    pool = graph.pool()
                except Exception as e:  # a module capture refuses (a TensorRT plan, say): this call runs eagerly
                    print(f"lantern: {call.graph} call {call.regime} not captured as a CUDA graph "
                          f"({str(e).splitlines()[0]}); running it eagerly", file=sys.stderr)
                    graph, outputs = None, None
            self._bound[id(call)] = (call, static, graph, outputs)

    def _capture(self, graph_name, args, pool):
        """A CUDA graph of one call over static inputs (warmed up on a side stream first, as
        torch.cuda.graphs requires), allocating from `pool`."""
        torch = self.torch
        module = self.modules[graph_name]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):
                module(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
            out = module(*args)
        out = out if isinstance(out, tuple) else (out,)
        return graph, dict(zip(self.outputs[graph_name], out))

    def bound_inputs(self, call):
        """{input name: static device tensor} bind() made for a call (CUDA), else {}."""
        bound = self._bound.get(id(call))
        return bound[1] if bound is not None and bound[0] is call else {}

    def _copy_feeds(self, call, static):
        for name, buf in call.feeds.items():
            if not isinstance(buf, self.torch.Tensor):
                static[name].copy_(self.torch.from_numpy(np.ascontiguousarray(buf)), non_blocking=True)

    def release(self, plan):
        for call in plan.calls.values():
            self._bound.pop(id(call), None)
        step = self._steps.pop(id(plan), None)
        if step is not None:
            for calls in step.calls:
                self._step_graphs.pop(id(calls), None)

    def run(self, call):
        bound = self._bound.get(id(call))
        if bound is not None and bound[0] is call:
            _, static, graph, outputs = bound
            self._copy_feeds(call, static)
            if graph is not None:
                graph.replay()
                return self._update_in_place(call.graph, outputs, static)
            args = [static[n] for n in self.inputs[call.graph]]
        else:
            floats = self.floats[call.graph]
            args = [self._tensor(call.feeds[name], name in floats) for name in self.inputs[call.graph]]
        module = self.modules[call.graph] if call.graph in self.modules else self.phase_modules[call.graph]
        with self.torch.inference_mode():
            out = module(*args)
        out = out if isinstance(out, tuple) else (out,)
        out = self._update_in_place(call.graph, dict(zip(self.outputs[call.graph], out)),
                                    dict(zip(self.inputs[call.graph], args)))
        if call.outputs:  # written where the step's next call reads them
            for name, target in call.outputs.items():
                if out[name] is not target:
                    target.copy_(out[name])
            return call.outputs
        return out

    def _update_in_place(self, graph, out, inputs):
        """Aliased outputs copied into their inputs (the caches), and returned as those."""
        for output, source in self.aliases[graph].items():
            target = inputs[source]
            if out[output] is not target:
                target.copy_(out[output])
            out[output] = target
        return out

    def call_shapes(self, graph):
        return None  # any shape runs

    def numpy(self, array):
        if isinstance(array, np.ndarray):
            return array
        return array.detach().float().cpu().numpy() if array.is_floating_point() else array.cpu().numpy()

    def _indices(self, *arrays):
        """Index arrays on the device, in one host-to-device copy."""
        stacked = self.torch.as_tensor(np.stack([np.broadcast_to(a, np.shape(arrays[0])) for a in arrays]),
                                       device=self.device)
        return stacked.unbind(0)

    def gather(self, src, rows, cols, out):
        r, c = self._indices(rows, cols)
        out.copy_(src[r, c])

    def copy(self, src, out):
        out.copy_(self._tensor(src, True))

    def commit(self, cache, new, rows, src, dst):
        r, s, d = self._indices(rows, src, dst)
        cache[:, r, :, d] = new[:, r, :, s]

    # -- the device step ---------------------------------------------------------------------
    def device_step_refusal(self, plan, sampler, proposer=None):
        """Why the device step cannot run a generation of this plan and sampler, or None."""
        if self.step_phases is None:
            return (f"this {self.name} backend was opened without the step's modules (open it with "
                    f"lantern.export.torch_backend.open_{self.name.replace('-', '_')}_backend)")
        return top_k_refusal(sampler, int(plan.calls["verify"].output_shapes["logits"][-1]))

    def device_step(self, decoding):
        """The device step for one generation (after its prefill); a plan's next generation with
        the same key refills the same buffers. Its host crossings go through decoding.backend
        (this backend, or a wrapper that records them)."""
        step = self._steps.get(id(decoding.plan))
        if step is not None and step.serves(decoding):
            step.load(decoding)
            return step
        if step is not None:  # another key on this plan: the old step's graphs go with it
            for calls in step.calls:
                self._step_graphs.pop(id(calls), None)
        step = self._steps[id(decoding.plan)] = GraphStep(decoding.backend, decoding, self.step_graphs(decoding))
        return step

    def step_graphs(self, decoding):
        """{phase: label} of the step's modules for this generation's tree, proposer and kind."""
        plan, view, proposer = decoding.plan, decoding.view, decoding.proposer
        kind = "greedy" if isinstance(decoding.sampler, Greedy) else "sampling"
        inplace = isinstance(plan.target_cache, InPlaceKVCache)
        key = (plan.tree.paths, kind, proposer.name, getattr(proposer, "init", None), tuple(view.extra.tolist()),
               inplace)
        if key not in self._phases:
            columns = np.concatenate([view.start + np.arange(view.codes), view.extra]).astype(np.int64)
            made = self.step_phases(plan.tree, columns, kind, proposer.name, getattr(proposer, "init", None),
                                    self.accept_precision)
            labels = {}
            for phase, (module, inputs, outputs) in made.items():
                label = f"step{len(self._phases)}:{phase}"
                self.phase_modules[label] = module.to(self.device)
                self.inputs[label], self.outputs[label] = [n for n, _ in inputs], [n for n, _ in outputs]
                self.floats[label], self.aliases[label] = set(), {}
                self._phase_io[label] = (inputs, outputs)
                labels[phase] = label
            self._phases[key] = labels
        return self._phases[key]

    def graph_inputs(self, label):
        return self._phase_io[label][0]

    def graph_outputs(self, label):
        return self._phase_io[label][1]

    def device_call(self, call, shared):
        """The call with device tensors for every feed (a host feed copied once; one tensor per
        host buffer in `shared`) and preallocated outputs: what the step's phases write and read."""
        torch = self.torch
        feeds = {}
        for name, buf in call.feeds.items():
            if not isinstance(buf, torch.Tensor):
                if id(buf) not in shared:
                    shared[id(buf)] = self._tensor(buf, name in self.floats[call.graph]).clone()
                buf = shared[id(buf)]
            feeds[name] = buf
        specs = self.manifest.graphs[call.graph].outputs
        outputs = {name: torch.empty(shape, dtype=self.dtype if specs[name].dtype in ("float16", "bfloat16") else
                                     getattr(torch, specs[name].dtype), device=self.device)
                   for name, shape in call.output_shapes.items()}
        return Call(graph=call.graph, regime=call.regime, feeds=feeds, output_shapes=call.output_shapes,
                    outputs=outputs, tokens=call.tokens)

    def bind_calls(self, calls):
        """The step's calls run eagerly (their buffers are the device's already)."""

    def run_all(self, calls):
        """A step's calls in order; on CUDA one graph of them all, captured after one eager run
        (one warning line and eager runs where capture fails)."""
        entry = self._step_graphs.get(id(calls))
        if entry is not None and entry[1] is not None:
            entry[1].replay()
            return
        with self.torch.inference_mode():
            for call in calls:
                self.run(call)
        if entry is None and self.cuda_graphs:
            self._step_graphs[id(calls)] = [calls, self._capture_step(calls)]

    def _capture_step(self, calls):
        torch = self.torch
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize()
            with torch.inference_mode(), torch.cuda.graph(graph):
                for call in calls:
                    self.run(call)
        except Exception as e:  # some op refuses capture: the eager step stays correct
            print(f"lantern: device step not captured as a CUDA graph ({str(e).splitlines()[0]}); running it "
                  f"eagerly", file=sys.stderr)
            return None
        return graph

    def array(self, host):
        """A device tensor holding a copy of a host array."""
        return self.torch.tensor(np.asarray(host), device=self.device)

    def fill(self, tensor, values):
        tensor.copy_(self.torch.as_tensor(np.asarray(values)).to(tensor.dtype), non_blocking=True)

    def fill_rows(self, tensor, rows, values):
        """tensor[rows] = values in place (a continuous batch's joiner into a running step's buffers)."""
        index = self.torch.as_tensor(np.asarray(rows), device=self.device)
        tensor[index] = self.torch.as_tensor(np.asarray(values)).to(device=self.device, dtype=tensor.dtype)

    def read(self, tensor, width):
        """The first `width` columns of a device tensor, on the host (one transfer)."""
        return self.to_host(tensor[:, :width].contiguous())

    def to_device(self, array):
        """A device tensor holding a copy of a host array."""
        return self.torch.tensor(np.asarray(array), device=self.device)

    def to_host(self, tensor):
        """A host copy of a device tensor; on CUDA through a pinned buffer, one synchronisation."""
        if self.device.type != "cuda":
            return tensor.numpy().copy()
        key = (tuple(tensor.shape), tensor.dtype)
        buffer = self._pinned.get(key)
        if buffer is None:
            buffer = self._pinned[key] = self.torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        buffer.copy_(tensor, non_blocking=True)
        self.torch.cuda.current_stream(self.device).synchronize()
        return buffer.numpy().copy()

    def synchronize(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()
