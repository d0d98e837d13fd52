"""The demo embedded in GPT-B's shapes (lantern.export.embed): exactness and speed over AR. Prints JSON.

  python -m lantern.tools.bench.embed [--shape GPT-B] [--workdir engines/bench-embed] [--threads 2]

Measures, in one run on one machine (ONNX Runtime on the CPU, CFG 3, sampling at temperature 1):
  equivalence  the embedded target's logits over the demo's 256 codes and its hidden states on
               the demo's dims against the demo's (PyTorch, fp32, teacher-forced on demo
               generations), the dims past the demo's (must be exactly 0), the drafter's logits
               and top-20; then the tokens of the demo engine and the embedded engine, greedy and
               sampled, with ar, exact and lantern++ (fraction equal: 1.0 means token for token);
  latency      L(T), the target call over T tokens, and the drafter call, on the embedded engine
               and on a random-weight engine of the same shapes (it costs what GPT-B costs);
  speed        per mode (exact, lantern++ at the demo's lam 5, k 20) and draft tree (chains,
               small and preset trees, the tree `lantern-run tune` chose): steps per image, the
               step's cost in AR steps and the wall-clock speed-up over ar on the same engine in
               the same run, at 1 image per call (median over --images calls) and at --batch.
Engines are exported once into --workdir (GPT-B: ~2 min each on 2 cores) and reused.
"""
import argparse
import json
import os
import time

import numpy as np
import torch

from lantern.export import checkpoints, embed, llamagen
from lantern.export.onnx_export import export_engine
from lantern.runtime.generator import Engine
from lantern.runtime.manifest import read_manifest
from lantern.runtime.settings import GenerationSettings
from lantern.tools import tune, tune_record
from lantern.tools.latency import draft_latency, verify_latency

LAM, K = 5.0, 20  # the demo's lantern++ settings
TREES = ("chain-1", "chain-2", "chain-3", "chain-4", "chain-5", "kary-2-2", "kary-2-3", "reverse_balanced_25",
         "mc_sim_7b_63")
BATCH_TREES = ("chain-1", "chain-2", "chain-3", "chain-4", "kary-2-2")  # at the batch (wide trees cost too much there)


def engines(workdir, shape, threads):
    """{name: engine dir} of the demo, the embedded demo and a random engine of the same shapes,
    exported where missing; and the export seconds of those exported now."""
    src = embed.demo_sources(embed.DEMO_DIR)
    dirs = {name: os.path.join(workdir, name) for name in ("demo", "embedded", "random")}
    seconds = {}
    torch.set_num_threads(threads)

    def export(name, target, config, drafter, vq):
        if os.path.exists(os.path.join(dirs[name], "manifest.json")):
            return
        t = time.perf_counter()
        export_engine(dirs[name], target, target_options={"config_file": config}, drafter=drafter, vq=vq,
                      tree="mc_sim_7b_63", force=True)
        seconds[name] = round(time.perf_counter() - t, 1)

    export("demo", src["target"], src["target_config"], src["drafter"], src["vq"])
    ckpt = os.path.join(workdir, "embedded-checkpoints")
    if not os.path.exists(os.path.join(dirs["embedded"], "manifest.json")):
        t = time.perf_counter()
        big = embed.write_embedded(embed.DEMO_DIR, shape, ckpt)
        seconds["embedding"] = round(time.perf_counter() - t, 1)
        export("embedded", big["target"], big["target_config"], big["drafter"], big["vq"])
    if not os.path.exists(os.path.join(dirs["random"], "manifest.json")):
        rnd = os.path.join(workdir, "random-checkpoints")
        os.makedirs(rnd, exist_ok=True)
        args = llamagen.ModelArgs(**read_manifest(dirs["embedded"]).model["config"])  # the embedded engine's shapes
        checkpoints.save_llamagen_pt(llamagen.init_random(llamagen.Transformer(args)), os.path.join(rnd, "gpt.pt"))
        with open(os.path.join(rnd, "gpt_config.json"), "w") as f:
            json.dump(args.to_dict(), f)
        drafter = llamagen.Drafter(llamagen.DrafterArgs.for_target(args))
        checkpoints.save_drafter(llamagen.init_random(drafter, seed=1), os.path.join(rnd, "drafter"), fmt="safetensors")
        export("random", os.path.join(rnd, "gpt.pt"), os.path.join(rnd, "gpt_config.json"),
               os.path.join(rnd, "drafter"), src["vq"])
    return dirs, seconds


def torch_equivalence(shape, demo_engine, images=4, seed=0):
    """Worst errors of the embedded models against the demo's, teacher-forced on the demo's own
    sampled generations (both CFG halves)."""
    src = embed.demo_sources(embed.DEMO_DIR)
    small, _ = checkpoints.load_target(src["target"], config_file=src["target_config"])
    small_drafter, _ = checkpoints.load_drafter(src["drafter"], small.args)
    big_args = embed.embedded_config(small.args, shape)
    big, big_drafter = embed.embed_target(small, big_args), embed.embed_drafter(small_drafter, small.args, big_args)
    n = small.args.num_classes
    classes = [(i * n) // images for i in range(images)]
    tokens = torch.from_numpy(demo_engine.generate(mode="ar", classes=classes, cfg_scale=3.0, seed=seed).tokens)
    cond = torch.tensor(classes + [small.null_class] * images)
    ids = tokens.repeat(2, 1)
    B, T = ids.shape[0], ids.shape[1]
    d, codes = small.args.dim, small.args.codes

    def run(model, drafter):
        x = torch.cat([model.embed_condition(cond), model.embed_tokens(ids[:, :-1])], 1)
        pos = torch.arange(T)[None].expand(B, T)
        mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T)
        logits, hidden, *_ = model(x, pos, mask, *model.empty_cache(B))
        # the drafter's input pair (h_t, x_{t+1}) at the position of x_{t+1}
        dmask = mask[:, :, :T - 1, :T - 1]
        h, *_ = drafter(hidden[:, :-1], ids[:, :-1], pos[:, 1:], dmask, *drafter.empty_cache(B), model.rope)
        return logits, hidden, model.output(h).float()

    with torch.no_grad():
        a_logits, a_hidden, a_draft = run(small, small_drafter)
        b_logits, b_hidden, b_draft = run(big, big_drafter)
    top = 20
    return {
        "sequences": B, "tokens_per_sequence": T,
        "target_logits_worst_abs_error": float((a_logits - b_logits[..., :codes]).abs().max()),
        "target_logits_scale": float(a_logits.abs().max()),
        "target_argmax_equal": float((a_logits.argmax(-1) == b_logits[..., :codes].argmax(-1)).float().mean()),
        "target_hidden_worst_abs_error": float((a_hidden - b_hidden[..., :d]).abs().max()),
        "target_hidden_past_demo_dims_max_abs": float(b_hidden[..., d:].abs().max()),
        "drafter_logits_worst_abs_error": float((a_draft - b_draft[..., :codes]).abs().max()),
        f"drafter_top{top}_equal": float((a_draft.topk(top).indices == b_draft[..., :codes].topk(top).indices)
                                         .float().mean()),
    }


def engine_equivalence(demo, embedded, tree, images=3, seeds=(0, 1)):
    """Fraction of tokens equal between the demo engine and the embedded one, per mode, greedy and
    sampled (CFG 3)."""
    n = demo.manifest.condition.num_classes
    classes = [(i * n) // images for i in range(images)]
    out = {}
    for mode in ("ar", "exact", "lantern++"):
        for greedy in (True, False):
            equal = []
            for seed in seeds[:1] if greedy else seeds:
                kw = dict(mode=mode, classes=classes, cfg_scale=3.0, seed=seed, greedy=greedy,
                          **({"tree": tree} if mode != "ar" else {}),
                          **({"lam": LAM, "k": K} if mode == "lantern++" else {}))
                equal.append(float((demo.generate(**kw).tokens == embedded.generate(**kw).tokens).mean()))
            out[f"{mode} {'greedy' if greedy else 'sampling'}"] = min(equal)
    return {"tree": tree, "images": images, "tokens_equal": out}


def latency(engines_, repeats, rounds=5):
    """L(T) and the drafter call (CFG: 2 rows per image) on each engine, in turns: each round
    times every size on every engine, and a size keeps its fastest round, so load from other
    processes falls on both engines alike."""
    sizes = {"verify": (1, 2, 3, 4, 6, 8, 16, 32), "draft": (1, 2, 4)}
    best = {name: {kind: {} for kind in sizes} for name in engines_}
    for _ in range(rounds):
        for name, engine in engines_.items():
            for kind, fn in (("verify", verify_latency), ("draft", draft_latency)):
                for size, s in fn(engine, sizes[kind], cfg_scale=3.0, context=16, repeats=repeats).items():
                    best[name][kind][size] = min(s, best[name][kind].get(size, s))
    out = {name: {"verify_ms": {t: round(1000 * s, 3) for t, s in b["verify"].items()},
                  "verify_over_L1": {t: round(s / b["verify"][1], 3) for t, s in b["verify"].items()},
                  "draft_ms": {w: round(1000 * s, 3) for w, s in b["draft"].items()}}
           for name, b in best.items()}
    a, b = out["embedded"]["verify_ms"], out["random"]["verify_ms"]
    out["embedded_over_random"] = {t: round(a[t] / b[t], 3) for t in a}
    return out


def mode_settings(spec):
    """'exact', 'lantern++' (the demo's lam 5, k 20) or 'lantern++:LAM' -> generate's keywords."""
    mode, _, lam = spec.partition(":")
    return dict(mode=mode, **({"lam": float(lam or LAM), "k": K} if mode == "lantern++" else {}))


def speed(engine, modes, trees, batch_trees, images, batch, repeats_at_batch, tuned):
    """Rows of steps per image, step cost in AR steps and speed-up over ar, at 1 image per call
    (`images` calls, classes spread) and at `batch` images per call. Every call of a mode runs
    right after the same call with ar (same classes, same seeds), so both see the same machine;
    the speed-up is the ratio of their summed seconds. tuned: modes whose tuned tree generate
    picks (tree None)."""
    n = engine.manifest.condition.num_classes
    common = dict(cfg_scale=3.0, temperature=1.0, top_k=0)
    rows = []
    setups = (("1 image", [[(i * n) // images] for i in range(images)], trees),
              (f"{batch} images", [[(i * n) // batch % n for i in range(batch)]] * repeats_at_batch, batch_trees))
    for where, calls, tree_list in setups:
        for spec in modes:
            for tree in list(tree_list) + ([None] if spec in tuned else []):
                kw = dict(common, **mode_settings(spec), **({"tree": tree} if tree else {}))
                engine.generate(classes=calls[0], seed=100, **kw)  # warm: this call size's plan and sessions
                pairs = [(engine.generate(classes=c, seed=i, mode="ar", **common).stats,
                          engine.generate(classes=c, seed=i, **kw).stats) for i, c in enumerate(calls)]
                ar_s, s = (sum(p[j]["seconds"] for p in pairs) for j in (0, 1))
                ar_steps, steps = (float(np.mean([p[j]["steps_per_image"] for p in pairs])) for j in (0, 1))
                rows.append({"mode": spec, "tree": tree or f"tuned: {pairs[0][1]['tree']}", "per_call": where,
                             "ar_ms_per_image": round(1000 * ar_s / (len(calls) * len(calls[0])), 1),
                             "ms_per_image": round(1000 * s / (len(calls) * len(calls[0])), 1),
                             "steps_per_image": round(steps, 2),
                             "mean_accepted_length": round(float(np.mean([p[1]["mean_accepted_length"] for p in pairs])), 3),
                             "step_cost_vs_ar": round((s / steps) / (ar_s / ar_steps), 3),
                             "speedup": round(ar_s / s, 3)})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def tune_modes(engine, modes, threads, images):
    out = {}
    for mode in modes:
        settings = tune.tuning_settings(engine, GenerationSettings(
            mode=mode, cfg_scale=3.0, temperature=1.0, top_k=0, **({"lam": LAM, "k": K} if mode == "lantern++" else {})))
        conds, note = tune.conditions(engine, images)
        t = time.perf_counter()
        report, chosen = tune.tune(engine, settings, conds, budget=32, depth=5, batches=(1, 8), repeats=3, loop_runs=1,
                                   threads=threads, note=note, log=lambda *a: None)
        tune_record.install(engine.directory, chosen, report)
        out[mode] = {"seconds": round(time.perf_counter() - t, 1),
                     "chosen": {b: {"tree": r["chosen"]["name"], "nodes": r["chosen"]["nodes"],
                                    "predicted_speedup": r["chosen"]["speedup_vs_ar"]}
                                for b, r in report["batches"].items()}}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="GPT-B")
    p.add_argument("--workdir", default=os.path.join("engines", "bench-embed"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--images", type=int, default=3, help="single-image calls per row (median)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--batch-repeats", type=int, default=2, help="calls per row at --batch")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per size and round of the latency (median)")
    p.add_argument("--trees", default=",".join(TREES))
    p.add_argument("--batch-trees", default=",".join(BATCH_TREES))
    p.add_argument("--modes", default="exact,lantern++",
                   help="exact, lantern++ (lam 5, k 20), lantern++:LAM (another lam), comma-separated")
    p.add_argument("--no-tune", action="store_true")
    args = p.parse_args(argv)

    start = time.perf_counter()
    dirs, export_seconds = engines(args.workdir, args.shape, args.threads)
    opened = {name: Engine(d, threads=args.threads) for name, d in dirs.items()}
    modes = args.modes.split(",")
    result = {"shape": args.shape, "threads": args.threads, "cfg_scale": 3.0, "export_seconds": export_seconds,
              "equivalence_torch": torch_equivalence(args.shape, opened["demo"]),
              "equivalence_engines": engine_equivalence(opened["demo"], opened["embedded"], "reverse_balanced_25")}
    print(json.dumps(result), flush=True)
    result["latency"] = latency({k: opened[k] for k in ("embedded", "random")}, args.repeats)
    print(json.dumps(result["latency"]), flush=True)
    embedded = opened["embedded"]
    tuned = [m for m in modes if m in ("exact", "lantern++")]  # the settings generate looks tuned trees up by
    if not args.no_tune:
        result["tune"] = tune_modes(embedded, tuned, args.threads, 8)
        print(json.dumps(result["tune"]), flush=True)
        embedded = Engine(dirs["embedded"], threads=args.threads)  # reopened: generate finds the tuned trees
    result["speed"] = speed(embedded, modes, args.trees.split(","), args.batch_trees.split(","), args.images,
                            args.batch, args.batch_repeats, () if args.no_tune else tuned)
    result["best"] = max(result["speed"], key=lambda r: r["speedup"])
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
