"""Calibration: the cheapest per-layer supports that meet quality targets on calibration units, then the same
configuration re-measured on held-out units the search never saw, beside every uniform support.

The search is Optuna's TPE sampler with constraints (Optuna is imported when a search runs; ``pip install optuna``):
the first trials are the uniform supports, then each trial picks one support per layer among ``choices``, measures
the calibration units (:class:`Units`: corpus prompts decoded against their dense references by the paired
protocol, :func:`sparsedecode.protocol.paired.compare`, and RULER-style task samples answered from their dense
prefill, :mod:`.calibration_tasks`; each only where a target reads it) and is *feasible* when every target holds on
them. Its cost is the positions a decode step reads per layer at the prompts' context, the mean over the layers
(:func:`cost`; the anchor and the window included). A trial that can no longer meet a target whatever its remaining
units give is pruned (stopped early, infeasible). The study lives in an SQLite file, so a search that was stopped
resumes where it was and can be read while it runs. A search killed mid-trial resumes to the same trials as one
never stopped: the trial it left running is failed and proposed again, and each proposal depends only on the
finished trials and the seed (:data:`SAMPLER`).

Targets (:mod:`.calibration_targets`): ``tf-match>=X``, ``dppl<=X``, ``task-accuracy>=X`` or ``>=dense-X``,
``length-ratio<=X``; several combine, all must hold. The held-out check reports every measure with a 95% bootstrap
interval over the held-out units (:func:`held_out`): few units give wide intervals, and the report says how many
there were.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..config import SparseConfig
from ..errors import SparseDecodeError, one_line
from .calibration_study import (
    abandon_unfinished,
    best_feasible,
    finished,
    repeat_of,
    sampler_seed,
    tell,
    tell_repeat,
    unfinished_round,
)
from .calibration_targets import (
    CORPUS,
    Target,
    bootstrap_interval,
    constraints,
    hopeless,
    interval_row,
    judged_at_bound,
    parse_target,
    summary,
)
from .calibration_units import TrialUnit, Units, UnitsSpec, held_out, measure

__all__ = [  # with the target names tests and the command import from here
    "SAMPLER",
    "Search",
    "Target",
    "TrialUnit",
    "Units",
    "UnitsSpec",
    "bootstrap_interval",
    "check_param_search",
    "check_costable",
    "check_reuse_search",
    "cost",
    "drawn_prompts",
    "finished",
    "held_out",
    "hopeless",
    "layer_config",
    "measure",
    "open_study",
    "parse_target",
    "reads_vary",
    "run_search",
    "selection_cost",
    "with_params",
]


def layer_config(base: SparseConfig, supports: list[int]) -> SparseConfig:
    """``base`` with layer ``i`` reading ``supports[i]`` (named in ``layer_supports`` for every layer)."""
    return dataclasses.replace(base, layer_supports=tuple(enumerate(supports)))


def cost(cfg: SparseConfig, layers: int, context: int, *, selection: bool = False,
         sparse_read: float | None = None) -> float:  # fmt: skip
    """Positions a decode step at ``context`` reads per layer, the mean over ``layers`` layers: each layer's
    effective support (or ``sparse_read``, what a sparse layer was measured to read: :func:`measured_cost`), or the
    whole context where that is smaller (a support past it, or a dense layer, reads everything). With ``selection``,
    plus what selecting reads per step (:func:`selection_cost`), for searches over the reuse R."""
    sizes = [context if s is None else min(s, context) for s in cfg.supports_by_layer(layers)]
    reads = [size if size >= context else (size if sparse_read is None else sparse_read)
             + (selection_cost(cfg.for_layer(layer), context) if selection else 0.0)
             for layer, size in enumerate(sizes)]  # fmt: skip
    return statistics.mean(reads)


def selection_cost(cfg: SparseConfig, context: int) -> float:
    """What one sparse step at ``context`` reads to select, in positions (a position is a key and a value, two
    vectors): the block statistics of every complete distant block (one vector per statistic and block), at one
    step in ``R``; 0 where the support covers the context (no selection). For selectors that keep block statistics
    (:attr:`~sparsedecode.selectors.base.Selector.statistics`), as :func:`check_reuse_search` requires."""
    if cfg.effective_support >= context:
        return 0.0
    blocks = (context - 1 - cfg.window) // cfg.block_size
    return blocks * len(cfg.selector.cached_statistics()) / 2 / cfg.reuse


def check_reuse_search(base: SparseConfig, reuses: tuple[int, ...]) -> None:
    """Refuse a reuse search the cost cannot weigh: a selector without block statistics, or a bad list of R."""
    if not base.selector.statistics or base.selector.reselects_every_step:
        raise SparseDecodeError(
            f"--search-reuse weighs the block statistics a selection reads, and {base.selector_name} keeps none: "
            "search the supports alone"
        )
    if len(set(reuses)) != len(reuses) or any(r < 1 for r in reuses):
        raise SparseDecodeError(f"--search-reuse takes distinct intervals R >= 1, got {list(reuses)}")


def with_params(selector, changes: dict):
    """``selector`` (an instance) with the parameters ``changes`` set, the others as they were."""
    from ..selectors.registry import build

    return build(type(selector), {**selector.params(), **changes}) if changes else selector


def check_param_search(base: SparseConfig, params: dict, targets: list[Target]) -> dict:
    """``params`` (``{name: [value text, ...]}``, from ``--search-param NAME=V1,V2``) as typed values of the base
    selector's parameters, each value checked by building the selector with it; one line naming what is wrong
    otherwise. An adaptive selector's reads are measured on the corpus prompts, so it needs a corpus target."""
    from ..selectors.registry import parse_params

    typed = {}
    for name, texts in params.items():
        values = [parse_params(type(base.selector), f"{name}={text}")[name] for text in texts]
        if len(values) < 2 or len(set(map(repr, values))) != len(values):
            raise SparseDecodeError(f"--search-param {name} needs two or more distinct values, got {texts}")
        for value in values:  # each value builds (the selector checks it), and is costed as it reads
            check_costable(dataclasses.replace(base, selector=with_params(base.selector, {name: value})), targets)
        typed[name] = tuple(values)
    check_costable(base, targets)
    return typed


def reads_vary(cfg: SparseConfig) -> bool:
    """Whether a step of ``cfg``'s selector can read other than its support: an adaptive budget reads less, a
    support per query head reads the union of its query heads' positions per KV head."""
    return cfg.selector.adaptive or cfg.selector.per_query_head


def check_costable(base: SparseConfig, targets: list[Target]) -> None:
    """Refuse a search whose cost cannot be known: a selector whose reads vary (:func:`reads_vary`) is costed by
    what it read on the corpus prompts, so it needs a corpus target."""
    if reads_vary(base) and not any(t.kind == CORPUS for t in targets):
        what = "chooses how much it reads" if base.selector.adaptive else "reads a support per query head"
        raise SparseDecodeError(
            f"{base.selector_name} {what}, which calibrate measures on the corpus prompts: add a tf-match or dppl "
            "target"
        )


SAMPLER = "tpe-reseeded/1"
"""How trials are proposed, stored with the search (a study proposed another way is not resumed): trial ``k`` (the
``k``-th to finish, from 0) is uniform support ``sorted(choices)[k]`` while ``k < len(choices)``, then Optuna's TPE
with constraints seeded by :func:`sampler_seed` ``(seed, k)``, so it depends on the finished trials alone."""


@dataclass
class Search:
    """A search's settings, as its study stores them (a resume must match them)."""

    model: str
    selector: str
    context: int
    tokens: int
    prompts: int
    choices: tuple[int, ...]
    targets: tuple[str, ...]
    layers: int
    seed: int = 0
    tasks: tuple[str, ...] = ()
    answer_tokens: int | None = None
    reuses: tuple[int, ...] = ()  # reuse intervals R a trial picks among (none: the base's R alone)
    params: dict = field(default_factory=dict)  # selector parameter -> the values a trial picks among
    batch: int = 1  # trials proposed per round (Ray's workers); another batch proposes other trials
    feasible: str = "mean"  # a trial meets a target by its mean over the units, or by its interval's bound
    groups: int = 0  # 0: a support per layer; G: G runs of consecutive layers, one support each
    split: str = "order"  # corpus prompts: the first ones for the calibration ("order"), or drawn at random ("random")
    sampler: str = SAMPLER
    corpus: str = "python-docs"  # the corpus as given (--corpus): another draws other prompts
    dtype: str = "float32"  # the model's dtype (--dtype)
    generator: int | None = None  # with task targets, the task generators' version (ruler.GENERATOR_VERSION)

    def record(self) -> dict:
        data = dataclasses.asdict(self)
        lists = {name: list(data[name]) for name in ("choices", "targets", "tasks", "reuses")}
        return {**data, **lists, "params": {name: list(values) for name, values in self.params.items()}}

    def names(self) -> list[str]:
        """The support parameters: ``layer_i`` for each layer, or ``group_k`` for each of :attr:`groups` runs of
        consecutive layers (layer ``i`` in group ``i * groups // layers``)."""
        return [f"group_{k}" for k in range(self.groups)] if self.groups else [f"layer_{i}" for i in range(self.layers)]

    def supports(self, params: dict) -> list[int | None]:
        """The support of every layer in a trial's parameters (``None`` where a parameter is missing)."""
        if self.groups:
            return [params.get(f"group_{i * self.groups // self.layers}") for i in range(self.layers)]
        return [params.get(f"layer_{i}") for i in range(self.layers)]

    def config(self, base: SparseConfig, params: dict) -> SparseConfig:
        """A trial's configuration from its parameters (:meth:`names`, ``reuse`` when the search picks R,
        ``param_NAME`` for each searched selector parameter)."""
        cfg = layer_config(base, self.supports(params))
        if self.params:
            changes = {name: params[f"param_{name}"] for name in self.params}
            cfg = dataclasses.replace(cfg, selector=with_params(cfg.selector, changes))
        return dataclasses.replace(cfg, reuse=params["reuse"]) if self.reuses else cfg

    def cost(self, cfg: SparseConfig, rows: dict | None = None) -> float:
        """:func:`cost` of ``cfg``; for a selector whose reads vary (:func:`reads_vary`), what it read on the
        corpus prompts of ``rows`` (:func:`measured_cost`)."""
        if reads_vary(cfg) and rows is not None:
            return measured_cost(cfg, self.layers, self.context, rows[CORPUS], selection=bool(self.reuses))
        return cost(cfg, self.layers, self.context, selection=bool(self.reuses))


def measured_cost(cfg: SparseConfig, layers: int, context: int, corpus: list[dict], *, selection: bool) -> float:
    """:func:`cost` with what the sparse layers read measured (an adaptive budget reads at most its support, a
    support per query head the union of the group's positions per KV head): the
    mean over the prompts of ``support_read_mean`` (positions a KV head read per sparse step) for every layer that
    decodes sparse, the context for one that reads it all. Every sparse layer is sparse at the same steps with the
    same heads, so that mean is the mean over those layers, and the mean over all layers is exact."""
    read = [row["support_read_mean"] for row in corpus if row.get("support_read_mean") is not None]
    return cost(cfg, layers, context, selection=selection, sparse_read=statistics.mean(read) if read else None)


def drawn_prompts(available: int, seed: int) -> list[int]:
    """The corpus's ``available`` prompt indices in the order a random split takes them, shuffled by ``seed`` alone:
    the calibration prompts are the first ``prompts`` of them, the held-out ones follow. Consecutive prompts are
    consecutive stretches of one text (a corpus sorted by topic holds its topics in runs), so the first prompts are
    no random sample of it; drawn ones are, and a held-out check then tests prompts drawn like the calibration's."""
    order = list(range(available))
    random.Random(f"calibrate/split/{seed}").shuffle(order)
    return order


def open_study(path: Path, search: Search):
    """The search's Optuna study in ``path`` (SQLite), created or resumed; a study of other settings is refused."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.create_study(
            study_name="calibrate", storage=f"sqlite:///{path}", direction="minimize", load_if_exists=True
        )
        stored, wanted = study.user_attrs.get("search"), search.record()
    except Exception as error:  # not SQLite, or SQLite that is no Optuna storage
        said = one_line(error)[:160]
        raise SparseDecodeError(
            f"{path} is not a calibration study ({type(error).__name__}: {said}); use another --out"
        ) from None
    if stored is None:
        study.set_user_attr("search", wanted)
        stored = wanted
    # a setting added after the study was made had its default; task samples, the generators' version 1
    stored = {**_added_later(), "generator": 1 if stored.get("tasks") else None, **stored}
    if stored != wanted:
        differ = [k for k in {**stored, **wanted} if stored.get(k) != wanted.get(k)]
        raise SparseDecodeError(
            f"{path} holds a search of other settings ({', '.join(differ)} differ): use another --out, or the same "
            "settings to resume it"
        )
    return study


def _added_later() -> dict:
    """The settings a study made before they existed had, in :meth:`Search.record`'s form: their defaults."""
    given = {name: "" for name in ("model", "selector", "context", "tokens", "prompts", "choices", "targets", "layers")}
    later = ("feasible", "groups", "split", "corpus", "dtype")
    return {name: value for name, value in Search(**given).record().items() if name in later}


def suggest(trial, search: Search) -> dict:
    """A trial's parameters: a support per layer or group (:meth:`Search.names`), ``reuse`` when the search picks R,
    ``param_NAME`` for each searched selector parameter."""
    params = {name: trial.suggest_categorical(name, list(search.choices)) for name in search.names()}
    if search.reuses:
        params["reuse"] = trial.suggest_categorical("reuse", list(search.reuses))
    for name, values in search.params.items():
        params[f"param_{name}"] = trial.suggest_categorical(f"param_{name}", list(values))
    return params


def propose(study, search: Search, done: int, count: int) -> list:
    """Ask the study for ``count`` trials after ``done`` finished ones: trial ``done + k`` is the next uniform support
    while some are left, else TPE's proposal seeded by :func:`sampler_seed` ``(seed, done + k)``; the ones asked
    before it in this round are running (TPE's constant liar counts them), so a round is proposed the same way
    whenever it is proposed after the same finished trials. Returns ``(trial, params)`` pairs."""
    import optuna

    uniform, asked = sorted(search.choices), []
    for number in range(done, done + count):
        study.sampler = optuna.samplers.TPESampler(seed=sampler_seed(search.seed, number), n_startup_trials=8)
        if number < len(uniform):  # the uniform supports first: known points the sampler learns from
            fixed = dict.fromkeys(search.names(), uniform[number])
            study.enqueue_trial(fixed | ({"reuse": min(search.reuses)} if search.reuses else {}))
        asked.append(_asked(study, search, done))
    return asked


def _asked(study, search: Search, round_: int) -> tuple:
    """The next trial asked of the study (an enqueued one first), marked with its round (the finished trials before
    it), and its parameters."""
    trial = study.ask()
    trial.set_user_attr("round", round_)
    return trial, suggest(trial, search)


def finish_round(study, search: Search, round_: int, leftover: list[dict]) -> list:
    """The trials of a round a stopped search left partly told (:func:`.calibration_study.unfinished_round`), asked
    again with the parameters they were proposed with, as :func:`propose` returns them."""
    asked = []
    for params in leftover:
        study.enqueue_trial(params)
        asked.append(_asked(study, search, round_))
    return asked


def conclude(study, trial, search: Search, cfg: SparseConfig, targets: list[Target], rows: dict | None) -> None:
    """Tell the study how a trial ended (:func:`.calibration_study.tell`): stopped early (``rows`` None), or complete
    with its means (and bounds, judged at the bound), its constraints and its cost as the value."""
    if rows is None:
        tell(study, trial, targets, None)
        return
    values = summary(targets, rows)
    attrs = {"means": values}
    if search.feasible == "bound":
        values = judged_at_bound(targets, interval_row(targets, rows), values)
        attrs["bounds"] = {t.measure: values[t.measure] for t in targets}
    tell(study, trial, targets, constraints(targets, values), search.cost(cfg, rows), attrs)


def _measured(model, units: Units, cfg: SparseConfig, targets: list[Target]) -> dict | None:
    """:func:`measure`'s rows, or ``None`` for a trial stopped early."""
    import optuna

    try:
        return measure(model, units, cfg, targets, prune=True)
    except optuna.TrialPruned:
        return None


def run_search(model, units: Units, base: SparseConfig, search: Search, study, trials: int, *, progress=None,
               execute=None, spec: UnitsSpec | None = None):  # fmt: skip
    """Run the study until it holds ``trials`` finished trials (those a stopped search finished count; those it
    left unfinished are failed and proposed again, see :data:`SAMPLER`). Returns the best feasible trial or None.

    Trials are proposed in rounds of ``search.batch`` (:func:`propose`) and told in the order proposed. Here, one
    after another on ``units``; with ``execute`` (an :class:`~.work.Executor`: Ray's workers), a round's trials at
    once, as :class:`TrialUnit` s over the units of ``spec``, which each worker builds once. A round stopped midway
    leaves its trials unfinished, so it is proposed again whole on resume."""
    import optuna

    targets = [parse_target(text) for text in search.targets]
    round_, leftover = unfinished_round(study)  # a round stopped while its trials were told: the rest as proposed
    abandon_unfinished(study)
    while (done := len(finished(study))) < trials:
        count = min(search.batch, trials - done)
        asked = (
            finish_round(study, search, round_, leftover[:count]) if leftover else propose(study, search, done, count)
        )
        leftover = []
        repeats = [repeat_of(study, params) for _, params in asked]  # TPE proposes measured configurations again
        configs = [search.config(base, params) for _, params in asked]
        new = [(trial, cfg) for (trial, _), cfg, earlier in zip(asked, configs, repeats) if earlier is None]
        try:
            got = {}
            if execute is None:
                got = {trial.number: _measured(model, units, cfg, targets) for trial, cfg in new}
            elif new:
                work = [TrialUnit(trial.number, cfg, search.targets, spec) for trial, cfg in new]
                got = {row["number"]: row["rows"] for _, rows in execute.run(work, len(work)) for row in rows}
        except BaseException:
            for trial, _ in asked:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            raise
        for (trial, _), cfg, earlier in zip(asked, configs, repeats):  # told in the order proposed
            if earlier is None:
                conclude(study, trial, search, cfg, targets, got[trial.number])
            else:
                tell_repeat(study, trial, earlier, targets)
        if progress is not None:
            best = best_feasible(study)
            progress(len(finished(study)), trials, None if best is None else best.value)
    return best_feasible(study)
