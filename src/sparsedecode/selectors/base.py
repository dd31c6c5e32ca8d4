"""The selector protocol (docs/definitions.md, section 8): what a user implements to have a method judged.

A selector decides which distant positions a decode step reads. Everything else is the library's and the same for
every selector: the anchor and the window, top-``b`` blocks (or top positions) with the tie rule (higher score first,
ties to the lowest index), reuse ``R``, batches, sessions, the audit and the certificate, the kernels, lossless
drafting and every report. A selector is a frozen dataclass whose fields are its parameters::

    @dataclass(frozen=True)
    class MaxKeyBlocks(BlockSelector):
        '''Blocks by their largest logit under the group-mean query (cite the method's paper here).'''

        name = "max-key"

        def score_blocks(self, queries, keys, layout):
            # queries (query_heads, d), keys (kv_heads, N, d), both post-RoPE -> (kv_heads, layout.n_blocks)
            q = group_mean_queries(queries, keys.shape[0])
            logits = torch.einsum("hd,hnd->hn", q, keys.float())[:, 1 : layout.distant_end]
            padded = torch.nn.functional.pad(logits, (0, layout.n_blocks * layout.block_size - logits.shape[1]),
                                             value=float("-inf"))
            return padded.view(keys.shape[0], layout.n_blocks, -1).amax(dim=-1)

Capabilities some selectors need are class attributes, read by the library; it never tests a selector's name:

* ``statistics`` (block selectors): block statistics the session keeps incrementally (``"mean"``, ``"min"``,
  ``"max"``); such a selector receives a dict of ``(kv_heads, n_blocks, d)`` float32 tensors, one per statistic
  (the short last block included), instead of the keys, so a step reads ``N / B`` statistics, never ``N`` keys.
* ``uses_history`` (token selectors): receives the attention every position received from the earlier queries of
  the sequence, ``(kv_heads, N)`` (H2O's heavy hitters), instead of the keys.
* ``reads_every_key``: the selector reads every key at every selection (the oracles): a reference that bounds what
  selection could do, not a method one could deploy; the audit, ``bench op`` and the docs say so.
* ``reselects_every_step``: the choice is a function of ``N`` alone (StreamingLLM), made afresh at every step
  whatever the reuse interval.
* ``kernel_scoring``: the name of a scoring rule the fast kernels implement themselves (``"mean-dot"``:
  ``<group-mean query, block mean key> / sqrt(d)``); a subclass that overrides :meth:`BlockSelector.score_blocks`
  loses it unless it sets it again.
* adaptive budgets: a block selector that overrides :meth:`BlockSelector.budget` may read fewer than ``b`` blocks
  per KV head; rows then report the support read per step (mean, min, max).

``layout`` is the step's :class:`~sparsedecode.layout.BlockLayout`: ``n`` positions (the current token included),
the window, the blocks, and the layer index, the attention scale and the session's seed.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ..errors import SparseDecodeError

if TYPE_CHECKING:  # the protocol imports no torch, so naming a selector on the command line stays cheap
    import torch

    from ..layout import BlockLayout

STATISTICS = ("mean", "min", "max")


def library_code(obj) -> bool:
    """Whether ``obj`` (a class or a function) is this library's own code, by the module that defines it."""
    return getattr(obj, "__module__", "").startswith("sparsedecode.")


_DERIVED = (functools.cached_property, property)
_PLAIN = (bool, int, float, str, bytes, type(None))


def _identity_of(value) -> tuple:
    """A value as :meth:`Selector.identity` keys it: a plain value (or a tuple, list or dict of them) by its type and
    text, anything else by the object (held, so its id is not reused; compared by id first, never by ``==``)."""

    def plain(v) -> bool:
        if isinstance(v, (tuple, list)):
            return all(plain(x) for x in v)
        if isinstance(v, dict):
            return all(plain(x) for x in (*v, *v.values()))
        return isinstance(v, _PLAIN)

    if plain(value):
        return (type(value).__name__, repr(value))
    return ("object", _Held(value))


class _Held:
    """An object in a key: hashed by its id and equal only to itself (a tensor's ``==`` is no answer, an array has
    no hash); holding it keeps its id from being reused."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Held) and other.value is self.value


@dataclass(frozen=True)
class Selector:
    """What every selector has: a name, parameters (the dataclass fields) and capabilities (class attributes)."""

    name: ClassVar[str] = ""
    """The registered name (:func:`~sparsedecode.selectors.registry.register_selector`); the class name if empty."""
    statistics: ClassVar[tuple[str, ...]] = ()
    uses_history: ClassVar[bool] = False
    reads_every_key: ClassVar[bool] = False
    reselects_every_step: ClassVar[bool] = False
    kernel_scoring: ClassVar[str | None] = None
    level: ClassVar[str] = ""
    """``"block"`` or ``"token"``: set by :class:`BlockSelector` and :class:`TokenSelector`."""
    reads: ClassVar[str] = ""
    """What a selection reads, in words (tables print it); derived from the capabilities when empty."""
    source: ClassVar[tuple[str, str] | None] = None
    """For a class imported from a file (``path.py:Class``): the path as given and the file's sha256."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.source = None  # a subclass is not its parent's file (the file loader sets its own classes')
        overrides = "score_blocks" in cls.__dict__ or "score_positions" in cls.__dict__
        changes = overrides or "statistics" in cls.__dict__
        if changes and "kernel_scoring" not in cls.__dict__:
            cls.kernel_scoring = None  # the kernels implement the parent's scores over its statistics, not this class's
        for kind in cls.statistics:
            if kind not in STATISTICS:
                raise SparseDecodeError(f"{cls.__name__}: unknown block statistic {kind!r}; known: {STATISTICS}")

    @classmethod
    def selector_name(cls) -> str:
        """The registered name; a user's class (a subclass of a built-in too) answers with a name set on itself, else
        its class name (a subclass of ``twilight`` is not ``twilight`` in rows and errors)."""
        own = cls.name if library_code(cls) else cls.__dict__.get("name", "")
        return own or cls.__name__

    def params(self) -> dict:
        """The parameters, field by field, as given."""
        return (
            {f.name: getattr(self, f.name) for f in dataclasses.fields(self)} if dataclasses.is_dataclass(self) else {}
        )

    def identity(self) -> tuple:
        """What this selector *is*, for keying caches (compiled decoders, a custom op's configurations): its class,
        the object itself (two classes of one name in two files differ; a file edited and imported again is a new
        class), and its parameters and other attributes: plain values (numbers, strings, tuples of them) by their
        text, any other (a tensor, whose text is rounded and cut) by the object itself. Never its ``repr``, which
        reads the same for all of those."""
        derived = {n for klass in type(self).__mro__ for n, v in vars(klass).items() if isinstance(v, _DERIVED)}
        values = {**getattr(self, "__dict__", {}), **self.params()}
        return (type(self), tuple((k, *_identity_of(v)) for k, v in values.items() if k not in derived))

    def changed_params(self) -> dict:
        """The parameters that differ from their defaults (what a spec string names)."""
        changed = {}
        for f in dataclasses.fields(self) if dataclasses.is_dataclass(self) else ():
            default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
            if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                default = f.default_factory()  # type: ignore[misc]
            value = getattr(self, f.name)
            if default is dataclasses.MISSING or not _same(value, default):
                changed[f.name] = value
        return changed

    def spec(self) -> str:
        """The selector as the command line names it: ``name[:key=value,...]`` or ``path.py:Class[:key=value,...]``
        (changed parameters only, in field order); stored in every row, so two parameterisations differ."""
        base = f"{self.source[0]}:{type(self).__name__}" if self.source else self.selector_name()
        changed = self.changed_params()
        if not changed:
            return base
        return base + ":" + ",".join(f"{k}={_format(v)}" for k, v in changed.items())

    def record(self) -> dict:
        """What a result file stores of the selector: its spec, parameters and, for a file, the file's sha256."""
        params = {k: v if _identity_of(v)[0] != "object" else _format(v) for k, v in self.params().items()}
        out = {"selector": self.spec(), "selector_params": params}  # a tensor's as its text: JSON holds no tensor
        if self.source:
            out["selector_sha256"] = self.source[1]
        return out

    @property
    def token_level(self) -> bool:
        return self.level == "token"

    @property
    def per_query_head(self) -> bool:
        """Whether the selector chooses a support for every query head (scores ``(query_heads, ...)``, each query head
        attending over its own positions) rather than one per KV head that its group's query heads share (scores
        ``(kv_heads, ...)``, the default). A selector whose grouping is a parameter (``quest:grouping=...``) answers
        by its parameter; rows store it with the parameters."""
        return False

    def rows(self, query_heads: int, kv_heads: int) -> int:
        """How many supports a step of this selector has: one per query head or one per KV head."""
        return query_heads if self.per_query_head else kv_heads

    @property
    def kernel_scored(self) -> bool:
        """Whether the kernels choose its blocks themselves: their ``mean-dot`` scoring (``kernel_scoring``), a fixed
        budget and one support per KV head (an eager, planned or paged step alike; otherwise scored in torch)."""
        return self.kernel_scoring == "mean-dot" and not self.adaptive and not self.per_query_head

    @property
    def practical(self) -> bool:
        """Whether one could deploy it: every selector but those that read every key (the references)."""
        return not self.reads_every_key

    def key_fraction(self, head_dim: int) -> float:
        """The share of every cached key one selection reads (0 for selectors handed statistics or a history, or
        that read no key; 1 by default for a selector handed the keys); ``bench op`` counts bytes with it."""
        return 0.0 if self.statistics or self.uses_history else 1.0

    def cached_statistics(self) -> tuple[str, ...]:
        """The block statistics a centroid cache keeps for this selector: its own, else the centroids (``mean``,
        which the kernels score for the built-in mean-dot selection)."""
        return self.statistics or ("mean",)

    def describe_reads(self) -> str:
        if self.reads:
            return self.reads
        if self.reads_every_key:
            return "every key: an upper reference"
        if self.statistics:
            return f"{'/'.join(self.statistics)} block statistics (cached) + the tail block's keys"
        if self.uses_history:
            return "its history, N floats (attention received)"
        return "the keys it is handed"


def _same(value, default) -> bool:
    """Whether a parameter holds its default: of its type and equal to it; a tensor or an array (whose ``==`` compares
    element by element) of its shape and dtype, every element equal."""
    if type(value) is not type(default):
        return False
    try:
        return bool(value == default)
    except Exception:  # noqa: BLE001 - no single truth: element by element, or not known to be the default
        pass
    try:
        alike = value.shape == default.shape and value.dtype == default.dtype
        return bool(alike and (value == default).all())
    except Exception:  # noqa: BLE001
        return value is default


def _format(value) -> str:
    """A parameter as a spec writes it, so that the spec reads back: a float subclass (NumPy's ``float64``, whose
    ``repr`` is ``np.float64(0.5)``) as the float it is; a value no spec can give (a tensor) on one line, as error
    messages name the selector by its spec."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(float(value))
    return value if isinstance(value, str) else " ".join(str(value).split())


@dataclass(frozen=True)
class BlockSelector(Selector):
    """Keeps the anchor, the window and ``b`` whole distant blocks of ``B`` positions, ``b = (S - 1 - W) // B``."""

    level: ClassVar[str] = "block"

    def score_blocks(self, queries: torch.Tensor, keys, layout: BlockLayout) -> torch.Tensor:
        """Scores of the distant blocks, higher = keep: ``(kv_heads, layout.n_blocks)``, finite.

        ``queries`` ``(query_heads, d)``: the current token's post-RoPE queries; query heads
        ``h * G .. (h + 1) * G - 1`` share KV head ``h``. ``keys`` ``(kv_heads, N, d)``: the post-RoPE cache, the
        current token's key included; or, with ``statistics``, a dict of block statistics (see the module). Block
        ``j`` covers positions ``[1 + j * B, min(1 + (j + 1) * B, layout.distant_end))``.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement score_blocks(queries, keys, layout)")

    def budget(self, scores: torch.Tensor, layout: BlockLayout) -> torch.Tensor | None:
        """How many of the top-scored blocks each KV head keeps, ``(kv_heads,)`` integers (the library caps them at
        ``b``), or ``None`` for the fixed budget ``b``. Adaptive selectors override this."""
        return None

    @property
    def adaptive(self) -> bool:
        return type(self).budget is not BlockSelector.budget


@dataclass(frozen=True)
class TokenSelector(Selector):
    """Keeps ``S`` positions: the anchor, the window and the ``S - 1 - W`` best distant positions (fewer with an
    adaptive :meth:`budget`)."""

    level: ClassVar[str] = "token"

    def score_positions(self, queries: torch.Tensor, keys, layout: BlockLayout) -> torch.Tensor:
        """Scores of every position, higher = keep: ``(kv_heads, N)``, finite; only the distant ones
        ``[1, layout.distant_end)`` are ranked. ``keys`` as for :meth:`BlockSelector.score_blocks`, or with
        ``uses_history`` the accumulated attention ``(kv_heads, N)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement score_positions(queries, keys, layout)")

    def budget(self, scores: torch.Tensor, layout: BlockLayout) -> torch.Tensor | None:
        """How many of the top-scored distant positions each row keeps, ``(rows,)`` integers (the library caps them at
        ``S - 1 - W``), or ``None`` for exactly ``S - 1 - W``. Adaptive selectors (Twilight) override this."""
        return None

    @property
    def adaptive(self) -> bool:
        return type(self).budget is not TokenSelector.budget


_SPEC_PARSER = None


def set_spec_parser(parser) -> None:
    """Take the function that makes a selector from its spec string: the registry hands over its ``parse_selector``
    when it is imported (a built-in that names another selector by its spec, Twilight's ``base``, reaches the
    registry through here: the registry imports the built-ins, so they cannot import it)."""
    global _SPEC_PARSER
    _SPEC_PARSER = parser


def parse_spec(text: str):
    """A selector from its spec string (:func:`sparsedecode.selectors.registry.parse_selector`); ``None`` where the
    registry has not been imported yet."""
    return None if _SPEC_PARSER is None else _SPEC_PARSER(text)


def check_selector_class(cls: object) -> type[Selector]:
    """``cls`` if it is a usable selector class, else a :class:`SparseDecodeError` saying why."""
    if not isinstance(cls, type) or not issubclass(cls, (BlockSelector, TokenSelector)):
        raise SparseDecodeError(
            f"{getattr(cls, '__name__', cls)!r} is not a selector class: subclass sparsedecode.BlockSelector "
            "(score_blocks) or sparsedecode.TokenSelector (score_positions)"
        )
    method = "score_blocks" if issubclass(cls, BlockSelector) else "score_positions"
    if getattr(cls, method) is getattr(BlockSelector if method == "score_blocks" else TokenSelector, method):
        raise SparseDecodeError(f"selector class {cls.__name__} does not implement {method}(queries, keys, layout)")
    if cls.uses_history and issubclass(cls, BlockSelector):
        raise SparseDecodeError(f"selector class {cls.__name__}: uses_history is for token selectors")
    if cls.statistics and issubclass(cls, TokenSelector):
        raise SparseDecodeError(f"selector class {cls.__name__}: statistics are for block selectors")
    if cls.kernel_scoring is not None and (cls.kernel_scoring != "mean-dot" or "mean" not in cls.statistics):
        raise SparseDecodeError(
            f"selector class {cls.__name__}: kernel_scoring {cls.kernel_scoring!r} is not a rule the kernels know "
            "over its statistics (only 'mean-dot', over statistics holding 'mean'); leave it None to be scored by "
            "its own score_blocks"
        )
    return cls
