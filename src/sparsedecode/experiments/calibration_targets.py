"""What a calibration target reads and how it holds: the measures, their parsing, their value over a set of rows
(one row per prompt or task sample) and the best value a trial can still reach, and bootstrap intervals.

Measures (:data:`MEASURES`), each over one kind of unit:

* ``tf-match`` (corpus prompts): the mean teacher-forced match, percent; ``dppl`` (corpus prompts): the mean change
  of teacher-forced perplexity, percent (the paired protocol, docs/definitions.md, section 3).
* ``task-accuracy`` (task samples): the mean RULER score of the answers, percent (the RULER-style tasks of
  ``eval``, :mod:`.ruler`); a target may name it against dense on the same samples, ``task-accuracy>=dense-2``.
* ``length-ratio`` (task samples): the answers' generated tokens under sparse decoding over dense's on the same
  samples (the ratio of the sums; an answer ends at an end token or at its budget), as ``eval``'s report shows it.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import SparseDecodeError

CORPUS, TASKS = "corpus", "tasks"
"""The two kinds of unit a measure reads: corpus prompts (the paired protocol) and task samples (RULER answers)."""


def _mean_of(field: str, scale: float = 1.0) -> Callable[[list[dict]], float]:
    return lambda rows: scale * statistics.mean(row[field] for row in rows)


def _length_ratio(rows: list[dict]) -> float:
    dense = sum(row["dense_tokens"] for row in rows)
    sparse = sum(row["output_tokens"] for row in rows)
    return sparse / dense if dense else (1.0 if sparse == 0 else math.inf)


@dataclass(frozen=True)
class Measure:
    """One measure: the unit it reads, the direction a target holds in, its value over rows (``statistic``) and,
    where one exists, the best value rows reach once the ``pending`` units (their dense rows) are measured at best."""

    kind: str
    op: str
    statistic: Callable[[list[dict]], float]
    best: Callable[[list[dict], list[dict]], float] | None = None
    dense_field: str | None = None  # the rows' dense value, for a target against dense


MEASURES = {
    "tf-match": Measure(
        CORPUS, ">=", _mean_of("teacher_forced_match"),
        lambda rows, pending: statistics.mean([*(r["teacher_forced_match"] for r in rows), *([100.0] * len(pending))]),
    ),
    "dppl": Measure(CORPUS, "<=", _mean_of("delta_ppl_percent")),
    "task-accuracy": Measure(
        TASKS, ">=", _mean_of("score", 100.0),
        lambda rows, pending: 100.0 * statistics.mean([*(r["score"] for r in rows), *([1.0] * len(pending))]),
        dense_field="dense_score",
    ),
    "length-ratio": Measure(
        TASKS, "<=", _length_ratio,
        lambda rows, pending: _length_ratio([*rows, *({"output_tokens": 0, "dense_tokens": p["output_tokens"]}
                                                      for p in pending)]),
    ),
}  # fmt: skip
"""Every measure a target may name."""


def dense_value(measure: str, rows: list[dict]) -> float | None:
    """The measure under dense decoding on the same units (``None`` where it is not defined)."""
    field = MEASURES[measure].dense_field
    return None if field is None else 100.0 * statistics.mean(row[field] for row in rows)


@dataclass(frozen=True)
class Target:
    """``measure op value``, or with ``relative`` ``measure op dense+value``: the measure over the units must satisfy
    the comparison (against the dense value of the same units when relative)."""

    measure: str
    value: float
    relative: bool = False

    @property
    def op(self) -> str:
        return MEASURES[self.measure].op

    @property
    def kind(self) -> str:
        return MEASURES[self.measure].kind

    def threshold(self, dense: float | None = None) -> float:
        return self.value + dense if self.relative else self.value

    def slack(self, value: float, dense: float | None = None) -> float:
        """How far ``value`` lies inside the target (>= 0 when it holds, negative when it does not); ``dense`` the
        dense value of the same units, for a relative target."""
        limit = self.threshold(dense)
        return value - limit if self.op == ">=" else limit - value

    def __str__(self) -> str:
        if self.relative:
            shift = ("+" if self.value > 0 else "") + _exact(self.value) if self.value else ""
            return f"{self.measure}{self.op}dense{shift}"
        return f"{self.measure}{self.op}{_exact(self.value)}"


def _exact(value: float) -> str:
    """``value`` as written back exactly (the stored settings are parsed again: ``:g`` rounded 90.47619 to 90.4762 and
    chose another configuration), whole numbers without ``.0``."""
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


PERCENTS = ("tf-match", "task-accuracy")
"""The measures that are percentages of 0 to 100 (a target outside can never, or always, hold)."""
FLOORS = {
    "dppl": (-100.0, False, "a change of perplexity in percent, above -100 (a perplexity stays above 0)"),
    "length-ratio": (0.0, True, "a ratio of token counts, at least 0"),
}
"""The measures read against an upper limit that cannot go below a floor (and whether the floor itself can be
reached): a limit under it can never hold."""


def _forms() -> str:
    """The targets' written forms, for an error message."""
    forms = []
    for name, m in MEASURES.items():
        forms += [f"{name}{m.op}X"] + ([f"{name}{m.op}dense-X"] if m.dense_field else [])
    return ", ".join(forms)


def parse_target(text: str) -> Target:
    """A target from ``tf-match>=99``, ``dppl<=1``, ``task-accuracy>=dense-2`` (or ``>=90``), ``length-ratio<=1.05``."""
    compact = text.replace(" ", "")
    for name, measure in MEASURES.items():
        head, found, tail = compact.partition(measure.op)
        if not found or head != name:
            continue
        relative = measure.dense_field is not None and tail.startswith("dense")
        number = (tail[len("dense") :] or "+0") if relative else tail
        if relative and number[:1] not in ("+", "-"):
            break
        try:
            value = float(number)
        except ValueError:
            break
        if not math.isfinite(value):
            break
        if name in PERCENTS and not relative and not 0 <= value <= 100:
            raise SparseDecodeError(f"target {text!r}: {name} is a percentage, between 0 and 100")
        floor, reached, what = FLOORS.get(name, (None, True, ""))
        if floor is not None and not relative and (value < floor or (value == floor and not reached)):
            raise SparseDecodeError(f"target {text!r} can never hold: {name} is {what}")
        return Target(name, value, relative)
    raise SparseDecodeError(f"a target is one of {_forms()} (X a number), got {text!r}")


def summary(targets: list[Target], rows: dict[str, list[dict]]) -> dict:
    """Every measure the rows hold, ``{name: value}``, with ``dense <name>`` for those a target reads against dense."""
    values = {name: m.statistic(rows[m.kind]) for name, m in MEASURES.items() if rows.get(m.kind)}
    for target in targets:
        if target.relative:
            values[f"dense {target.measure}"] = dense_value(target.measure, rows[target.kind])
    return values


def constraints(targets: list[Target], values: dict) -> list[float]:
    """Optuna's constraints of a summary (:func:`summary`): <= 0 where a target holds."""
    return [-t.slack(values[t.measure], values.get(f"dense {t.measure}")) for t in targets]


def hopeless(targets: list[Target], rows: list[dict], pending: list[dict], dense: float | None = None) -> bool:
    """Whether a target on the units of ``rows`` and ``pending`` (the dense rows of those not measured yet) can no
    longer hold, whatever the pending units give; ``dense`` is the dense value over all of them, for a relative
    target. Targets without a bound (``dppl``) never make a trial hopeless."""
    for target in targets:
        best = MEASURES[target.measure].best
        if best is not None and target.slack(best(rows, pending), dense) < 0:
            return True
    return False


def bootstrap_interval(
    values: list, *, statistic: Callable[[list], float] = statistics.mean, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """The 95% percentile bootstrap interval of ``statistic`` over ``values`` (resampling the units)."""
    if len(values) == 1:
        return statistic(values), statistic(values)
    generator = random.Random(seed)
    draws = sorted(statistic(generator.choices(values, k=len(values))) for _ in range(resamples))
    return draws[int(0.025 * resamples)], draws[int(0.975 * resamples) - 1]


def interval_row(targets: list[Target], rows: dict[str, list[dict]], *, bound: bool = False) -> dict:
    """Every measure the rows hold as ``{mean, low, high}`` (the value over all units and its 95% bootstrap
    interval; for ``length-ratio`` the ratio of sums), the dense values relative targets need, for each of those
    the interval of the paired difference from dense (``"<measure> - dense"``: resampling units, each with its dense
    value), and whether each target holds (``targets_met``; with ``bound``, also at the interval's safe end:
    ``targets_met_at_bound``)."""
    out: dict = {}
    for name, m in MEASURES.items():
        if rows.get(m.kind):
            low, high = bootstrap_interval(rows[m.kind], statistic=m.statistic)
            out[name] = {"mean": m.statistic(rows[m.kind]), "low": low, "high": high}
    for name in dict.fromkeys(t.measure for t in targets if t.relative and rows.get(t.kind)):

        def difference(units: list[dict], name: str = name) -> float:
            return MEASURES[name].statistic(units) - dense_value(name, units)

        low, high = bootstrap_interval(rows[MEASURES[name].kind], statistic=difference)
        out[f"{name} - dense"] = {"mean": difference(rows[MEASURES[name].kind]), "low": low, "high": high}
    values = summary(targets, rows)
    for key, value in values.items():
        if key.startswith("dense "):
            out[key] = value
    out["targets_met"] = {str(t): held <= 0 for t, held in zip(targets, constraints(targets, values))}
    if bound:
        at_bound = constraints(targets, judged_at_bound(targets, out, values))
        out["targets_met_at_bound"] = {str(t): held <= 0 for t, held in zip(targets, at_bound)}
    return out


def judged_at_bound(targets: list[Target], interval: dict, values: dict) -> dict:
    """``values`` with each target's measure at the safe end of its 95% bootstrap interval in ``interval`` (an
    :func:`interval_row`; the low end for a ``>=`` target, the high end for ``<=``): what ``feasible="bound"`` judges
    a trial by, so that a trial whose few units happened to favour it is not chosen for its mean. A target against
    dense is judged at the safe end of the paired difference from dense (dense's value plus that end), as it reads:
    the units that favour dense favour the configuration as much, so one answering as dense on every unit meets
    ``>=dense`` at the bound (found by probing: its own low end against dense's mean refused it)."""
    safe = {t.measure: "low" if t.op == ">=" else "high" for t in targets}
    return values | {
        t.measure: values[f"dense {t.measure}"] + interval[f"{t.measure} - dense"][safe[t.measure]]
        if t.relative
        else interval[t.measure][safe[t.measure]]
        for t in targets
    }
