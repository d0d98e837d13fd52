"""The whole step run as the engine's step graphs (lantern.export.step_graphs, added by
`lantern-export accept`): per step the phases and the engine calls in one fixed order
(begin, draft0, level1, ..., draft{D-1}, level{D}, verify, accept), every call's inputs and
outputs bound once per generation to buffers the backend owns, so a phase writes its outputs
where the next call reads them and the host reads back only the report (accepted, emitted
tokens, invalid: D + 3 integers per image; decisions and node tokens when an observer asks).

How the buffers are wired (by the graphs' names; step_graphs documents them):
- state (count, root, pending, the caches' visible slots and lengths, the draw counter) has two
  buffers; a phase reads the current one and writes next_NAME into the other, and the names flip
  after it, so every call's bindings repeat with period two (even and odd steps, bound once each);
- REGIME.FEED outputs are the engine call's own feed buffers, REGIME.OUTPUT inputs its bound
  outputs; the caches' K/V are bound as both input and output (written in place, only the kept
  entries);
- the generation's constants (rows, CFG, the rule's numbers, the neighbor table, the forced
  columns, the streams' table) are bound once; the table is refilled in place when the step
  counter runs past a chunk (lantern.runtime.backends.torch_step.table_steps).
"""
import numpy as np

from lantern.runtime.plan import Call
from lantern.runtime.sampling import Greedy

TABLE_BYTES = 64 * 2**20  # the most the streams' table holds at once


def table_steps(images, steps, block):
    """Steps of uniforms per upload of the streams' table: all `steps` when they fit TABLE_BYTES."""
    return max(1, min(steps, TABLE_BYTES // max(8 * images * block, 1)))


class GraphStep:
    """One generation's step on the engine's step graphs. decoding: the loop's Decoding after
    prefill (its plan's buffers hold the state the first step starts from); graphs: {phase:
    label} of the graphs the backend opened for this tree and kind."""

    whole_step = True

    def __init__(self, backend, decoding, graphs):
        d, plan = decoding, decoding.plan
        self.backend, self.plan, self.tree = backend, plan, plan.tree
        self.N, self.depth, self.M = d.N, plan.tree.depth, plan.tree.num_nodes
        self.window, self.columns = d.proposer.name == "jacobi", d.view.size
        self.types = {}  # every graph input's dtype, by name
        for label in graphs.values():
            self.types.update(backend.graph_inputs(label))
        self.streams = d.streams
        self.draws = "table" in self.types  # sampling, or a window's fresh drafts
        self.table_steps = table_steps(d.N, max(d.length - 1, 1), d.streams.block) if self.draws else 0
        self.steps_run = 0
        state = self._state(d)
        self.constants = self._constants(d)
        self.caches = {"target": plan.target_cache}
        if plan.drafter_cache is not None:
            self.caches["drafter"] = plan.drafter_cache
        self.values = {}  # tokens{d}, cand_ids{d}, cand_probs{d}, report: one buffer each
        current = {name: 0 for name in state}
        levels = self.depth if plan.drafts else 0  # a drafter-free proposer's drafts come out of its begin
        order = ["begin"] + [x for d_ in range(1, levels + 1) for x in (f"draft{d_ - 1}", f"level{d_}")] + \
            ["verify", "accept"] + ["commit"] * ("commit" in plan.calls)  # in place: the accepted path moved
        self.order = [(None, plan.calls[x]) if x in plan.calls else (x, None) for x in order]
        self.calls = []  # per parity: [Call] in order (engine calls are the plan's own)
        for parity in (0, 1):
            calls = []
            for phase, call in self.order:
                if call is not None:
                    calls.append(call)
                    continue
                feeds = {name: self._input(name, state, current) for name, _ in backend.graph_inputs(graphs[phase])}
                outputs, flips = {}, []
                for name, dtype in backend.graph_outputs(graphs[phase]):
                    outputs[name] = self._output(name, dtype, state, current, flips)
                for name in flips:
                    current[name] = 1 - current[name]
                calls.append(Call(graph=graphs[phase], regime=phase, feeds=feeds, outputs=outputs))
            self.calls.append(calls)
        if current != {name: 0 for name in state}:  # each state tensor written once per step (or twice)
            raise RuntimeError(f"the step graphs' state does not alternate: {current}")
        backend.bind_calls([c for calls in self.calls for c in calls if c.regime in graphs])
        self.report = self.values["report"]

    # -- wiring ---------------------------------------------------------------------------------
    def _state(self, d):
        """The state's two buffers each, the first holding the prefill's outcome (the loop's and
        the proposer's: the drafter tree's pending pairs, or the window's re-drafts)."""
        plan, b, proposer = d.plan, self.backend, d.proposer
        start = {"count": d.count, "root": d.tokens[np.arange(d.N), d.count - 1],
                 "target_visible": plan.target_cache.visible, "target_length": plan.target_cache.length,
                 "draws_taken": np.zeros(1, np.int64)}
        if plan.drafter_cache is not None:
            start.update(pending=proposer.pending, drafter_visible=plan.drafter_cache.visible,
                         drafter_length=plan.drafter_cache.length)
        if proposer.name == "jacobi":
            start.update(window_drafts=proposer.drafts, window_kept=proposer.kept, window_q=proposer.q, body=d.tokens)
        return {name: [b.array(np.array(value, dtype=self.types[name])), b.array(np.zeros_like(value, self.types[name]))]
                for name, value in start.items() if name in self.types}

    def _constants(self, d):
        """The generation's constants, in the dtypes the graphs take."""
        plan, view, rule = d.plan, d.view, d.rule
        cond_rows = np.arange(d.N)
        values = dict(image_of_row=d.image_of_row, offset=d.offset, forced_columns=view.forced_column,
                      cond_rows=cond_rows, uncond_rows=cond_rows + d.N if d.cfg else cond_rows,
                      cfg_scale=[d.cfg_scale if d.cfg else 1.0], cfg_interval=[d.cfg_interval if d.cfg else -1],
                      neighbors=d.neighbors if d.neighbors is not None else np.zeros((view.size, 1)),
                      k=[rule.k], lam=[getattr(rule, "lam", 1.0)], delta=[getattr(rule, "delta", 0.0)])
        if plan.drafts:
            values["cfg_partners"] = plan.cfg_partners
        if not isinstance(d.sampler, Greedy):
            s = d.sampler
            values.update(temperature=[s.temperature], top_k=[s.top_k], top_p=[s.top_p])
        if self.draws:
            values["table"] = d.streams.table(self.table_steps)
        if d.proposer.name == "jacobi":
            values["window_stride"] = [d.proposer.stride]
        return {name: self.backend.array(np.ascontiguousarray(value, dtype=self.types[name]))
                for name, value in values.items() if name in self.types}

    def _input(self, name, state, current):
        if name in state:
            return state[name][current[name]]
        if "." in name:  # an engine call's output
            regime, output = name.split(".")
            return self.plan.calls[regime].outputs[output]
        cache, _, part = name.partition("_")
        if cache in self.caches and part in ("keys", "values"):
            return getattr(self.caches[cache], part)
        if name in self.constants:
            return self.constants[name]
        return self.values[name]  # made by an earlier phase

    def _output(self, name, dtype, state, current, flips):
        if name.startswith("next_"):
            flips.append(name[5:])
            return state[name[5:]][1 - current[name[5:]]]
        if name.endswith("_out"):  # a cache, written in place
            cache, _, part = name[:-4].partition("_")
            return getattr(self.caches[cache], part)
        if name == "cfg_pair":  # every drafter call's
            return self.plan.settings["cfg_pair"]
        if "." in name:  # an engine call's feed
            regime, feed = name.split(".")
            return self.plan.calls[regime].feeds[feed]
        if name not in self.values:
            self.values[name] = self.backend.array(np.zeros(self._shape(name), dtype=dtype))
        return self.values[name]

    def _shape(self, name):
        depths = self.tree.depths
        if name == "report":
            return (self.N, self.depth + 3 + 2 * self.M)
        if self.window:  # the window's slots 1..W-1, and their q over the token space
            return {"tokens1": (self.N, self.depth), "window_block_q": (self.N, self.M, self.columns)}[name]
        for prefix in ("cand_ids", "cand_probs", "tokens"):
            if name.startswith(prefix):
                n = int((depths == int(name[len(prefix):])).sum())
                return (self.N, n) + ((self.plan.manifest.candidates,) if prefix != "tokens" else ())
        raise KeyError(name)

    # -- the step -------------------------------------------------------------------------------
    def step(self, decisions=False):
        """Run one step; returns (accepted [N], emitted [N, depth + 1] vocabulary ids, invalid
        [N] bool, decisions [N, M] or None, node tokens [N, M] or None)."""
        b = self.backend
        if self.draws and self.steps_run and self.steps_run % self.table_steps == 0:
            b.fill(self.constants["table"], self.streams.table(self.table_steps))  # the next chunk
        for call in self.calls[self.steps_run % 2]:
            b.run(call)
        self.steps_run += 1
        D, M = self.depth, self.M
        report = b.read(self.report, D + 3 + (2 * M if decisions else 0))
        return (report[:, 0], report[:, 1: D + 2], report[:, D + 2].astype(bool),
                report[:, D + 3: D + 3 + M].astype(np.int8) if decisions else None,
                report[:, D + 3 + M:] if decisions else None)
