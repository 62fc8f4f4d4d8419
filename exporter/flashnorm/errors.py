"""The one exception type the CLI turns into a one-line message and a non-zero exit."""


class FlashNormError(Exception):
    """A bad or unsupported input. The message is one line that names what was asked for
    and, where it helps, what exists instead."""

    exit_code = 2
