"""The library's switches in the environment (``SPARSEDECODE_*``), read by one reader per kind of value.

Every switch accepts the same spellings: on/off as ``1``/``0``, ``true``/``false``, ``yes``/``no`` or ``on``/``off``
in any case; a choice as one of its words; a count as a whole number. Unset or empty means the default. Anything
else is refused in one line naming the variable and what it takes: a misspelt value read as off would change what
is measured without a word. The switches are read when their module is imported (:mod:`sparsedecode.compiled.cpu`,
:mod:`sparsedecode.compiled.decoder`), so a bad one stops the first command that
imports it, before any work.
"""

from __future__ import annotations

import os

from .errors import SparseDecodeError

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def _given(name: str) -> str | None:
    text = os.environ.get(name)
    return text.strip() if text is not None and text.strip() else None


def flag(name: str, default: bool) -> bool:
    """An on/off switch: :data:`TRUE` or :data:`FALSE` in any case, else one line naming ``name``."""
    text = _given(name)
    if text is None:
        return default
    if text.lower() in TRUE:
        return True
    if text.lower() in FALSE:
        return False
    raise SparseDecodeError(
        f"{name}={os.environ[name]!r} is not an on/off value: use 1/0, true/false, yes/no or on/off (any case), "
        f"or unset it for the default ({'on' if default else 'off'})"
    )


def choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (in any case), else one line naming ``name`` and them."""
    text = _given(name)
    if text is None:
        return default
    if text.lower() in choices:
        return text.lower()
    raise SparseDecodeError(
        f"{name}={os.environ[name]!r}: choose one of {', '.join(choices)}, or unset it for the default ({default})"
    )


def count(name: str, default: int, minimum: int = 1) -> int:
    """A whole number of at least ``minimum``, else one line naming ``name``."""
    text = _given(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise SparseDecodeError(
            f"{name}={os.environ[name]!r}: expected a whole number >= {minimum}, or unset it for the default "
            f"({default})"
        )
    return value


def text(name: str, default: str) -> str:
    """A free-form word (a backend's name, checked where it is used)."""
    return _given(name) or default
