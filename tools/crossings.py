"""What crosses the host boundary while an engine generates: RecordingBackend wraps any backend
and counts every crossing as events (kind, bytes), for `lantern-run profile` and the step
benchmarks (lantern.tools.bench.device_step)."""
import numpy as np

OWN_BUFFERS = ("target_hidden", "cond_embeds")


class RecordingBackend:
    """A real backend with every host crossing counted as events (kind, bytes): arrays the loop
    hands to run() (feeds that a GPU backend copies up), index arrays of gather/commit/copy,
    numpy(), to_host() and read() reads, to_device(), array() and fill() writes, synchronisations,
    launches from the host (run_all: one per call of the step).
    `start`: where the last device step's steps begin in `events` (its setup is not counted)."""

    def __init__(self, inner):
        self.inner = inner
        self.events = []
        self.start = 0
        self.last_step = None  # the inner backend's device step of the last generation

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _up(self, *arrays):
        self.events.append(("to_device", sum(a.nbytes for a in arrays if isinstance(a, np.ndarray))))

    def run(self, call):
        # the backend's own buffers (caches, hidden states, condition embeddings: made by
        # backend.zeros, on its device) do not cross; what the loop wrote on the host does
        self._up(*(v for k, v in call.feeds.items() if not k.startswith("past_") and k not in OWN_BUFFERS))
        self.events.append(("launch", 0))
        return self.inner.run(call)

    def numpy(self, array):
        out = self.inner.numpy(array)
        self.events += [("to_host", out.nbytes), ("sync", 0)]
        return out

    def gather(self, src, rows, cols, out):
        self._up(np.asarray(rows), np.asarray(cols))
        return self.inner.gather(src, rows, cols, out)

    def commit(self, cache, new, rows, src, dst):
        self._up(*(np.asarray(a) for a in (rows, src, dst)))
        return self.inner.commit(cache, new, rows, src, dst)

    def copy(self, src, out):
        self._up(src)
        return self.inner.copy(src, out)

    def to_device(self, array):
        self._up(np.asarray(array))
        return self.inner.to_device(array)

    def to_host(self, tensor):
        out = self.inner.to_host(tensor)
        self.events += [("to_host", out.nbytes), ("sync", 0)]
        return out

    def synchronize(self):
        self.events.append(("sync", 0))
        return self.inner.synchronize()

    # the device step's buffers (lantern.runtime.graph_step.GraphStep runs on decoding.backend,
    # this wrapper): made and bound at setup, refilled by fill, read back by read, run by run_all
    def array(self, host):
        self._up(np.asarray(host))
        return self.inner.array(host)

    def fill(self, buffer, values):
        self._up(np.asarray(values))
        return self.inner.fill(buffer, values)

    def read(self, buffer, width):
        out = self.inner.read(buffer, width)
        self.events += [("to_host", out.nbytes), ("sync", 0)]
        return out

    def device_call(self, call, shared):
        return self.inner.device_call(call, shared)

    def bind_calls(self, calls):
        return self.inner.bind_calls(calls)

    def graph_inputs(self, label):
        return self.inner.graph_inputs(label)

    def graph_outputs(self, label):
        return self.inner.graph_outputs(label)

    def run_all(self, calls):
        # one launch per call; their feeds are the device buffers bound once: nothing goes up
        self.events += [("launch", 0)] * len(calls)
        return self.inner.run_all(calls)

    def device_step(self, decoding):
        step = self.inner.device_step(decoding)
        self.last_step = step
        self.start = len(self.events)
        return step

    def totals(self, start):
        """{to_device, to_host: bytes; sync, launch: count} since event `start`."""
        out = dict(to_device=0, to_host=0, sync=0, launch=0)
        for kind, size in self.events[start:]:
            out[kind] += size if kind.startswith("to_") else 1
        return out

