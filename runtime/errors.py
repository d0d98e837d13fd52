"""The one exception type for bad user input: the CLIs print its message as one line and exit 2."""


class LanternError(ValueError):
    """Bad input (file, option, checkpoint, engine directory) described in one readable line."""


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so `finally` / `except BaseException` blocks run (a
    staged output directory is removed) instead of the process dying where it stands."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def cli_main(parser, argv, prog):
    """Parse argv and run the chosen subcommand: a LanternError becomes one line on stderr and
    exit code 2, never a traceback. SIGTERM ends the command like Ctrl-C does (exit 143)."""
    import signal
    import sys
    import threading

    args = parser.parse_args(argv)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main else None
    try:
        return args.func(args) or 0
    except LanternError as e:
        print(f"{prog}: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print(f"{prog}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
