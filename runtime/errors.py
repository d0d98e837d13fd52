"""The one exception type for bad user input: the CLIs print its message as one line and exit 2."""


class LanternError(ValueError):
    """Bad input (file, option, checkpoint, engine directory) described in one readable line."""
