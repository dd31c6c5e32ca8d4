"""User-facing errors.

Anything a user can fix by changing their input (a model spec, a support, a context length, being
offline) raises :class:`SparseDecodeError` with a one-line message that says what to do. The CLI prints
that line and exits with status 2; library users catch it like any ``ValueError``.
"""

import contextlib
from collections.abc import Iterator


class SparseDecodeError(ValueError):
    """A problem with the user's input or environment, explained in one line."""


NONFINITE_SCORES = (
    "block selection scores hold NaN or infinite values (queries or keys in the KV cache that are not finite, or so "
    "large that their products overflow); check the model's weights and dtype"
)
"""What the torch path (:func:`sparsedecode.validate.check_scores`) and the C kernel say of non-finite scores."""


def one_line(error: BaseException) -> str:
    """The error's message on one line: an ``OSError`` as its reason and the path(s) it concerns."""
    if isinstance(error, OSError) and error.strerror:
        paths = [str(name) for name in (error.filename, error.filename2) if name is not None]
        text = error.strerror + (f": {' -> '.join(paths)}" if paths else "")
    else:
        text = str(error) or type(error).__name__
    return " ".join(text.split())


USER_CODE_FAILURES = (Exception, SystemExit)
"""What a user's code (a selector's file, constructor or methods) may raise that the library reports in one line
naming it: ``sys.exit()`` there too, which would otherwise end a command silently, with status 0 for ``exit(0)``."""


def failure(error: BaseException) -> str:
    """A user's code's failure on one line: its type and message, or the ``sys.exit`` it called."""
    if isinstance(error, SystemExit):
        return f"called sys.exit({error.code!r})"
    return f"{type(error).__name__}: {one_line(error)}"


@contextlib.contextmanager
def naming(path) -> Iterator[None]:
    """Give an ``OSError`` raised inside the block without a file name (``ENOSPC`` from a write, say) ``path``'s
    name, so that its one-line message says which file could not be written."""
    try:
        yield
    except OSError as error:
        if error.filename is None and error.strerror:
            raise OSError(error.errno, error.strerror, str(path)) from error
        raise
