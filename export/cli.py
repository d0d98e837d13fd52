"""`lantern-export`: inspect checkpoints, compute codebook neighbors, export engines (ONNX, TensorRT plans)
and check them."""
import argparse
import sys

from lantern.export import check, neighbors, quantize, trt_export
from lantern.runtime.errors import cli_main


def build_parser(more=()):
    """more: add_parser functions of commands from above this package (lantern-export's `demo`
    lives in lantern.tools, which may import export but not the other way round)."""
    parser = argparse.ArgumentParser(prog="lantern-export", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    # Each subcommand module adds its parser and sets `func`.
    from lantern.export import accept_engine, inspect_cmd, onnx_export  # torch at their tops

    inspect_cmd.add_parser(sub)
    neighbors.add_parser(sub)
    onnx_export.add_parser(sub)
    accept_engine.add_parser(sub)
    quantize.add_parser(sub)
    trt_export.add_parser(sub)
    check.add_parser(sub)
    for add_parser in more:
        add_parser(sub)
    return parser


def main(argv=None, parser=None):
    return cli_main(parser or build_parser(), argv, "lantern-export")


if __name__ == "__main__":
    sys.exit(main())
