"""What a calibration measures a configuration on, and one trial as a unit of work another process can run.

:class:`Units` are the prepared units (corpus prompts with their dense references, task samples with their dense
prefills and answers); :func:`measure` runs a configuration over them. :class:`UnitsSpec` says which units a side of
the calibration holds (the calibration prompts, or the held-out ones) and builds them in any process that has the
model; :class:`TrialUnit` is one trial's measurement as a unit of :mod:`.work` (what ``--backend ray`` runs on its
workers), which builds its side's units once per process and keeps them for the next trials.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import SparseConfig
from ..protocol.paired import compare, dense_reference
from .calibration_targets import CORPUS, TASKS, Target, dense_value, hopeless, interval_row, parse_target
from .calibration_tasks import TaskSet, measure_tasks, prepare_tasks, task_samples


@dataclass
class Units:
    """What a configuration is measured on: corpus ``prompts`` with their dense ``references`` (``tokens`` decoded
    per prompt), and ``tasks`` (task samples with their dense answers; ``None`` when no target reads them)."""

    prompts: list = field(default_factory=list)
    references: list = field(default_factory=list)
    tokens: int = 64
    tasks: TaskSet | None = None
    tokenizer: object = None


def measure(model, units: Units, cfg: SparseConfig, targets: list[Target] = (), *, prune: bool = False) -> dict:
    """Every unit under ``cfg``: ``{"corpus": rows, "tasks": rows}`` (one row per prompt or sample). With ``prune``,
    raises ``optuna.TrialPruned`` as soon as a target can no longer hold (:func:`.calibration_targets.hopeless`)."""
    rows: dict[str, list[dict]] = {CORPUS: [], TASKS: []}

    def check(kind: str, pending: list[dict], dense: float | None = None):
        def after_unit(done: list[dict]) -> None:
            if prune and hopeless([t for t in targets if t.kind == kind], done, pending[len(done) :], dense):
                import optuna

                raise optuna.TrialPruned()

        return after_unit

    on_prompt = check(CORPUS, [{}] * len(units.prompts))
    for ids, reference in zip(units.prompts, units.references):
        result = compare(model, None, ids, cfg, units.tokens, reference=reference)
        rows[CORPUS].append({"teacher_forced_match": result.teacher_forced_match,
                             "delta_ppl_percent": result.delta_ppl_percent,
                             "first_divergence": result.first_divergence,
                             "support_read_mean": result.support_read_mean})  # fmt: skip
        on_prompt(rows[CORPUS])
    if units.tasks is not None:
        dense = dense_value("task-accuracy", [{"dense_score": d["score"]} for d in units.tasks.dense])
        on_sample = check(TASKS, units.tasks.dense, dense)
        rows[TASKS] = measure_tasks(model, units.tokenizer, units.tasks, cfg, on_sample=on_sample)
    return rows


@dataclass(frozen=True)
class UnitsSpec:
    """The units of one side: corpus prompts ``first .. first+count-1`` of ``corpus`` at ``context`` tokens (when
    ``prompts``, i.e. a target reads the corpus), or the prompts ``indices`` where given (a split drawn at random),
    and samples ``first .. first+count-1`` of each of ``tasks``."""

    corpus: str
    context: int
    first: int
    count: int
    tokens: int
    prompts: bool = True
    tasks: tuple[str, ...] = ()
    answer_tokens: int | None = None
    need_end: bool = False
    indices: tuple[int, ...] | None = None

    def samples(self, tokenizer) -> list:
        """The task samples of this side (none without tasks), built without the model: the command builds both
        sides' before a search, so a sample no haystack size fits is refused before trials are spent, not at the
        held-out check after them."""
        span = range(self.first, self.first + self.count)
        return task_samples(tokenizer, self.tasks, self.context, span, corpus=self.corpus,
                            max_new_tokens=self.answer_tokens) if self.tasks else []  # fmt: skip

    def build(self, model, tokenizer, *, progress=None, side: str = "") -> Units:
        """The units, each dense reference and dense answer computed here; ``progress(what, done, total)``."""
        from .corpus import prompt_ids

        units = Units(tokens=self.tokens, tokenizer=tokenizer)
        span = range(self.first, self.first + self.count)
        if self.prompts:
            chosen = span if self.indices is None else self.indices
            units.prompts = [prompt_ids(tokenizer, self.corpus, self.context, i, self.tokens) for i in chosen]
            for index, ids in enumerate(units.prompts):
                units.references.append(dense_reference(model, ids, tokens=self.tokens))
                if progress is not None:
                    progress(f"dense references{side}", index + 1, len(chosen))
        if self.tasks:
            samples = self.samples(tokenizer)
            shown = None if progress is None else (lambda done, total: progress(f"dense answers{side}", done, total))
            units.tasks = prepare_tasks(model, tokenizer, samples, need_end=self.need_end, progress=shown)
        return units


_BUILT: dict[UnitsSpec, Units] = {}
"""The units a worker process built, by spec: one trial after another measures the same ones."""


@dataclass(frozen=True, eq=False)
class TrialUnit:
    """One trial's measurement, run where the model is (``run(model, tokenizer)``): the configuration over the
    units of ``spec``, stopped early when a target of ``targets`` can no longer hold. Its one row is ``{"number":
    the trial's number, "pruned": bool, "rows": measure's rows, or None when pruned}``."""

    number: int
    config: SparseConfig
    targets: tuple[str, ...]
    spec: UnitsSpec

    def __str__(self) -> str:
        return f"trial {self.number}"

    def run(self, model, tokenizer, *, progress=None, on_row=None) -> list[dict]:
        import optuna

        units = _BUILT.get(self.spec)
        if units is None:
            units = _BUILT[self.spec] = self.spec.build(model, tokenizer)
        try:
            rows = measure(model, units, self.config, [parse_target(t) for t in self.targets], prune=True)
            row = {"number": self.number, "pruned": False, "rows": rows}
        except optuna.TrialPruned:
            row = {"number": self.number, "pruned": True, "rows": None}
        if on_row is not None:
            on_row(row)
        return [row]


def held_out(model, units: Units, configs: dict, targets: list[Target], search, progress=None) -> list[dict]:
    """Each named configuration on the held-out units: every measure with its 95% bootstrap interval
    (:func:`.calibration_targets.interval_row`), its cost (``search.cost``, :class:`~.calibrate.Search`), its R, and
    whether each target holds by the mean (``targets_met``) and, for a search judged at the bound, at the safe end of
    the interval too (``targets_met_at_bound``, the search's own standard); ``prompts`` and ``samples`` count the
    units. ``progress(stage, done, total)`` hears each configuration begin and end."""
    rows = []
    for done, (name, cfg) in enumerate(configs.items()):
        if progress is not None:
            progress("held out, configurations", done, len(configs), name)
        measured = measure(model, units, cfg)
        row = {"configuration": name, "cost": search.cost(cfg, measured), "reuse": cfg.reuse,
               "selector": cfg.selector.spec(), "prompts": len(units.prompts)}  # fmt: skip
        if units.tasks is not None:
            row["samples"] = len(units.tasks)
        rows.append(row | interval_row(targets, measured, bound=search.feasible == "bound"))
    if progress is not None:
        progress("held out, configurations", len(configs), len(configs))
    return rows
