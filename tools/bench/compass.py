"""The compass: one image from the official LlamaGen eager PyTorch `generate()` against our ONNX
Runtime `ar` on the same weights and CPU (fp32, and the int8 / int4 engines). Prints JSON.

  python -m lantern.tools.bench.compass PATH/TO/LlamaGen [--threads 2] [--cfg-scale 4] [--workdir DIR]

PATH/TO/LlamaGen is a checkout of FoundationVision/LlamaGen (not part of this repository); its
`autoregressive.models.gpt` and `autoregressive.models.generate` are imported from there.
GPT-B, c2i, 256 image tokens, random weights (one checkpoint loaded into both), class 207,
cfg 4, temperature 1, top-k 2000 (LlamaGen's sample_c2i defaults), torch with `threads`
threads, ONNX Runtime with `threads` intra-op threads. Both sides get one short warm-up run.
Goal: ours >= 5x faster than eager.

torch's OpenMP threads spin-wait between ops; on a machine shared with other jobs a descheduled
spinning thread stalls every barrier (a [2, 768] x [768, 2304] matmul took 12-30 ms instead of
~1 ms here). So torch gets OMP_WAIT_POLICY=PASSIVE, the counterpart of the runtime's
`session.intra_op.allow_spinning=0` (set before torch is imported; an explicit setting wins).
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np
from lantern.export.quantize import quantize_engine, QuantizeOptions
from lantern.runtime.generator import Engine


def llamagen_seconds(checkout, state_dict, args):
    """Seconds for LlamaGen's own generate() of one image, its model built from its own code."""
    import torch

    sys.path.insert(0, os.path.abspath(checkout))
    try:
        from autoregressive.models.generate import generate
        from autoregressive.models.gpt import GPT_models
    except ImportError as e:
        raise SystemExit(f"{checkout}: not a LlamaGen checkout ({e})")
    model = GPT_models["GPT-B"](vocab_size=16384, block_size=256, num_classes=1000, cls_token_num=1, model_type="c2i")
    model.load_state_dict(state_dict, strict=True)
    model = model.to(dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[args.llamagen_dtype]).eval()
    classes = torch.tensor([args.cls])
    sampling = dict(cfg_scale=args.cfg_scale, temperature=1.0, top_k=args.top_k, top_p=1.0, sample_logits=True)
    torch.manual_seed(args.seed)
    generate(model, classes, 8, **sampling)  # warm up (allocations, first-call overheads)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        tokens = generate(model, classes, 256, **sampling)
        times.append(time.perf_counter() - start)
    assert tokens.shape == (1, 256)
    return times


def ours_seconds(engine_dir, args):
    engine = Engine(engine_dir, threads=args.threads)
    options = dict(classes=[args.cls], mode="ar", cfg_scale=args.cfg_scale, top_k=args.top_k, seed=args.seed)
    engine.generate(**options)  # warm up
    return [engine.generate(**options).stats["seconds"] for _ in range(args.repeats)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("llamagen", help="path to a FoundationVision/LlamaGen checkout")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cfg-scale", type=float, default=4.0)
    p.add_argument("--top-k", type=int, default=2000)
    p.add_argument("--cls", type=int, default=207)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="timed images per side (median reported)")
    p.add_argument("--schemes", default="fp32,int8,int4", help="our engines to time (default fp32,int8,int4)")
    p.add_argument("--llamagen-dtype", default="fp32", choices=("fp32", "bf16"),
                   help="LlamaGen's dtype (its sample script defaults to bf16; fp32 is the same weights as ours)")
    p.add_argument("--workdir", help="where the checkpoint and engines go (default: a temporary directory)")
    args = p.parse_args(argv)

    import torch

    from lantern.export import checkpoints, llamagen
    from lantern.export.onnx_export import export_engine

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    work = args.workdir or tempfile.mkdtemp(prefix="lantern-compass-")
    target = llamagen.init_random(llamagen.Transformer(llamagen.make_config("GPT-B"))).eval()
    checkpoint = os.path.join(work, "gpt.pt")
    checkpoints.save_llamagen_pt(target, checkpoint)
    engines = {"fp32": os.path.join(work, "engine")}
    export_engine(engines["fp32"], checkpoint, target_options={"name": "GPT-B"}, force=True)
    for scheme in args.schemes.split(","):
        if scheme != "fp32":
            engines[scheme] = os.path.join(work, f"engine-{scheme}")
            quantize_engine(engines["fp32"], engines[scheme], QuantizeOptions(scheme), force=True)

    eager = llamagen_seconds(args.llamagen, target.state_dict(), args)
    del target
    ours = {scheme: ours_seconds(path, args) for scheme, path in engines.items() if scheme in args.schemes.split(",")}
    base = float(np.median(eager))
    report = {
        "benchmark": "one image: LlamaGen eager generate() vs lantern ar on ONNX Runtime CPU, same weights",
        "note": "timings from a shared 2-core machine (other jobs running)", "load_average": os.getloadavg(),
        "model": "GPT-B", "random_weights": True, "image_tokens": 256, "cfg_scale": args.cfg_scale, "top_k": args.top_k,
        "threads": args.threads, "torch": torch.__version__, "llamagen_dtype": args.llamagen_dtype,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "llamagen_eager_seconds": round(base, 2),
        "ours_ar_seconds": {s: round(float(np.median(t)), 2) for s, t in ours.items()},
        "speedup_vs_eager": {s: round(base / float(np.median(t)), 2) for s, t in ours.items()},
        "goal_speedup": 5.0,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
