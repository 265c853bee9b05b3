"""User-facing errors.

Anything the user can fix (a bad params value, a malformed input file, a wrong interpreter) is raised
as an :class:`EaglenestError`. Stage entry points and the CLI print it as one line and exit with
status 2, so no traceback from deep inside torch ever reaches the user for a problem of theirs.
"""


class EaglenestError(Exception):
    """A problem with the user's input or environment, reported without a traceback."""


class ParamsError(EaglenestError):
    """One or more params values are invalid; the message lists every problem."""


class InputFileError(EaglenestError):
    """An input file is missing, malformed or inconsistent; the message names the file."""


class TemplateError(EaglenestError):
    """The chat template cannot be used to locate assistant tokens."""
