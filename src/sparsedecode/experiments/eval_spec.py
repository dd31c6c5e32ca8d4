"""What defines an evaluation's results (:class:`EvalSpec`), with its checks: no torch, so ``sparsedecode eval``
refuses bad arguments before importing it. :mod:`.evaluate` runs it and re-exports these names."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import SparseConfig, parse_layer_supports, parse_layers
from ..errors import SparseDecodeError
from ..selectors.registry import provided
from .corpus import DEFAULT_CORPUS
from .ruler import TEMPLATES
from .ruler_tasks import TASK_NAMES, TASKS, check_tasks
from .specs import Spec

DENSE = "dense"
KEY_FIELDS = ("task", "context", "sample", "selector", "support")
"""The fields of a row that identify its run; dense rows have selector ``"dense"`` and support ``None``."""

GRID_FIELDS = ("tasks", "contexts", "samples", "selectors", "supports")
"""The :class:`EvalSpec` fields that span the grid of runs: a resume or a merge may add to these, nothing else (as
a sweep's :data:`.specs.GRID_FIELDS`)."""

RunKey = tuple[str, int, int, str, "int | None"]
Group = tuple[str, int, int]
"""``(task, context, sample)``: the runs that share one sample and one dense prefill."""


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class EvalSpec(Spec):
    """Everything that defines an evaluation's results. ``answer_tokens`` caps every task's answer (``None``: each
    task's own budget, see :data:`.ruler.TASKS`); ``template`` is ``auto``, ``chat`` or ``plain``."""

    WHAT = "eval spec"
    GRID = GRID_FIELDS
    COUNTS = ("samples",)
    GRID_WORDS = "more tasks, contexts, samples, selectors or supports"

    model: str
    dtype: str = "float32"
    tasks: tuple[str, ...] = TASK_NAMES
    contexts: tuple[int, ...] = (4096,)
    samples: int = 5
    selectors: tuple[str, ...] = ("mean-pooled",)
    supports: tuple[int, ...] = (193,)
    window: int = 64
    block_size: int = 16
    reuse: int = 1
    corpus: str = DEFAULT_CORPUS
    template: str = "auto"
    seed: int = 0
    answer_tokens: int | None = None
    dense_layers: tuple[int, ...] = ()
    layer_supports: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_layers", parse_layers(self.dense_layers))
        object.__setattr__(self, "layer_supports", parse_layer_supports(self.layer_supports))
        # a spec read back from eval.json may hold any JSON value: every field's kind is checked before its use
        for name in ("model", "dtype", "corpus", "template"):
            if not isinstance(getattr(self, name), str):
                raise SparseDecodeError(f"{name} must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise SparseDecodeError(f"seed must be an integer, got {self.seed!r}")
        for name in ("tasks", "selectors"):
            value = getattr(self, name)
            if not isinstance(value, str) and not (
                isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
            ):
                raise SparseDecodeError(f"{name} must be a list of names, got {value!r}")
        object.__setattr__(self, "tasks", check_tasks(self.tasks))
        for name in ("contexts", "supports"):
            values = getattr(self, name)
            values = tuple(values) if isinstance(values, (list, tuple)) else values
            object.__setattr__(self, name, values)
            if not isinstance(values, tuple) or not values or not all(_positive_int(v) for v in values):
                raise SparseDecodeError(f"{name} must be a non-empty list of positive integers, got {values!r}")
            if len(set(values)) != len(values):
                raise SparseDecodeError(f"{name} lists a value twice: {', '.join(map(str, values))}")
        selectors = (self.selectors,) if isinstance(self.selectors, str) else tuple(self.selectors)
        if DENSE not in selectors:
            from .specs import canonical_selectors

            selectors = canonical_selectors(selectors)
        object.__setattr__(self, "selectors", selectors)
        if not selectors or len(set(selectors)) != len(selectors) or DENSE in selectors:
            raise SparseDecodeError(f"selectors must be distinct selector names (dense always runs), got {selectors!r}")
        if not isinstance(self.samples, int) or self.samples < 1:
            raise SparseDecodeError(f"samples must be an integer >= 1, got {self.samples!r}")
        if self.template not in TEMPLATES:
            raise SparseDecodeError(f"unknown template {self.template!r}; choose one of: {', '.join(TEMPLATES)}")
        if self.answer_tokens is not None and (not isinstance(self.answer_tokens, int) or self.answer_tokens < 1):
            raise SparseDecodeError(f"answer_tokens must be an integer >= 1, got {self.answer_tokens!r}")
        self.check_settings()  # the selectors imported unless stored (Spec.from_dict)

    def configs(self) -> list[SparseConfig]:
        """One :class:`SparseConfig` per (selector, support): selectors outer."""
        with provided(self.sources()):  # a stored name's file, where a resume adopted one (.specs.adopt_stored)
            return [
                SparseConfig(
                    support=s,
                    window=self.window,
                    block_size=self.block_size,
                    reuse=self.reuse,
                    selector=sel,
                    dense_layers=self.dense_layers,
                    layer_supports=self.layer_supports,
                )
                for sel in self.selectors
                for s in self.supports
            ]

    def answer_budget(self, task: str) -> int:
        return self.answer_tokens if self.answer_tokens is not None else TASKS[task].max_new_tokens

    def groups(self) -> list[Group]:
        """Every sample in run order: samples outer, so a partial run covers every task and context."""
        return [(t, c, s) for s in range(self.samples) for c in self.contexts for t in self.tasks]

    def group_keys(self, group: Group) -> list[RunKey]:
        return [(*group, DENSE, None), *((*group, sel, s) for sel in self.selectors for s in self.supports)]

    def keys(self) -> list[RunKey]:
        return [key for group in self.groups() for key in self.group_keys(group)]
