"""Engine call latencies measured through real step plans: the target's verification cost L(T)
for T tokens and the drafter's cost per call width, at a given cache fill, on the engine's own
backend. The runtime benchmark plots them; the tree tuner models a step with them.

A call is timed as the loop pays for it: feeds written in place, the plan's bound buffers,
backend.run + synchronize; the median of `repeats` runs after one warm-up (or their minimum,
`stat="min"`: what the machine can do when nothing else runs, steadier on a shared machine).
clock="cpu" times with this process's CPU time instead of the wall clock: other processes on
the cores then cost nothing, but it equals wall time only for a single-threaded CPU backend."""
import time

import numpy as np

from lantern.runtime.plan import StepPlan
from lantern.runtime.tree import build_tree, root_only


def verify_tree(tokens):
    """A tree whose verification feeds `tokens` tokens (root + tokens - 1 children of the root)."""
    return root_only() if tokens == 1 else build_tree([[r] for r in range(tokens - 1)], name=f"flat-{tokens}")


def draft_tree(width):
    """A tree with a drafter call of `width` tokens: `width` nodes at depth 1, one below them."""
    return build_tree([[r] for r in range(width)] + [[0, 0]], name=f"draft-{width}")


def plan_for(engine, tree, images, cfg_scale, context):
    """A plan on the engine's backend with `context` cache slots filled (visible) per row."""
    prefix = engine.condition.prefix(cfg_scale > 1, **default_condition(engine.manifest, images))
    settings = dict(cfg_scale=cfg_scale, temperature=1.0, top_k=0, top_p=1.0)
    engine.check_memory(tree, prefix)
    plan = StepPlan(engine.manifest, engine.backend, tree, prefix, settings)
    engine.backend.bind(plan)
    for cache in (plan.target_cache, plan.drafter_cache):
        if cache is not None:
            fill = min(context, cache.capacity - tree.num_nodes)
            cache.visible[:, :fill] = True
            cache.length[:] = fill
    return plan


def default_condition(manifest, images):
    """Inputs for `images` images of any condition kind (classes, blank captions, or prompts of
    five token ids)."""
    c = manifest.condition
    if c.kind == "class":
        return {"classes": [i % c.num_classes for i in range(images)]}
    if c.kind == "caption":
        return {"caption": np.zeros((images, c.tokens, c.caption_dim), dtype=np.float32)}
    return {"prompt_ids": np.full((images, 5), 100, dtype=np.int64)}


STATS = {"median": np.median, "min": np.min}
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def time_call(engine, plan, regime, repeats, rng, stat="median", clock="wall"):
    call = plan.calls[regime]
    cache = plan.target_cache if call.graph == "target" else plan.drafter_cache
    V = engine.manifest.vocabulary
    call.feeds["input_ids"][:] = rng.integers(V.image_start, V.image_end, call.feeds["input_ids"].shape)
    call.feeds["position_ids"][:] = np.minimum(cache.length[:, None] + np.arange(call.tokens),
                                               engine.manifest.max_positions - 1)
    cache.mask_into(call)
    be = engine.backend
    now = CLOCKS[clock]
    times = []
    for i in range(repeats + 1):
        t = now()
        be.run(call)
        be.synchronize()
        if i:
            times.append(now() - t)
    return float(STATS[stat](times))


def release(engine, plan):
    """Let the backend drop a plan's bound buffers (one plan per size would pile up otherwise)."""
    engine.backend.release(plan)


def verify_latency(engine, tokens, images=1, cfg_scale=1.0, context=256, repeats=7, seed=0, stat="median",
                   clock="wall"):
    """{T: seconds} of the target call over T new tokens."""
    return _latencies(engine, tokens, verify_tree, "verify", images, cfg_scale, context, repeats, seed, stat, clock)


def draft_latency(engine, widths, images=1, cfg_scale=1.0, context=256, repeats=7, seed=0, stat="median",
                  clock="wall"):
    """{width: seconds} of one drafter call over `width` tokens."""
    return _latencies(engine, widths, draft_tree, "draft1", images, cfg_scale, context, repeats, seed, stat, clock)


def _latencies(engine, sizes, tree_of, regime, images, cfg_scale, context, repeats, seed, stat, clock):
    """{size: seconds} of one regime's call, a plan per size (made, timed, released)."""
    rng = np.random.default_rng(seed)
    out = {}
    for size in sizes:
        plan = plan_for(engine, tree_of(size), images, cfg_scale, context)
        out[size] = time_call(engine, plan, regime, repeats, rng, stat, clock)
        release(engine, plan)
    return out
