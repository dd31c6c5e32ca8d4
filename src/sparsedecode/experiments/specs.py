"""The settings that define an experiment's results, with their checks: no torch, so the command line can refuse
bad arguments before importing it (an answer in well under a second).

:class:`SweepSpec` (the survival sweep, :mod:`.sweep`) and :class:`RetrievalSpec` (the passkey probe,
:mod:`.retrieval`); both modules re-export them. :class:`Spec` is their shared base, and that of
:class:`~.eval_spec.EvalSpec` (a module of its own: its row keys carry the same names as a sweep's).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, fields
from pathlib import Path

from ..config import SparseConfig, parse_layer_supports, parse_layers
from ..errors import SparseDecodeError
from ..selectors.registry import provided
from .corpus import DEFAULT_CORPUS, GAP

KEY_FIELDS = ("context", "prompt_index", "support", "reuse", "selector")
"""The fields of a row that identify its run; a sweep never holds two rows with the same key."""

GRID_FIELDS = ("contexts", "prompts", "supports", "reuse", "selectors")
"""The :class:`SweepSpec` fields that span the grid of runs: a resume or a merge may add to these, nothing else."""

_STORED = contextvars.ContextVar("sparsedecode_stored_spec", default=False)
"""Set while :meth:`Spec.from_dict` builds a spec a results folder stored: its selectors are taken as stored."""

RunKey = tuple[int, int, int, int, str]
Group = tuple[int, int]
"""``(context, prompt_index)``: the runs that share one dense reference."""


class Spec:
    """What every spec dataclass shares: its JSON form and back, what differs between two of them, and the rules by
    which a results folder grows (:meth:`extension_of`, :meth:`union`). ``WHAT`` names the spec in messages;
    ``GRID`` names the fields that span its grid of runs (lists of values, or the counts in ``COUNTS``, such as a
    number of prompts), which a resume or a merge may add to, and ``GRID_WORDS`` says what adding to them means."""

    WHAT = "spec"
    GRID = ()
    COUNTS = ()
    GRID_WORDS = ""

    def to_dict(self) -> dict:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict):
        """Inverse of :meth:`to_dict`; fields missing from older files take their defaults, unknown ones are refused.

        A spec read back is what a folder stored: its selectors are taken as their stored spec strings and never
        imported (a selector file may have moved or be gone, and a relative path would name another file from
        another directory: the rows hold everything a report prints); every other setting is checked."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if "dense_layers" in names and "dense_layers" not in data:  # written before issue #39: selectors renamed
            data = upgraded_selectors(data)
        if unknown:
            raise SparseDecodeError(f"{cls.WHAT} has unknown fields {', '.join(unknown)}: written by a newer version?")
        token = _STORED.set(True)
        try:
            return cls(**data)
        finally:
            _STORED.reset(token)

    def sources(self) -> dict:
        """Selector files' contents this spec reads under the names a folder stored (:func:`adopt_stored`)."""
        return getattr(self, "_sources", {})

    def check_settings(self) -> None:
        """Every setting checked as decoding would (:meth:`configs`); a stored spec's without importing its
        selectors (see :meth:`from_dict`): supports, window, block size and reuse with the default selector."""
        if not _STORED.get():
            self.configs()
            return
        for support in self.supports:
            for reuse in self.reuse if isinstance(self.reuse, tuple) else (self.reuse,):
                SparseConfig(support=support, window=self.window, block_size=self.block_size, reuse=reuse)

    def differences(self, other) -> list[str]:
        """``"name: mine vs other"`` for every field that differs."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [f"{name}: {mine[name]!r} vs {theirs[name]!r}" for name in mine if mine[name] != theirs[name]]

    def differences_outside_grid(self, other) -> list[str]:
        """:meth:`differences` in the fields outside ``GRID``: those no resume or merge may change."""
        return [d for d in self.differences(other) if d.split(":")[0] not in self.GRID]

    def extension_of(self, stored) -> list[str] | None:
        """What this spec adds to ``stored``'s grid, one ``"name: stored -> mine"`` per grown field (empty when
        equal); ``None`` when it is no extension: a field outside ``GRID`` differs, or a stored grid value is missing
        or out of its stored order (a smaller count, a dropped context, reordered selectors)."""
        mine, theirs = self.to_dict(), stored.to_dict()
        grown = []
        for name in mine:
            if mine[name] == theirs[name]:
                continue
            if name not in self.GRID:
                return None
            if name in self.COUNTS and mine[name] < theirs[name]:
                return None
            if name not in self.COUNTS and [v for v in mine[name] if v in theirs[name]] != theirs[name]:
                return None
            grown.append(f"{name}: {theirs[name]!r} -> {mine[name]!r}")
        return grown

    @classmethod
    def union(cls, specs: list):
        """The smallest spec whose grid holds every spec's grid: values in first-seen order, the largest counts.

        Raises :class:`SparseDecodeError` when the specs differ outside ``GRID``.
        """
        first = specs[0]
        merged = first.to_dict()
        for spec in specs[1:]:
            outside = first.differences_outside_grid(spec)
            if outside:
                raise SparseDecodeError(f"settings outside the grid differ ({'; '.join(outside)})")
            theirs = spec.to_dict()
            for name in cls.GRID:
                if name in cls.COUNTS:
                    merged[name] = max(merged[name], theirs[name])
                else:
                    merged[name] = merged[name] + [v for v in theirs[name] if v not in merged[name]]
        return cls.from_dict(merged)


def upgraded_selectors(data: dict) -> dict:
    """A spec written before issue #39 (no ``dense_layers`` field: every spec written since stores one) with its
    selectors named as today (:func:`~sparsedecode.protocol.results.upgrade_selector`): its ``quest`` and ``sparq``
    ran the group-mean variants, its ``top-p`` is ``block-top-p``."""
    data = dict(data)
    if isinstance(data.get("selectors"), (list, tuple)):
        data["selectors"] = [_upgraded(name) for name in data["selectors"]]
    if isinstance(data.get("selector"), str):
        data["selector"] = _upgraded(data["selector"])
    return data


def _upgraded(name):
    from ..protocol.results import upgrade_selector  # results imports torch: command-line errors come before it

    return upgrade_selector({"selector": name})["selector"] if isinstance(name, str) else name


def canonical_selectors(specs) -> tuple[str, ...]:
    """Each selector spec string as :meth:`~sparsedecode.selectors.Selector.spec` writes it (``block-top-p:p=0.90``
    and ``block-top-p:p=0.9`` are one selector), so folders, resumes and merges compare like with like; a stored
    spec's as stored (:meth:`Spec.from_dict`)."""
    from ..selectors import resolve_selector

    if _STORED.get():
        return tuple(specs)
    return tuple(resolve_selector(spec).spec() for spec in specs)


def selector_files(specs) -> dict[str, str]:
    """``{spec: sha256}`` of the selectors among ``specs`` that come from a file (``path.py:Class``)."""
    from ..selectors import resolve_selector

    found = {}
    for spec in specs:
        selector = resolve_selector(spec)
        if selector.source is not None:
            found[spec] = selector.source[1]
    return found


def _adopt_corpus(spec: Spec, stored) -> Spec:
    mine = getattr(spec, "corpus", None)
    if not isinstance(stored, str) or not isinstance(mine, str) or stored == mine:
        return spec
    try:
        if not Path(stored).expanduser().samefile(Path(mine).expanduser()):
            return spec
    except OSError:  # either is no file: not the same
        return spec
    adopted = type(spec).from_dict({**spec.to_dict(), "corpus": stored})
    object.__setattr__(adopted, "_sources", spec.sources())
    return adopted


def adopt_stored(spec: Spec, meta: dict | None, directory) -> Spec:
    """``spec`` with each file selector that a folder (its description ``meta``) holds under another spelling named
    as the folder names it: the same class and parameters from the file at the same absolute path (a resume from
    another directory, ``../x/sel.py`` for ``sel.py``), or from a file of the same content. Its runs then continue
    the stored ones (the same keys); the spec carries the file's content for the stored name (:meth:`Spec.sources`),
    so nothing else in the process reads that name otherwise. A file at the stored path whose content changed is
    refused (:func:`check_selector_files`). A corpus file the folder names by another path to the same file
    (``./corp.txt`` for ``corp.txt``) is named as the folder names it too (its text is compared by hash besides)."""
    from ..selectors import resolve_selector
    from ..selectors.registry import file_cut, read_source

    spec = _adopt_corpus(spec, ((meta or {}).get("spec") or {}).get("corpus"))
    stored_files, stored_paths = (meta or {}).get("selector_files") or {}, (meta or {}).get("selector_paths") or {}
    if not isinstance(stored_files, dict) or not isinstance(stored_paths, dict):
        return spec
    renamed, sources = {}, {}
    for wanted in spec.selectors:
        source = resolve_selector(wanted).source if wanted not in stored_files else None
        for held, digest in stored_files.items() if source is not None else ():
            cut, mine = file_cut(held), file_cut(wanted)
            if cut is None or held[cut:] != wanted[mine:]:
                continue  # another class or other parameters
            if stored_paths.get(held) == str(Path(source[0]).expanduser().resolve()) or digest == source[1]:
                check_selector_files(directory, {held: digest}, {held: source[1]})
                renamed[wanted], sources[held[:cut]] = held, read_source(source[0])  # the stored name, this file
                break
    if not renamed:
        return spec
    adopted = type(spec).from_dict({**spec.to_dict(), "selectors": [renamed.get(n, n) for n in spec.selectors]})
    object.__setattr__(adopted, "_sources", {**spec.sources(), **sources})
    return adopted


def record_selector_files(directory, meta: dict, spec: Spec) -> None:
    """The rule of every folder that takes runs (sweep, evaluation): refuse runs of a selector file that changed since
    the folder's runs of it (:func:`check_selector_files`), and record in ``meta`` each file's sha256
    (``selector_files``) and where it is (``selector_paths``, kept as first recorded)."""
    found = {cfg.selector_name: cfg.selector.source for cfg in spec.configs() if cfg.selector.source is not None}
    files = {name: source[1] for name, source in found.items()}
    check_selector_files(directory, meta.get("selector_files"), files)
    if files:
        paths = {name: Path(source[0]).expanduser() for name, source in found.items()}
        meta["selector_files"] = {**meta.get("selector_files", {}), **files}
        here = {name: str(path.resolve()) for name, path in paths.items() if path.is_file()}
        meta["selector_paths"] = {**here, **meta.get("selector_paths", {})}


def check_selector_files(directory, stored: dict | None, now: dict) -> None:
    """Refuse to add to ``directory`` runs of a selector file that changed since its stored runs."""
    for spec, digest in now.items():
        before = (stored or {}).get(spec)
        if before is not None and before != digest:
            raise SparseDecodeError(
                f"{directory} holds runs of selector {spec} from a file whose sha256 was {before[:12]}..., and the "
                f"file now has {digest[:12]}...: restore the file, give the changed one another name, or use another "
                "--out"
            )


@dataclass(frozen=True)
class SweepSpec(Spec):
    """Everything that defines a sweep's results (and nothing that does not, such as the output folder).

    ``prompts`` counts prompts per context (prompt indices ``0 .. prompts - 1``, non-overlapping corpus
    prefixes spaced ``context + tokens + gap`` tokens apart). ``reuse`` is a list of selection intervals R,
    ``selectors`` a list of selector names (every selector runs against the same dense references).
    """

    WHAT = "sweep spec"
    GRID = GRID_FIELDS
    COUNTS = ("prompts",)
    GRID_WORDS = "more contexts, prompts, supports, reuse values or selectors"

    model: str
    dtype: str = "float32"
    corpus: str = DEFAULT_CORPUS
    contexts: tuple[int, ...] = (2048,)
    supports: tuple[int, ...] = (97, 193, 385, 769)
    reuse: tuple[int, ...] = (1,)
    selectors: tuple[str, ...] = ("mean-pooled",)
    prompts: int = 5
    tokens: int = 128
    window: int = 64
    block_size: int = 16
    audit: bool = False
    gap: int = GAP
    dense_layers: tuple[int, ...] = ()
    layer_supports: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_layers", parse_layers(self.dense_layers))
        object.__setattr__(self, "layer_supports", parse_layer_supports(self.layer_supports))
        for name in ("contexts", "supports", "reuse"):
            values = tuple(getattr(self, name))
            object.__setattr__(self, name, values)
            if not values or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                raise SparseDecodeError(f"{name} must be a non-empty list of integers, got {values!r}")
            if len(set(values)) != len(values):
                raise SparseDecodeError(f"{name} lists a value twice: {', '.join(map(str, values))}")
        selectors = (self.selectors,) if isinstance(self.selectors, str) else tuple(self.selectors)
        if not selectors or not all(isinstance(s, str) for s in selectors):
            raise SparseDecodeError(f"selectors must be a non-empty list of selector names, got {selectors!r}")
        selectors = canonical_selectors(selectors)
        object.__setattr__(self, "selectors", selectors)
        if len(set(selectors)) != len(selectors):
            raise SparseDecodeError(f"selectors lists a selector twice: {', '.join(selectors)}")
        if any(c < 1 for c in self.contexts):
            raise SparseDecodeError("contexts must be >= 1")
        if not isinstance(self.prompts, int) or self.prompts < 1:
            raise SparseDecodeError(f"prompts must be an integer >= 1, got {self.prompts!r}")
        if not isinstance(self.tokens, int) or self.tokens < 2:
            raise SparseDecodeError(f"tokens must be an integer >= 2 (got {self.tokens!r}): step 1 is shared")
        if not isinstance(self.gap, int) or self.gap < 0:
            raise SparseDecodeError(f"gap must be an integer >= 0, got {self.gap!r}")
        self.check_settings()  # supports, window, block size, reuse and (unless stored) selectors

    def configs(self) -> list[SparseConfig]:
        """One :class:`SparseConfig` per (selector, support, reuse): selectors outer, then supports."""
        with provided(self.sources()):
            return self._configs()

    def _configs(self) -> list[SparseConfig]:
        return [
            SparseConfig(
                support=s,
                window=self.window,
                block_size=self.block_size,
                reuse=r,
                selector=selector,
                audit=self.audit,
                dense_layers=self.dense_layers,
                layer_supports=self.layer_supports,
            )
            for selector in self.selectors
            for s in self.supports
            for r in self.reuse
        ]

    def groups(self) -> list[Group]:
        """All (context, prompt) groups in run order: prompts outer, so a partial sweep covers every context."""
        return [(c, p) for p in range(self.prompts) for c in self.contexts]

    def group_keys(self, group: Group) -> list[RunKey]:
        """The group's runs in :meth:`configs` order (selectors outer, then supports, then reuse), each keyed by its
        selector's canonical spec string (no selector imported: a stored spec's keys need none)."""
        context, prompt = group
        return [(context, prompt, s, r, sel) for sel in self.selectors for s in self.supports for r in self.reuse]

    def keys(self) -> list[RunKey]:
        """Every run of the sweep, in the order an unsharded sweep runs them."""
        return [key for group in self.groups() for key in self.group_keys(group)]

    @classmethod
    def from_dict(cls, data: dict) -> SweepSpec:
        """As :meth:`Spec.from_dict`; files written before several selectors per sweep hold one ``selector``: read as
        ``selectors = [it]``."""
        data = dict(data)
        if "selector" in data:
            if "selectors" in data:
                raise SparseDecodeError("sweep spec has both 'selector' and 'selectors'; keep one")
            data["selectors"] = [data.pop("selector")]
        return super().from_dict(data)


@dataclass(frozen=True)
class RetrievalSpec(Spec):
    """Everything that defines the probe's results. ``haystack`` is ``filler`` or a corpus name or path."""

    WHAT = "retrieval spec"

    model: str
    dtype: str = "float32"
    contexts: tuple[int, ...] = (2048,)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    trials: int = 3
    supports: tuple[int, ...] = (97, 193)
    window: int = 64
    block_size: int = 16
    reuse: int = 1
    selector: str = "mean-pooled"
    haystack: str = "filler"
    digits: int = 5
    answer_tokens: int = 8
    seed: int = 0
    dense_layers: tuple[int, ...] = ()
    layer_supports: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_layers", parse_layers(self.dense_layers))
        object.__setattr__(self, "layer_supports", parse_layer_supports(self.layer_supports))
        if not isinstance(self.selector, str):
            raise SparseDecodeError(f"selector must be a selector name, got {self.selector!r}")
        object.__setattr__(self, "selector", canonical_selectors((self.selector,))[0])
        for name in ("contexts", "depths", "supports"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
            if not getattr(self, name):
                raise SparseDecodeError(f"{name} must not be empty")
        if any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise SparseDecodeError(f"depths must lie in [0, 1], got {list(self.depths)}")
        for name in ("trials", "digits", "answer_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise SparseDecodeError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        self.check_settings()

    def configs(self) -> list[SparseConfig]:
        return [
            SparseConfig(
                support=s,
                window=self.window,
                block_size=self.block_size,
                reuse=self.reuse,
                selector=self.selector,
                dense_layers=self.dense_layers,
                layer_supports=self.layer_supports,
            )
            for s in self.supports
        ]
