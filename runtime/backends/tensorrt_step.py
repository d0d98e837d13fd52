"""The device step on TensorRT: the backend half of lantern.runtime.graph_step's GraphStep over
the plans `lantern-export trt` builds of the engine's step graphs (`lantern-export accept`), a
mixin of TensorRTBackend (which owns the contexts, bindings and the one stream).

- open_graphs deserializes a tree's step plans (labelled by their files) and checks each was built
  from the file the engine has now (the build records its sha256);
- device_call gives each engine call of the plan device buffers for every feed, bound in the
  plan call's own context, so the phases write the next call's feeds where it reads them;
- bind_calls gives each phase call an exact profile of its own: GraphStep binds every phase
  twice (even and odd steps, the two state buffers swapped), a context holds one set of tensor
  addresses and a profile one context at a time, so `lantern-export trt` builds each shape twice
  (tensorrt_plans.step_profiles assigns them); set once, the addresses never change;
- run_all enqueues a parity's calls on the stream, then (cuda_graphs) captures the whole list as
  one CUDA graph after that eager first run; where capture fails, one warning line, and the calls
  are launched one by one from then on;
- array / fill / read over the backend's device buffers (the report: a few integers per image).
Nothing of it has run on a GPU yet (no machine here has one): the backend's default step stays
the host step until tools/gpu_check's tensorrt graph-step section measures both.
"""
import sys

import numpy as np

from lantern.runtime.backends.cuda import DeviceArray, _host_values
from lantern.runtime.backends.tensorrt_plans import rebuild_command, step_plan_refusal, step_profiles
from lantern.runtime.errors import LanternError
from lantern.runtime.graph_step import GraphStep, phase_files
from lantern.runtime.plan import Call


class _Sequence:
    """A step's call list (one parity of a GraphStep) and, once captured, its one CUDA graph."""

    def __init__(self, calls, keys):
        self.calls, self.keys = calls, keys  # keys: the contexts its calls run in
        self.runs, self.graph, self.failed = 0, None, False


class TensorRTGraphStep:
    """TensorRTBackend's device step (see the module docstring)."""

    def device_step_refusal(self, plan, sampler, proposer=None):
        """Why this backend's device step (the whole step on the plans of the engine's step graphs
        for the plan's tree) cannot run a generation of this plan, sampler and proposer (None: the
        drafter tree), or None."""
        if proposer is not None and proposer.name == "jacobi":
            return "TensorRT has no plans of a Jacobi window's step graphs yet (`lantern-export trt` builds the trees')"
        return step_plan_refusal(self.manifest, self.directory, self.key, self.plans, plan, sampler, self.gpu)

    def device_step(self, decoding):
        """The generation's whole step on the step graphs' plans (lantern.runtime.graph_step):
        engine calls and phases bound once, one CUDA graph per parity, a few integers read back."""
        plan = decoding.plan
        step = self._steps.get(id(plan))
        if step is not None and step.serves(decoding):
            step.load(decoding)  # the plan's next generation: the same buffers and bindings, refilled
            return step
        if step is not None:
            self._drop_step(step)
        entry = self.manifest.step_graphs_for(plan.tree)
        graphs = self.open_graphs(phase_files(entry, decoding.sampler, decoding.view.size))
        step = self._steps[id(plan)] = GraphStep(decoding.backend, decoding, graphs)  # a recording wrapper too
        return step

    def open_graphs(self, files):
        """{name: label} of a tree's step graphs at files {name: path in the engine directory}:
        their plans (labelled by the file) deserialized once and checked (load_plan; a plan built
        from another version of the file is refused with the rebuild line)."""
        rebuild = rebuild_command(self.directory, self.plans.flavor, self.gpu)
        built_from = self.plans.builder.get("step_files", {})  # file -> its sha256 when the plans were built
        labels = {}
        for name, rel in files.items():
            if rel not in self.engines:
                plan_file = self.plans.plans.get(rel)
                if plan_file is None:
                    raise LanternError(f"plans/{self.key} have no plan of {rel}; rebuild them with `{rebuild}`")
                record = self.manifest.files.get(rel)
                if record is None or built_from.get(rel) != record.sha256:
                    raise LanternError(f"plans/{self.key}: the plan of {rel} was built from another version of the "
                                       f"step graph; rebuild them with `{rebuild}`")
                self.engines[rel] = self._deserialize(rel, plan_file)
                self._grow_scratch(self.engines[rel].device_memory_size_v2)
            labels[name] = rel
        return labels

    def _io(self, label, mode):
        engine = self.engines[label]
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        # bf16 has no numpy type: such a tensor reads as float32 (the step graphs' own buffers are never bf16)
        return [(n, np.dtype("float32" if self._tensor_dtype(label, n) == "bfloat16" else self._tensor_dtype(label, n)))
                for n in names if engine.get_tensor_mode(n) == mode]

    def graph_inputs(self, label):
        return self._io(label, self.trt.TensorIOMode.INPUT)

    def graph_outputs(self, label):
        return self._io(label, self.trt.TensorIOMode.OUTPUT)

    def device_call(self, call, shared):
        """The plan's call with a device buffer for every feed (a host feed copied once; one buffer
        per host buffer in `shared`: the drafter calls share cfg_pair) and its bound outputs, bound
        in the context of the plan's call (the plan binds every regime in a profile of its own)."""
        feeds = {}
        for name, buf in call.feeds.items():
            if not isinstance(buf, DeviceArray):
                if id(buf) not in shared:
                    dtype = self._tensor_dtype(call.graph, name)
                    shared[id(buf)] = self.array(np.asarray(buf), dtype)
                buf = shared[id(buf)]
            feeds[name] = buf
        device = Call(graph=call.graph, regime=call.regime, feeds=feeds, output_shapes=call.output_shapes,
                      tokens=call.tokens)
        profile = self._bound[id(call)].context_key[1]
        bound, device.outputs = self._prepare(device, profile, call.outputs)
        self._bound[id(device)] = bound
        return device

    def bind_calls(self, calls):
        """Bind a GraphStep's phase calls (both parities): each in a profile of its own
        (tensorrt_plans.step_profiles: a phase's two parities bind other state buffers, and a
        context holds one set of addresses), its outputs the buffers the step gives."""
        calls = list(calls)
        for call, profile in zip(calls, step_profiles(self.directory, self.key, self.plans, calls, self.gpu)):
            bound, call.outputs = self._prepare(call, profile, call.outputs)
            self._bound[id(call)] = bound

    def run_all(self, calls):
        """A step's calls in order on the one stream; with cuda_graphs the whole list is captured as
        one CUDA graph after its first, eager run (one warning line and per-call launches where the
        capture fails). Every feed is a device buffer: nothing is staged from the host."""
        sequence = self._sequences.get(id(calls))
        if sequence is None or sequence.calls is not calls:
            sequence = self._sequences[id(calls)] = _Sequence(calls, {self._bound[id(c)].context_key for c in calls})
        if sequence.graph is not None:
            sequence.graph.launch()
            sequence.runs += 1
            return
        self._enqueue_all(calls)
        sequence.runs += 1
        if self.cuda_graphs and sequence.runs == 1 and not sequence.failed:
            self.synchronize()  # the eager run did TensorRT's lazy setup; capture the next ones
            capturable = all(self._capturable(self._bound[id(c)]) for c in calls)
            sequence.graph = self.cuda.capture(lambda: self._enqueue_all(calls, check=False)) if capturable else None
            if sequence.graph is None:
                sequence.failed = True
                print("lantern: warning: TensorRT's step could not be captured as a CUDA graph; its calls are "
                      "launched one by one", file=sys.stderr)

    def _enqueue_all(self, calls, check=True):
        for call in calls:
            bound = self._bound[id(call)]
            self._set_addresses(bound)
            if not self._enqueue(bound):
                if not check:
                    return False
                raise LanternError(f"{call.graph} call {call.regime}: TensorRT's enqueue failed "
                                   f"({self.logger.first_error()})")
        return True

    def array(self, host, dtype=None):
        """A device buffer holding a copy of a host array (of the host's dtype unless given)."""
        host = np.asarray(host)
        out = self._empty(host.shape, dtype or host.dtype.name)
        self.copy(host, out)
        return out

    def fill(self, array, values):
        self.copy(np.asarray(values), array)

    def fill_rows(self, array, rows, values):
        """array[rows] = values in place, one copy per row (a continuous batch's joiner into a
        running step's buffers)."""
        values = _host_values(np.asarray(values), array.dtype)
        row = array.nbytes // array.shape[0]
        for i, r in enumerate(np.asarray(rows).reshape(-1).tolist()):
            self.cuda.memcpy(array.ptr + r * row, values[i].ctypes.data, row, "cudaMemcpyHostToDevice")
        self.synchronize()  # `values` is a temporary

    def read(self, array, width):
        """The first `width` columns of a device buffer, on the host (the report: a few integers)."""
        return self.numpy(array)[:, :width]

    def _drop_step(self, step):
        for call in [c for calls in step.calls for c in calls] + list(step.model_calls.values()):
            self._unbind(call)
        for calls in step.calls:
            self._sequences.pop(id(calls), None)
