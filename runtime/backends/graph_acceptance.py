"""Acceptance on the engine's acceptance graphs (lantern.export.accept_graphs, added by
`lantern-export accept`) where the verification logits are: what the ONNX Runtime and TensorRT
device steps share. Each binds the graph's logits input to the verify call's logits output (no
copy); the rest of its inputs are the small host buffers here, refilled each step; its outputs
are the outcome (accepted count, path, next token, decisions, invalid), a few integers per image.

The step's other phases (drafting with its draw of each node's children, masks, commits) stay
the host loop's: whole_step is False, and the generator's host step runs with the backend's
acceptance in place of numpy's. The graphs compute in float32 where numpy computes sampling in
float64: greedy decisions are the same, sampling ones up to rounding at their edges
(tests/test_device_step.py measures how often)."""
import numpy as np

from lantern.runtime.accept import Outcome
from lantern.runtime.contracts import ACCEPT_TOP_K_LIMIT
from lantern.runtime.errors import LanternError
from lantern.runtime.plan import Call
from lantern.runtime.sampling import Greedy


STEP_INPUTS = ("count", "tokens", "draft_ids", "draft_probs", "uniforms")  # the feeds refill() writes


def refusal(manifest, directory, plan, sampler):
    """Why no acceptance graph of the engine serves a generation of this plan and sampler, or None."""
    if not plan.tree.depth:
        return "AR has no acceptance graph (its step is the host's)"
    entry = manifest.acceptance_for(plan.tree)
    if entry is None:
        return (f"the engine has no acceptance graph for tree {plan.tree.name!r}; add it with "
                f"`lantern-export accept {directory} --tree ...`")
    if isinstance(sampler, Greedy):
        return None
    if entry.sampling is None:
        return (f"the engine has no sampling acceptance graph for tree {plan.tree.name!r}; add it with "
                f"`lantern-export accept {directory}`")
    return top_k_refusal(sampler, manifest.vocabulary.codes + len(entry.forced_ids))


def top_k_refusal(sampler, columns):
    """Why a sampling acceptance (as a graph, over `columns` token-space columns) cannot filter
    this sampler's top_k, or None: it serves top_k up to ACCEPT_TOP_K_LIMIT, or none."""
    if not isinstance(sampler, Greedy) and ACCEPT_TOP_K_LIMIT < sampler.top_k < columns:
        return (f"its sampling acceptance graph serves top_k up to {ACCEPT_TOP_K_LIMIT} (or none), not "
                f"{sampler.top_k}")
    return None


def graph_label(manifest, tree, sampling):
    """The manifest's label of the acceptance graph a generation runs ('accept_greedy@NAME')."""
    entry = manifest.acceptance_for(tree)
    name = next(n for n, e in manifest.acceptance.items() if e is entry)
    return f"accept_{'sampling' if sampling else 'greedy'}@{name}"


class AcceptanceIO:
    """One generation's inputs and outputs of its acceptance graph, as host arrays: `feeds`
    (every input but logits; refill() writes the step's values into them, in place, so buffers
    bound to them once stay valid) and `outputs` (what the graph writes, read by outcome())."""

    def __init__(self, manifest, decoding):
        d, plan = decoding, decoding.plan
        view = self.view = d.view
        self.entry = entry = manifest.acceptance_for(plan.tree)
        if tuple(entry.forced_ids) != tuple(int(i) for i in view.extra):
            raise LanternError(f"the acceptance graph of tree {plan.tree.name!r} serves forced ids "
                               f"{list(entry.forced_ids)}, this generation forces {view.extra.tolist()}; use "
                               f"step='host'")
        self.sampling = not isinstance(d.sampler, Greedy)
        self.graph = entry.sampling if self.sampling else entry.greedy
        self.label = graph_label(manifest, plan.tree, self.sampling)
        rule = d.rule
        neighbors = d.neighbors if d.neighbors is not None else np.zeros((view.size, 1), dtype=np.int64)
        cond_rows = np.arange(d.N)
        M, D = plan.tree.num_nodes, plan.tree.depth
        self.feeds = dict(
            cond_rows=cond_rows, uncond_rows=cond_rows + d.N if d.cfg else cond_rows.copy(),
            cfg_scale=np.array([d.cfg_scale if d.cfg else 1.0], np.float32),
            cfg_interval=np.array([d.cfg_interval if d.cfg else -1], np.int64),
            count=np.zeros(d.N, np.int64), forced_columns=view.forced_column.astype(np.int64),
            tokens=np.zeros((d.N, M), np.int64), neighbors=np.ascontiguousarray(neighbors, np.int64),
            k=np.array([rule.k], np.int64), lam=np.array([getattr(rule, "lam", 1.0)], np.float32),
            delta=np.array([getattr(rule, "delta", 0.0)], np.float32))
        if self.sampling:
            sampler = d.sampler
            self.feeds.update(
                draft_ids=np.zeros(d.cand_ids.shape, np.int64), draft_probs=np.zeros(d.cand_probs.shape, np.float32),
                uniforms=np.zeros((d.N, M), np.float32), temperature=np.array([sampler.temperature], np.float32),
                top_k=np.array([sampler.top_k], np.int64), top_p=np.array([sampler.top_p], np.float32))
        self.outputs = dict(accepted=np.zeros(d.N, np.int64), next_token=np.zeros(d.N, np.int64),
                            path=np.zeros((d.N, D + 1), np.int64), decisions=np.zeros((d.N, M), np.int64),
                            invalid=np.zeros(d.N, np.bool_))

    def constants(self):
        """{name: host array} of the feeds that hold for the whole generation (the neighbor table,
        the rule's and the filters' numbers, rows, forced columns): a device backend uploads
        them once; refill() writes only the others (STEP_INPUTS)."""
        return {name: value for name, value in self.feeds.items() if name not in STEP_INPUTS}

    def refill(self, decoding, uniforms):
        """This step's values: counts and node tokens; sampling adds the drafter's candidates and
        probabilities and the step's acceptance uniforms [N, M] (the images' streams' draws)."""
        self.feeds["count"][:] = decoding.count
        self.feeds["tokens"][:] = self.view.columns(decoding.node_tokens)
        if self.sampling:
            self.feeds["draft_ids"][:] = decoding.cand_ids
            self.feeds["draft_probs"][:] = decoding.cand_probs
            self.feeds["uniforms"][:] = uniforms  # float64 -> float32, what the graph takes

    def outcome(self, active, where):
        """The Outcome of the active images from the graph's outputs (as lantern.runtime.accept's)."""
        out = self.outputs
        bad = np.flatnonzero(out["invalid"] & active)
        if bad.size:
            raise LanternError(f"target logits of image {int(bad[0])} contain NaN or +inf, or are all -inf "
                               f"({where})")
        a = np.flatnonzero(active)
        return Outcome(path=out["path"][a].copy(), accepted=out["accepted"][a].copy(),
                       next_token=out["next_token"][a].copy(), decisions=out["decisions"][a].astype(np.int8))


def acceptance_call(io, logits, constants=None):
    """The acceptance graph as one more call of the step (a backend that binds calls, TensorRT,
    runs it so): the verify call's logits output buffer, AcceptanceIO's feeds (constants: device
    copies of io.constants() in their place) and its outputs' shapes."""
    feeds = dict(io.feeds, **(constants or {}), logits=logits)
    return Call(graph=io.label, regime="accept", feeds=feeds,
                output_shapes={name: array.shape for name, array in io.outputs.items()})
