"""Finding selectors: by name (built-ins, :func:`register_selector`, the ``sparsedecode.selectors`` entry-point
group) or by file (``path/to/file.py:ClassName``), with parameters (``NAME:key=value,...``).

A spec string is ``NAME`` or ``FILE.py:CLASS``, optionally followed by ``:key=value,key=value`` (``;`` separates
them too, where commas separate something else: lm-eval's ``--model_args``). A file's path may hold colons: it ends
at the last ``.py:`` followed by a class name. Values are read by the field's annotation (int, float, bool as
true/false, str; ``X | None`` or ``Optional[X]`` also takes ``none``), or by its default's type where the annotation
says nothing the command line can give. In a comma-separated list of selectors (``sweep --selectors``) an item
holding ``=`` but no ``:`` continues (or starts) the parameters of the selector before it, so
``mean-pooled,twilight:p=0.9,base=quest,quest`` and ``mean-pooled,block-top-p,p=0.8,quest`` are three selectors each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import sys
import types
import typing
from importlib import metadata
from pathlib import Path

from ..errors import USER_CODE_FAILURES, SparseDecodeError, failure, one_line
from .base import Selector, check_selector_class, library_code, set_spec_parser

ENTRY_POINTS = "sparsedecode.selectors"
_REGISTRY: dict[str, type[Selector]] = {}
_BUILTINS_LOADED = False
_ENTRY_POINTS_LOADED = False
_FILES: dict[tuple[str, str], tuple[str, object]] = {}


def register_selector(cls: type[Selector] | None = None, *, name: str | None = None, replace: bool = False):
    """Register a selector class under ``name`` (default: its ``name`` attribute); usable as ``@register_selector``.

    A name already taken by another class is refused unless ``replace=True``."""

    def add(klass):
        check_selector_class(klass)
        _load_builtins()  # a built-in's name is taken even before anything looked one up
        key = name or klass.selector_name()
        if not isinstance(key, str):
            raise SparseDecodeError(f"selector name {key!r}: a name is a string of letters, digits and dashes")
        # a space would be stripped from the spec that names it (" x" is looked up as "x"), a newline split its line
        if not key or any(c in key for c in ":,=") or key.endswith(".py") or any(c.isspace() for c in key):
            raise SparseDecodeError(
                f"selector name {key!r}: use letters, digits and dashes (no ':', ',', '=' or white space)"
            )
        own = klass.__dict__.get("name")
        if name is not None and own and own != name:  # its specs would name ``own``, which reads back as another
            raise SparseDecodeError(
                f"selector class {klass.__qualname__} names itself {own!r}: register it under that name (its rows "
                f"carry it), not {name!r}"
            )
        if key in RETIRED:  # stored rows that name it are read as the built-in it was (protocol.results)
            raise SparseDecodeError(
                f"selector name {key!r} was a built-in's: stored rows that name it are read as that built-in's, so "
                "it cannot be taken; register yours under another name"
            )
        held = _REGISTRY.get(key)
        if held is not None and held is not klass and key in _BUILTIN_NAMES:
            raise SparseDecodeError(
                f"selector name {key!r} is a built-in's: rows name it, so it cannot be replaced; register yours "
                "under another name"
            )
        if held is not None and held is not klass and not replace:
            raise SparseDecodeError(f"selector name {key!r} is taken by {held.__module__}.{held.__qualname__}")
        if name is not None and not klass.__dict__.get("name"):  # a subclass's own, not its parent's; once taken
            klass.name = name
        _REGISTRY[key] = klass
        return klass

    return add if cls is None else add(cls)


_BUILTIN_NAMES: frozenset[str] = frozenset()
"""The names the built-in selectors registered (:func:`_load_builtins`): never replaced."""


def _load_builtins() -> None:
    global _BUILTINS_LOADED, _BUILTIN_NAMES
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        from .methods import BUILTINS

        for cls in BUILTINS:
            register_selector(cls)

        _BUILTIN_NAMES = frozenset(_REGISTRY)


def _load_entry_points() -> None:
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    for point in metadata.entry_points(group=ENTRY_POINTS):
        if point.name in _REGISTRY or point.name in RETIRED:  # a built-in's name, now or before
            continue
        try:
            register_selector(point.load(), name=point.name)
        except USER_CODE_FAILURES as error:  # a broken plug-in names itself instead of breaking every command
            raise SparseDecodeError(f"selector entry point {point.name!r} ({point.value}): {failure(error)}") from None


def selector_names() -> tuple[str, ...]:
    """Every registered name: built-ins first, then registrations and entry points in order."""
    _load_builtins()
    _load_entry_points()
    return tuple(_REGISTRY)


RETIRED = {
    "top-p": "top-p is now block-top-p (an adaptive budget over blocks, this project's); Twilight's token-level "
    "top-p is twilight",
}
"""Names built-ins no longer have, with where they went (stored rows are renamed when read: protocol.results)."""


def selector_class(name: str) -> type[Selector]:
    _load_builtins()
    if name not in _REGISTRY:
        _load_entry_points()
    if name not in _REGISTRY and name in RETIRED:
        raise SparseDecodeError(f"unknown selector {name!r}: {RETIRED[name]}")
    if name not in _REGISTRY:
        raise SparseDecodeError(
            f"unknown selector {name!r}; choose one of: {', '.join(selector_names())}; or path/to/file.py:ClassName"
        )
    return _REGISTRY[name]


_PROVIDED: dict[str, tuple[str, str]] = {}
"""Selector files' contents handed to this process by another (a Ray worker's driver), by location:
``(sha256, text)``. They are used instead of the path, which may not exist here or may hold another version."""


def provide_sources(sources: dict[str, tuple[str, str]] | None) -> None:
    """Take selector files' contents (:func:`loaded_sources` of another process) for :func:`load_file_class`."""
    for location, (digest, text) in (sources or {}).items():
        if hashlib.sha256(text.encode("utf-8")).hexdigest() != digest:
            raise SparseDecodeError(f"selector file {location!r}: the content handed over does not match its sha256")
        _PROVIDED[location] = (digest, text)


@contextlib.contextmanager
def provided(sources: dict[str, tuple[str, str]]):
    """:func:`provide_sources` for the block only: afterwards each location reads what it read before (a file's own
    content, or what was provided before)."""
    saved = {location: _PROVIDED.get(location) for location in sources}
    provide_sources(sources)
    try:
        yield
    finally:
        for location, held in saved.items():
            if held is None:
                _PROVIDED.pop(location, None)
            else:
                _PROVIDED[location] = held


def loaded_sources() -> dict[str, tuple[str, str]]:
    """``{location: (sha256, text)}`` of every selector file this process imported: what a worker needs to import the
    same classes."""
    return {location: (digest, text) for (location, digest), (text, _) in _FILES.items()}


def read_source(location: str) -> tuple[str, str]:
    """``(sha256, text)`` of the selector file ``location`` (the content a worker was handed, if any)."""
    if location in _PROVIDED:
        return _PROVIDED[location]
    path = Path(location).expanduser()
    if not path.is_file():
        what = ("is a folder, not a Python file" if path.is_dir() else "is no regular file (a pipe or a device?)"
                if path.exists() else "does not exist")  # fmt: skip
        raise SparseDecodeError(f"selector file {location!r} {what}")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise SparseDecodeError(f"selector file {location!r}: {error.strerror or error}") from None
    try:
        return hashlib.sha256(data).hexdigest(), data.decode("utf-8")
    except UnicodeDecodeError:
        raise SparseDecodeError(f"selector file {location!r} is not UTF-8 text") from None


def load_file_class(location: str, class_name: str) -> type[Selector]:
    """Class ``class_name`` of the Python file ``location``, imported by path (each content once per process)."""
    digest, text = read_source(location)
    key = (location, digest)
    held = _FILES.get(key)
    if held is None:
        module_name = f"sparsedecode_user_selector_{digest[:16]}"
        module = types.ModuleType(module_name)
        module.__file__ = location
        sys.modules[module_name] = module  # dataclasses look their module up while building the class
        try:
            exec(compile(text, location, "exec"), module.__dict__)
        except USER_CODE_FAILURES as error:
            del sys.modules[module_name]
            raise SparseDecodeError(f"selector file {location!r} failed to import: {failure(error)}") from None
        held = _FILES[key] = (text, module)
    module = held[1]
    cls = getattr(module, class_name, None)
    if cls is None:
        raise SparseDecodeError(f"selector file {location!r} has no class {class_name!r}")
    check_selector_class(cls)
    if cls.__module__ == module.__name__:  # defined in this file: it records the file, and pickles with it
        cls.source = (location, digest)
        cls.__reduce_ex__ = _reduce_file_selector
    # else the file imports it (a built-in, or another file's class): it keeps its own origin
    return cls


def _reduce_file_selector(self: Selector, protocol):
    """A selector from a file pickles with the file's content, so a worker elsewhere (Ray) rebuilds the same class even
    where the path does not exist. A subclass defined elsewhere (no file of its own) pickles as usual."""
    if type(self).source is None:
        return object.__reduce_ex__(self, protocol)
    location, digest = self.source
    text = _FILES[(location, digest)][0]
    return rebuild_file_selector, (location, digest, text, type(self).__name__, self.params())


def rebuild_file_selector(location: str, digest: str, text: str, class_name: str, params: dict) -> Selector:
    """Unpickling a selector from a file: the file's content travels with it (see ``Selector.__reduce_ex__``)."""
    provide_sources({location: (digest, text)})
    return build(load_file_class(location, class_name), params)


def file_cut(text: str) -> int | None:
    """Where the path of a file spec ends (the index of the ``:`` after ``.py``): the last ``.py:`` followed by a
    class name, in a path without ``=`` (a parameter's value); ``None`` when ``text`` names no file."""
    cuts = [i + 3 for i in range(len(text)) if text.startswith(".py:", i)]
    for cut in reversed(cuts):
        class_name = text[cut + 1 :].partition(":")[0]
        if class_name.isidentifier() and "=" not in text[:cut]:
            return cut
    head = text.partition(":")[0]
    if "=" in text and not any(c in head for c in "=/\\") and not head.endswith(".py"):
        return None  # 'NAME:key=path.py:Class': a registered selector whose parameter is a file spec
    return cuts[0] if cuts else None  # a path holding '=', or one naming no class (refused as such)


def _split(text: str) -> tuple[str, str]:
    """``(what, parameters)`` of a spec string: ``NAME`` or ``path.py:Class``, and what follows."""
    cut = file_cut(text)
    if cut is None and text.partition(":")[0].endswith(".py"):
        cut = len(text.partition(":")[0])
    if cut is not None:  # FILE.py:CLASS[:params]
        class_name, _, params = text[cut + 1 :].partition(":")
        if not class_name or "=" in class_name:
            raise SparseDecodeError(f"selector {text!r}: a file selector is path/to/file.py:ClassName")
        return f"{text[:cut]}:{class_name}", params
    head, _, rest = text.partition(":")
    return head, rest


_KINDS = {"bool": bool, "int": int, "float": float, "str": str}


def _annotation(selector: type, field: dataclasses.Field):
    """``(kind, optional)`` of a field from its annotation (``typing.get_type_hints``, which reads string annotations
    under ``from __future__ import annotations``; the annotation's text where that fails): ``kind`` is bool, int,
    float or str, else ``None`` (read by the default's type)."""
    try:
        hint = typing.get_type_hints(selector).get(field.name, field.type)
    except Exception:  # a name the annotations use that the module does not define
        hint = field.type
    if isinstance(hint, str):  # the text: "int | None", "Optional[int]", "float"
        words = hint.replace("Optional[", "").replace("typing.", "").rstrip("]").split("|")
        kinds = [_KINDS.get(word.strip(), type(None) if word.strip() == "None" else object) for word in words]
        optional = "Optional[" in hint or type(None) in kinds
    else:
        kinds = list(typing.get_args(hint)) if typing.get_origin(hint) in (typing.Union, types.UnionType) else [hint]
        optional = type(None) in kinds
    kinds = [kind for kind in kinds if kind is not type(None)]
    kind = kinds[0] if len(kinds) == 1 and kinds[0] in _KINDS.values() else None
    return kind, optional


def _value(selector: type, field: dataclasses.Field, text: str):
    kind, optional = _annotation(selector, field)
    if optional and text.lower() == "none":
        return None
    default = field.default
    if kind is None and default is not dataclasses.MISSING and default is not None:
        kind = type(default)
    try:
        if kind is bool:
            if text.lower() in ("true", "false"):
                return text.lower() == "true"
        elif kind is int:
            return int(text)
        elif kind is float:
            return float(text)
        elif kind is str or kind is None:
            return text
    except ValueError:
        pass
    wanted = kind.__name__ + (" (true or false)" if kind is bool else "")
    raise SparseDecodeError(
        f"selector {selector.selector_name()}: parameter {field.name}={text!r} is not {wanted}"
        + (" (or none)" if optional else "")
    )


def parse_params(cls: type[Selector], text: str) -> dict:
    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    params = {}
    for item in text.replace(";", ",").split(",") if text else ():  # ';' where ',' separates something else
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise SparseDecodeError(f"selector {cls.selector_name()}: parameters are key=value, got {item!r}")
        if key not in fields:
            known = ", ".join(fields) or "none"
            raise SparseDecodeError(
                f"selector {cls.selector_name()} has no parameter {key!r} (its parameters: {known})"
            )
        if key in params:
            raise SparseDecodeError(f"selector {cls.selector_name()}: parameter {key!r} given twice")
        params[key] = _value(cls, fields[key], value.strip())
    return params


def build(cls: type[Selector], params: dict) -> Selector:
    try:
        return cls(**params)
    except SparseDecodeError:
        raise
    except (TypeError, ValueError) as error:
        raise SparseDecodeError(f"selector {cls.selector_name()}: {one_line(error)}") from None
    except USER_CODE_FAILURES as error:  # anything else a user's constructor raises, or its sys.exit()
        raise SparseDecodeError(f"selector {cls.selector_name()}: building it failed: {failure(error)}") from None


def parse_selector(text: str) -> Selector:
    """A selector from its spec string (see the module)."""
    if not isinstance(text, str) or not text.strip():
        raise SparseDecodeError(f"a selector is a name or path/to/file.py:ClassName, got {text!r}")
    what, params = _split(text.strip())
    if ":" in what:
        location, class_name = what.rsplit(":", 1)
        cls = load_file_class(location, class_name)
    else:
        cls = selector_class(what)
    return build(cls, parse_params(cls, params))


set_spec_parser(parse_selector)


def parameter_names(text: str) -> tuple[str, ...] | None:
    """The parameters of the selector a spec string names (its class's fields), or ``None`` when it names none."""
    try:
        what = _split(text.strip())[0]
        cls = load_file_class(*what.rsplit(":", 1)) if ":" in what else selector_class(what)
    except SparseDecodeError:
        return None
    return tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else ()


def resolve_selector(selector) -> Selector:
    """A selector instance from a spec string, a selector class (default parameters) or an instance."""
    if isinstance(selector, Selector):
        _check_own_name(check_selector_class(type(selector)))
        return selector
    if isinstance(selector, type):
        return build(_check_own_name(check_selector_class(selector)), {})
    return parse_selector(selector)


def _check_own_name(cls: type[Selector]) -> type[Selector]:
    """A user's class passed as itself may not answer with a built-in's name (registering one is refused): its rows
    would be read back as the built-in's."""
    _load_builtins()
    name = cls.selector_name()
    if not library_code(cls) and not getattr(cls, "source", None) and (name in _BUILTIN_NAMES or name in RETIRED):
        raise SparseDecodeError(
            f"selector class {cls.__module__}.{cls.__qualname__} is named {name!r}, a built-in selector's name: its "
            "rows would read as the built-in's; give it a name of its own (name = '...')"
        )
    return cls


def split_selector_list(text: str) -> list[str]:
    """Comma-separated selector specs, parameters included (see the module)."""
    items: list[str] = []
    for part in text.split(","):
        if items and "=" in part and ":" not in part:
            try:  # a selector given without parameters starts them; a malformed spec is refused when resolved
                joint = "," if _split(items[-1])[1] else ":"
            except SparseDecodeError:
                joint = ","
            items[-1] += joint + part
        else:
            items.append(part)
    return items
