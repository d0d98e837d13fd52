"""`lantern-run`: `generate` (the runtime's, torch-free on ONNX Runtime; `--backend torch` runs the
graphs' PyTorch modules, rebuilt through lantern.export), `quality` (the harness), `tune` (the
fastest draft tree for this machine) and `whatif` (the same search on a latency model from a
file: a planning aid), `serve` (an HTTP endpoint on Ray Serve) and `client` (its client)."""
import argparse
import sys

from lantern.runtime import cli as runtime_cli
from lantern.tools import quality, serve, serve_client, tree_report, tune


def _torch_backend(engine_dir, threads, device):
    from lantern.export.torch_backend import open_torch_backend

    return open_torch_backend(engine_dir, threads=threads, device=device)


def _tensorrt_torch_backend(engine_dir, threads, device):
    from lantern.export.torch_backend import open_tensorrt_torch_backend

    return open_tensorrt_torch_backend(engine_dir, device=device)


def _onnxruntime_torch_backend(engine_dir, threads, device):
    from lantern.export.torch_backend import open_onnxruntime_torch_backend

    return open_onnxruntime_torch_backend(engine_dir, threads=threads, device=device)


LOADERS = {"torch": _torch_backend, "tensorrt-torch": _tensorrt_torch_backend,
           "onnxruntime-torch": _onnxruntime_torch_backend}


def build_parser():
    parser = argparse.ArgumentParser(prog="lantern-run", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    runtime_cli.add_parser(sub, backend_loaders=LOADERS)
    quality.add_parser(sub)
    tune.add_parser(sub, backend_loaders=LOADERS)
    tree_report.add_parser(sub, "whatif")
    serve.add_parser(sub)
    serve_client.add_parser(sub)
    return parser


def main(argv=None):
    return runtime_cli.main(argv, parser=build_parser())


if __name__ == "__main__":
    sys.exit(main())
