"""`lantern-run`: `generate` (the runtime's, torch-free on ONNX Runtime; the torch-based backends
run PyTorch modules built through lantern.export), `quality` (the harness), `tune` (the
fastest draft tree for this machine) and `whatif` (the same search on a latency model from a
file: a planning aid), `serve` (an HTTP endpoint on Ray Serve) and `client` (its client)."""
import argparse
import sys

from lantern.runtime import cli as runtime_cli
from lantern.runtime.backends import names, runner
from lantern.runtime.errors import LanternError
from lantern.tools import profile, quality, serve, serve_client, tree_report, tune


def _opener(name):
    """A loader of the backends lantern.export opens (their graphs' torch modules, or their
    runners inside the torch backend, with the device step's acceptance modules)."""

    def load(engine_dir, threads, device):
        try:
            import lantern.export.torch_backend as torch_backend
        except ImportError as e:  # torch (or another export dependency) is missing
            raise LanternError(f"--backend {name} needs PyTorch and lantern's export extra ({e}); "
                               f"{runner(name).install}") from None
        return torch_backend.OPENERS[name](engine_dir, threads=threads, device=device)

    return load


LOADERS = {name: _opener(name) for name in names(export=True)}


def build_parser():
    parser = argparse.ArgumentParser(prog="lantern-run", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    runtime_cli.add_parser(sub, backend_loaders=LOADERS)
    quality.add_parser(sub)
    tune.add_parser(sub, backend_loaders=LOADERS)
    profile.add_parser(sub, backend_loaders=LOADERS)
    tree_report.add_parser(sub, "whatif")
    serve.add_parser(sub)
    serve_client.add_parser(sub)
    return parser


def main(argv=None):
    return runtime_cli.main(argv, parser=build_parser())


if __name__ == "__main__":
    sys.exit(main())
