"""A calibration's Optuna study as :mod:`.calibrate` drives it: the sampler's seed per trial, the trials that
finished, those a stopped search left unfinished, the cheapest feasible one, how a trial's end is told to the study,
and a proposal repeating a measured configuration (told what that one measured). Optuna is imported inside each
function."""

from __future__ import annotations

import hashlib

from .calibration_targets import Target


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


def unfinished_round(study) -> tuple[int | None, list[dict]]:
    """The round a stopped search left partly told (``round`` attribute, see :func:`.calibrate.propose`): its number
    and the parameters of its trials left running, in the order asked; ``(None, [])`` when no round was (a round
    stopped before any of its trials was told is proposed again whole). Read before :func:`abandon_unfinished`: its
    trials must be measured as proposed, since proposing them again after their round-mates finished would draw
    others than the uninterrupted search did (found by probing: a stop while a round was being told)."""
    import optuna

    running = [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING and "round" in t.user_attrs]
    told = {t.user_attrs.get("round") for t in finished(study)}
    rounds = sorted({t.user_attrs["round"] for t in running} & told)
    if not rounds:
        return None, []
    return rounds[0], [t.params for t in running if t.user_attrs["round"] == rounds[0]]


def best_feasible(study):
    """The cheapest complete trial whose every target held (the first of equal cost), or ``None``."""
    import optuna

    feasible = [
        t
        for t in study.trials
        if t.state == optuna.trial.TrialState.COMPLETE and all(c <= 0 for c in t.user_attrs.get("constraints", [1]))
    ]
    return min(feasible, key=lambda t: (t.value, t.number)) if feasible else None


def repeat_of(study, params: dict):
    """The first finished trial of exactly these parameters, or ``None``."""
    return next((t for t in finished(study) if t.params == params), None)


def tell(
    study, trial, targets: list[Target], held: list[float] | None, value: float | None = None, attrs: dict | None = None
) -> None:
    """Tell the study how a trial ended: stopped early (``held`` None: every target its constraint 1, pruned), or
    complete with ``held``, its constraint per target (<= 0 where the target holds; also the ``constraints``
    attribute), ``attrs`` as its user attributes and ``value`` (its cost)."""
    import optuna

    for key, attr in (attrs or {}).items():
        trial.set_user_attr(key, attr)
    if held is None:
        for target in targets:
            trial.set_constraint(str(target), 1.0)
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        return
    for target, constraint in zip(targets, held):
        trial.set_constraint(str(target), constraint)
    trial.set_user_attr("constraints", held)
    study.tell(trial, value)


def tell_repeat(study, trial, earlier, targets: list[Target]) -> None:
    """Tell ``trial`` what ``earlier``, a finished trial of the same parameters, measured, without measuring again:
    a configuration measures the same every time (same seed and thread count), so the study, its proposals and its
    choice are those of a search that measured it twice. The trial carries ``repeat_of``."""
    import optuna

    attrs = {"repeat_of": earlier.number} | {
        k: earlier.user_attrs[k] for k in ("means", "bounds") if k in earlier.user_attrs
    }
    pruned = earlier.state == optuna.trial.TrialState.PRUNED
    tell(study, trial, targets, None if pruned else earlier.user_attrs["constraints"], earlier.value, attrs)
