"""How a failure reaches the user: one line, whether the command fails here or in a Ray worker."""

from __future__ import annotations

__all__ = ["one_line"]


def one_line(error: BaseException) -> str:
    """The error's message on one line: an ``OSError`` as its reason and the path(s) it concerns."""
    if isinstance(error, OSError) and error.strerror:
        paths = [str(name) for name in (error.filename, error.filename2) if name is not None]
        text = error.strerror + (f": {' -> '.join(paths)}" if paths else "")
    else:
        text = str(error) or type(error).__name__
    return " ".join(text.split())
