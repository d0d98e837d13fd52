"""Continuous (iteration-level) batching: a running batch of image slots that images join at a
step boundary and leave the step they are done, so a server keeps its batch full instead of
running each batch to its slowest image.

    batch = ContinuousBatch(engine, settings, slots=8)
    batch.admit({"classes": [3]}, seed=7, tag="a")      # True: it took a free slot
    while batch.running:
        for done in batch.step():                       # Finished images, the step they finish
            ...

How an image joins: it is prefilled on a plan of its own (with the images joining at the same
step: groups of 1, 2, 4, ...), then its state moves into a free slot of the running plan: its rows of
the KV caches, the rows of the feeds that carry state from one step to the next (draft0's pairs,
the condition embeddings), its counters and position offsets, its proposer's state
(`proposer.adopt`) and its random stream. The running plan keeps its shapes (static, bound
once); the images already running wait one prefill call. An image's tokens depend on its seed
and settings only, so each equals Engine.generate of that image alone (tests/test_continuous.py,
greedy and sampling, both proposers, plain and in-place caches).

A free slot keeps running in its rows (static shapes) on the state the last image left there,
never read. All images of a batch share its settings, proposer (tree or window: pinned when the
batch starts) and grid; a joiner whose prompt does not fit the running plan's prefix slots waits
for a batch of its own (`admit` says False).

Where the step runs: where generate would (Engine's step path for the batch's settings and plan):
the graph step (lantern.runtime.graph_step) on ONNX Runtime over an engine's step graphs and on
the torch runners asked for step="device" (their default on CUDA); there a joiner's rows also go
into the running GraphStep's buffers (`GraphStep.take`: its state rows, offsets, draft0's pairs on
the device, and its stream's row of the streams' table from the shared step counter on). The
host step runs where the graph step cannot, as generate's does: an engine without step graphs
(or of another STEP_VERSION), a Jacobi window on ONNX Runtime (no window graphs), a sampling
top_k past the acceptance's limit, step="host"; `stats` says which ("step", and "step_reason"
where the default gave way).
"""
import copy
import dataclasses
import threading
import time
from dataclasses import dataclass

import numpy as np

from lantern.runtime.backends import RUNNERS
from lantern.runtime.errors import LanternError
from lantern.runtime.kvcache import cache_layout
from lantern.runtime.plan import StepPlan
from lantern.runtime.settings import GenerationSettings

# feeds that carry state between steps: draft0's pairs and the condition embeddings
CARRIED = [("draft0", name) for name in ("input_ids", "position_ids", "target_hidden")] + [("verify", "cond_embeds")]


@dataclass
class Finished:
    tag: object  # what admit() was given
    tokens: np.ndarray  # [1, rows * columns] VQ codes
    grid: tuple
    stats: dict  # steps_per_image, mean_accepted_length, seconds (admitted -> done), engine_seconds (its
    # prefill and the steps it ran in), mean_running_images (per step it ran in, itself included)


class ContinuousBatch:
    def __init__(self, engine, settings, slots, tree=None, prefill_sizes=None):
        """A batch of `slots` images (an engine batch size) for these settings; tree: the draft
        tree every image runs (as generate's), pinned for the batch's life; prefill_sizes: the
        batch sizes joiners may be prefilled at (default 1, 2, 4, ...; a TensorRT engine's plans'
        batches: a group smaller than any is padded with copies of its last image)."""
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise LanternError(f"slots must be an integer >= 1, got {slots!r}")
        if not isinstance(settings, GenerationSettings):
            raise LanternError("settings must be a GenerationSettings")
        name = engine.backend.name
        if name in RUNNERS and not RUNNERS[name].row_views:
            able = ", ".join(n for n, r in RUNNERS.items() if r.row_views)
            raise LanternError(f"continuous batching does not run on the {name} runner yet (its device buffers do "
                               f"not slice into rows); it runs on {able}")
        self.engine, self.settings, self.slots, self.tree = engine, settings, slots, tree
        self.prefill_sizes = sorted(prefill_sizes or [1 << i for i in range(slots.bit_length())])
        self.decoding = None  # the running batch's loop state, made by the first admit
        self.device = None  # the backend's device step where it runs the batch (made with the running plan)
        self.why = None  # why the step runs on the host where the engine's default would not
        self.owner = [None] * slots  # tag per slot; None: free
        self.steps = np.zeros(slots, dtype=np.int64)
        self.admitted = np.zeros(slots)  # when each slot's image joined (perf_counter)
        self.engine_seconds = np.zeros(slots)  # its prefill and the steps it ran in
        self.shared = np.zeros(slots)  # the running images of the steps it ran in, summed
        self.lock = threading.Lock()  # one admit or step at a time

    @property
    def running(self):
        """Images in the batch now."""
        return sum(o is not None for o in self.owner)

    @property
    def free(self):
        return self.slots - self.running

    @property
    def stats(self):
        """The running plan's stats so far (tree, proposer, phase times), {} before it starts."""
        if self.decoding is None:
            return {}
        d = self.decoding
        stats = dict(self.setup.describe(), mode=d.rule.name if d.tree.depth else "ar", tree=d.tree.name,
                     step=d.step_path, backend=self.engine.backend.name)
        if self.why is not None:
            stats["step_reason"] = self.why
        return stats

    # -- joining -----------------------------------------------------------------------------------
    def admit(self, condition, seed, tag):
        """Image `tag` (condition: generate's condition arguments for one image; seed: its int
        seed) into a free slot, prefilled; False where it cannot join now (no free slot, or its
        prompt or grid does not fit the running plan: it waits for a batch of its own)."""
        return self.admit_many([(condition, seed, tag)]) == 1

    def admit_many(self, images):
        """Images [(condition, seed, tag)] into free slots, in order, prefilled together in groups
        of the prefill sizes (one prefill call per group); how many joined (it stops at the first
        that cannot join now)."""
        with self.lock, self.engine._lock:
            if images and self.decoding is None:
                self._start(*images[0][:2])
            joined = 0
            while joined < len(images) and self.free:
                group = images[joined: joined + self._group_size(min(len(images) - joined, self.free))]
                try:
                    setup = self._joiner(group)
                    if setup is None and len(group) > 1:  # one of them does not fit: try them one at a time
                        group = group[:1]
                        setup = self._joiner(group)
                    if setup is None:
                        break
                    start = time.perf_counter()
                    joiner = setup.decoding(self.engine, self._prefill_plan(setup))
                    joiner.prefill()
                except LanternError:
                    if joined:  # those joined stay; the caller hears of the rest on its next admit
                        break
                    raise
                seconds = (time.perf_counter() - start) / len(group)
                for i, (_, _, tag) in enumerate(group):
                    n = self.owner.index(None)
                    self._take(joiner, i, n)
                    self.owner[n], self.steps[n], self.admitted[n] = tag, 0, start
                    self.engine_seconds[n], self.shared[n] = seconds, 0.0
                joined += len(group)
            return joined

    def _group_size(self, n):
        """Joiners per prefill for n waiting: the largest prefill size up to n (else n, padded)."""
        fits = [k for k in self.prefill_sizes if k <= n]
        return fits[-1] if fits else n

    def _start(self, condition, seed):
        """The running plan, from the first image: every slot prefilled with it, all free."""
        e = self.engine
        one = e.prepare(self.settings, condition, seed, self.tree)
        if one.prefix.images != 1:
            raise LanternError(f"admit takes one image's condition, got {one.prefix.images}")
        condition = {k: (v if k == "grid" else _repeat(v, self.slots)) for k, v in condition.items()}
        self.setup = setup = dataclasses.replace(
            one, prefix=e.condition.prefix(one.settings.cfg, **condition), seeds=[int(seed)] * self.slots)
        tree, drafter = setup.proposer.tree, setup.proposer.drafter
        e.check_memory(tree, setup.prefix, drafter)
        self.plan = StepPlan(e.manifest, e.backend, tree, setup.prefix, setup.feeds, drafter)
        e.backend.bind(self.plan)
        path, self.why = e._step_path(self.plan, setup.proposer, setup.rule, setup.sampler)  # as generate's
        self.decoding = d = setup.decoding(e, self.plan, step_path=path)
        d.prefill()
        d.count[:] = d.length  # every slot free until an image joins
        if path == "device":  # its state starts from the free slots': every image done
            self.device = e.backend.device_step(d)

    def _joiner(self, group):
        """The Setup of a group of joiners prefilled together (the batch's proposer kind, their
        own prefix and seeds), or None where one does not fit the running plan."""
        e, d = self.engine, self.decoding
        pad = next((k for k in self.prefill_sizes if k >= len(group)), len(group)) - len(group)
        group = list(group) + [group[-1]] * pad  # copies of the last: prefilled, never taken
        prefix = e.condition.prefix(self.setup.settings.cfg, **_concat([c for c, _, _ in group]))
        if prefix.images != len(group):
            raise LanternError("admit takes one image's condition per image")
        e.check_positions(prefix)
        if not np.array_equal(prefix.forced, self.plan.prefix.forced):  # another grid
            return None
        if cache_layout(e.manifest, prefix, d.tree, self.plan.drafts)[2] > self.plan.target_cache.capacity:
            return None  # a longer prompt than the running plan holds
        return dataclasses.replace(self.setup, prefix=prefix, seeds=[int(seed) for _, seed, _ in group],
                                   proposer=copy.copy(d.proposer))

    def _prefill_plan(self, setup):
        """The plan a group of joiners is prefilled on, made for this prefill and let go after it
        (its memory checked as generate's; a fresh buffer costs little, a kept one per group size
        would hold about the running plan's memory again)."""
        e, tree, drafter = self.engine, setup.proposer.tree, setup.proposer.drafter
        e.check_memory(tree, setup.prefix, drafter)
        return StepPlan(e.manifest, e.backend, tree, setup.prefix, setup.feeds, drafter)

    def _take(self, joiner, i, n):
        """Image i of the prefilled joiners as slot n's image."""
        d, plan, small, backend = self.decoding, self.plan, joiner.plan, self.engine.backend
        rows, src = np.flatnonzero(d.image_of_row == n), np.flatnonzero(joiner.image_of_row == i)
        for cache, from_cache in ((plan.target_cache, small.target_cache), (plan.drafter_cache, small.drafter_cache)):
            if cache is None:
                continue
            for r, s in zip(rows, src):
                width = int(from_cache.length[s])  # what prefill filled (the drafter's: nothing yet)
                backend.copy(from_cache.keys[:, s: s + 1, :, :width], cache.keys[:, r: r + 1, :, :width])
                backend.copy(from_cache.values[:, s: s + 1, :, :width], cache.values[:, r: r + 1, :, :width])
                cache.visible[r] = False
                cache.visible[r, :width] = from_cache.visible[s, :width]
                cache.length[r] = from_cache.length[s]
        for regime, name in CARRIED:
            if regime in plan.calls and name in plan.calls[regime].feeds:
                for r, s in zip(rows, src):
                    _copy_row(backend, small.calls[regime].feeds[name], s, plan.calls[regime].feeds[name], r)
        if "draft0" in plan.calls:
            plan.calls["draft0"].block[rows] = small.calls["draft0"].block[src]
        d.offset[rows] = joiner.offset[src]
        d.tokens[n], d.count[n] = joiner.tokens[i], joiner.count[i]
        d.streams.generators[n] = joiner.streams.generators[i]
        d.proposer.adopt(joiner.proposer, i, n)
        if self.device is not None:  # the running graph step's rows, from the host state just written
            self.device.take(d, n, rows, CARRIED)

    # -- running -----------------------------------------------------------------------------------
    def step(self):
        """One step of every running image; the images it finished, their slots freed."""
        with self.lock, self.engine._lock:
            d = self.decoding
            if d is None or not self.running:
                return []
            active = d.count < d.length
            start = time.perf_counter()
            if self.device is not None:  # the backend's GraphStep
                d.device_step(self.device, active)
            else:
                d.host_step(active)
            self.steps[active] += 1
            self.engine_seconds[active] += time.perf_counter() - start
            self.shared[active] += active.sum()
            done = [n for n in range(self.slots) if self.owner[n] is not None and d.count[n] >= d.length]
            out = []
            for n in done:
                steps = int(self.steps[n])
                out.append(Finished(self.owner[n], d.view.codes_of(d.tokens[n: n + 1]), self.plan.prefix.grid,
                                    dict(steps_per_image=steps, mean_accepted_length=(d.length - 1) / max(steps, 1),
                                         seconds=time.perf_counter() - self.admitted[n],
                                         engine_seconds=float(self.engine_seconds[n]),
                                         mean_running_images=float(self.shared[n] / max(steps, 1)))))
                self.owner[n] = None
            return out

    def cancel(self, tag):
        """Free the slot of image `tag` now (its client went away); False if it is not running."""
        with self.lock:
            if tag not in self.owner:
                return False
            n = self.owner.index(tag)
            self.owner[n] = None
            self.decoding.count[n] = self.decoding.length  # a graph step's copy runs on, never read, until a joiner
            return True

    def close(self):
        """Let the running plan's bindings go (the batch is done)."""
        with self.lock, self.engine._lock:
            if self.decoding is not None:
                self.engine.backend.release(self.plan)  # its GraphStep too
            self.decoding = self.device = None


def _concat(conditions):
    """Several images' conditions (generate's arguments, one image each) as one call's."""
    out = {"grid": conditions[0]["grid"]} if "grid" in conditions[0] else {}
    for name, first in conditions[0].items():
        if name != "grid":
            rows = [c[name] for c in conditions]
            out[name] = np.concatenate(rows) if isinstance(first, np.ndarray) else [r for row in rows for r in row]
    return out


def _repeat(rows, times):
    """One image's condition entry as `times` images' (arrays: along the first axis)."""
    if isinstance(rows, np.ndarray):
        return np.repeat(rows[:1], times, axis=0)
    return [rows[0]] * times


def _copy_row(backend, src, s, dst, r):
    if isinstance(dst, np.ndarray):
        dst[r] = src[s]
    else:  # a buffer on the backend's device
        backend.copy(src[s: s + 1], dst[r: r + 1])
