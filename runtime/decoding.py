"""The decoding loop: AR and static-tree speculative decoding (exact, LANTERN, LANTERN++) around
engine calls, over one StepPlan (Engine.generate makes it; lantern.runtime.continuous keeps one
running).

One step (DESIGN.md "One decoding step"); `ar` is the same loop over the root-only tree. The
draft phase is the proposer's (lantern.runtime.proposers): the drafter tree, as below, or a
drafter-free Jacobi window (lantern.runtime.jacobi: the last verification's rows re-drafted,
no calls):
  draft   draft0: one drafter call over the pairs the last step accepted, (h_t, x_{t+1}) with the
          target's own hidden states, ending with the root, whose candidates fill depth 1; then
          one call per depth over that depth's nodes (fed the drafter's own hidden states).
  verify  one target call over [root + all nodes], positions = past + depth, mask = cache + tree
  accept  the rule over all images at once (lantern.runtime.accept) -> paths + next tokens
  commit  the accepted paths' K/V into the target cache; their pairs feed the next draft0
Every call's shapes and buffers come from the plan. A backend's device step
(lantern.runtime.generator) replaces the host step where it runs.
"""
import time
from dataclasses import dataclass, field

import numpy as np

from lantern.runtime import accept as acceptance
from lantern.runtime.errors import LanternError
from lantern.runtime.vocabulary import VocabularyView


@dataclass
class Generation:
    tokens: np.ndarray  # [N, rows * columns] int64 VQ codes in grid order
    stats: dict = field(default_factory=dict)
    grid: tuple = None  # (rows, columns) of the codes
    body: np.ndarray = None  # [N, tokens generated] vocabulary ids as generated (forced tokens included)


@dataclass(frozen=True)
class StepRecord:
    """What one step decided, for observers (profiling, the tree tuner, the tests' references):
    decisions [N, M] int8 (1 on the accepted path, 0 evaluated and not on it, -1 never evaluated;
    rows of finished images are -1), accepted [N] draft tokens accepted (0 for finished images),
    active [N], tokens [N, M] the block's node tokens as proposed (vocabulary ids; node 0 the
    root; rows of finished images -1)."""

    step: int
    tree: object
    active: np.ndarray
    decisions: np.ndarray
    accepted: np.ndarray
    tokens: np.ndarray = None


class Decoding:
    """One generate() call: the loop's state between steps. Tokens are kept as vocabulary ids
    (what the graphs take); acceptance works on image codes (the logits' image-token columns,
    id = code + image_start), the space of the neighbor table."""

    def __init__(self, engine, plan, proposer, rule, sampler, cfg_scale, cfg_interval, streams, observer,
                 step_path="host"):
        self.engine, self.backend, self.plan, self.tree = engine, engine.backend, plan, plan.tree
        self.proposer = proposer
        self.step_path = step_path
        self.rule, self.sampler, self.streams, self.observer = rule or acceptance.Exact(), sampler, streams, observer
        self.cfg, self.cfg_scale, self.cfg_interval = plan.prefix.cfg, cfg_scale, cfg_interval
        self.N, self.B = plan.images, plan.rows
        self.image_of_row = plan.image_of_row  # [B]: the image each batch row belongs to (CFG: both halves)
        self.offset = plan.prefix.position_offset.copy()  # per row: a continuous batch's joiners bring their own
        self.max_position = engine.manifest.max_positions - 1
        self.view = VocabularyView(engine.manifest.vocabulary, plan.prefix.forced)
        self.neighbors = self.view.neighbors(engine.neighbors)
        self.length = plan.image_tokens
        self.tokens = np.zeros((self.N, self.length), dtype=np.int64)
        self.count = np.zeros(self.N, dtype=np.int64)
        # the step's block, filled by the proposer: node tokens and q (lantern.runtime.proposers)
        self.node_tokens = np.zeros((self.N, self.tree.num_nodes), dtype=np.int64)
        self.cand_ids, self.cand_probs = proposer.q_buffers(self.N, self.view)
        self.buffers = {}  # CFG-combined logits per shape, reused every step
        self.times = dict(prefill=0.0, draft=0.0, verify=0.0, accept=0.0, commit=0.0, engine=0.0)
        self.engine_calls = 0
        self.accepted = []

    def call(self, regime):
        t = time.perf_counter()
        out = self.backend.run(self.plan.calls[regime])
        self.backend.synchronize()
        self.times["engine"] += time.perf_counter() - t
        self.engine_calls += 1
        return out

    def positions(self, slots):
        """Position ids of tokens at cache slots [B, T] (rows' offsets applied, clamped to the table)."""
        return np.clip(slots - self.offset[:, None], 0, self.max_position)

    def combined_logits(self, logits, token_index):
        """CFG-combined logits per image [N, T, columns of the vocabulary view] (float32) for the
        tokens at body indices token_index [N, T]; after cfg_interval tokens only the conditional
        logits count; forced tokens applied."""
        logits = self.view.gather(self.backend.numpy(logits)).astype(np.float32, copy=False)
        if not self.cfg:
            out = logits[: self.N] if self.view.plain else logits[: self.N].copy()
        else:  # uncond + s * (cond - uncond), computed into a buffer kept per shape
            cond, uncond = logits[: self.N], logits[self.N:]
            out = self.buffers.get(cond.shape)
            if out is None:
                out = self.buffers[cond.shape] = np.empty(cond.shape, dtype=np.float32)
            np.subtract(cond, uncond, out=out)
            np.multiply(out, np.float32(self.cfg_scale), out=out)
            np.add(out, uncond, out=out)
            if self.cfg_interval >= 0:
                late = token_index >= self.cfg_interval
                out[late] = cond[late]
        return self.view.force(out, token_index)

    # -- prefill -------------------------------------------------------------------------------
    def prefill(self):
        t0 = time.perf_counter()
        plan, C = self.plan, self.plan.prefix.tokens
        if "condition" in plan.calls:
            self.backend.copy(self.call("condition")["cond_embeds"], plan.calls["prefill"].feeds["cond_embeds"])
        out = self.call("prefill")
        plan.target_cache.append(plan.calls["prefill"], out, np.arange(self.B),
                                 np.broadcast_to(np.arange(C), (self.B, C)), np.full(self.B, C),
                                 visible=plan.prefix.key_visible)
        logits = self.combined_logits(out["logits"][:, -1:], np.zeros((self.N, 1), dtype=np.int64))[:, 0]
        self.tokens[:, 0] = self.view.ids(self.sampler.draw(logits, self.streams.first()))
        self.count[:] = 1
        self.proposer.start(self, out)
        self.times["prefill"] += time.perf_counter() - t0

    # -- one step ------------------------------------------------------------------------------
    def verify(self):
        call, tree, cache = self.plan.calls["verify"], self.tree, self.plan.target_cache
        call.feeds["input_ids"][:] = self.node_tokens[self.image_of_row]
        call.feeds["position_ids"][:] = self.positions(cache.length[:, None] + tree.depths[None, :])
        cache.mask_into(call)
        return self.call("verify")

    def accept(self, active, logits, uniforms):
        """The rule over the CFG-combined logits [N, M, columns] of every image (numpy's acceptance)."""
        a = slice(None) if active.all() else np.flatnonzero(active)  # no copy of the logits while all run
        return self.sampler.accept(self.tree, self.view.columns(self.node_tokens[a]), logits[a], self.cand_ids[a],
                                   self.cand_probs[a], self.rule, uniforms[a], self.neighbors)

    def commit(self, active, outcome, out, logits):
        """The accepted paths' tokens and K/V; the proposer keeps what its next step needs."""
        a = np.flatnonzero(active)
        path = outcome.path  # [len(a), depth + 1]
        emitted = self.node_tokens[a[:, None], np.maximum(np.roll(path, -1, axis=1), 0)]
        emitted[np.arange(len(a)), outcome.accepted] = self.view.ids(outcome.next_token)
        emit = self.emit(a, outcome.accepted, emitted)
        rows = np.flatnonzero(active[self.image_of_row])
        slot = np.searchsorted(a, self.image_of_row[rows])  # each active row's image among the active ones
        cols = np.maximum(path[slot], 0)
        self.engine_calls += self.plan.target_cache.append(self.plan.calls["verify"], out, rows, cols, emit[slot])
        self.proposer.commit(self, active, outcome, emitted, emit, rows, cols, out, logits)
        self.count[a] += emit

    def emit(self, a, accepted, emitted):
        """Images a's tokens emitted [len(a), depth + 1] (accepted + 1 of them each, up to the
        end) into the generated tokens; returns how many each took. Counts advance in commit."""
        emit = np.minimum(accepted + 1, self.length - self.count[a])
        for i, n in enumerate(a):  # at most depth + 1 tokens per image
            self.tokens[n, self.count[n]: self.count[n] + emit[i]] = emitted[i, : emit[i]]
        self.accepted.extend(accepted.tolist())
        return emit

    # -- the loop ------------------------------------------------------------------------------
    def host_step(self, active):
        """One step on the host: draft, verify, accept (numpy's), commit; returns the Outcome of
        the active images."""
        t0 = time.perf_counter()
        draws = self.streams.step()
        self.proposer.propose(self, active, draws.race)
        t1 = time.perf_counter()
        out = self.verify()
        t2 = time.perf_counter()
        logits = self.combined_logits(out["logits"], self.count[:, None] + self.tree.depths[None, :])
        outcome = self.accept(active, logits, draws.accept)
        t3 = time.perf_counter()
        self.commit(active, outcome, out, logits)
        t4 = time.perf_counter()
        for key, dt in zip(("draft", "verify", "accept", "commit"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            self.times[key] += dt
        return outcome

    def device_step(self, device, active):
        """One step on the backend's device (all four phases, timed as engine time); the host
        reads back what the active images emitted. Returns their Outcome (paths are not read
        back: decisions only when an observer asks)."""
        t0 = time.perf_counter()
        accepted, emitted, invalid, decisions, tokens = device.step(decisions=self.observer is not None)
        self.times["engine"] += time.perf_counter() - t0
        self.engine_calls += len(self.plan.calls) - ("prefill" in self.plan.calls) - ("condition" in self.plan.calls)
        bad = np.flatnonzero(invalid & active)
        if bad.size:
            raise LanternError(f"target logits of image {int(bad[0])} contain NaN or +inf, or are all -inf "
                               f"(device step)")
        a = np.flatnonzero(active)
        self.count[a] += self.emit(a, accepted[a], emitted[a])
        if tokens is not None:
            self.node_tokens[:] = tokens  # the observer's record reads them here, as on the host step
        return acceptance.Outcome(path=None, accepted=accepted[a], next_token=None,
                                  decisions=None if decisions is None else decisions[a])

    def generate(self):
        start = time.perf_counter()
        self.prefill()
        steps = np.zeros(self.N, dtype=np.int64)
        step, prefill_calls = 0, self.engine_calls
        device = self.backend.device_step(self) if self.step_path == "device" else None
        while (active := self.count < self.length).any():
            steps[active] += 1
            outcome = self.device_step(device, active) if device is not None else self.host_step(active)
            if self.observer is not None:
                self.observer(self.record(step, active, outcome))
            step += 1
        seconds = time.perf_counter() - start
        stats = self.stats(steps, seconds)
        stats["engine_calls_per_step"] = (self.engine_calls - prefill_calls) / max(step, 1)
        stats["steps"] = step  # loop iterations (the batch runs until its last image is done)
        return Generation(tokens=self.view.codes_of(self.tokens), stats=stats, grid=self.plan.prefix.grid,
                          body=self.tokens)

    def record(self, step, active, outcome):
        decisions = np.full((self.N, self.tree.num_nodes), -1, dtype=np.int8)
        accepted = np.zeros(self.N, dtype=np.int64)
        decisions[active], accepted[active] = outcome.decisions, outcome.accepted
        tokens = np.where(active[:, None], self.node_tokens, -1)
        return StepRecord(step=step, tree=self.tree, active=active.copy(), decisions=decisions, accepted=accepted,
                          tokens=tokens)

    def stats(self, steps, total):
        speculative = self.tree.depth > 0
        return {
            "mode": self.rule.name if speculative else "ar",
            "tree": self.tree.name,
            "images": self.N,
            "tokens_per_image": self.length,
            "steps_per_image": float(steps.mean()),
            # tokens per target step after prefill, the bonus token included (LANTERN's tau)
            "mean_accepted_length": float((self.length - 1) / steps.mean()) if steps.mean() else 0.0,
            "mean_accepted_drafts": float(np.mean(self.accepted)) if speculative and self.accepted else 0.0,
            # steps (per image) that accepted 0, 1, ..., depth draft tokens
            "accepted_histogram": np.bincount(self.accepted, minlength=self.tree.depth + 1).tolist()
            if speculative else [],
            "seconds": total,
            "tokens_per_second": self.N * self.length / total,
            "phase_seconds": {k: v for k, v in self.times.items() if k != "engine"},
            "engine_seconds": self.times["engine"],
            "engine_calls": self.engine_calls,
            "host_overhead_seconds": total - self.times["engine"],
            "backend": self.backend.name,
            "step": self.step_path,
        }
