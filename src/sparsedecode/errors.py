"""User-facing errors.

Anything a user can fix by changing their input (a model spec, a support, a context length, being
offline) raises :class:`SparseDecodeError` with a one-line message that says what to do. The CLI prints
that line and exits with status 2; library users catch it like any ``ValueError``.
"""


class SparseDecodeError(ValueError):
    """A problem with the user's input or environment, explained in one line."""
