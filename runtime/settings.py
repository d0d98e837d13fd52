"""The generation settings: how tokens are chosen and accepted, one frozen value per request.

    s = GenerationSettings(mode="lantern++", lam=2.0, k=100, cfg_scale=4.0, top_k=2000)
    s = s.resolve(engine.manifest, engine.directory)   # k checked against the neighbor table
    s.key            # 'lantern++_lam2_k100_t1-topk2000-topp1_cfg4'
    s.canonical()    # what a tuned tree is recorded under (only what changes acceptance or shapes)

Validation happens once, on construction, with the one-line errors of the CLI and the Python
API; `resolve` adds what only the engine knows (the modes it serves, its neighbor table's
width). The seed and the draft tree are not settings: an image depends on its own seed, and the
tree is chosen per engine and machine (`lantern-run tune`). A tree changes only the speed of
`exact` (lossless: the target's distribution whatever the tree), but the images of the relaxed
modes (lantern, lantern++ accept drafts by their neighbours, so other drafts give other
images); every generation says which tree ran and why. Requests with equal keys can share one
batch.
"""
import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np

from lantern.runtime import accept as acceptance
from lantern.runtime.errors import LanternError
from lantern.runtime.jacobi import check_window, DEFAULT_WINDOW
from lantern.runtime.sampling import sampler_for

MODES = ("ar", "exact", "lantern", "lantern++", "gsd")
RELAXED = ("lantern", "lantern++", "gsd")  # the modes that read the latent neighbours (k of them)
PROPOSERS = ("tree", "jacobi")  # lantern.runtime.proposers
DEFAULT_K = 100  # neighbors per draft when k is not given (fewer where the table is narrower)
# Bounds that keep every step finite: logits (float32 in every graph) are mixed by cfg_scale and
# divided by the temperature, and lam multiplies probabilities; past these a request overflows
# float32 or rounds a filter to zero and the logits turn inf/NaN. Counts are int64 graph feeds.
TEMPERATURE_RANGE = (1e-3, 1e3)  # below: use greedy
MAX_CFG_SCALE = 100.0
MAX_LAM = 1e4
MIN_TOP_P = 1e-6
MAX_COUNT = 2**31 - 1  # k, top_k, cfg_interval


def _is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


@dataclass(frozen=True)
class GenerationSettings:
    mode: str = "lantern++"
    lam: float = 2.0  # lantern++: p~(x) <= lam * p(x)
    delta: float = 0.1  # lantern: moved mass <= delta
    k: Optional[int] = None  # neighbors per draft (lantern, lantern++); None: resolve() picks
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0
    cfg_scale: float = 1.0  # classifier-free guidance; <= 1 turns CFG off
    cfg_interval: int = -1  # CFG for the first cfg_interval tokens only; -1: all
    tau: float = 1.0  # gsd: a neighbour joins the draft's group when |p(j) - p(x)| < tau
    proposer: str = "tree"  # tree: the drafter's static tree; jacobi: a drafter-free window
    window: Optional[int] = None  # jacobi: slots per verification (root included); None: tuned, else DEFAULT_WINDOW
    init: str = "random"  # jacobi: fresh drafts (random, uniform, spatial)

    def __post_init__(self):
        if self.mode not in MODES:
            raise LanternError(f"unknown mode {self.mode!r}; valid: {', '.join(MODES)}")
        if self.mode != "ar":  # the mode's own parameters, checked by its rule (k may come later)
            self._rule(0 if self.k is None else self.k)
        if self.proposer not in PROPOSERS:
            raise LanternError(f"unknown proposer {self.proposer!r}; valid: {', '.join(PROPOSERS)}")
        if self.proposer == "jacobi":
            check_window(DEFAULT_WINDOW if self.window is None else self.window, self.init)
        self.sampler()  # the filters, checked where sampling uses them
        s = self.cfg_scale
        if not (isinstance(s, (int, float, np.floating)) and not isinstance(s, bool)
                and (isinstance(s, int) or np.isfinite(s)) and s >= 0):  # an int of any size is finite
            raise LanternError(f"cfg scale must be a finite number >= 0 (<= 1 turns CFG off), got {s!r}")
        if not _is_int(self.cfg_interval) or self.cfg_interval < -1:
            raise LanternError(f"cfg interval must be an integer >= -1 (-1: CFG for every token), "
                               f"got {self.cfg_interval!r}")
        self._check_bounds()

    def _check_bounds(self):
        """The numeric bounds above (types and signs were checked by the rules and filters)."""
        low, high = TEMPERATURE_RANGE
        if not self.greedy and not low <= self.temperature <= high:
            raise LanternError(f"temperature must be in [{low:g}, {high:g}] (lower: use greedy), "
                               f"got {self.temperature!r}")
        if not self.greedy and self.top_p < MIN_TOP_P:
            raise LanternError(f"top_p must be >= {MIN_TOP_P:g}, got {self.top_p!r}")
        if self.cfg_scale > MAX_CFG_SCALE:
            raise LanternError(f"cfg scale must be <= {MAX_CFG_SCALE:g}, got {self.cfg_scale!r}")
        if self.mode == "lantern++" and self.lam > MAX_LAM:
            raise LanternError(f"lam must be <= {MAX_LAM:g}, got {self.lam!r}")
        for name in ("k", "top_k", "cfg_interval"):
            value = getattr(self, name)
            if value is not None and value > MAX_COUNT:
                raise LanternError(f"{name} must be <= {MAX_COUNT}, got {value!r}")

    @property
    def cfg(self):
        return self.cfg_scale > 1.0

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def resolve(self, manifest, where="the engine"):
        """These settings on an engine: its modes checked, k resolved against its neighbor table.
        The drafter tree serves the engine's modes (gsd wherever lantern++ is); the jacobi
        proposer needs the target alone, and a neighbor table for the relaxed modes."""
        if self.proposer == "jacobi" or self.mode == "gsd":
            needs = "a neighbor table (export with --vq)" if self.mode in RELAXED and manifest.neighbors is None \
                else "a drafter (re-export with one, or use --proposer jacobi)" \
                if self.proposer == "tree" and "exact" not in manifest.modes else None
            if needs is not None:
                raise LanternError(f"mode {self.mode!r} with the {self.proposer} proposer needs {needs}; {where} "
                                   f"has none")
        elif self.mode not in manifest.modes:
            raise LanternError(f"{where} serves modes {', '.join(manifest.modes)}, not {self.mode!r} "
                               f"(re-export with a drafter for speculative modes, with --vq for lantern/lantern++; "
                               f"--proposer jacobi needs no drafter)")
        if self.mode not in RELAXED:
            return self
        width = manifest.neighbors.k
        if self.k is None:
            return self.replace(k=min(DEFAULT_K, width))
        if _is_int(self.k) and self.k > width:
            raise LanternError(f"k = {self.k} exceeds the engine's neighbor table ({width} per token); "
                               f"use k <= {width} or re-export with a larger --neighbors-k")
        return self

    def rule(self):
        """The acceptance rule (None for ar); relaxed modes need k resolved."""
        if self.mode == "ar":
            return None
        if self.mode in RELAXED and self.k is None:
            raise LanternError(f"mode {self.mode!r} needs k; resolve the settings against an engine first")
        return self._rule(self.k)

    def _rule(self, k):
        group = {"tau": self.tau} if self.mode == "gsd" else {}  # gsd's own parameter
        return acceptance.rule_for(self.mode, k=k, delta=self.delta, lam=self.lam, **group)

    def sampler(self):
        return sampler_for(self.greedy, self.temperature, self.top_k, self.top_p)

    def canonical(self):
        """Only what changes the acceptance statistics or the calls' shapes: parameters of other
        modes and greedy's unused filters dropped, CFG off as scale 1. Numbers survive JSON."""
        s = {"mode": self.mode}
        if self.mode == "lantern++":
            s["lam"] = float(self.lam)
        if self.mode == "lantern":
            s["delta"] = float(self.delta)
        if self.mode == "gsd":
            s["tau"] = float(self.tau)
        if self.mode in RELAXED:
            if self.k is None:
                raise LanternError(f"mode {self.mode!r} needs k; resolve the settings against an engine first")
            s["k"] = int(self.k)
        if self.greedy:
            s["sampling"] = "greedy"
        else:
            s.update(sampling="sample", temperature=float(self.temperature), top_k=int(self.top_k),
                     top_p=float(self.top_p))
        s["cfg_scale"] = float(self.cfg_scale) if self.cfg else 1.0
        s["cfg_interval"] = int(self.cfg_interval) if self.cfg else -1
        if self.proposer == "jacobi" and self.mode != "ar":  # a window left open is the tuned one's key
            s.update(proposer="jacobi", init=self.init, **({} if self.window is None else {"window": int(self.window)}))
        return s

    @property
    def key(self):
        """A file-name-safe name of canonical(), e.g. 'lantern++_lam5_k20_t1-topk0-topp1_cfg3'."""
        s = self.canonical()
        parts = [s["mode"]]
        if "lam" in s:
            parts.append(f"lam{_number(s['lam'])}")
        if "delta" in s:
            parts.append(f"delta{_number(s['delta'])}")
        if "tau" in s:
            parts.append(f"tau{_number(s['tau'])}")
        if "k" in s:
            parts.append(f"k{s['k']}")
        if s["sampling"] == "greedy":
            parts.append("greedy")
        else:
            parts.append(f"t{_number(s['temperature'])}-topk{s['top_k']}-topp{_number(s['top_p'])}")
        if self.cfg:
            parts.append(f"cfg{_number(s['cfg_scale'])}" + (f"-first{s['cfg_interval']}" if s["cfg_interval"] >= 0
                                                            else ""))
        else:
            parts.append("nocfg")
        if "proposer" in s:
            parts.append(f"jacobi{s.get('window', '')}-{s['init']}")
        return "_".join(parts)

    @classmethod
    def from_canonical(cls, data):
        """The settings a canonical() dict names (defaults for what it leaves out)."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {name: value for name, value in data.items() if name in known}
        values["greedy"] = data.get("sampling") == "greedy"
        return cls(**values)


def _number(x):
    """A setting's number as a key fragment: 5.0 -> '5', 0.95 -> '0.95' (repr: no rounding)."""
    x = float(x)
    return str(int(x)) if x.is_integer() else repr(x)
