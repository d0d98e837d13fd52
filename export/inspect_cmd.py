"""`lantern-export inspect CHECKPOINT`: what the loaders detect (format, family, config, size).
`lantern-export inspect ENGINE`: what an engine directory's manifest lists (graphs, modes, plans; --json as JSON);
with --graphs each ONNX graph as Polygraphy's `inspect model` prints it (inputs and outputs with
their symbolic shapes, node counts, with --layers every node), on any machine; with --plans each
TensorRT plan's bindings and layers, read back by Polygraphy, which needs an NVIDIA GPU."""
import json
import os

from lantern.export import checkpoints
from lantern.export import polygraphy_check as pg
from lantern.export.families import family_of
from lantern.runtime.errors import LanternError
from lantern.runtime.manifest import read_manifest


def add_model_options(parser):
    """Options that pick a target's config when the checkpoint does not carry one."""
    parser.add_argument("--format", choices=checkpoints.FORMATS, help="override format detection")
    parser.add_argument("--model", dest="name", help="LlamaGen config name (GPT-B, GPT-L, GPT-XL, ...)")
    parser.add_argument("--config", dest="config_file", help="JSON file of LlamaGen ModelArgs fields")
    parser.add_argument("--image-size", type=int, help="image size in pixels (default: from the checkpoint, else 256)")
    parser.add_argument("--downsample-size", type=int, help="VQ downsampling factor (default 16)")
    parser.add_argument("--model-type", choices=("c2i", "t2i"), help="class- or text-conditional")
    parser.add_argument("--num-classes", type=int, help="number of classes (c2i)")
    parser.add_argument("--weights", default="model", choices=("model", "ema"),
                        help="which weights of a LlamaGen .pt to use (default: model, as LlamaGen's samplers)")


def target_options(args):
    return dict(name=args.name, config_file=args.config_file, image_size=args.image_size,
                downsample_size=args.downsample_size, model_type=args.model_type,
                num_classes=args.num_classes, weights=args.weights)


def add_parser(sub):
    p = sub.add_parser("inspect", help="print what a checkpoint is (format, family, config, parameters, dtype) "
                                       "or what an engine directory holds")
    p.add_argument("checkpoint", help="a LlamaGen .pt, a LANTERN target or drafter directory, a VQ .pt, or an "
                                      "engine directory (with manifest.json)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--graphs", action="store_true", help="engine: each ONNX graph as Polygraphy's inspect prints it")
    p.add_argument("--plans", action="store_true", help="engine: each TensorRT plan's bindings, read back by "
                                                        "Polygraphy (needs an NVIDIA GPU)")
    p.add_argument("--layers", action="store_true", help="with --graphs or --plans: every node or layer too")
    add_model_options(p)
    p.set_defaults(func=run)


def inspect(path, fmt=None, **target_opts):
    return family_of(path, fmt).inspect(path, fmt, **target_opts)


def is_engine_directory(path):
    return os.path.isfile(os.path.join(path, "manifest.json"))


def engine_summary(manifest):
    """What an engine directory holds, from its manifest: the facts `inspect ENGINE` prints (--json: as is)."""
    return {"family": manifest.family, "dtype": manifest.dtype, "modes": list(manifest.modes),
            "graphs": {name: {"file": g.file, "dtype": g.dtype, "inputs": list(g.inputs), "outputs": list(g.outputs)}
                       for name, g in manifest.graphs.items()},
            "plans": {f"{key}/{name}": {"file": plan.file, "profiles": len(plan.profiles),
                                        "bytes": manifest.files[plan.file].size}
                      for key, plans in (manifest.tensorrt or {}).items() for name, plan in plans.plans.items()}}


def engine_listing(summary):
    """The summary as text: one line per graph and per plan."""
    lines = [f"engine       {summary['family']} {summary['dtype']}, modes {', '.join(summary['modes'])}"]
    for name, graph in summary["graphs"].items():
        lines.append(f"graph        {name}: {graph['file']} ({graph['dtype']}), {len(graph['inputs'])} inputs, "
                     f"{len(graph['outputs'])} outputs")
    for name, plan in summary["plans"].items():
        lines.append(f"plan         {name}: {plan['file']}, {plan['profiles']} profiles, {plan['bytes']:,} bytes")
    return lines


def inspect_engine(args):
    if args.json and (args.graphs or args.plans):
        raise LanternError("--json prints the manifest's listing; --graphs and --plans print text, without --json")
    manifest = read_manifest(args.checkpoint, verify=False)  # the graphs' structure only: no hashing of weights
    if args.json:
        print(json.dumps(engine_summary(manifest), indent=2))
        return 0
    if not (args.graphs or args.plans):
        print("\n".join(engine_listing(engine_summary(manifest))))
        return 0
    if args.graphs:
        for name, graph in manifest.graphs.items():
            print(f"==== graph {name} ({graph.file})")
            print(pg.graph_summary(os.path.join(args.checkpoint, graph.file), layers=args.layers))
    if args.plans:
        if not manifest.tensorrt:
            raise LanternError(f"{args.checkpoint} has no TensorRT plans (build them with `lantern-export trt`)")
        for key, plans in manifest.tensorrt.items():
            for name, plan in plans.plans.items():
                print(f"==== plan {key}/{name} ({plan.file})")
                print(pg.plan_summary(os.path.join(args.checkpoint, plan.file), plans.flavor, layers=args.layers))
    return 0


def run(args):
    if is_engine_directory(args.checkpoint):
        return inspect_engine(args)
    if args.graphs or args.plans or args.layers:
        raise LanternError(f"--graphs, --plans and --layers inspect an engine directory; {args.checkpoint} has no "
                           "manifest.json")
    info = inspect(args.checkpoint, args.format, **target_options(args))
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    config = info.pop("config", {})
    for key in ("format", "role", "family", "config_name", "parameters", "dtype", "weights", "path"):
        if info.get(key) is not None:
            value = info[key]
            print(f"{key:12s} {value:,}" if isinstance(value, int) else f"{key:12s} {value}")
    print("config       " + ", ".join(f"{k}={v}" for k, v in config.items() if v is not None))
    return 0
