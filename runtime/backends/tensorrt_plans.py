"""Which TensorRT plans run here (pure: tested without a GPU): the manifest's plan builds
(`Manifest.tensorrt`) matched against the installed flavor and its exact version and the GPU's
compute capability; a plan built for another GPU or TensorRT version is refused with the
`lantern-export trt` line that rebuilds it; each call of a step plan gets a profile of its own.
"""
import importlib

import numpy as np

from lantern.runtime.backends.cuda import DeviceArray
from lantern.runtime.contracts import STEP_VERSION
from lantern.runtime.errors import LanternError
from lantern.runtime.graph_step import phase_files, step_graphs_refusal
from lantern.runtime.sampling import Greedy

FLAVOR_MODULES = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx"}
_INSTALL = {"tensorrt": "pip install 'lantern[tensorrt]'", "tensorrt-rtx": "pip install 'lantern[tensorrt-rtx]'"}


# ---------------------------------------------------------------------------------------------
# Which plans run here (pure: tested without a GPU)


def installed_versions():
    """{flavor: version} of the TensorRT flavors whose module imports here."""
    found = {}
    for flavor, module in FLAVOR_MODULES.items():
        try:
            found[flavor] = importlib.import_module(module).__version__
        except ImportError:
            pass
    return found


def rebuild_command(directory, flavor, compute_capability, batches=None, trees=None, cfg=None, step_graphs=None):
    """The `lantern-export trt` line that builds plans for this GPU (and these calls, and the step
    graphs of these kinds where the default, greedy's, is not enough)."""
    cc = compute_capability[2:] if flavor == "tensorrt-rtx" and compute_capability else "current"
    line = f"lantern-export trt {directory} --flavor {flavor} --compute-capability {cc}"
    if batches:
        line += " --batch " + " ".join(map(str, batches))
    if trees:
        line += " --tree " + " ".join(trees)
    if cfg is not None and len(cfg) == 1:
        line += " --cfg" if cfg[0] else " --no-cfg"
    if step_graphs:
        line += " --step-graphs " + " ".join(step_graphs)
    return line + " --force"


def select_plans(manifest, directory, gpu, installed, flavor=None, key=None):
    """(key, TensorRTPlans) of the first plan build that runs here: the flavor installed at the
    version that built it, built for this GPU's compute capability (gpu: "SM89"). Else a
    LanternError that says why each build does not run and how to rebuild."""
    builds = dict(manifest.tensorrt or {})
    if key is not None:
        if key not in builds:
            raise LanternError(f"{directory} has no plans/{key} (it has: {', '.join(builds) or 'none'})")
        builds = {key: builds[key]}
    if flavor is not None:
        if flavor not in FLAVOR_MODULES:
            raise LanternError(f"unknown TensorRT flavor {flavor!r}; valid: {', '.join(FLAVOR_MODULES)}")
        builds = {k: b for k, b in builds.items() if b.flavor == flavor}
    wanted = flavor or (next(iter(installed)) if installed else "tensorrt-rtx")
    if not builds:
        raise LanternError(f"{directory} has no TensorRT plans{f' for {flavor}' if flavor else ''}; build them with "
                           f"`{rebuild_command(directory, wanted, gpu)}`")
    reasons = []
    for k, b in builds.items():
        if b.flavor not in installed:
            reasons.append(f"plans/{k} need {b.flavor} {b.version}, which is not installed ({_INSTALL[b.flavor]})")
        elif installed[b.flavor] != b.version:
            reasons.append(f"plans/{k} were built by {b.flavor} {b.version}; this is {installed[b.flavor]}")
        elif gpu not in b.compute_capabilities:
            reasons.append(f"plans/{k} were built for {', '.join(b.compute_capabilities)}; this GPU is {gpu}")
        else:
            return k, b
    b = next(iter(builds.values()))
    rebuild = b.flavor if b.flavor in installed else wanted
    if rebuild == "tensorrt-rtx" and gpu not in rtx_targets():
        rebuild = "tensorrt"  # TensorRT for RTX does not target this GPU (Hopper, datacenter Blackwell)
    raise LanternError(f"{directory}: no TensorRT plans run here: {'; '.join(reasons)}; rebuild them with "
                       f"`{rebuild_command(directory, rebuild, gpu, b.batches, b.trees or None, b.cfg)}`")


def rtx_targets():
    """The compute capabilities TensorRT for RTX can build for: its own list where it is
    installed, else those of version 1.7."""
    try:
        trt = importlib.import_module("tensorrt_rtx")
        return {name for name in trt.ComputeCapability.__members__ if name.startswith("SM")}
    except ImportError:
        return {"SM75", "SM80", "SM86", "SM89", "SM120", "SM121"}


def find_profile(plan_file, shapes, taken=()):
    """Index of the first profile of a plan that covers a call's input shapes and is not taken
    (by another call of the same step plan), or None."""
    for index, profile in enumerate(plan_file.profiles):
        if index not in taken and profile.covers(shapes):
            return index
    return None


def assign_profiles(directory, key, entry, plan, gpu):
    """{regime: profile index} for every call of a StepPlan, each call a profile of its own
    (TensorRT lets one execution context hold a profile at a time, and every regime gets its own
    context and CUDA graph); a LanternError with the rebuild line for a call none covers."""
    return dict(zip(plan.calls, step_profiles(directory, key, entry, plan.calls.values(), gpu, plan)))


def step_profiles(directory, key, entry, calls, gpu, plan=None):
    """[profile index] for calls in order (a StepPlan's, or a GraphStep's phase calls of both
    parities): each call the first profile of its plan that covers its shapes and no earlier call
    of the same plan took. `lantern-export trt` builds two equal profiles per shape of a step
    graph (even and odd steps): a phase's two calls bind the two state buffers the other way
    round, and a TensorRT context holds one set of addresses, a profile one context at a time."""
    taken, out = {}, []
    for call in calls:
        if call.graph not in entry.plans:
            raise LanternError(f"plans/{key} have no plan of {call.graph}; rebuild them with "
                               f"`{rebuild_command(directory, entry.flavor, gpu)}`")
        shapes = call_shapes(call)
        index = find_profile(entry.plans[call.graph], shapes, taken.setdefault(call.graph, set()))
        if index is None:
            raise uncovered_call(directory, key, entry, call.graph, call.regime, shapes, gpu, plan)
        taken[call.graph].add(index)
        out.append(index)
    return out


def step_plan_refusal(manifest, directory, key, entry, plan, sampler, gpu):
    """Why the plans of build `entry` (plans/KEY) cannot run the device step (GraphStep on the
    step graphs' plans) of a generation of this plan and sampler, or None: the engine's step
    graphs for the tree, of this STEP_VERSION and forced ids, a top_k the graphs filter, and a
    plan of each step graph the generation runs (`lantern-export trt` builds them after
    `lantern-export accept`)."""
    graphs, why = step_graphs_refusal(manifest, directory, plan, sampler)
    if why is not None:
        if graphs is None:
            return f"{why}, then rebuild the plans with `{rebuild_command(directory, entry.flavor, gpu)}`"
        return why + (", then rebuild the plans" if graphs.version != STEP_VERSION else "")
    tree = plan.tree
    name = tree.name if tree.depth else "ar"
    columns = manifest.vocabulary.codes + len(graphs.forced_ids)
    missing = [f for f in phase_files(graphs, sampler, columns).values() if f not in entry.plans]
    if missing:
        trees = list(entry.trees) + ([name] if tree.depth and name not in entry.trees else [])
        kinds = None if isinstance(sampler, Greedy) else ("greedy", "sampling")  # greedy's alone by default
        return (f"plans/{key} have no plans of the step graphs of tree {name} ({missing[0]}"
                f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}); rebuild them with "
                f"`{rebuild_command(directory, entry.flavor, gpu, entry.batches, trees or None, entry.cfg, kinds)}`")
    return None


def call_shapes(call):
    """{input: shape} of a call's feeds, host arrays or device buffers."""
    return {name: tuple(buf.shape if isinstance(buf, DeviceArray) else np.shape(buf)) for name, buf in call.feeds.items()}


def uncovered_call(directory, key, entry, graph, regime, shapes, gpu, plan=None):
    """The LanternError for a call no profile covers: what the plans serve, what the call needs, and
    the rebuild line (with the plan's tree and batch added when the call comes from a StepPlan)."""
    served = sorted({label for p in entry.plans[graph].profiles for label in p.serves})
    what = ", ".join(f"{n} {list(s)}" for n, s in shapes.items()  # one cache input stands for all layers
                     if n in entry.plans[graph].profiles[0].shapes and (not n.startswith("past_") or n == "past_keys_0"))
    batches, trees, cfg = list(entry.batches), list(entry.trees), entry.cfg
    needs = ""
    if plan is not None:
        batches = sorted(set(batches) | {plan.images})
        if plan.tree.depth and plan.tree.name not in trees:
            trees.append(plan.tree.name)
        if plan.prefix.cfg not in cfg:
            cfg = None
        needs = (f" (tree {plan.tree.name}, {plan.images} image(s), {'with' if plan.prefix.cfg else 'without'} "
                 f"CFG)")
    return LanternError(f"the {graph} call {regime}{needs} with {what} is not covered by plans/{key} (built for "
                        f"{'; '.join(served)}); rebuild them with "
                        f"`{rebuild_command(directory, entry.flavor, gpu, batches, trees or None, cfg)}`")
