"""The one exception type for bad user input: the CLIs print its message as one line and exit 2."""


class LanternError(ValueError):
    """Bad input (file, option, checkpoint, engine directory) described in one readable line."""


def cli_main(parser, argv, prog):
    """Parse argv and run the chosen subcommand: a LanternError becomes one line on stderr and
    exit code 2, never a traceback."""
    import sys

    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except LanternError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
