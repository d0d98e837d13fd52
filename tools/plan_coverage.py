"""Which of an engine's compiled TensorRT plans (`Manifest.tensorrt`) cover a tree's calls, as
the tensorrt backend assigns them: every call of one step plan (StepPlan.shapes()) needs a profile
of its own. `lantern-run tune` keeps its search within the plans on the tensorrt backend, and on
another backend reports a chosen tree the plans do not cover as needing `lantern-export trt` again.
"""
import numpy as np

from lantern.runtime.plan import StepPlan
from lantern.runtime.tree import build_tree


class _ShapesOnly:
    """A stand-in backend for StepPlan when only its shapes are wanted: nothing is allocated."""

    name = "shapes"
    float_dtype = np.float32

    def zeros(self, shape):
        return np.broadcast_to(np.float32(0), shape)


def call_shapes(manifest, condition, tree, images, cfg):
    """StepPlan.shapes() of a generation of `images` images with `tree`, allocating nothing
    (prompt engines: a five-token prompt, as lantern.tools.latency times them)."""
    c = manifest.condition
    if c.kind == "class":
        inputs = {"classes": [0] * images}
    elif c.kind == "caption":
        inputs = {"caption": np.zeros((images, c.tokens, c.caption_dim), dtype=np.float32)}
    else:
        inputs = {"prompt_ids": np.full((images, 5), 100, dtype=np.int64)}
    prefix = condition.prefix(cfg, **inputs)
    settings = dict(cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0)
    return StepPlan(manifest, _ShapesOnly(), build_tree(tree), prefix, settings).shapes()


def plans_coverage(manifest, condition, tree, images, cfg):
    """None when the engine records no TensorRT plans (`Manifest.tensorrt`); else per plans
    build {key: the call regimes of the tree's generation (for `images` images, CFG on or off)
    that no profile of their graph's plan covers}, [] where every call fits. As the tensorrt
    backend assigns them, every call of one step plan needs a profile of its own."""
    if not manifest.tensorrt:
        return None
    shapes = call_shapes(manifest, condition, tree, images, cfg)
    out = {}
    for key, entry in manifest.tensorrt.items():
        taken, missing = {}, []
        for regime, (graph, call) in shapes.items():
            plan, used = entry.plans.get(graph), taken.setdefault(graph, set())
            index = None if plan is None else next(
                (i for i, p in enumerate(plan.profiles) if i not in used and p.covers(call)), None)
            if index is None:
                missing.append(regime)
            else:
                used.add(index)
        out[key] = missing
    return out


def coverage_note(coverage):
    if coverage is None:
        return "no TensorRT plans recorded"
    notes = []
    for key, missing in coverage.items():
        notes.append(f"within plans/{key}" if not missing else
                     f"plans/{key} do not cover {', '.join(missing)}: needs `lantern-export trt` again to run it there")
    return "; ".join(notes)
