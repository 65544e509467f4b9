"""The one exception type the CLI turns into a clear message and a non-zero exit."""


class DDTreeError(Exception):
    """A user-facing error: bad checkpoint, bad prompt file, bad flag. The message names the culprit."""
