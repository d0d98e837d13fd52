"""The torch backend's device step: draft -> verify -> accept -> commit with every piece of the
loop's state as tensors on the backend's device, so a step's only traffic with the host is its
report, a few integers per image (what it emitted, how many drafts it accepted, whether its
logits were void).

What the host loop (decoding.Decoding) builds on the host per step is built here by tensor ops
of fixed shapes: node tokens from the drafter's top-K, draft0's pairs from the outcome, position
ids and attention masks from the caches' visible slots and lengths, and the commits into the
caches. Acceptance is the exported module itself (lantern.export.accept_graphs.GreedyAcceptance,
handed in by whoever opened the backend: the runtime never imports lantern.export).

Every shape is a function of the plan, and nothing in a step reads a device value on the host
(no item(), no 0-dim tensor index, no data-sized output: the tests watch every op a step
dispatches, on the CPU), so on CUDA the whole step is captured as one CUDA graph per plan and
replayed (after one eager step that warms the kernels up); the backend keeps a plan's step for
its next generations, which refill the same tensors (load), so the graph is captured once per
plan, not per generation. Python values the graph bakes in are constants of the plan (or of
`key_of`). On the CPU, and where capture fails (one warning line), the same function runs
eagerly. Finished images keep running in their batch rows (static shapes); their commits are
made harmless instead of skipped: entries they would keep land on slots that no one sees, and
their token counts stop.

Where the host loop writes only the entries it keeps, the step writes fixed-width blocks and
points the unneeded ones at a kept entry (the same value written twice) or at an invisible slot,
so no scatter ever has two different values for one place.

Sampling (temperature / top-k / top-p, every mode) reads the images' own random streams
(lantern.runtime.streams) from a table on the device: `streams.table(chunk)` is uploaded when the
generation starts, [N, chunk, block] float64, and the step counter (a device tensor; every
image's stream advances each step) picks its block; chunk is every step the generation can take (image tokens - 1) unless that
would pass TABLE_BYTES, then as many as fit, and the host uploads the next chunk when the step
counter reaches it (a copy into the same tensor: a captured graph stays valid). One upload per
generation for the shapes the project runs: GPT-B's 24x24 grid with mc_sim_7b_63 and 64
candidates is 26 * 65 uniforms * 575 steps * 8 bytes = 7.8 MB per image, 62 MB for 8 images (the
tests' 6x6 grid: 124 kB per image); a bigger table (Anole's 1024 tokens, wide trees, big
batches) goes in chunks rather than holding device memory the caches need. The children of a node are
drawn without replacement by the exponential race of lantern.runtime.sampling.Sampling.children
(keys -log(u) / q in float64, the first `width` in a stable sort: ties to the lower candidate),
acceptance is lantern.export.accept_graphs.SamplingAcceptance, run in float64 by default: the
CFG combination is made in float32 first, as the host loop makes it, so float64 acceptance
makes the decisions numpy makes (tests/test_device_step.py: token for token). float32
(TorchBackend(accept_precision="float32"), what TensorRT would run) agrees up to rounding at the
decisions' edges. The first token after prefill is drawn by the host loop's prefill, as for
greedy (one draw per generation; prefill's logits are read there anyway).

Two proposers (lantern.runtime.proposers), each ported as a mixin of the step's class
(lantern.runtime.backends.torch_proposers): the drafter tree and the drafter-free jacobi window.

Both cache forms (lantern.runtime.kvcache; as the step keeps them: torch_caches). Plain caches:
the step copies the entries it keeps into them (Cache). In-place engines (`--attention
inplace`): the graphs write their new K/V into the static caches themselves, at write_index, and
attend over the whole cache, so the step writes each call's write_index (the cache's lengths, or
the plan's fixed scratch slot) and puts the call's block into its mask at those slots; after
verification the plan's commit graph, run over every row, moves the accepted path to the slots
after the committed ones (InPlaceCache).
The torch modules return the updated caches as new tensors, copied into the cache buffers (a
device copy per call, as TorchBackend.run makes it): this is the in-place engines' reference."""
import numpy as np

from lantern.runtime.contracts import ACCEPT_TOP_K_LIMIT
from lantern.runtime.kvcache import InPlaceKVCache
from lantern.runtime.backends.torch_caches import Cache, InPlaceCache
from lantern.runtime.backends.torch_proposers import DeviceDrafting, DeviceJacobiWindow
from lantern.runtime.sampling import Greedy

TABLE_BYTES = 64 * 2**20  # the most the streams' table holds on the device at once


def table_steps(images, steps, block):
    """Steps of uniforms per upload of the streams' table: all `steps` when they fit TABLE_BYTES."""
    return max(1, min(steps, TABLE_BYTES // max(8 * images * block, 1)))


def refusal(plan, sampler):
    """Why the device step cannot run a generation of this plan and sampler, or None."""
    vocab = int(plan.calls["verify"].output_shapes["logits"][-1])
    if not isinstance(sampler, Greedy) and ACCEPT_TOP_K_LIMIT < sampler.top_k < vocab:
        return (f"its sampling acceptance serves top_k up to {ACCEPT_TOP_K_LIMIT} (or none), not "
                f"{sampler.top_k}")
    return None


class TorchDeviceStep(DeviceDrafting, DeviceJacobiWindow):
    """The device step of one plan: its tensors and, on CUDA, its captured graph, kept by the
    backend for the plan's next generations (load() refills the same tensors, so the graph
    stays valid). decoding: the loop's Decoding (lantern.runtime.decoding) after prefill (its plan's feeds and caches
    hold the state the first step starts from); backend: the one it runs on (decoding.backend:
    every host crossing goes through its to_device / to_host)."""

    whole_step = True  # draft, verify, accept and commit: the generator only reads the report

    def __init__(self, backend, decoding, acceptance_modules, accept_dtype="float64"):
        """acceptance_modules: {"greedy": factory, "sampling": factory}, each (tree, columns,
        codes) -> the acceptance module; accept_dtype: the sampling acceptance's precision."""
        torch = self.torch = backend.torch
        self.backend = b = backend
        d, plan = decoding, decoding.plan
        tree = self.tree = plan.tree
        self.plan = plan
        self.N, self.B, self.length = d.N, d.B, d.length
        self.depth = tree.depth
        self.drafts = plan.drafts  # drafter calls (the tree); a jacobi window has none
        self.jacobi = d.proposer.name == "jacobi"
        self.init = d.proposer.init if self.jacobi else None
        self.key = self.key_of(decoding)
        self.sampling = not isinstance(d.sampler, Greedy)
        self.accept_dtype = getattr(torch, accept_dtype)
        dev = b.device
        up = self._up
        # constants of the plan
        self.batch_rows = torch.arange(d.B, device=dev)
        self.max_position = d.max_position
        self.depths = up(tree.depths, np.int64)
        view = d.view
        self.codes, self.start, self.plain_view = view.codes, view.start, view.plain
        self.vocab = int(plan.calls["verify"].output_shapes["logits"][-1])
        self.node_tokens = torch.zeros((d.N, tree.num_nodes), dtype=torch.int64, device=dev)
        self.inplace = isinstance(plan.target_cache, InPlaceKVCache)
        # each call's block (its new tokens among themselves): a plain mask holds it in its block
        # columns, which the plan filled (load points self.blocks at them); the in-place form places
        # it at the slots the call writes, from these constants. draft0's block is state (_set_pending)
        self.blocks = {"verify": up(tree.mask)} if self.inplace else {}
        self.first_slots = {}
        if self.drafts:
            W = tree.depth + 1
            self.pair_index = torch.arange(W, device=dev)
            self.pair_block = torch.tril(torch.ones((W, W), dtype=torch.bool, device=dev))
            self.pair_self = torch.eye(W, dtype=torch.bool, device=dev)
            self.ancestors = {depth: up(extra) for depth, extra in plan.scratch_ancestors.items()}
            self.scratch_slots = {lv.depth: up(plan.scratch + lv.nodes - 1, np.int64) for lv in tree.levels[:-1]}
            self.levels = [dict(depth=lv.depth, nodes=up(lv.nodes, np.int64), slots=up(lv.slots, np.int64),
                                ranks=up(lv.ranks, np.int64), parents=up(np.unique(lv.parents), np.int64))
                           for lv in tree.levels]
            self.widths = [lv.width for lv in tree.levels]
            for lv in tree.levels[:-1]:
                call = plan.calls[f"draft{lv.depth}"]
                if self.inplace:
                    self.blocks[call.regime] = up(np.eye(call.tokens, dtype=bool))
                self.first_slots[call.regime] = torch.full((d.B,), call.first_slot, dtype=torch.int64, device=dev)
        self.race_width = d.proposer.candidates  # uniforms per node per step in the streams' race block
        if self.jacobi:
            # q dense over the view's columns (JacobiWindow.q_buffers): every column a candidate
            S = view.size
            self.columns = torch.arange(S, device=dev)
            self.candidates = self.columns[None, None, :].expand(d.N, tree.num_nodes, S)
            self.candidate_probs = torch.zeros((d.N, tree.num_nodes, S), dtype=self.accept_dtype, device=dev)
            self.uniform_q = up(np.where(np.arange(S) < view.codes, 1.0 / view.codes, 0.0), np.float64).to(
                self.accept_dtype)  # init uniform: q over the image codes, 1 / codes as the host's float64
            self.slots = torch.arange(1, tree.depth + 1, device=dev)[None, :]  # [1, W - 1]: the window's drafts
            self.pair_columns = torch.arange(tree.depth + 1, device=dev)[None, :]  # [1, W]: a step's emitted tokens
        else:
            K = d.engine.manifest.candidates if tree.depth else 0  # AR: no drafts, no candidates
            self.candidates = torch.zeros((d.N, tree.num_nodes, K), dtype=torch.int64, device=dev)
            self.candidate_probs = torch.zeros((d.N, tree.num_nodes, K), dtype=torch.float32, device=dev)
            self.first_candidate = torch.arange(K, device=dev) == 0  # a forced draft's q: all mass on rank 0
        self.cfg_interval_on = d.cfg and d.cfg_interval >= 0
        # acceptance: the exported module over this token space
        factory = acceptance_modules["sampling" if self.sampling else "greedy"]
        self.view_ids = np.concatenate([view.start + np.arange(view.codes), view.extra])  # each column's id
        self.accept_module = factory(tree, self.view_ids, view.codes).to(dev).eval()
        self.view_ids = up(self.view_ids, np.int64)
        # the random streams' table: steps per upload (a constant of the plan, baked into the graph);
        # a jacobi window reads it greedy too (its fresh drafts)
        self.draws = self.sampling or self.jacobi
        self.table_steps = table_steps(d.N, max(d.length - 1, 1), d.streams.block) if self.draws else 0
        self.steps_run = 0
        # the report: per image accepted, emitted tokens [depth + 1], invalid; decisions and the
        # node tokens after it (read only for an observer)
        self.report = torch.zeros((d.N, tree.depth + 3 + 2 * tree.num_nodes), dtype=torch.int64, device=dev)
        self.graph = None
        self.eager_steps = 0
        self.capture = b.device.type == "cuda" and getattr(b, "cuda_graphs", False)
        self.state = {}  # name -> the device tensor the step reads (refilled in place by load)
        self.load(decoding)

    @staticmethod
    def key_of(decoding):
        """What fixes the step's structure beyond its plan: a generation with another key needs
        a step of its own (and its own graph)."""
        view = decoding.view
        proposer = decoding.proposer
        return (decoding.cfg and decoding.cfg_interval >= 0, tuple(view.extra.tolist()),
                None if decoding.neighbors is None else decoding.neighbors.shape,
                not isinstance(decoding.sampler, Greedy), proposer.name,
                getattr(proposer, "window", None), getattr(proposer, "init", None))

    def _up(self, x, dtype=None):
        return self.backend.to_device(np.ascontiguousarray(x) if dtype is None else np.asarray(x, dtype=dtype))

    def _keep(self, name, value, dtype=None):
        """The state tensor `name` holding `value` (host): the tensor already there, refilled, so
        a captured graph reads the new values; else a new one."""
        new = self._up(value, dtype)
        old = self.state.get(name)
        if old is None:
            self.state[name] = new
            return new
        old.copy_(new)
        return old

    def load(self, decoding):
        """A generation's starting state (after its prefill) into the step's tensors."""
        torch, d, plan = self.torch, decoding, decoding.plan
        keep = self._keep
        # the loop's state (mirrors of what Decoding keeps on the host)
        self.count = keep("count", d.count, np.int64)
        self.root = keep("root", d.tokens[np.arange(d.N), d.count - 1], np.int64)
        if self.drafts:
            self.pending = keep("pending", d.proposer.pending, np.int64)
        self.image_of_row = keep("image_of_row", d.image_of_row, np.int64)
        self.offset = keep("offset", d.offset, np.int64)
        view = d.view
        self.column_of_id = keep("column_of_id", view.columns(np.arange(self.vocab)), np.int64)
        self.extra = keep("extra", view.extra if len(view.extra) else np.zeros(1), np.int64)
        self.forced_column = keep("forced_column", view.forced_column, np.int64)
        # caches: K/V live on the device already; what each row sees and how much it holds
        cache_type = InPlaceCache if self.inplace else Cache
        self.target = cache_type(self, "target", plan.target_cache)
        self.drafter = cache_type(self, "drafter", plan.drafter_cache) if self.drafts else None
        # each call's feeds as device tensors (float ones are the plan's device buffers already);
        # where the backend bound the call (CUDA), its static input tensors themselves, so every
        # step path feeds a plan's calls from the same addresses (tensorrt-torch keys its
        # execution contexts by them)
        self.feeds = {}
        regimes = ["verify"] + [f"draft{i}" for i in range(self.depth if self.drafts else 0)] + \
            ["commit"] * ("commit" in plan.calls)
        for regime in regimes:
            call, feeds = plan.calls[regime], {}
            bound = self.backend.bound_inputs(call)
            for name, buf in call.feeds.items():
                if isinstance(buf, torch.Tensor):
                    feeds[name] = buf
                    continue
                if name in bound:
                    self.state.setdefault(f"{regime}/{name}", bound[name])
                feeds[name] = keep(f"{regime}/{name}", plan.settings["cfg_pair"] if name == "cfg_pair" else buf)
            self.feeds[regime] = feeds
        if self.drafts:  # every drafter call's cfg_pair: the step writes them all at once
            self.cfg_pairs = [f["cfg_pair"] for r, f in self.feeds.items() if r.startswith("draft") and "cfg_pair" in f]
            self.cfg_partners = keep("cfg_partners", plan.cfg_partners)
        if self.inplace and self.drafts:
            self.blocks["draft0"] = keep("draft0/block", plan.calls["draft0"].block)  # the prefill's pair
        elif not self.inplace:  # a plain mask's block columns hold its block (uploaded with it): write there
            for regime, feeds in self.feeds.items():
                mask = feeds["attention_mask"]
                self.blocks[regime] = mask[:, 0, :, mask.shape[3] - mask.shape[2]:]
        rule = d.rule
        neighbors = d.neighbors if d.neighbors is not None else np.zeros((view.size, 1), dtype=np.int64)
        cond_rows = np.arange(d.N)
        self.accept_feeds = dict(
            cond_rows=keep("cond_rows", cond_rows, np.int64),
            uncond_rows=keep("uncond_rows", cond_rows + d.N if d.cfg else cond_rows, np.int64),
            cfg_scale=keep("cfg_scale", [d.cfg_scale if d.cfg else 1.0], np.float32),
            cfg_interval=keep("cfg_interval", [d.cfg_interval if d.cfg else -1], np.int64), forced_columns=self.forced_column,
            neighbors=keep("neighbors", neighbors, np.int64), k=keep("k", [rule.k], np.int64),
            lam=keep("lam", [getattr(rule, "lam", 1.0)], np.float32),
            delta=keep("delta", [getattr(rule, "delta", 0.0)], np.float32))
        self.steps_run = 0
        if self.sampling:
            # the rule's and filters' numbers in the acceptance's precision (float64: the host's
            # Python floats exactly); the CFG combination is made here, so the module's is off
            real = np.float64 if self.accept_dtype == torch.float64 else np.float32
            sampler, a = d.sampler, self.accept_feeds
            a.update(lam=keep("s/lam", [getattr(rule, "lam", 1.0)], real),
                     delta=keep("s/delta", [getattr(rule, "delta", 0.0)], real),
                     temperature=keep("s/temperature", [sampler.temperature], real),
                     top_k=keep("s/top_k", [sampler.top_k], np.int64), top_p=keep("s/top_p", [sampler.top_p], real),
                     plain_scale=keep("s/plain_scale", [1.0], np.float32),
                     plain_interval=keep("s/plain_interval", [-1], np.int64))
        if self.draws:
            self.streams = d.streams
            self.table = keep("table", d.streams.table(self.table_steps), np.float64)  # [N, steps, block]
            # the step counter every image's stream is read at (all advance each step, finished or not)
            self.draws_taken = keep("draws_taken", [0], np.int64)  # [1]: a 0-dim index would be read on the host
        if self.jacobi:  # the window's state after prefill (JacobiWindow.start)
            w = d.proposer
            self.redrafts = keep("j/drafts", w.drafts, np.int64)  # [N, W - 1] columns
            self.kept = keep("j/kept", w.kept, np.int64)  # [N]: re-drafts in slots 1..kept
            if self.sampling:  # their q [N, W - 1, S] (greedy reads none)
                self.redraft_q = keep("j/q", w.q, np.float64 if self.accept_dtype == torch.float64 else np.float32)
            if self.init == "spatial":  # the code a grid row above (or left) comes from the body
                self.stride = keep("j/stride", [w.stride], np.int64)
                self.body = keep("j/body", d.tokens, np.int64)  # [N, length] ids generated so far

    @property
    def report_width(self):
        """Integers per image a step reads back (decisions only when an observer wants them)."""
        return self.depth + 3

    # -- the host side: one call per step ------------------------------------------------------
    def step(self, decisions=False):
        """Run one step; returns (accepted [N], emitted [N, depth + 1] vocabulary ids,
        invalid [N] bool, decisions [N, M] or None, node tokens [N, M] or None) read back in one
        transfer (decisions and node tokens only when asked: an observer's record)."""
        if self.draws and self.steps_run and self.steps_run % self.table_steps == 0:
            self.table.copy_(self._up(self.streams.table(self.table_steps), np.float64))  # the next chunk
        self.steps_run += 1
        if self.graph is not None:
            self.graph.replay()
        else:
            with self.torch.inference_mode():
                self._step()
            self.eager_steps += 1
            if self.capture and self.eager_steps == 1:
                self.graph = self._capture()
        width = self.report.shape[1] if decisions else self.report_width
        report = self.backend.to_host(self.report[:, :width])
        D, M = self.depth, self.tree.num_nodes
        return (report[:, 0], report[:, 1: D + 2], report[:, D + 2].astype(bool),
                report[:, D + 3: D + 3 + M].astype(np.int8) if decisions else None,
                report[:, D + 3 + M:] if decisions else None)

    def _capture(self):
        """The whole step as one CUDA graph over the step's static tensors; None (eager from
        here on, one warning line) where capture fails. The tests replay the step as a graph
        would on the CPU (tests/engines.py CpuGraph: ops recorded once, Python values baked in)
        and find no op capture refuses; the capture itself has not run on a GPU yet."""
        torch = self.torch
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize()
            with torch.inference_mode(), torch.cuda.graph(graph):
                self._step()
        except Exception as e:  # capture of some op failed: the eager step stays correct
            import sys

            print(f"lantern: device step not captured as a CUDA graph ({str(e).splitlines()[0]}); running it "
                  f"eagerly", file=sys.stderr)
            self.capture = False
            return None
        return graph

    # -- the step itself: device ops only, shapes fixed by the plan ----------------------------
    def _run(self, regime, graph):
        b = self.backend
        feeds = self.feeds[regime]
        out = b.modules[graph](*(feeds[name] for name in b.inputs[graph]))
        out = dict(zip(b.outputs[graph], out if isinstance(out, tuple) else (out,)))
        if b.aliases[graph]:  # in-place graphs: their updated caches into the cache buffers
            out = b._update_in_place(graph, out, feeds)
        return out

    def _positions(self, slots):
        return (slots - self.offset[:, None]).clamp(0, self.max_position)

    def _ids(self, columns):
        if self.plain_view:
            return columns + self.start if self.start else columns
        extra = self.extra[(columns - self.codes).clamp(min=0) % self.extra.shape[0]]
        return self.torch.where(columns < self.codes, columns + self.start, extra)

    def _mask(self, regime, cache, start, extra=None):
        cache.mask(self.feeds[regime], self.blocks[regime], start, extra)

    def _step(self):
        torch = self.torch
        N, iob = self.N, self.image_of_row
        active = self.count < self.length
        self.node_tokens[:, 0] = self.root
        uniforms = race = None
        if self.draws:  # this step's block of every image's stream (finished images' advance unread)
            M = self.tree.num_nodes
            block = self.table.index_select(1, self.draws_taken % self.table_steps)[:, 0]  # [N, block]
            uniforms, race = block[:, :M], block[:, M:].reshape(N, M, self.race_width)
            self.draws_taken += 1
        if self.drafts:
            self._draft(active, race)
        elif self.jacobi:
            self._propose_window(race)
        # verify
        feeds = self.feeds["verify"]
        torch.index_select(self.node_tokens, 0, iob, out=feeds["input_ids"])
        feeds["position_ids"].copy_(self._positions(self.target.length[:, None] + self.depths[None, :]))
        self._mask("verify", self.target, self.target.length)
        out = self._run("verify", "target")
        # accept
        a = self.accept_feeds
        tokens = self.node_tokens if self.plain_view and not self.start else self.column_of_id[self.node_tokens]
        combined = self._combined(out["logits"]) if self.sampling or self.jacobi else None
        if self.sampling:
            accepted, next_column, path, decisions, invalid = self.accept_module(
                combined.to(self.accept_dtype), a["cond_rows"], a["cond_rows"],
                a["plain_scale"], a["plain_interval"], self.count, a["forced_columns"], tokens, self.candidates,
                self.candidate_probs, uniforms, a["neighbors"], a["k"], a["lam"], a["delta"], a["temperature"],
                a["top_k"], a["top_p"])
        else:
            accepted, next_column, path, decisions, invalid = self.accept_module(
                out["logits"], a["cond_rows"], a["uncond_rows"], a["cfg_scale"], a["cfg_interval"], self.count,
                a["forced_columns"], tokens, a["neighbors"], a["k"], a["lam"], a["delta"])
        # commit
        emitted = self.node_tokens.gather(1, torch.roll(path, -1, 1).clamp(min=0))
        emitted.scatter_(1, accepted[:, None], self._ids(next_column)[:, None])
        emit = torch.where(active, torch.minimum(accepted + 1, self.length - self.count), 0)
        cols = path.clamp(min=0)[iob]
        self.target.append(out, cols, emit[iob])
        if self.jacobi:  # before count moves: row i of the verification predicted body index count + i
            self._commit_window(combined, active, accepted, race, emitted, emit)
        if self.drafts:
            counts = torch.where(active, emit.clamp(min=1), 1)
            tokens = torch.where(active[:, None], emitted, 0)
            self._set_pending(out["hidden"], torch.where(active[iob][:, None], cols, 0), tokens,
                              counts)
        self.root.copy_(torch.where(active, emitted.gather(1, (emit - 1).clamp(min=0)[:, None])[:, 0], self.root))
        self.count += emit
        D = self.depth
        self.report[:, 0] = torch.where(active, accepted, 0)
        self.report[:, 1: D + 2] = emitted
        self.report[:, D + 2] = (invalid & active).to(torch.int64)
        self.report[:, D + 3: D + 3 + self.tree.num_nodes] = decisions
        self.report[:, D + 3 + self.tree.num_nodes:] = self.node_tokens

    def _combined(self, logits):
        """The CFG-combined verification logits [N, M, V] in float32, op for op as the host
        loop's combined_logits ((cond - uncond) * scale + uncond; conditional only past
        cfg_interval), so that float64 acceptance reads the numbers numpy reads."""
        torch, N = self.torch, self.N
        logits = logits.float()
        cond = logits[:N]
        if logits.shape[0] == N:  # no CFG
            return cond
        uncond = logits[N:]
        a = self.accept_feeds
        combined = (cond - uncond) * a["cfg_scale"] + uncond
        if self.cfg_interval_on:
            late = (self.count[:, None] + self.depths[None, :]) >= a["cfg_interval"]
            combined = torch.where(late[..., None], cond, combined)
        return combined
