"""Calibration: the cheapest per-layer supports that meet a quality target on calibration prompts, then the same
configuration re-measured on held-out prompts the search never saw, beside every uniform support.

The search is Optuna's TPE sampler with constraints (Optuna is imported when a search runs; ``pip install optuna``):
the first trials are the uniform supports, then each trial picks one support per layer among ``choices``, decodes
the calibration prompts against their dense references (the paired protocol,
:func:`sparsedecode.protocol.paired.compare`) and is *feasible* when every target
holds on the mean over those prompts. Its cost is the positions a decode step reads per layer at the prompts'
context, the mean over the layers (:func:`cost`; the anchor and the window included). A trial that can no longer
reach a ``tf-match`` target whatever its remaining prompts give is pruned (stopped early, infeasible). The study
lives in an SQLite file, so a search that was stopped resumes where it was and can be read while it runs. A search
killed mid-trial resumes to the same trials as one never stopped: the trial it left running is failed and proposed
again, and each proposal depends only on the finished trials and the seed (:data:`SAMPLER`).

Targets (:func:`parse_target`): ``tf-match>=X`` (mean teacher-forced match, percent) and ``dppl<=X`` (mean change
of teacher-forced perplexity, percent); several combine, all must hold. The held-out check reports each target's
mean with a 95% bootstrap interval over the held-out prompts (:func:`held_out`): few prompts give wide intervals,
and the report says how many there were.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from ..config import SparseConfig
from ..errors import SparseDecodeError
from ..protocol.paired import compare

MEASURES = {"tf-match": ("teacher_forced_match", ">="), "dppl": ("delta_ppl_percent", "<=")}
"""Each target's name, the row field it reads and the direction it must hold in."""


@dataclass(frozen=True)
class Target:
    """``measure op value``: the mean over prompts of ``measure`` must satisfy the comparison."""

    measure: str
    value: float

    @property
    def field(self) -> str:
        return MEASURES[self.measure][0]

    @property
    def op(self) -> str:
        return MEASURES[self.measure][1]

    def slack(self, mean: float) -> float:
        """How far ``mean`` lies inside the target (>= 0 when it holds, negative when it does not)."""
        return mean - self.value if self.op == ">=" else self.value - mean

    def __str__(self) -> str:
        return f"{self.measure}{self.op}{self.value:g}"


def parse_target(text: str) -> Target:
    """A target from ``tf-match>=99`` or ``dppl<=1``."""
    for name, (_, op) in MEASURES.items():
        head, found, tail = text.replace(" ", "").partition(op)
        if found and head == name:
            try:
                value = float(tail)
            except ValueError:
                break
            if math.isfinite(value):
                return Target(name, value)
            break
    known = ", ".join(f"{name}{op}X" for name, (_, op) in MEASURES.items())
    raise SparseDecodeError(f"a target is one of {known} (X a number), got {text!r}")


def layer_config(base: SparseConfig, supports: list[int]) -> SparseConfig:
    """``base`` with layer ``i`` reading ``supports[i]`` (named in ``layer_supports`` for every layer)."""
    return dataclasses.replace(base, layer_supports=tuple(enumerate(supports)))


def cost(cfg: SparseConfig, layers: int, context: int) -> float:
    """Positions a decode step at ``context`` reads per layer, the mean over ``layers`` layers: each layer's
    effective support, or the whole context where that is smaller (a support past it reads everything)."""
    return statistics.mean(min(cfg.for_layer(layer).effective_support, context) for layer in range(layers))


def measure(model, prompts: list, references: list, cfg: SparseConfig, tokens: int, *, on_prompt=None) -> list[dict]:
    """The paired protocol on every prompt: one ``{field: value}`` per prompt (the target fields, first divergence).
    ``on_prompt(rows so far)`` is called after each prompt and may raise to stop."""
    rows = []
    for ids, reference in zip(prompts, references):
        result = compare(model, None, ids, cfg, tokens, reference=reference)
        rows.append({field: getattr(result, field) for field, _ in MEASURES.values()})
        rows[-1]["first_divergence"] = result.first_divergence
        if on_prompt is not None:
            on_prompt(rows)
    return rows


def means(rows: list[dict]) -> dict:
    return {name: statistics.mean(row[field] for row in rows) for name, (field, _) in MEASURES.items()}


def hopeless(targets: list[Target], rows: list[dict], total: int) -> bool:
    """Whether a ``tf-match`` target can no longer hold on the mean over ``total`` prompts, the rest at 100%."""
    for target in targets:
        if target.measure == "tf-match":
            best = (sum(row[target.field] for row in rows) + 100.0 * (total - len(rows))) / total
            if best < target.value:
                return True
    return False


def bootstrap_interval(values: list[float], *, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 95% percentile bootstrap interval of the mean of ``values`` (resampling prompts)."""
    if len(values) == 1:
        return values[0], values[0]
    generator = random.Random(seed)
    draws = sorted(statistics.mean(generator.choices(values, k=len(values))) for _ in range(resamples))
    return draws[int(0.025 * resamples)], draws[int(0.975 * resamples) - 1]


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
    sampler: str = SAMPLER

    def record(self) -> dict:
        return {**dataclasses.asdict(self), "choices": list(self.choices), "targets": list(self.targets)}


def open_study(path: Path, search: Search):
    """The search's Optuna study in ``path`` (SQLite), created or resumed; a study of other settings is refused."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name="calibrate", storage=f"sqlite:///{path}", direction="minimize", load_if_exists=True
    )
    stored, wanted = study.user_attrs.get("search"), search.record()
    if stored is None:
        study.set_user_attr("search", wanted)
    elif stored != wanted:
        differ = [k for k in {**stored, **wanted} if stored.get(k) != wanted.get(k)]
        raise SparseDecodeError(
            f"{path} holds a search of other settings ({', '.join(differ)} differ): use another --out, or the same "
            "settings to resume it"
        )
    return study


def sampler_seed(seed: int, finished_trials: int) -> int:
    """The sampler's seed for the trial proposed after ``finished_trials`` finished ones: a resumed study draws what
    an uninterrupted one drew at the same point."""
    digest = hashlib.sha256(f"calibrate/{seed}/{finished_trials}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def finished(study) -> list:
    """The study's trials that ended (complete or pruned), in order."""
    import optuna

    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    return [t for t in study.trials if t.state in states]


def abandon_unfinished(study) -> list[int]:
    """Mark failed the trials a killed search left running or waiting (one process searches a study at a time: the
    command holds its folder's lock), so they are not resumed half-measured; returns their numbers. The search then
    proposes the next trial from the finished ones alone, as an uninterrupted search did."""
    import optuna

    state = optuna.trial.TrialState
    running = [t.number for t in study.trials if t.state == state.RUNNING]
    for number in running:
        study.tell(number, state=state.FAIL)
    waiting = []
    while any(t.state == state.WAITING for t in study.get_trials(deepcopy=False)):
        trial = study.ask()  # takes the first waiting trial
        waiting.append(trial.number)
        study.tell(trial, state=state.FAIL)
    return running + waiting


def best_feasible(study):
    """The cheapest complete trial whose every target held (the first of equal cost), or ``None``."""
    import optuna

    feasible = [
        t
        for t in study.trials
        if t.state == optuna.trial.TrialState.COMPLETE and all(c <= 0 for c in t.user_attrs.get("constraints", [1]))
    ]
    return min(feasible, key=lambda t: (t.value, t.number)) if feasible else None


def run_trial(trial, model, prompts, references, base: SparseConfig, search: Search, targets: list[Target]) -> float:
    """One trial: a support per layer, the calibration prompts measured; its cost, or ``optuna.TrialPruned`` once
    a ``tf-match`` target is out of reach. The targets are the trial's constraints (<= 0 where one holds)."""
    import optuna

    supports = [trial.suggest_categorical(f"layer_{i}", list(search.choices)) for i in range(search.layers)]
    cfg = layer_config(base, supports)

    def check(rows):
        if hopeless(targets, rows, len(prompts)):
            for target in targets:  # infeasible
                trial.set_constraint(str(target), 1.0)
            raise optuna.TrialPruned()

    rows = measure(model, prompts, references, cfg, search.tokens, on_prompt=check)
    summary = means(rows)
    trial.set_user_attr("means", summary)
    constraints = [-target.slack(summary[target.measure]) for target in targets]
    for target, value in zip(targets, constraints):
        trial.set_constraint(str(target), value)
    trial.set_user_attr("constraints", constraints)
    return cost(cfg, search.layers, search.context)


def run_search(model, prompts, references, base: SparseConfig, search: Search, study, trials: int, *, progress=None):
    """Run the study until it holds ``trials`` finished trials (those a stopped search finished count; those it
    left unfinished are failed and proposed again, see :data:`SAMPLER`). Returns the best feasible trial or None."""
    import optuna

    targets = [parse_target(text) for text in search.targets]
    abandon_unfinished(study)
    uniform = sorted(search.choices)
    while (done := len(finished(study))) < trials:
        study.sampler = optuna.samplers.TPESampler(seed=sampler_seed(search.seed, done), n_startup_trials=8)
        if done < len(uniform):  # the uniform supports first: known points the sampler learns from
            study.enqueue_trial({f"layer_{i}": uniform[done] for i in range(search.layers)})
        trial = study.ask()
        try:
            value = run_trial(trial, model, prompts, references, base, search, targets)
        except optuna.TrialPruned:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        except BaseException:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            raise
        else:
            study.tell(trial, value)
        if progress is not None:
            best = best_feasible(study)
            progress(done + 1, trials, None if best is None else best.value)
    return best_feasible(study)


def held_out(model, prompts, references, configs: dict, targets: list[Target], tokens: int, layers: int) -> list:
    """Each named configuration on the held-out prompts: every measure's mean and 95% bootstrap interval, its
    cost (:func:`cost` at the prompts' context) and whether each target holds on the mean."""
    context = int(prompts[0].shape[1])
    rows = []
    for name, cfg in configs.items():
        measured = measure(model, prompts, references, cfg, tokens)
        row = {"configuration": name, "cost": cost(cfg, layers, context), "prompts": len(prompts)}
        for measure_name, (field, _) in MEASURES.items():
            values = [r[field] for r in measured]
            low, high = bootstrap_interval(values)
            row[measure_name] = {"mean": statistics.mean(values), "low": low, "high": high}
        row["targets_met"] = {str(t): t.slack(row[t.measure]["mean"]) >= 0 for t in targets}
        rows.append(row)
    return rows
