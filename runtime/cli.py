"""`lantern-run generate`: images from an engine directory (no torch needed on the onnxruntime backend).
Arguments are checked where the Python API checks them, so both give the same one-line errors."""
import argparse
import json
import os
import sys

import numpy as np

from lantern.runtime.backends import DEFAULT, RUNNERS, TORCH, names, runner, spoken
from lantern.runtime.errors import cli_main, LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.outdir import OutputDirectory, write_file
from lantern.runtime.png import write_png
from lantern.runtime.jacobi import DEFAULT_WINDOW, INITS
from lantern.runtime.settings import GenerationSettings, MODES, PROPOSERS


def _classes(text):
    try:
        return [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"class labels are comma-separated integers, got {text!r}") from None


def _seeds(text):
    """One int (image i gets seed + i) or one int per image, comma-separated."""
    try:
        seeds = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        seeds = []
    if not seeds:
        raise argparse.ArgumentTypeError(f"a seed is an integer, or one integer per image comma-separated; "
                                         f"got {text!r}")
    return seeds[0] if len(seeds) == 1 and "," not in text else seeds


def _grid(text):
    try:
        h, w = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a grid is ROWSxCOLUMNS, e.g. 48x48; got {text!r}") from None
    return h, w


def add_generation_options(p, tree=True):
    p.add_argument("--mode", default="lantern++", choices=MODES)
    p.add_argument("--lam", type=float, default=2.0, help="LANTERN++ bound: p~(x) <= lam * p(x) (lam >= 1)")
    p.add_argument("--delta", type=float, default=0.1, help="LANTERN bound on the moved mass (0..1)")
    p.add_argument("--k", type=int, default=None,
                   help="latent neighbors considered per draft token (default: 100, or all the table has)")
    p.add_argument("--tau", type=float, default=1.0,
                   help="gsd: a neighbor joins a draft's group when their probabilities differ by less (0..1]")
    p.add_argument("--proposer", default="tree", choices=PROPOSERS,
                   help="where drafts come from: tree (the drafter's static tree) or jacobi (a drafter-free window: "
                        "speculative Jacobi decoding; serves engines without a drafter)")
    p.add_argument("--window", type=int, default=None,
                   help=f"jacobi: slots per verification, the root included (default: the window `lantern-run tune "
                        f"--proposer jacobi` chose for these settings, else {DEFAULT_WINDOW}, the fastest measured on a "
                        f"CPU; 16 saves more steps where a wide verification costs about one token's, on a GPU)")
    p.add_argument("--init", default="random", choices=INITS,
                   help="jacobi: fresh drafts: random codes (q one-hot), uniform (q uniform), spatial (the code above)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (default: sampling)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = no top-k filter")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--cfg-scale", type=float, default=1.0, help="classifier-free guidance scale (> 1 enables CFG)")
    p.add_argument("--cfg-interval", type=int, default=-1, help="use CFG for the first N tokens only (-1: all)")
    p.add_argument("--seed", type=_seeds, default=0,
                   help="image i gets SEED + i; or one seed per image, e.g. 7,7,3 (an image's tokens depend "
                        "on its own seed only)")
    if tree:
        p.add_argument("--tree", help="draft tree for this run (preset or JSON file; default: the engine's tuned "
                                      "tree for these settings, else its exported one)")
    cuda = names(device="cuda")
    p.add_argument("--backend", default=DEFAULT, choices=tuple(RUNNERS),
                   help=f"the runner (default {DEFAULT}); {spoken(names(export=True))} are built from torch modules "
                        f"lantern.export makes ({TORCH.install})")
    p.add_argument("--device", default=None, help=f"cpu or cuda[:N] (default: cuda for {spoken(cuda)}, else cpu)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help=f"{spoken(names(cuda_graphs_option=True))}: enqueue every call instead of replaying a CUDA "
                        f"graph per call regime ({spoken(names(export=True, onnx=False))} capture theirs always on "
                        f"CUDA)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: all cores)")
    torch_based = spoken(names(export=True))
    p.add_argument("--step", choices=("host", "device"), default=None,
                   help=f"where each decoding step runs: host (acceptance in numpy over logits read back) or device "
                        f"(the whole step as the step graphs, a few integers per image read back: {torch_based} run "
                        f"their modules, onnxruntime the graphs `lantern-export accept` writes into the engine, "
                        f"tensorrt acceptance only); default: the backend's (device for onnxruntime where the "
                        f"engine has step graphs and on CUDA for {torch_based}, else host)")


def generation_settings(args):
    """The GenerationSettings the options name (validated: one line on bad values)."""
    return GenerationSettings(mode=args.mode, lam=args.lam, delta=args.delta, k=args.k, greedy=args.greedy,
                              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              cfg_scale=args.cfg_scale, cfg_interval=args.cfg_interval, tau=args.tau,
                              proposer=args.proposer, window=args.window, init=args.init)


def add_parser(sub, backend_loaders=None):
    """backend_loaders: {name: loader(engine_dir, threads, device) -> backend} for backends the
    runtime cannot open by itself (lantern-run adds torch through lantern.export)."""
    loaders = dict(backend_loaders or {})
    g = sub.add_parser("generate", help="generate images: tokens.npy, stats.json and PNGs into --out")
    g.add_argument("engine", help="engine directory (from lantern-export onnx)")
    add_generation_options(g)
    g.add_argument("--classes", type=_classes, help="class labels, e.g. 3,7 (c2i engines)")
    g.add_argument("--caption", help="T5 caption features .npy [N, tokens, dim], left-padded (t2i engines)")
    g.add_argument("--caption-mask", help=".npy [N, tokens] of 0/1: which caption tokens are real")
    g.add_argument("--prompt", action="append",
                   help="text prompt (Anole / Lumina-mGPT engines); repeat for several images")
    g.add_argument("--prompt-ids", help=".npy [L] or [N, L] of the prompts' text token ids, as the tokenizer gives "
                                        "them, without the model's special tokens")
    g.add_argument("--grid", type=_grid, help="latent rows x columns, e.g. 48x48 (Lumina-mGPT; default: the engine's)")
    g.add_argument("--out", required=True, help="output directory (appears whole when the run succeeds)")
    g.add_argument("--force", action="store_true",
                   help="replace --out if it holds an earlier run's outputs (tokens.npy, stats.json, image_*.png only)")
    g.set_defaults(func=run_generate, backend_loaders=loaders)


def build_parser():
    parser = argparse.ArgumentParser(prog="lantern-run", description=__doc__)
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def _load_npy(path, what):
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise LanternError(f"{path}: cannot read {what} ({str(e).splitlines()[0]})") from None


def device_of(args):
    """The device a command runs on: --device, else its runner's."""
    return args.device or runner(args.backend).device


def open_engine(args):
    device = device_of(args)
    options = {"cuda_graphs": args.cuda_graphs} if runner(args.backend).cuda_graphs_option else {}
    loader = args.backend_loaders.get(args.backend)
    backend = loader(args.engine, args.threads, device) if loader else args.backend
    return Engine(args.engine, backend=backend, threads=args.threads, device=device, step=args.step, **options)


def write_outputs(stage, tokens, stats, images=None):
    """tokens.npy, stats.json and one PNG per image into a staging directory (OutputDirectory
    places it whole)."""

    try:
        with open(os.path.join(stage, "tokens.npy"), "wb") as f:
            np.save(f, tokens, allow_pickle=False)
        write_file(os.path.join(stage, "stats.json"), (json.dumps(stats, indent=2) + "\n").encode())
        for i, image in enumerate(images if images is not None else []):
            write_png(os.path.join(stage, f"image_{i:03d}.png"), image)
    except OSError as e:  # a full disk or a file-size limit: the staged outputs are removed
        raise LanternError(f"cannot write the outputs ({e.strerror}); free space (or raise the limit) and run "
                           f"again") from None


def run_generate(args):
    caption = _load_npy(args.caption, "caption features") if args.caption else None
    mask = _load_npy(args.caption_mask, "caption mask") if args.caption_mask else None
    prompt_ids = _load_npy(args.prompt_ids, "prompt ids") if args.prompt_ids else None
    # --out is checked and locked before the work, and placed whole after it
    with OutputDirectory(args.out, force=args.force) as stage:
        engine = open_engine(args)
        result = engine.generate(classes=args.classes, caption=caption, caption_mask=mask, prompt=args.prompt,
                                 prompt_ids=prompt_ids, grid=args.grid, settings=generation_settings(args),
                                 seed=args.seed, tree=args.tree)
        images = engine.decode(result.tokens, result.grid) if "vq_decoder" in engine.manifest.graphs else None
        write_outputs(stage, result.tokens, result.stats, images)
    s = result.stats
    print(f"tree {s['tree']}: {s['tree_reason']}")
    if s["tree_source"] == "tuned":  # say so when the request's tree (or mode) was not what ran
        ran = "AR, " if s["mode"] == "ar" else f"tree {s['tree']}, "
        s_mode = f"{s['mode']} ({ran}tuned for mode {s['requested_mode']} with these settings)"
    else:
        s_mode = s["mode"]
    print(f"{s['images']} images, mode {s_mode}: {s['steps_per_image']:.1f} steps/image, "
          f"mean accepted length {s['mean_accepted_length']:.2f}, {s['tokens_per_second']:.1f} tokens/s, "
          f"{s['step']} step -> {args.out}")
    if "step_reason" in s and engine.backend.default_step == "device":  # an engine the device step cannot run
        print(f"the step ran on the host: {s['step_reason']}")
    return 0


def main(argv=None, parser=None):
    return cli_main(parser or build_parser(), argv, "lantern-run")


if __name__ == "__main__":
    sys.exit(main())
