"""The one exception type users see: a single line naming the problem and the fix."""


class BlockfoldError(Exception):
    """Bad input or an impossible request; the CLI prints it as one line and exits non-zero."""
