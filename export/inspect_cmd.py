"""`lantern-export inspect CHECKPOINT`: what the loaders detect (format, family, config, size)."""
import json

from lantern.export import checkpoints
from lantern.export.families import family_of


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
    p = sub.add_parser("inspect", help="print what a checkpoint is (format, family, config, parameters, dtype)")
    p.add_argument("checkpoint", help="a LlamaGen .pt, a LANTERN target or drafter directory, or a VQ .pt")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_model_options(p)
    p.set_defaults(func=run)


def inspect(path, fmt=None, **target_opts):
    return family_of(path, fmt).inspect(path, fmt, **target_opts)


def run(args):
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
