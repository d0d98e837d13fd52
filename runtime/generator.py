"""Engines: open an engine directory once, generate many times.

    engine = Engine("engines/demo")                      # onnxruntime on the CPU by default
    out = engine.generate(classes=[3, 7], mode="lantern++", lam=2.0, k=100, cfg_scale=4.0)
    out.tokens        # [images, image tokens] VQ codes
    out.stats         # steps, mean accepted length, time per phase
    engine.decode(out.tokens)  # uint8 images [N, H, W, 3] when the engine has a VQ decoder

An Engine resolves a generation (Engine.prepare: settings, prefix, seeds, the proposer with its
tree or window and why), makes or reuses its step plan, and runs the decoding loop
(lantern.runtime.decoding) on it. Where the step runs (Engine(step=...)): "host" is the loop's own
step, with acceptance in numpy over logits read back to the host; "device" hands the step to the
backend (backend.device_step): the torch backend's (and tensorrt-torch's and onnxruntime-torch's,
whose plans and sessions are its modules) runs the whole step, draft -> verify -> accept ->
commit, on its device and reads back a few integers per image; ONNX Runtime's runs the whole
step too, on the engine's step graphs of the generation's tree (`lantern-export accept`;
lantern.runtime.graph_step), with the same draws of the images' streams the host step reads.
None takes the backend's default_step (host where a backend has none; ONNX Runtime's is device,
and a generation its graphs cannot run takes the host step). The same loop drives every path;
stats["step"] says which ran.
"""
import os
import threading
from dataclasses import dataclass

import numpy as np

from lantern.runtime.backends import DEFAULT, open_backend
from lantern.runtime.conditions import condition_adapter
from lantern.runtime.decoding import Decoding
from lantern.runtime.errors import LanternError
from lantern.runtime.integrity import load_neighbors
from lantern.runtime.jacobi import DEFAULT_WINDOW
from lantern.runtime.manifest import read_manifest
from lantern.runtime.memory import available_memory
from lantern.runtime.plan import Call, check_memory as check_plan_memory, decode_bytes, StepPlan
from lantern.runtime.proposers import proposer_for
from lantern.runtime.settings import GenerationSettings
from lantern.runtime.streams import image_seeds, RandomStreams
from lantern.runtime.tree import build_tree, root_only

DECODE_CHUNK = 8  # images per VQ decoder call
DEVICE_RULES = ("exact", "lantern", "lantern++")  # what the device steps' acceptance serves


@dataclass
class Setup:
    """A generation as Engine.prepare resolved it (see there)."""
    settings: GenerationSettings
    rule: object
    sampler: object
    prefix: object
    seeds: list
    proposer: object
    source: str  # where the proposer's tree or window came from: given, tuned, exported, default, ar
    why: str

    @property
    def feeds(self):
        """The drafter calls' sampling inputs (StepPlan's settings)."""
        s = self.sampler
        return dict(cfg_scale=self.settings.cfg_scale if self.prefix.cfg else 1.0, temperature=s.temperature,
                    top_k=s.top_k, top_p=s.top_p)

    def decoding(self, engine, plan, observer=None, step_path="host"):
        """The loop's state for one run of this setup on `plan` (streams from the seeds)."""
        streams = RandomStreams(self.seeds, plan.tree.num_nodes, self.proposer.candidates)
        return Decoding(engine, plan, self.proposer, self.rule, self.sampler, self.settings.cfg_scale,
                         self.settings.cfg_interval, streams, observer, step_path)

    def describe(self):
        """Which tree (or window) ran and why: a tuned tree (or AR) may stand in for the exported one."""
        out = dict(requested_mode=self.settings.mode, tree_source=self.source, tree_reason=self.why,
                   proposer=self.proposer.name)
        if self.proposer.name == "jacobi":
            out.update(window=self.proposer.window, init=self.proposer.init)
        return out


class Engine:
    """An engine directory opened on one backend. Holds no per-generation state but the last
    step plan, which the next generation with the same tree and batch reuses.

    Threads: one Engine may be shared by several threads; its generate and decode calls are
    serialised (a lock per Engine: the step plan's buffers and the backend's bound session are
    used by one call at a time), so a second thread's call waits for the first and both return
    what they would alone. For parallel generations open one Engine per worker."""

    def __init__(self, directory, backend=DEFAULT, threads=None, device=None, verify=True,
                 memory_limit=None, step=None, **backend_options):
        """step: "host", "device" or None (the backend's default_step); see the module docstring."""
        if step not in (None, "host", "device"):
            raise LanternError(f"unknown step path {step!r}; valid: host, device")
        self.directory = os.fspath(directory)
        self.manifest = m = read_manifest(self.directory, verify=verify)
        # A backend name, or an opened backend (e.g. a TorchBackend over in-memory modules).
        if isinstance(backend, str):  # device None: the backend's own default (cpu; cuda for tensorrt)
            options = dict(backend_options, threads=threads, **({} if device is None else {"device": device}))
            backend = open_backend(backend, self.directory, m, **options)
        self.backend = backend
        self.step = step or backend.default_step
        self._step_asked = step is not None
        self.condition = condition_adapter(m, self.backend.float_dtype, self.directory)
        self.tree = build_tree(m.tree) if m.tree else None
        self.neighbors = None
        if m.neighbors is not None:

            self.neighbors = load_neighbors(os.path.join(self.directory, m.neighbors.file), m.vocabulary.codes,
                                            m.neighbors.k)
        self.memory_limit = memory_limit
        self._plan = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------------
    def generate(self, settings=None, *, classes=None, caption=None, caption_mask=None, prompt=None, prompt_ids=None,
                 grid=None, seed=0, tree=None, observer=None, **keywords):
        """Generate one image per class (c2i), caption row (t2i) or prompt (Chameleon family:
        text, or the tokenizer's ids without special tokens; grid = (rows, columns) of codes for
        Lumina-mGPT). Returns a Generation.
        settings: a GenerationSettings, or its fields as keywords (mode=, lam=, k=, cfg_scale=, ...).
        tree: another draft tree for this call (preset name, JSON file or paths); its widest node
        must fit the drafter graph's candidates; it always wins. Default: the tree `lantern-run
        tune` chose for these settings on this backend (manifest tuned_trees), else the one
        exported with. stats["tree"], ["tree_source"] and ["tree_reason"] say which ran and why.
        A tree changes speed only for `exact` (its distribution, and its greedy tokens, are the
        target's whatever the tree); in the relaxed modes it changes which drafts are offered,
        so the images too.
        observer: called with a StepRecord after every step's acceptance.
        seed: an int s (image i gets seed s + i) or one int per image; an image's tokens depend on
        its own seed and settings only, never on the images beside it (lantern.runtime.streams)."""
        if settings is None:
            settings = GenerationSettings(**keywords)
        elif keywords:
            raise TypeError(f"generate() takes settings or its fields as keywords, not both ({', '.join(keywords)})")
        with self._lock:
            return self._generate(settings, classes, caption, caption_mask, prompt, prompt_ids, grid, seed, tree,
                                  observer)

    def _generate(self, settings, classes, caption, caption_mask, prompt, prompt_ids, grid, seed, tree, observer):
        setup = self.prepare(settings, dict(classes=classes, caption=caption, caption_mask=caption_mask, prompt=prompt,
                                            prompt_ids=prompt_ids, grid=grid), seed, tree)
        plan = self._plan_for(setup.proposer.tree, setup.prefix, setup.feeds, setup.proposer.drafter)
        path, why = self._step_path(plan, setup.proposer, setup.rule, setup.sampler)
        out = setup.decoding(self, plan, observer, path).generate()
        out.stats.update(setup.describe())
        if why is not None:  # the default device step gave way: say why (an old engine names its upgrade)
            out.stats["step_reason"] = why
        return out

    def prepare(self, settings, condition, seed, tree=None):
        """What a generation of these settings, condition (generate's condition arguments) and
        seed runs, before any plan: the resolved settings, rule and sampler, the prefix, the
        images' seeds and the proposer (the tree given, tuned or exported; or the jacobi window)
        with why it was chosen."""
        settings = settings.resolve(self.manifest, self.directory)
        rule, sampler = settings.rule(), settings.sampler()
        given = tree
        jacobi = settings.proposer == "jacobi" and settings.mode != "ar"
        if jacobi and given is not None:
            raise LanternError("a draft tree is the drafter's; the jacobi proposer verifies a window (window=, "
                               "--window) instead: give one or the other")
        if not jacobi:
            tree = root_only() if settings.mode == "ar" else self._tree(tree)
            if not settings.greedy and not tree.contiguous:
                raise LanternError(f"tree {tree.name!r} skips child ranks; sampling needs every node's children to "
                                   f"be ranks 0..w-1 (drafts drawn without replacement in rank order)")
        prefix = self.condition.prefix(settings.cfg, **condition)
        seeds = image_seeds(seed, prefix.images)
        self.check_positions(prefix)
        if jacobi:
            proposer, (source, why) = self._jacobi(settings, prefix.images)
        else:
            source, why = self._tree_source(given, settings)
            if given is None and settings.mode != "ar":
                chosen = self._tuned_tree(settings, prefix.images)
                if chosen is not None:
                    tree, (source, why) = chosen
            if isinstance(tree, int):  # tune measured a jacobi window faster than the drafter's trees
                proposer = proposer_for("jacobi", None, self.manifest, settings.replace(proposer="jacobi", window=tree))
            else:
                proposer = proposer_for("tree", tree, self.manifest, settings)
        return Setup(settings, rule, sampler, prefix, seeds, proposer, source, why)

    def _tree_source(self, given, settings):
        """(source, why) of the tree a request names or defaults to, before any tuned one."""
        if settings.mode == "ar":
            return "ar", "mode ar drafts nothing" + (" (the given tree is not used)" if given is not None else "")
        if given is not None:
            return "given", "given for this call"
        return "exported", "exported with the engine (no tree tuned for these settings on this backend)"

    def _step_path(self, plan, proposer, rule, sampler):
        """(where this generation's steps run, why not on the device or None): the engine's step
        path, except that a default device step gives way to the host for a generation it cannot
        run (asked for by name, it is an error that says why)."""
        if self.step == "host":
            return "host", None
        if proposer.name not in getattr(self.backend, "device_step_proposers", ("tree",)):
            why = f"it runs the drafter tree only, not the {proposer.name} proposer"
        elif rule is not None and rule.name not in DEVICE_RULES:
            why = f"it runs modes {', '.join(DEVICE_RULES)}, not {rule.name}"
        else:  # a drafter-free proposer's graphs depend on its settings too (a window's slots and init)
            why = self.backend.device_step_refusal(plan, sampler, *(() if proposer.name == "tree" else (proposer,)))
        if why is None:
            return "device", None
        if self._step_asked:
            raise LanternError(f"the device step cannot run this generation: {why}; use step='host'")
        return "host", why

    def check_positions(self, prefix):
        """Every token fed to the model (the prefix and all generated tokens but the last) needs a
        position the model has (its RoPE table); positions past it would be clamped silently."""
        limit = self.manifest.max_positions
        need = int(prefix.positions.max()) + prefix.length  # the last fed token's position + 1
        if need > limit:
            h, w = prefix.grid
            raise LanternError(f"the prompt ({prefix.tokens} tokens) and a {h}x{w} grid ({prefix.length} tokens "
                               f"generated) need positions 0..{need - 1}; the model has {limit} (0..{limit - 1}): "
                               f"use a shorter prompt or a smaller grid")

    def _tree(self, spec):
        """The draft tree for a call: the exported one, or `spec` where it fits the drafter."""
        if spec is None:
            return self.tree
        tree = build_tree(spec)
        if tree.max_width > self.manifest.candidates:
            raise LanternError(f"tree {tree.name!r} needs {tree.max_width} children per node but the exported "
                               f"drafter returns {self.manifest.candidates} candidates; re-export with --candidates "
                               f"{tree.max_width} or pick a narrower tree")
        return tree

    def _jacobi(self, settings, images):
        """(proposer, (source, why)) of a jacobi generation: the window given, else the one `lantern-run
        tune --proposer jacobi` chose for these settings on this backend (for the tuned batch
        nearest `images`; AR where it found AR fastest), else DEFAULT_WINDOW."""
        if settings.window is not None:
            proposer = proposer_for("jacobi", None, self.manifest, settings)
            return proposer, ("given", f"a jacobi window of {proposer.window} slots, given for this call")
        entry = self.manifest.tuned_trees.get(settings.key)
        if entry is not None and entry.backend == self.backend.name:
            chosen = entry.tree_for(images)
            what = "AR was fastest" if chosen.window is None else f"a window of {chosen.window} slots"
            why = (f"tuned by `lantern-run tune` for these settings on {entry.backend}, batch {chosen.images} ({what}); "
                   f"--window picks another")
            if chosen.window is None:
                return proposer_for("tree", root_only(), self.manifest, settings), ("tuned", why)
            return proposer_for("jacobi", None, self.manifest, settings.replace(window=chosen.window)), ("tuned", why)
        proposer = proposer_for("jacobi", None, self.manifest, settings.replace(window=DEFAULT_WINDOW))
        return proposer, ("default", f"the jacobi proposer's default window of {DEFAULT_WINDOW} slots (none tuned for "
                                     f"these settings on this backend: `lantern-run tune --proposer jacobi`)")

    def _tuned_tree(self, settings, images):
        """(tree, ("tuned", why)) of the tree tuned for these settings on this backend, for the
        tuned batch nearest `images`; root_only() where the tuner found AR fastest; the window (an int)
        where `tune --also-jacobi` found the jacobi proposer fastest; None if untuned."""
        entry = self.manifest.tuned_trees.get(settings.key)
        if entry is None or entry.backend != self.backend.name:
            return None
        chosen = entry.tree_for(images)
        what = chosen.file or (f"the jacobi proposer's window of {chosen.window} slots was fastest" if chosen.window
                               else "AR was fastest")
        why = (f"tuned by `lantern-run tune` for these settings on {entry.backend}, batch {chosen.images} "
               f"({what}); --tree picks another")
        if chosen.window is not None:
            return chosen.window, ("tuned", why)
        if chosen.file is None:
            return root_only(), ("tuned", why)
        tree = build_tree(os.path.join(self.directory, chosen.file))
        if tree.max_width > self.manifest.candidates or not tree.contiguous:
            raise LanternError(f"{self.directory}: tuned tree {chosen.file} does not fit the drafter's "
                               f"{self.manifest.candidates} candidates in rank order; run `lantern-run tune` again")
        return tree, ("tuned", why)

    def _plan_for(self, tree, prefix, feeds, drafter=True):
        """The step plan for this tree and batch (drafter: whether its proposer calls the
        drafter): the last one when it fits (its bound buffers are reused), else a new one, once
        the estimate says the machine can hold it."""
        drafter = drafter and tree.depth > 0
        if self._plan is not None and self._plan.tree == tree and self._plan.drafts == drafter \
                and self._plan.fits(prefix):
            self._plan.reset(prefix, feeds)
            return self._plan
        if self._plan is not None:
            self.backend.release(self._plan)
        self._plan = None  # let the old buffers go before the new ones are allocated
        self.check_memory(tree, prefix, drafter)
        plan = StepPlan(self.manifest, self.backend, tree, prefix, feeds, drafter)
        self.backend.bind(plan)
        self._plan = plan
        return plan

    def check_memory(self, tree, prefix, drafter=True):
        """Refuse, in one line and before anything is allocated, a step plan for `tree` and
        `prefix` that the machine cannot hold (the estimate from shapes alone). Commands that make
        plans of their own (tune, its latency model, quality) call it first too."""
        limit = self.memory_limit if self.memory_limit is not None else available_memory()
        check_plan_memory(self.manifest, tree, prefix, np.dtype(self.backend.float_dtype).itemsize, limit,
                          drafter=drafter)

    def release(self):
        """Let the last step plan go (its buffers, bindings and CUDA graphs), so a backend this
        engine shares with others gets them back; the next generate makes a new plan."""
        with self._lock:
            if self._plan is not None:
                self.backend.release(self._plan)
            self._plan = None

    def decode(self, tokens, grid=None):
        """VQ codes [N, rows * columns] -> uint8 images [N, H, W, 3]; grid (rows, columns)
        defaults to the engine's."""
        if "vq_decoder" not in self.manifest.graphs:
            raise LanternError(f"{self.directory} has no VQ decoder (export with --vq)")
        h, w = grid or (self.manifest.image.grid_height, self.manifest.image.grid_width)
        codes = np.asarray(tokens)
        n_codes = self.manifest.vocabulary.codes
        if codes.dtype == object or not np.issubdtype(codes.dtype, np.integer) or codes.size == 0 \
                or codes.size % (h * w):
            raise LanternError(f"decode takes integer VQ codes [N, {h * w}] ({h}x{w} grid), got {codes.dtype} "
                               f"{list(codes.shape)}")
        if codes.min() < 0 or codes.max() >= n_codes:
            raise LanternError(f"decode: code {int(codes.max() if codes.max() >= n_codes else codes.min())} is "
                               f"outside the codebook (0..{n_codes - 1})")
        codes = codes.astype(np.int64).reshape(-1, h, w)
        need = decode_bytes(self.manifest, len(codes), DECODE_CHUNK, (h, w))
        limit = self.memory_limit if self.memory_limit is not None else available_memory()
        if limit is not None and need > 0.8 * limit:
            raise LanternError(f"decoding {len(codes)} images needs about {need / 2**30:.2f} GiB, more than this "
                               f"machine can give ({limit / 2**30:.2f} GiB available); decode fewer at a time")
        with self._lock:
            images = None
            for start in range(0, len(codes), DECODE_CHUNK):  # memory stays that of one chunk's activations
                image = self.backend.numpy(self.backend.run(
                    Call("vq_decoder", "decode", {"codes": codes[start:start + DECODE_CHUNK]}))["image"])
                if images is None:
                    images = np.empty((len(codes),) + image.shape[2:] + image.shape[1:2], dtype=np.uint8)
                images[start:start + len(image)] = np.clip(
                    (image.transpose(0, 2, 3, 1) + 1) * 127.5 + 0.5, 0, 255).astype(np.uint8)
            return images
