"""The whole step run as the engine's step graphs (lantern.export.step_graphs): per step the
phases and the engine calls in one fixed order (begin, draft0, level1, ..., draft{D-1},
level{D}, verify, accept, and commit on in-place engines; a Jacobi window: begin, verify,
accept), every call's inputs and outputs bound once per plan to buffers on the backend's device,
so a phase writes its outputs where the next call reads them and the host reads back only the
report (accepted, emitted tokens, invalid: D + 3 integers per image; decisions and node tokens
when an observer asks). The runners all run it: ONNX Runtime over the exported graphs, torch over
the same modules (one CUDA graph per plan on CUDA).

How the buffers are wired (by the graphs' names; step_graphs documents them):
- state (count, root, the caches' visible slots and lengths, the draw counter, the proposer's:
  pending pairs, or the window's re-drafts) has two buffers; a phase reads the current one and
  writes next_NAME into the other, and the names flip after it, so the bindings repeat with
  period two (even and odd steps, bound once each);
- REGIME.FEED outputs are the engine call's feed buffers on the device, REGIME.OUTPUT inputs its
  outputs (backend.device_call: the plan's own bound call where the buffers are the host's); the
  caches' K/V are bound as both input and output (written in place, only the kept entries);
- the generation's constants (rows, CFG, the rule's numbers, the neighbor table, the forced
  columns, the streams' table) are bound once; the table is refilled in place when the step
  counter runs past a chunk.
A plan's next generation refills the same buffers (load), so the bindings (and a captured
CUDA graph) stay valid.
"""
import numpy as np

from lantern.runtime.contracts import ACCEPT_TOP_K_LIMIT, STEP_VERSION
from lantern.runtime.manifest import window_name
from lantern.runtime.plan import Call
from lantern.runtime.sampling import Greedy
from lantern.runtime.tree import build_tree
from lantern.runtime.vocabulary import VocabularyView

TABLE_BYTES = 64 * 2**20  # the most the streams' table holds on the device at once
ROW_STATE = ("target_visible", "target_length", "drafter_visible", "drafter_length")  # per cache row; the rest of
# the state is per image but for the shared draw counter


def table_steps(images, steps, block):
    """Steps of uniforms per upload of the streams' table: all `steps` when they fit TABLE_BYTES
    (GPT-B's 24x24 grid, mc_sim_7b_63, 64 candidates: 7.8 MB per image for all 575 steps)."""
    return max(1, min(steps, TABLE_BYTES // max(8 * images * block, 1)))


def accept_variant(sampler, columns):
    """The accept phase a generation runs: sampling ones come per filter combination
    ("accept+top_k+top_p"), since a filter that is off costs nothing only where it is absent."""
    if isinstance(sampler, Greedy):
        return "accept"
    return "+".join(("accept",) + (("top_k",) if 0 < sampler.top_k < columns else ()) +
                    (("top_p",) if sampler.top_p < 1.0 else ()))


def top_k_refusal(sampler, columns):
    """Why the step graphs' sampling accept (over `columns` token-space columns) cannot filter
    this sampler's top_k, or None: its TopK serves top_k up to ACCEPT_TOP_K_LIMIT, or none."""
    if not isinstance(sampler, Greedy) and ACCEPT_TOP_K_LIMIT < sampler.top_k < columns:
        return (f"its sampling acceptance graph serves top_k up to {ACCEPT_TOP_K_LIMIT} (or none), not "
                f"{sampler.top_k}")
    return None


def step_graphs_refusal(manifest, directory, plan, sampler, window=None):
    """(entry, why): the engine's step graphs a generation of this plan and sampler runs (its
    tree's, or those of `window`, a jacobi proposer's), and why they cannot serve it (None when
    they can): missing, of another STEP_VERSION, other forced ids, or a top_k their accept
    cannot filter. Each reason names the command that mends it; a runner with plans of its own
    adds their rebuild."""
    if window is not None:
        name = f"window {window_name(window.window, window.init)}"
        entry = manifest.window_graphs_for(window.window, window.init)
        add = f"lantern-export accept {directory} --window {window.window} --init {window.init}"
        if entry is None:
            return None, (f"the engine has no step graphs for a jacobi window of {window.window} slots with init "
                          f"{window.init}; add them with `{add}`")
        upgrade = add  # accept exports an entry of another version again
    else:
        tree = plan.tree
        name = f"tree {tree.name if tree.depth else 'ar'}"
        entry = manifest.step_graphs_for(tree)
        if entry is None:
            default = not tree.depth or (manifest.tree is not None and build_tree(manifest.tree).paths == tree.paths)
            return None, (f"the engine has no step graphs for {name}; add them with `lantern-export accept "
                          f"{directory}{'' if default else ' --tree ...'}`")
        upgrade = f"lantern-export accept {directory} --force"
    if entry.version != STEP_VERSION:
        return entry, (f"the engine's step graphs are version {entry.version}, this lantern runs {STEP_VERSION}: "
                       f"re-export them with `{upgrade}`")
    forced = [int(i) for i in VocabularyView(manifest.vocabulary, plan.prefix.forced).extra]
    if list(entry.forced_ids) != forced:
        return entry, f"the step graphs of {name} serve forced ids {list(entry.forced_ids)}, this generation forces {forced}"
    return entry, top_k_refusal(sampler, manifest.vocabulary.codes + len(entry.forced_ids))


def phase_files(entry, sampler, columns):
    """{phase: file} of a step-graphs entry (a tree's or a window's) that a generation runs: its
    kind's phases with the one accept it picks (accept_variant): a runner loads no other."""
    files = entry.greedy if isinstance(sampler, Greedy) else entry.sampling
    variant = accept_variant(sampler, columns)
    return {phase: f for phase, f in files.items() if not phase.startswith("accept") or phase == variant}


def step_key(decoding):
    """What fixes a step's graphs and buffers beyond its plan: a generation with another key needs
    a GraphStep of its own."""
    p = decoding.proposer
    return (isinstance(decoding.sampler, Greedy), accept_variant(decoding.sampler, decoding.view.size), p.name,
            getattr(p, "window", None), getattr(p, "init", None), tuple(decoding.view.extra.tolist()))


class GraphStep:
    """One plan's step on the engine's step graphs. decoding: the loop's Decoding after prefill
    (its plan's buffers hold the state the first step starts from); graphs: {phase: label} of
    the graphs (or modules) the backend opened for this tree, proposer and kind."""

    def __init__(self, backend, decoding, graphs):
        d, plan = decoding, decoding.plan
        self.backend, self.plan, self.tree, self.key = backend, plan, plan.tree, step_key(d)
        accept = graphs[accept_variant(d.sampler, d.view.size)]
        graphs = {name: label for name, label in graphs.items() if not name.startswith("accept")}
        graphs["accept"] = accept
        self.N, self.depth, self.M = d.N, plan.tree.depth, plan.tree.num_nodes
        self.window, self.columns = d.proposer.name == "jacobi", d.view.size
        self.types = {}  # every graph input's dtype, by name
        for label in graphs.values():
            self.types.update(backend.graph_inputs(label))
        self.draws = "table" in self.types  # sampling, or a window's fresh drafts
        self.table_steps = table_steps(d.N, max(d.length - 1, 1), d.streams.block) if self.draws else 0
        levels = self.depth if plan.drafts else 0  # a drafter-free proposer's drafts come out of its begin
        order = ["begin"] + [x for d_ in range(1, levels + 1) for x in (f"draft{d_ - 1}", f"level{d_}")] + \
            ["verify", "accept"] + ["commit"] * ("commit" in plan.calls)  # in place: the accepted path moved
        shared = {}  # host buffer id -> its device buffer (the drafter calls share cfg_pair)
        self.model_calls = {r: backend.device_call(plan.calls[r], shared) for r in order if r in plan.calls}
        start = self._start(d)
        self.state = {name: [backend.array(value), backend.array(np.zeros_like(value))] for name, value in start.items()}
        self.constants = {name: backend.array(value) for name, value in self._constants(d).items()}
        self.caches = {"target": plan.target_cache}
        if plan.drafter_cache is not None:
            self.caches["drafter"] = plan.drafter_cache
        self.values = {}  # tokens{d}, cand_ids{d}, cand_probs{d}, window_block_q, report: one buffer each
        current = {name: 0 for name in self.state}
        self.calls = []  # per parity: [Call] in order
        for parity in (0, 1):
            calls = []
            for name in order:
                if name in self.model_calls:
                    calls.append(self.model_calls[name])
                    continue
                feeds = {n: self._input(n, current) for n, _ in backend.graph_inputs(graphs[name])}
                outputs, flips = {}, []
                for n, dtype in backend.graph_outputs(graphs[name]):
                    outputs[n] = self._output(n, dtype, current, flips)
                for n in flips:
                    current[n] = 1 - current[n]
                calls.append(Call(graph=graphs[name], regime=name, feeds=feeds, outputs=outputs))
            self.calls.append(calls)
        if current != {name: 0 for name in self.state}:  # each state tensor written once per step
            raise RuntimeError(f"the step graphs' state does not alternate: {current}")
        backend.bind_calls([c for calls in self.calls for c in calls if c.regime in graphs])
        self.report = self.values["report"]
        self.steps_run = 0
        self.streams = d.streams

    def serves(self, decoding):
        """Whether a new generation runs on this step as it is (the same plan, key and backend):
        then load refills it instead of a new GraphStep binding everything again."""
        return self.plan is decoding.plan and self.key == step_key(decoding) and self.backend is decoding.backend

    def load(self, decoding):
        """A new generation of the same plan and key (after its prefill) into the same buffers."""
        b = self.backend
        for name, value in self._start(decoding).items():
            b.fill(self.state[name][0], value)
        for name, value in self._constants(decoding).items():
            b.fill(self.constants[name], value)
        for regime, call in self.model_calls.items():  # draft0's pairs from the prefill, the settings
            for name, host in self.plan.calls[regime].feeds.items():
                if call.feeds[name] is not host and isinstance(host, np.ndarray):
                    b.fill(call.feeds[name], host)
        self.steps_run = 0
        self.streams = decoding.streams

    def take(self, decoding, image, rows, feeds=()):
        """Restart image `image` (batch rows `rows`) of this running step from what decoding's host
        state holds for it, where a continuous batch has just moved a prefilled joiner
        (lantern.runtime.continuous; the caches' K/V it copies into the plan's buffers itself):
        its entries of the state the next step reads, its rows' position offsets, its rows of
        the engine feeds [(regime, name)] that carry state between steps (where the device keeps
        its own copy of them), and its stream's next blocks in the table. The other images'
        entries are left as they are."""
        b, parity = self.backend, self.steps_run % 2  # each state tensor flips once per step
        for name, value in self._start(decoding).items():
            if name != "draws_taken":  # the one counter of every image
                index = rows if name in ROW_STATE else [image]
                b.fill_rows(self.state[name][parity], index, value[index])
        if "offset" in self.constants:
            b.fill_rows(self.constants["offset"], rows, decoding.offset[rows].astype(self.types["offset"]))
        for regime, name in feeds:
            host = self.plan.calls[regime].feeds.get(name) if regime in self.model_calls else None
            if isinstance(host, np.ndarray) and self.model_calls[regime].feeds[name] is not host:
                b.fill_rows(self.model_calls[regime].feeds[name], rows, host[rows])
        if self.draws:
            # the next step reads table column steps_run % table_steps: the image's stream fills its row
            # from there to the chunk's end, and the refill after it reads on in the same generator
            # (decoding.streams, the step's own); at a chunk's boundary the refill comes first
            done = self.steps_run % self.table_steps
            if self.steps_run == 0 or done:
                fresh = decoding.streams.generators[image].random((self.table_steps - done, self.streams.block))
                row = np.concatenate([np.zeros((done, self.streams.block)), fresh])  # past columns: never read again
                b.fill_rows(self.constants["table"], [image], row[None].astype(self.types["table"]))

    # -- wiring ---------------------------------------------------------------------------------
    def _start(self, d):
        """The state after prefill (the loop's and the proposer's: the drafter tree's pending
        pairs, or the window's re-drafts), in the graphs' dtypes."""
        plan, proposer = d.plan, d.proposer
        start = {"count": d.count, "root": d.tokens[np.arange(d.N), d.count - 1],
                 "target_visible": plan.target_cache.visible, "target_length": plan.target_cache.length,
                 "draws_taken": np.zeros(1, np.int64)}
        if plan.drafter_cache is not None:
            start.update(pending=proposer.pending, drafter_visible=plan.drafter_cache.visible,
                         drafter_length=plan.drafter_cache.length)
        if proposer.name == "jacobi":
            start.update(window_drafts=proposer.drafts, window_kept=proposer.kept, window_q=proposer.q, body=d.tokens)
        return {name: np.array(value, dtype=self.types[name]) for name, value in start.items() if name in self.types}

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
        return {name: np.ascontiguousarray(value, dtype=self.types[name]) for name, value in values.items()
                if name in self.types}

    def _input(self, name, current):
        if name in self.state:
            return self.state[name][current[name]]
        if "." in name:  # an engine call's output
            regime, output = name.split(".")
            return self.model_calls[regime].outputs[output]
        cache, _, part = name.partition("_")
        if cache in self.caches and part in ("keys", "values"):
            return getattr(self.caches[cache], part)
        if name in self.constants:
            return self.constants[name]
        return self.values[name]  # made by an earlier phase

    def _output(self, name, dtype, current, flips):
        if name.startswith("next_"):
            flips.append(name[5:])
            return self.state[name[5:]][1 - current[name[5:]]]
        if name.endswith("_out"):  # a cache, written in place
            cache, _, part = name[:-4].partition("_")
            return getattr(self.caches[cache], part)
        if name == "cfg_pair":  # every drafter call's (one buffer)
            return self.model_calls["draft0"].feeds["cfg_pair"]
        if "." in name:  # an engine call's feed
            regime, feed = name.split(".")
            return self.model_calls[regime].feeds[feed]
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
        b.run_all(self.calls[self.steps_run % 2])
        self.steps_run += 1
        D, M = self.depth, self.M
        report = b.read(self.report, D + 3 + (2 * M if decisions else 0))
        return (report[:, 0], report[:, 1: D + 2], report[:, D + 2].astype(bool),
                report[:, D + 3: D + 3 + M].astype(np.int8) if decisions else None,
                report[:, D + 3 + M:] if decisions else None)
