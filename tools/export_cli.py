"""`lantern-export`: the export package's commands plus `demo` (which exports, checks, tunes and
runs the bundled demo model, so it lives here, above both)."""
import sys

from lantern.export import cli as export_cli
from lantern.tools import demo


def main(argv=None):
    return export_cli.main(argv, parser=export_cli.build_parser(more=(demo.add_parser,)))


if __name__ == "__main__":
    sys.exit(main())
