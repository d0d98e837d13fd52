"""`lantern-run`: `generate` (the runtime's, torch-free on ONNX Runtime) and `quality` (the harness)."""
import argparse
import sys

from lantern.runtime import cli as runtime_cli
from lantern.tools import quality


def build_parser():
    parser = argparse.ArgumentParser(prog="lantern-run", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    runtime_cli.add_parser(sub)
    quality.add_parser(sub)
    return parser


def main(argv=None):
    return runtime_cli.main(argv, parser=build_parser())


if __name__ == "__main__":
    sys.exit(main())
